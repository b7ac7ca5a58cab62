"""A small pretraining setup for loop tests: random-document stores and a recipe file, run through the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from orthon.core.net import free_port  # noqa: F401 (the tests' one import of it, beside the helpers)
from test_data_support import make_store

ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
    q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    index_n_heads=2, index_head_dim=16, index_topk=16, max_position_embeddings=256,
)


def make_stores(directory: Path, seed: int = 0) -> dict[str, Path]:
    """Train and valid stores of documents with learnable structure (runs of counting tokens)."""
    rng = np.random.default_rng(seed)

    def docs(n):
        out = []
        for _ in range(n):
            start, length = rng.integers(3, 200), rng.integers(5, 60)
            out.append([(start + i) % 297 + 3 for i in range(length)] + [2])
        return out

    return {"train": make_store(directory / "train", [docs(300), docs(300)]),
            "valid": make_store(directory / "valid", [docs(40)])}


def write_recipe(path: Path, stores: dict, run_dir: Path, **sections) -> Path:
    recipe = {
        "model": dict(MODEL),
        "runtime": {"sparse_attention": False},
        "data": {"sources": [{"path": str(stores["train"]), "name": "train"}],
                 "valid": [{"path": str(stores["valid"]), "name": "valid"}], "seq_len": 32, "seed": 7},
        "optim": {"algorithm": "muon"},
        "schedule": {"peak_lr": 0.01, "floor_lr": 0.002, "warmup_tokens": 512, "total_tokens": 40000},
        "batch": {"start_batch_tokens": 256, "end_batch_tokens": 512, "ramp_tokens": 2048},
        "train": {"run_dir": str(run_dir), "micro_batch_size": 4, "eval_interval": 5, "eval_samples": 8,
                  "checkpoint_interval": 4, "keep_last": 10, "progress": False, "log_sample_ids": True,
                  "builtin_dir": ""},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    return path


def env() -> dict:
    # One thread per process: identical arithmetic in every run, and no oversubscription of 2 cores.
    # The tests' folder on the path: a recipe may name a plug-in defined in a test module.
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": path}


def orthon(*args, nproc: int = 1, check: bool = True, env_extra: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
               "-m", "orthon.launch.cli", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "orthon.launch.cli", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env(), **(env_extra or {})}, cwd=ROOT, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def resumed_from(log: str) -> tuple[Path, int]:
    """The checkpoint directory a resumed run names in its log ("resumed from DIR at step N"), and N."""
    import re

    match = re.search(r"resumed from (\S+) at step (\d+)", log)
    assert match, f"the log names no checkpoint it resumed from:\n{log[-3000:]}"
    return Path(match[1]), int(match[2])


def records_up_to(lines: list[str], step: int) -> list[str]:
    """The metrics.jsonl lines of steps <= step (what a resume at that step keeps)."""
    return [line for line in lines if json.loads(line)["step"] <= step]


def sample_ids(run_dir: Path) -> list[int]:
    return [i for line in (run_dir / "samples.jsonl").read_text().splitlines() for i in json.loads(line)["ids"]]


def kill_when(cmd: list, target: Path, timeout: float = 300) -> None:
    """Start ``cmd``, SIGKILL it as soon as ``target`` exists, and check it really died mid-run."""
    import signal
    import time

    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
