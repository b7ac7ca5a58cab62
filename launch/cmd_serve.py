"""`orthon serve WEIGHTS_DIR --port P`: the in-process engine behind SGLang's HTTP API
(orthon.engine.server), for RL's rollout fleet or any SGLang client."""
from __future__ import annotations

from pathlib import Path


def register(parser, name):
    parser.add_argument("weights_dir", help="a weights directory (HF layout, e.g. RUN_DIR/final)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together")
    parser.add_argument("--max-length", type=int, default=None, help="longest prompt + response (default: the model's)")
    parser.add_argument("--tokenizer", help="a tokenizer, for requests that send text instead of input_ids")


def run(args, name):
    from orthon.core.errors import CheckpointError
    from orthon.engine.in_process import EngineConfig, InProcessEngine
    from orthon.engine.server import serve
    from orthon.pretrain.weights import load_weights

    weights = Path(args.weights_dir)
    if not (weights / "config.json").is_file():
        raise CheckpointError(f"{weights}: not a weights directory (no config.json)")
    tokenizer = None
    if args.tokenizer:
        from orthon.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    engine = InProcessEngine(load_weights(weights), EngineConfig(max_batch_size=args.max_batch_size,
                                                                 max_length=args.max_length))
    url = f"http://{args.host}:{args.port}"
    serve(engine, str(weights), args.host, args.port, tokenizer, ready=lambda: print(f"serving {weights} on {url}", flush=True))
    return 0
