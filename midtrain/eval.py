"""Long-context evaluation: passkey retrieval over lengths x depths, and perplexity by position.

Passkey: a prompt of exactly L tokens of real held-out text (the haystack, ``LongEvalConfig.haystack``)
with a needle ``PASSKEY = 71432`` inserted at a fraction d of it and, at the end, the needle's own prefix
``PASSKEY =`` (as the classic passkey task ends on "The pass key is"; both ``LongEvalConfig.needle`` and
``question``); the model's greedy continuation
(the prompts of a cell decoded together by the in-process engine, the path every generation takes)
is right when its first digits are the key. Prompts are generated on the fly from a seed, at any
length and depth.
Beside exact match, the teacher-forced NLL of the answer per key digit: below ln 10 = 2.30 the model
draws on the needle even where greedy decoding does not yet reproduce all five digits.

Perplexity by position: held-out sequences of one length, next-token NLL averaged per position
bucket; positions beyond the pretraining length show whether the model still predicts there.

Indexer recall: on the passkey prompts of each length above index_topk, the share of each layer's dense
attention mass (summed over heads) that its DSA indexer's top-k holds, beside the best any k keys hold.

Copying: random token sequences repeated once, at each length. The first half cannot be predicted; a
model with an induction (copy) head predicts the repeat, so its NLL on the second half falls far below
the first's. Retrieval of any kind needs that mechanism: where the two NLLs are equal, a passkey of 0
says the model cannot copy at all, not that its context is too short.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from orthon.core.errors import CheckpointError, ConfigError
from orthon.core.files import atomic_write_text
from orthon.core.metrics import pyplot, save_figure
from orthon.engine.in_process import InProcessEngine
from orthon.engine.protocol import Engine
from orthon.engine.sampling import SamplingParams
from orthon.midtrain import heads
from orthon.midtrain.config import LongEvalConfig
from orthon.midtrain.indexer_fit import indexer_recall
from orthon.midtrain.losses import IGNORE_INDEX, token_nll


def place_needle(filler: Sequence[int], needle: Sequence[int], question: Sequence[int], length: int,
                 depth: float) -> list[int]:
    """Exactly ``length`` tokens: filler with ``needle`` inserted at fraction ``depth`` of the filler
    part, then ``question``."""
    room = length - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"length {length}: too short for a {len(needle)}-token needle and a {len(question)}-token question")
    if len(filler) < room:
        raise ValueError(f"filler: {len(filler)} tokens, need {room} for length {length}")
    at = round(depth * room)
    return [*filler[:at], *needle, *filler[at:room], *question]


def answer_matches(text: str, key: str) -> bool:
    """Whether a generated continuation starts with the key (leading spaces ignored)."""
    return text.strip().startswith(key)


class Haystack:
    """Windows of a held-out token stream (the largest of the given stores)."""

    def __init__(self, stores: list):
        if not stores:
            raise ValueError("haystack: no held-out store")
        self.store = max(stores, key=lambda s: s.n_tokens)

    @classmethod
    def from_valid(cls, valid: list, name: str = "") -> "Haystack":
        """From a run's held-out sources (StoreSource): the one called ``name``, or with "" the largest
        that is not "recall" (recall documents hold needles of their own)."""
        from orthon.data.store import TokenStore

        if name:
            chosen = [s for s in valid if s.name == name]
            if not chosen:
                raise ConfigError(f"eval.haystack: no held-out store named {name!r} (the run has "
                                  f"{[s.name for s in valid]})")
        else:
            chosen = [s for s in valid if s.name != "recall"]
        return cls([TokenStore(s.path) for s in chosen])

    def window(self, n: int, rng: random.Random) -> list[int]:
        store = self.store
        if store.n_tokens < n:
            raise ValueError(f"haystack: the largest held-out store has {store.n_tokens} tokens, need {n}")
        start = rng.randrange(0, store.n_tokens - n + 1)
        return [int(t) for t in store.read(start, start + n)]


def greedy_continuations(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of the prompts, ``max_new_tokens`` each (no stop token), decoded together
    by the engine. A prompt the engine rejects (e.g. longer than its context) raises."""
    results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                      stop_token_ids=()))
    for result in results:
        if not result.ok:
            raise ValueError(f"greedy_continuations: {result.error}")
    return [result.tokens for result in results]


