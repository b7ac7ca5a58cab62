"""``orthon tokenizer``: train a sentencepiece BPE tokenizer; encode text with any tokenizer.

    orthon tokenizer train INPUT... --out tok.model [--vocab-size 4096] [--max-sentences N] [-c recipe.yaml]
    orthon tokenizer encode --tokenizer tok.model TEXT
"""
from __future__ import annotations

import argparse
import sys

from orthon.data.config import TokenizerTrainConfig
from orthon.core.errors import DataError
from orthon.launch.cmd_data import _add_read_args, _common, _config, _read_mapping


def register(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("train", help="train a sentencepiece BPE model on text files")
    p.add_argument("inputs", nargs="*", help="files, globs or directories")
    p.add_argument("--out", help="output .model path (its .vocab is written beside it)")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--model-type", choices=["bpe", "unigram"])
    p.add_argument("--max-sentences", type=int, help="lines sampled from the inputs (default 300000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--special-token", action="append", default=[], help="a token kept whole (repeatable)")
    _add_read_args(p)
    _common(p)

    p = sub.add_parser("encode", help="print the ids and pieces of a text")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("text")


def run(args, name: str) -> int:
    try:
        if args.action == "train":
            from orthon.data.tokenizer import load_tokenizer, train_from_files

            cfg = _config(TokenizerTrainConfig, args, {
                "inputs": args.inputs, "output": args.out, "vocab_size": args.vocab_size,
                "model_type": args.model_type, "max_sentences": args.max_sentences, "seed": args.seed,
                "special_tokens": args.special_token, "read": _read_mapping(args)})
            path = train_from_files(cfg)
            tok = load_tokenizer(path)
            print(f"tokenizer: {path} ({tok.vocab_size} pieces, eos {tok.eos_id}, bos {tok.bos_id})")
        else:
            from orthon.data.tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer)
            ids = tok.encode(args.text)
            print(ids)
            print([tok.decode([i]) for i in ids])
        return 0
    except DataError as exc:
        print(f"orthon {name} {args.action}: error: {exc}", file=sys.stderr)
        return 1
