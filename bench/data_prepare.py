"""``orthon data prepare`` throughput on the built-in corpus, against plain sentencepiece.

orthon: the whole ``prepare`` call (read JSON lines through datasets, check,
tokenise in worker processes, write shards, checksums, manifest), timed wall
clock, on the built-in corpus's training files.
Reference, in the same run: one process encoding the same documents with the
same sentencepiece model (``SentencePieceProcessor.encode``, one thread), texts
already in memory, nothing written.

The ratio is prepare's MB/s over the bare tokeniser's: above 1 when the worker
processes more than pay for the pipeline around them. A second figure runs
prepare in one process (``--workers 1``), which isolates the pipeline's own cost.

    python bench/data_prepare.py [--work DIR] [--workers N] [--repeats R]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def bare_encode(model: Path, texts: list[str]) -> float:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    start = time.perf_counter()
    for text in texts:
        sp.encode(text)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="directory for the built-in corpus (default: a temporary one)")
    parser.add_argument("--workers", type=int, default=0, help="prepare's worker processes (default: cores)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side; the best is reported")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    # One-time imports are not throughput: datasets imports torch on its first streamed read, and
    # the main command has torch loaded anyway.
    import datasets  # noqa: F401
    import torch  # noqa: F401

    from orthon.data.builtin import prepare_builtin
    from orthon.data.config import PrepareConfig, ReadConfig
    from orthon.data.prepare import prepare

    work = Path(args.work or tempfile.mkdtemp(prefix="orthon_bench_data_"))
    paths = prepare_builtin(work, vocab_size=args.vocab_size, log=None)
    files = paths.corpus["train"]
    texts = [json.loads(line)["text"] for f in files for line in f.open(encoding="utf-8")]
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    workers = args.workers or os.cpu_count() or 1

    def run_prepare(n_workers: int) -> float:
        nonlocal report
        out = work / "bench_store"
        shutil.rmtree(out, ignore_errors=True)
        cfg = PrepareConfig(inputs=[str(f) for f in files], out_dir=str(out), tokenizer=str(paths.tokenizer),
                            read=ReadConfig(format="jsonl"), workers=n_workers)
        start = time.perf_counter()
        report = prepare(cfg, log=None)
        return time.perf_counter() - start

    report = None
    prepare_s, inline_s, ref_s = [], [], []
    for _ in range(args.repeats):
        ref_s.append(bare_encode(paths.tokenizer, texts))
        inline_s.append(run_prepare(1))  # the pipeline's own cost, without parallelism
        prepare_s.append(run_prepare(workers))
    best_prepare, best_inline, best_ref = min(prepare_s), min(inline_s), min(ref_s)
    figures = {
        "corpus_mb": round(megabytes, 2),
        "tokens": report.tokens,
        "workers": workers,
        "cpu_count": os.cpu_count(),
        "prepare_s": round(best_prepare, 3),
        "sentencepiece_s": round(best_ref, 3),
        "prepare_1proc_s": round(best_inline, 3),
        "prepare_mb_per_s": round(megabytes / best_prepare, 3),
        "prepare_1proc_mb_per_s": round(megabytes / best_inline, 3),
        "sentencepiece_mb_per_s": round(megabytes / best_ref, 3),
    }
    ratios = {"mb_per_s_vs_sentencepiece": round(best_ref / best_prepare, 3),
              "mb_per_s_1proc_vs_sentencepiece": round(best_ref / best_inline, 3)}
    rows = [("orthon data prepare", f"{workers} worker processes", best_prepare, megabytes / best_prepare),
            ("orthon data prepare", "--workers 1 (inline)", best_inline, megabytes / best_inline),
            ("sentencepiece encode", "1 process, 1 thread", best_ref, megabytes / best_ref)]
    print(f"built-in corpus: {len(files)} files, {len(texts)} documents, {megabytes:.2f} MB, {report.tokens} tokens")
    print(f"{'':<22} {'setup':<24} {'seconds':>8} {'MB/s':>8}")
    for name, setup, seconds, rate in rows:
        print(f"{name:<22} {setup:<24} {seconds:>8.2f} {rate:>8.2f}")
    print(json.dumps({"bench": "data_prepare", "figures": figures, "ratios": ratios}))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