def needle_answer(needle: Sequence[int], question: Sequence[int]) -> tuple[int, list[int]]:
    """(n, answer): the needle and the question share their first n tokens; the answer is the rest of
    the needle (the key and what ends the line), the continuation a retrieving model predicts."""
    n = 0
    while n < min(len(needle), len(question)) and needle[n] == question[n]:
        n += 1
    return n, list(needle[n:])


@torch.no_grad()
def answer_nll(model, prompts: list[list[int]], question: Sequence[int], needles: list[list[int]],
               chunk: int = 1024) -> list[float]:
    """Teacher-forced NLL (nats, summed) of each needle's answer after its prompt: the prompt's
    question is cut back to the prefix it shares with the needle, then the answer follows. Unlike exact
    match, this shows retrieval that is partly there (chance for a 5-digit key: 5 ln 10)."""
    model.eval()
    device = model.lm_head.weight.device
    seqs, answers = [], []
    for prompt, needle in zip(prompts, needles):
        n, answer = needle_answer(needle, question)
        seqs.append(prompt[: len(prompt) - len(question) + n] + answer)
        answers.append(len(answer))
    out = [0.0] * len(seqs)
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        by_length.setdefault(len(seq), []).append(i)
    for length, rows in by_length.items():
        ids = torch.tensor([seqs[i] for i in rows], device=device)
        labels = ids[:, 1:].clone()
        for r, i in enumerate(rows):
            labels[r, : length - 1 - answers[i]] = IGNORE_INDEX
        hidden, _ = model.hidden_states(ids[:, :-1])
        nll = token_nll(hidden, model.lm_head.weight, labels, chunk).sum(dim=1)
        for r, i in enumerate(rows):
            out[i] = float(nll[r])
    return out


def passkey_prompts(tokenizer, haystack: Haystack, cfg: LongEvalConfig, length: int,
                    depth: float) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """(keys, needles, prompts) of one (length, depth) cell: cfg.trials random keys, each needle placed in
    its own haystack window; the same for a given cfg.seed."""
    question = tokenizer.encode(cfg.question)
    rng = random.Random(f"{cfg.seed}:{length}:{depth}")
    keys, needles, prompts = [], [], []
    for _ in range(cfg.trials):
        keys.append("".join(rng.choice("0123456789") for _ in range(cfg.digits)))
        needles.append(tokenizer.encode(cfg.needle.format(key=keys[-1])))
        prompts.append(place_needle(haystack.window(length, rng), needles[-1], question, length, depth))
    return keys, needles, prompts


@torch.no_grad()
def passkey_scores(model, tokenizer, haystack: Haystack, cfg: LongEvalConfig, log=print,
                   engine: Engine | None = None) -> tuple[dict, dict]:
    """({length: {depth: accuracy}}, {length: {depth: answer NLL per key digit}}) over cfg.trials
    random keys per cell; accuracy is greedy exact match, the NLL is teacher-forced (answer_nll).
    ``engine``: the greedy answers come from it (a served model) instead of an in-process engine on
    ``model``; with no ``model`` the NLL, which needs the weights, is left out ({})."""
    question = tokenizer.encode(cfg.question)
    engine = engine or InProcessEngine(model)  # packs its decode weights once for every cell
    accuracy: dict[int, dict[float, float]] = {}
    per_digit: dict[int, dict[float, float]] = {}
    for length in cfg.lengths:
        accuracy[length], per_digit[length] = {}, {}
        for depth in cfg.depths:
            keys, needles, prompts = passkey_prompts(tokenizer, haystack, cfg, length, depth)
            answers = greedy_continuations(engine, prompts, cfg.digits + 2)
            right = sum(answer_matches(tokenizer.decode(a), k) for a, k in zip(answers, keys))
            accuracy[length][depth] = right / cfg.trials
            if model is not None:
                nats = answer_nll(model, prompts, question, needles)
                per_digit[length][depth] = sum(nats) / (cfg.trials * cfg.digits)
        log(f"  passkey L={length}: " + " ".join(f"{d:.2f}:{a:.2f}" for d, a in accuracy[length].items())
            + ("  answer nats/digit " + " ".join(f"{v:.2f}" for v in per_digit[length].values())
               if per_digit[length] else ""))
    return accuracy, (per_digit if model is not None else {})


