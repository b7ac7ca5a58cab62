"""`orthon serve WEIGHTS_DIR --port P`: the engine server (orthon.engine.server), SGLang's HTTP worker
API over an in-process engine on the weights, for sglang-router and orthon's HTTP engine client, and
OpenAI's completions and chat API (conversations in orthon's chat format, orthon.rl.chat)."""
from __future__ import annotations


def register(parser, name):
    from orthon.engine.batcher import DEFAULT_WINDOW_S
    from orthon.engine.in_process import EngineConfig
    from orthon.engine.server_state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_DELTA_BYTES

    parser.add_argument("weights_dir", help="a weights directory (HF layout + orthon.json, e.g. RUN_DIR/final)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: a free port (printed when ready)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together")
    parser.add_argument("--max-length", type=int, default=None, help="longest prompt + response (default: the model's)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: as `orthon --threads`)")
    parser.add_argument("--tokenizer", default=None,
                        help="for text requests (default: tokenizer.json / .model beside the weights, else the run's)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest /generate (or control) request body")
    parser.add_argument("--max-delta-bytes", type=int, default=DEFAULT_MAX_DELTA_BYTES,
                        help="largest delta payload")
    parser.add_argument("--prefix-cache-tokens", type=int, default=EngineConfig.prefix_cache_tokens,
                        help="tokens of prompts and responses kept so that a prompt starting with them prefills "
                             "only the rest (multi-turn, GRPO groups, shared system prompts); 0: off")
    parser.add_argument("--batching", choices=("continuous", "waves"), default="continuous",
                        help="continuous: requests join the running batch as rows finish (the faster the more "
                             "response lengths differ); waves: each waits for the next batch")
    parser.add_argument("--join-free-share", type=float, default=EngineConfig.join_free_share,
                        help="continuous batching: waiting requests join the running batch once this share of "
                             "its rows is free (0: at every free row)")
    parser.add_argument("--batch-window-ms", type=float, default=DEFAULT_WINDOW_S * 1000,
                        help="how long an idle engine waits for a burst of requests to finish arriving (0: not at all)")


def run(args, name):
    from orthon.core.errors import ConfigError
    from orthon.engine.in_process import EngineConfig
    from orthon.engine.server import serve
    from orthon.rl.chat import ChatTemplate
    from orthon.launch.threads import set_threads

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port: {args.port} is not a TCP port")
    if args.max_body_bytes < 1 or args.max_delta_bytes < 1:
        raise ConfigError("--max-body-bytes and --max-delta-bytes must be positive")
    if not 0 <= args.batch_window_ms <= 1000:
        raise ConfigError(f"--batch-window-ms: must be in 0..1000, got {args.batch_window_ms}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads: must be >= 1, got {args.threads}")
        set_threads(args.threads)
    engine = EngineConfig(max_batch_size=args.max_batch_size, max_length=args.max_length,
                          prefix_cache_tokens=args.prefix_cache_tokens, join_free_share=args.join_free_share)
    serve(args.weights_dir, args.host, args.port, engine, args.tokenizer, args.max_body_bytes,
          args.max_delta_bytes, args.batch_window_ms / 1000, log=lambda line: print(line, flush=True),
          chat=ChatTemplate(), continuous=args.batching == "continuous")
    return 0
