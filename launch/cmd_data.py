"""``orthon data``: prepare token stores, build the built-in corpus, deduplicate, inspect a store.

    orthon data prepare INPUT... --tokenizer TOK.model --out STORE_DIR [--workers N] [-c recipe.yaml] [--set k=v]
    orthon data build-builtin --out DIR [--vocab-size 4096] [--seed 0]
    orthon data dedup INPUT... --out DEDUPED.jsonl [--threshold 0.8]
    orthon data inspect STORE_DIR [--verify] [--show N --tokenizer TOK.model]
"""
from __future__ import annotations

import argparse
import sys

from orthon.data.config import BuiltinConfig, DedupConfig, PrepareConfig
from orthon.core.errors import DataError
from orthon.core.config import apply_overrides, build, read_yaml


def _add_read_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["auto", "jsonl", "parquet", "text"], help="input format (default: by suffix)")
    p.add_argument("--text-field", help="field holding the text in jsonl/parquet records (default: text)")
    p.add_argument("--text-unit", choices=["line", "paragraph", "document"],
                   help="how a plain text file is cut into documents (default: line)")


def _read_mapping(args) -> dict:
    return {k: v for k, v in (("format", args.format), ("text_field", args.text_field),
                              ("text_unit", args.text_unit)) if v is not None}


def _config(cls, args, given: dict):
    """Recipe (-c) < command-line flags < --set overrides, then built and checked."""
    mapping = read_yaml(args.config) if args.config else {}
    for key, value in given.items():
        if isinstance(value, dict):
            mapping.setdefault(key, {}).update(value)
        elif value is not None and value != []:
            mapping[key] = value
    return build(cls, apply_overrides(mapping, args.set))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML recipe for this command's config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")


def register(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = sub.add_parser("prepare", help="tokenise text files into a token store (parallel, resumable)")
    p.add_argument("inputs", nargs="*", help="files, globs or directories")
    p.add_argument("--tokenizer", help="sentencepiece .model or HF tokenizer.json")
    p.add_argument("--out", help="store directory")
    p.add_argument("--workers", type=int, help="tokeniser processes (default: one per core)")
    p.add_argument("--shard-mb", type=float, help="input MB per shard, the unit of resume (default 64)")
    p.add_argument("--max-chars", type=int, help="skip (and count) longer documents (default 10M)")
    p.add_argument("--filter", action="append", default=[], metavar="DOTTED.PATH=MIN_SCORE",
                   help="quality scorer and its threshold, e.g. orthon.data.filters.heuristic_quality=1.0")
    p.add_argument("--overwrite", action="store_true", help="discard a store prepared with other settings")
    _add_read_args(p)
    _common(p)

    p = sub.add_parser("build-builtin", help="build the built-in corpus, train its tokenizer, prepare its stores")
    p.add_argument("--out", default="data_builtin", help="output directory (default: data_builtin)")
    p.add_argument("--vocab-size", type=int, default=BuiltinConfig.vocab_size)
    p.add_argument("--seed", type=int, default=BuiltinConfig.seed)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--arithmetic-problems", type=int, default=BuiltinConfig.arithmetic_problems)
    p.add_argument("--max-code-mb", type=float, default=0.0, help="cap on standard-library source (0: all)")

    p = sub.add_parser("dedup", help="remove near-duplicate documents (MinHash-LSH); writes jsonl + a report")
    p.add_argument("inputs", nargs="*")
    p.add_argument("--out", help="output .jsonl, or a folder (DIR/: DIR/dedup.jsonl); the report beside it")
    p.add_argument("--threshold", type=float, help="Jaccard similarity counted as duplicate (default 0.8)")
    p.add_argument("--num-perm", type=int)
    p.add_argument("--ngram", type=int)
    _add_read_args(p)
    _common(p)

    p = sub.add_parser("inspect", help="check a store and print its counts")
    p.add_argument("store", help="store directory or shard prefix")
    p.add_argument("--verify", action="store_true", help="also check every shard's sha256 against the manifest")
    p.add_argument("--show", type=int, default=0, metavar="N", help="decode the first N documents")
    p.add_argument("--tokenizer", help="tokenizer for --show")


def run(args, name: str) -> int:
    try:
        return {"prepare": _prepare, "build-builtin": _builtin, "dedup": _dedup, "inspect": _inspect}[args.action](args)
    except DataError as exc:
        print(f"orthon {name} {args.action}: error: {exc}", file=sys.stderr)
        return 1


def _prepare(args) -> int:
    from orthon.data.prepare import prepare

    filters = []
    for item in args.filter:
        path, sep, score = item.rpartition("=")
        if not sep:
            raise DataError(f"--filter {item!r}: expected DOTTED.PATH=MIN_SCORE")
        filters.append({"path": path, "min_score": score})
    cfg = _config(PrepareConfig, args, {
        "inputs": args.inputs, "tokenizer": args.tokenizer, "out_dir": args.out, "workers": args.workers,
        "shard_mb": args.shard_mb, "max_chars": args.max_chars, "filters": filters,
        "overwrite": args.overwrite or None, "read": _read_mapping(args)})
    prepare(cfg)
    return 0


def _builtin(args) -> int:
    from orthon.data.builtin import prepare_builtin

    paths = prepare_builtin(args.out, vocab_size=args.vocab_size, seed=args.seed, workers=args.workers,
                            arithmetic_problems=args.arithmetic_problems, max_code_mb=args.max_code_mb)
    print(f"tokenizer: {paths.tokenizer}")
    for split, stores in (("train", paths.train_stores), ("valid", paths.valid_stores)):
        for kind, store in stores.items():
            print(f"{split} store ({kind}): {store}  {paths.report['tokens'][f'{split}/{kind}']} tokens")
    return 0


def _dedup(args) -> int:
    from orthon.data.dedup import dedup_files

    cfg = _config(DedupConfig, args, {"inputs": args.inputs, "output": args.out, "threshold": args.threshold,
                                      "num_perm": args.num_perm, "ngram": args.ngram, "read": _read_mapping(args)})
    dedup_files(cfg)
    return 0


def _inspect(args) -> int:
    from pathlib import Path

    from orthon.core.files import sha256_file
    from orthon.data.store import StoreError, TokenStore

    store = TokenStore(args.store)
    lengths = store.doc_lengths()
    print(f"store {store.path}: {store.n_docs} documents, {store.n_tokens} tokens, {len(store.shards)} shards, "
          f"vocab {store.vocab_size}, eos {store.eos_id}")
    if store.n_docs:
        print(f"document length: mean {lengths.mean():.1f}, max {int(lengths.max())}")
    if store.meta.get("totals"):
        print(f"skipped while preparing: {store.meta['totals']['skipped'] or 'nothing'}")
    if args.verify:
        for entry in store.meta.get("shards", []):
            for suffix, key in ((".bin", "bin_sha256"), (".idx", "idx_sha256")):
                path = Path(store.path) / (entry["name"] + suffix)
                if sha256_file(path) != entry[key]:
                    raise StoreError(f"{path}: sha256 differs from the manifest (file changed or corrupted)")
        print("verify: every shard matches its recorded sha256")
    if args.show:
        from orthon.data.tokenizer import load_tokenizer

        if not args.tokenizer:
            raise DataError("--show needs --tokenizer")
        tok = load_tokenizer(args.tokenizer)
        for i in range(min(args.show, store.n_docs)):
            print(f"--- document {i} ({len(store.doc(i))} tokens)\n{tok.decode(store.doc(i))}")
    return 0