@torch.no_grad()
def indexer_recall_by_length(model, tokenizer, haystack: Haystack, cfg: LongEvalConfig) -> dict[int, dict]:
    """{length: {"recall", "oracle_recall", "queries"}} on the passkey prompts of every depth, for the
    lengths above index_topk (at or below it the top-k holds every key): the share of each full layer's
    dense attention mass its indexer's top-k holds (``indexer_fit.indexer_recall``), and the best share
    any k keys hold."""
    out = {}
    for length in cfg.lengths:
        if length <= model.config.index_topk:
            continue
        totals = {"recall": 0.0, "oracle_recall": 0.0, "queries": 0}
        for depth in cfg.depths:
            _, _, prompts = passkey_prompts(tokenizer, haystack, cfg, length, depth)
            r = indexer_recall(model, torch.tensor(prompts, device=model.lm_head.weight.device))
            for key in ("recall", "oracle_recall"):
                totals[key] += r[key] * r["queries"]
            totals["queries"] += r["queries"]
        n = max(totals["queries"], 1)
        out[length] = {"recall": totals["recall"] / n, "oracle_recall": totals["oracle_recall"] / n,
                       "queries": totals["queries"]}
    return out


@torch.no_grad()
def indexer_recall_on_documents(model, documents: Haystack, cfg: LongEvalConfig) -> dict[int, dict]:
    """{length: {"recall", "oracle_recall", "queries"}} as ``indexer_recall_by_length``, on
    cfg.recall_windows random windows of held-out documents at each length above index_topk."""
    out = {}
    device = model.lm_head.weight.device
    for length in cfg.lengths:
        if length <= model.config.index_topk:
            continue
        rng = random.Random(cfg.seed)
        ids = torch.tensor([documents.window(length, rng) for _ in range(cfg.recall_windows)], device=device)
        r = indexer_recall(model, ids)
        out[length] = {"recall": r["recall"], "oracle_recall": r["oracle_recall"], "queries": r["queries"]}
    return out


@torch.no_grad()
def perplexity_by_position(model, data_cfg, cfg: LongEvalConfig, chunk: int = 1024) -> list[dict]:
    """Held-out next-token perplexity per position bucket at cfg.ppl_length."""
    from orthon.data.loader import ValidData

    valid = ValidData(replace(data_cfg, seq_len=cfg.ppl_length), max_samples=cfg.ppl_samples)
    model.eval()
    device = model.lm_head.weight.device
    nll_sum = torch.zeros(cfg.ppl_length, dtype=torch.float64)
    count = torch.zeros(cfg.ppl_length, dtype=torch.float64)
    seen = 0
    for batch in valid.batches(4):
        if seen >= cfg.ppl_samples:
            break
        ids, labels = batch.input_ids[: cfg.ppl_samples - seen], batch.labels[: cfg.ppl_samples - seen]
        hidden, _ = model.hidden_states(ids.to(device))
        nll = token_nll(hidden, model.lm_head.weight, labels.to(device), chunk).cpu().double()
        kept = (labels != -100).double()
        nll_sum += (nll * kept).sum(0)
        count += kept.sum(0)
        seen += ids.shape[0]
    edges = np.linspace(0, cfg.ppl_length, cfg.ppl_buckets + 1).round().astype(int)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        n = float(count[lo:hi].sum())
        mean = float(nll_sum[lo:hi].sum()) / n if n else float("nan")
        buckets.append({"start": int(lo), "end": int(hi), "ppl": math.exp(mean) if n else float("nan")})
    return buckets


