"""Helpers for the data tests (no tests here): small real corpora, a small real tokenizer, plug-in scorers.

The scorers are loaded by dotted path (``test_data_support.slow_score``) in
the spawned tokeniser processes, which inherit this directory on sys.path.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import time
from pathlib import Path

from orthon.data.arithmetic import make_document
from orthon.data.builtin import stdlib_sources
from orthon.data.tokenizer import train_sentencepiece

CODE_SAMPLE = "def f(x):\n    if x > 1:\n\treturn x  +  1\n    return None\n"


def corpus_texts(n_arith_docs: int = 40, code_mb: float = 0.05, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [f"# {rel}\n{src}" for rel, src in stdlib_sources(code_mb)]
    texts += [make_document(rng, 8) for _ in range(n_arith_docs)]
    return texts


def train_tiny_tokenizer(directory: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    lines = [line for t in corpus_texts(seed=seed) for line in t.split("\n") if line.strip()]
    lines += ["Nous écrivons en français, ça marche.", "数字 37 и кириллица", CODE_SAMPLE]
    return train_sentencepiece(lines, Path(directory) / "tiny.model", vocab_size, seed=seed, threads=1)


def hf_tokenizer_json(path: Path) -> Path:
    """A small byte-level BPE tokenizer.json trained with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CODE_SAMPLE, "hello world, hello tokenizers"] * 20, trainer)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, records: list, raw_lines: list[bytes] = ()) -> Path:
    with open(path, "wb") as f:
        for r in records:
            f.write(json.dumps(r if isinstance(r, dict) else {"text": r}).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return path


def slow_score(text: str, delay: float = 0.02) -> float:
    """Keeps everything, slowly: gives a crash test time to strike mid-run."""
    time.sleep(delay)
    return 1.0


def boom_if_flag(text: str, flag: str = "") -> float:
    """Raises on a document containing BOOM while the flag file exists (a crash mid-shard)."""
    if "BOOM" in text and flag and os.path.exists(flag):
        raise RuntimeError("simulated crash while tokenising")
    return 1.0


def die_on_marker(text: str) -> float:
    """SIGKILLs the tokeniser process that scores a document containing DIE."""
    if "DIE" in text:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


class LengthScorer:
    """A class-style plug-in: score is 1 when the text has at least ``min_len`` characters."""

    def __init__(self, min_len: int = 10):
        self.min_len = min_len

    def __call__(self, text: str) -> float:
        return float(len(text) >= self.min_len)


def run_cli(name: str, argv: list[str]) -> int:
    """Run an orthon subcommand module the way launch/cli.py does."""
    from orthon.launch.cli import COMMANDS

    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"orthon {name}")
    module.register(parser, name)
    return int(module.run(parser.parse_args(argv), name) or 0)


def make_store(directory: Path, shards: list, vocab: int = 300, eos_id: int = 2) -> Path:
    """A complete store directory (manifest + shards) holding the given documents."""
    from orthon.data.store import MANIFEST, write_shard

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for k, docs in enumerate(shards):
        write_shard(directory / f"shard_{k}", docs, vocab)
        entries.append({"name": f"shard_{k}", "n_docs": len(docs), "n_tokens": int(sum(len(d) for d in docs))})
    (directory / MANIFEST).write_text(json.dumps({"complete": True, "shards": entries, "eos_id": eos_id,
                                                  "vocab_size": vocab}))
    return directory