def repeated_sequences(n: int, length: int, vocab_size: int, seed: int, low: int = 3) -> torch.Tensor:
    """(n, length) token ids: a random sequence of length // 2 ids in [low, vocab_size) and its exact
    repeat (one more random id first when length is odd)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(low, vocab_size, (n, length // 2), generator=g)
    head = torch.randint(low, vocab_size, (n, length % 2), generator=g)
    return torch.cat([head, half, half], dim=1)


@torch.no_grad()
def copy_nll(model, cfg: LongEvalConfig, n: int = 4, chunk: int = 1024) -> dict[int, dict[str, float]]:
    """{length: {"first": mean NLL predicting the random first half, "repeat": mean NLL predicting
    the repeat (its first token excluded: nothing tells where the repeat starts)}}."""
    model.eval()
    device = model.lm_head.weight.device
    out = {}
    for length in cfg.lengths:
        ids = repeated_sequences(n, length, model.config.vocab_size, cfg.seed).to(device)
        hidden, _ = model.hidden_states(ids[:, :-1])
        nll = token_nll(hidden, model.lm_head.weight, ids[:, 1:], chunk).cpu()
        start = length % 2 + length // 2  # index of the repeat's first token in ids
        out[length] = {"first": float(nll[:, length % 2 : start - 1].mean()), "repeat": float(nll[:, start:].mean())}
    return out


@torch.no_grad()
def head_scores(model, haystack: Haystack, cfg: LongEvalConfig, n: int = 2) -> dict[int, dict]:
    """{length: per-layer best-head previous-token score (held-out text), best-head induction score
    (a random half and its repeat), head-summed top-k mass (text, k = index_topk), and the uniform-
    attention levels of the first two} (``orthon.midtrain.heads``)."""
    model.eval()
    device = model.lm_head.weight.device
    k = model.config.index_topk
    out = {}
    for length in cfg.lengths:
        even = length - length % 2
        rng = random.Random(f"{cfg.seed}:heads:{length}")
        text = torch.tensor([haystack.window(even, rng) for _ in range(n)], device=device)
        repeats = repeated_sequences(n, even, model.config.vocab_size, cfg.seed).to(device)
        on_text = heads.layer_scores(model, text, k=k)
        on_repeats = heads.layer_scores(model, repeats, half=even // 2)
        layers = [{**t, "induction": r["induction"]} for t, r in zip(on_text, on_repeats)]
        out[length] = {"layers": layers, "uniform_previous_token": heads.uniform_previous_token_score(even),
                       "uniform_induction": heads.uniform_induction_score(even // 2),
                       "k": k}
    return out


# ---------------------------------------------------------------- runs and reports
def resolve_run(path) -> tuple[Path, Path]:
    """(run directory with config.yaml, its final weights dir) for a pretraining run, a mid-training
    run (its last stage) or one stage."""
    path = Path(path)
    stages = path / "stages"
    if stages.is_dir():
        done = sorted(p for p in stages.iterdir() if (p / "final").is_dir())
        if not done:
            raise CheckpointError(f"{path}: no stage has finished (no stages/*/final)")
        path = done[-1]
    if not (path / "config.yaml").is_file() or not (path / "final").is_dir():
        raise CheckpointError(f"{path}: not a run directory with config.yaml and final/")
    return path, path / "final"


def _run_inputs(path, cfg: LongEvalConfig):
    """(run directory, its weights directory, its recipe, tokenizer, haystack of held-out text) of a run."""
    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.recipe import load_recipe

    run_dir, weights = resolve_run(path)
    recipe = load_recipe(run_dir / "config.yaml")
    if not recipe.data.tokenizer or not recipe.data.valid:
        raise ValueError(f"{run_dir}: the run names no tokenizer or held-out stores (data.tokenizer, data.valid)")
    return run_dir, weights, recipe, load_tokenizer(recipe.data.tokenizer), Haystack.from_valid(recipe.data.valid,
                                                                                                 cfg.haystack)


def evaluate_run(path, cfg: LongEvalConfig, log=print, attention: str = "saved") -> dict:
    """Every measurement of this module on one run; ``attention`` "dense" / "sparse" overrides how the
    saved model attends ("saved": as saved)."""
    from orthon.pretrain.weights import load_weights

    run_dir, weights, recipe, tokenizer, haystack = _run_inputs(path, cfg)
    runtime = {} if attention == "saved" else {"sparse_attention": attention == "sparse"}
    model = load_weights(weights, **runtime).eval()
    log(f"evaluating {run_dir} (trained at {recipe.data.seq_len} tokens, rope_theta {model.config.rope_theta:g}, "
        f"DSA {'on' if model.runtime.sparse_attention else 'off'}, IndexShare "
        f"{'on' if 'shared' in (model.config.indexer_types or []) else 'off'})")
    accuracy, answer_nats = passkey_scores(model, tokenizer, haystack, cfg, log)
    return {"run": str(run_dir), "train_seq_len": recipe.data.seq_len, "rope_theta": model.config.rope_theta,
            "sparse_attention": model.runtime.sparse_attention, "indexer_types": model.config.indexer_types,
            "passkey": accuracy, "passkey_answer_nll": answer_nats,
            "indexer_recall": indexer_recall_by_length(model, tokenizer, haystack, cfg),
            **_recall_on_documents(model, recipe, cfg, log),
            "ppl_by_position": perplexity_by_position(model, recipe.data, cfg),
            "copy_nll": copy_nll(model, cfg),
            "heads": head_scores(model, haystack, cfg)}


def evaluate_served(path, url: str, cfg: LongEvalConfig, log=print) -> dict:
    """Passkey accuracy of the model served at ``url`` (``orthon serve`` or SGLang: the way to evaluate
    a model no one process holds, GLM-5 at 200K) on the prompts of the run at ``path`` (its tokenizer and
    held-out stores). Greedy answers only: what needs the weights (answer NLL, perplexity, indexer
    recall, heads) is the in-process evaluation's."""
    from orthon.engine.client import HTTPEngine

    run_dir, _, recipe, tokenizer, haystack = _run_inputs(path, cfg)
    engine = HTTPEngine(url, timeout_s=3600.0)  # a 200K-token prefill takes its time
    log(f"evaluating the model served at {engine.url} on {run_dir}'s prompts (trained at {recipe.data.seq_len} tokens)")
    accuracy, _ = passkey_scores(None, tokenizer, haystack, cfg, log, engine=engine)
    return {"run": str(run_dir), "served_by": engine.url, "train_seq_len": recipe.data.seq_len, "passkey": accuracy}


def _recall_on_documents(model, recipe, cfg: LongEvalConfig, log) -> dict:
    """{"indexer_recall_documents": ...} on the run's held-out store cfg.recall_store; {} when none is
    asked for or the run has no store of that name (a pretraining run without the long documents)."""
    if not cfg.recall_store:
        return {}
    if not any(s.name == cfg.recall_store for s in recipe.data.valid):
        log(f"  indexer recall on documents skipped: the run has no held-out store {cfg.recall_store!r}")
        return {}
    documents = Haystack.from_valid(recipe.data.valid, cfg.recall_store)
    return {"indexer_recall_documents": indexer_recall_on_documents(model, documents, cfg)}


def evaluate_runs(runs: dict[str, str], cfg: LongEvalConfig, log=print) -> dict[str, dict]:
    """{name: evaluate_run} for runs given as {name: path}, once per cfg.attention mode (the mode then
    named after the run's name when there is more than one)."""
    modes = cfg.attention
    return {(name if len(modes) == 1 else f"{name} ({mode})"): evaluate_run(path, cfg, log, mode)
            for name, path in runs.items() for mode in modes}


def _grid_rows(grid: dict) -> list[str]:
    """One table row per length of a {length: {depth: value}} grid, with the row mean."""
    rows = []
    for length, row in grid.items():
        vals = list(row.values())
        rows.append(f"    L={length:<15d}" + "".join(f"{a:<8.2f}" for a in vals) + f"  {sum(vals) / len(vals):.2f}")
    return rows


def format_table(results: dict[str, dict]) -> str:
    lines = []
    for name, r in results.items():
        depths = list(next(iter(r["passkey"].values())).keys())
        served = f", served at {r['served_by']}" if "served_by" in r else ""
        lines.append(f"{name}  ({r['run']}{served}, trained at {r['train_seq_len']} tokens)")
        lines.append("  passkey accuracy   " + "".join(f"d={d:<6.2f}" for d in depths) + "  mean")
        lines += _grid_rows(r["passkey"])
        if "passkey_answer_nll" in r:
            lines.append(f"  answer NLL, nats per key digit (chance ln 10 = {math.log(10):.2f})")
            lines += _grid_rows(r["passkey_answer_nll"])
        if "ppl_by_position" in r:
            lines.append("  perplexity by position  " + "  ".join(f"[{b['start']},{b['end']}): {b['ppl']:.2f}"
                                                               for b in r["ppl_by_position"]))
        if r.get("indexer_recall"):
            lines.append("  indexer recall of the dense attention mass (best any k keys hold)  " + "  ".join(
                f"L={L}: {x['recall']:.3f} ({x['oracle_recall']:.3f})" for L, x in r["indexer_recall"].items()))
        if r.get("indexer_recall_documents"):
            lines.append("  the same on held-out documents  " + "  ".join(
                f"L={L}: {x['recall']:.3f} ({x['oracle_recall']:.3f})" for L, x in r["indexer_recall_documents"].items()))
        if "copy_nll" in r:
            lines.append("  copying, NLL of a random half / of its repeat  " + "  ".join(
                f"L={L}: {c['first']:.2f} / {c['repeat']:.2f}" for L, c in r["copy_nll"].items()))
        for L, h in r.get("heads", {}).items():
            lines.append(f"  heads at L={L}, by layer: previous-token " + " ".join(f"{x['previous_token']:.2f}" for x in h["layers"])
                         + f" (uniform {h['uniform_previous_token']:.2f}), induction "
                         + " ".join(f"{x['induction']:.2f}" for x in h["layers"]) + f" (uniform {h['uniform_induction']:.3f}), "
                         + f"top-{h['k']} mass " + " ".join(f"{x['topk_mass']:.2f}" for x in h["layers"]))
    return "\n".join(lines)


def plot_report(results: dict[str, dict], out_png) -> None:
    """Heat maps (length x depth) of passkey accuracy, one per model, and perplexity by position."""
    plt = pyplot()

    n = len(results)
    ppl = [(name, r) for name, r in results.items() if "ppl_by_position" in r]  # none for a served model
    panels = n + bool(ppl)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), dpi=110, squeeze=False)
    axes = axes[0]
    for ax, (name, r) in zip(axes[:n], results.items()):
        lengths = list(r["passkey"].keys())
        depths = list(r["passkey"][lengths[0]].keys())
        grid = np.array([[r["passkey"][L][d] for d in depths] for L in lengths])
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        for i in range(len(lengths)):
            for j in range(len(depths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w" if grid[i, j] < 0.6 else "k")
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context length")
        ax.set_title(f"passkey: {name}")
    if ppl:
        ax = axes[n]
        for name, r in ppl:
            mids = [(b["start"] + b["end"]) / 2 for b in r["ppl_by_position"]]
            ax.plot(mids, [b["ppl"] for b in r["ppl_by_position"]], marker="o", label=name)
            ax.axvline(r["train_seq_len"], linestyle="--", linewidth=0.8, color=ax.lines[-1].get_color())
        ax.set_yscale("log")
        ax.set_xlabel("position")
        ax.set_ylabel("perplexity")
        ax.set_title("perplexity by position\n(dashed: length trained at)")
        ax.legend()
    save_figure(fig, out_png)


def write_report(results: dict[str, dict], out_dir) -> str:
    """eval.json, eval.txt and eval.png in out_dir (each written atomically); returns the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(results)
    atomic_write_text(out_dir / "eval.json", json.dumps(results, indent=1, default=str))
    atomic_write_text(out_dir / "eval.txt", table + "\n")
    plot_report(results, out_dir / "eval.png")
    return table
