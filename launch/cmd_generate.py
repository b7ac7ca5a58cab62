"""`orthon generate RUN_DIR --prompt "def "`: sample text from a run's final model, through the
in-process engine (orthon.engine), the same generation path as RL rollouts and the passkey eval.
RUN_DIR may also be a weights directory (what `orthon export` writes) holding its tokenizer, or
any weights directory with `--tokenizer`."""
from __future__ import annotations

from pathlib import Path


def register(parser, name):
    parser.add_argument("run_dir", help="a run directory, or a weights directory (config.json + safetensors)")
    parser.add_argument("--tokenizer", help="the tokenizer (default: the run's, or the weights directory's own)")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end once the text contains TEXT, which is not printed (repeatable; e.g. --stop $'\\n\\n')")


def sample_text(run_dir, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 40,
                top_p: float = 1.0, seed: int = 0, tokenizer=None, stop: tuple[str, ...] = (), on_text=None) -> str:
    """The prompt and its continuation by the run's final model (RUN_DIR/final, the tokenizer its
    config.yaml names) or a weights directory's model (its own tokenizer), ending at the tokenizer's
    end-of-sequence token, before the first of the ``stop`` strings, or after max_new_tokens.
    ``tokenizer`` replaces the one found there. ``on_text`` gets the continuation in pieces as it is
    generated (their sum is the continuation)."""
    from orthon.core.errors import OrthonError
    from orthon.data.tokenizer import load_tokenizer
    from orthon.engine.control import RequestControl
    from orthon.engine.in_process import InProcessEngine
    from orthon.engine.sampling import SamplingParams
    from orthon.engine.stop_strings import response_text, settled_text
    from orthon.launch.args import check_weights_fit
    from orthon.pretrain.weights import load_config, load_weights, weights_tokenizer

    if not prompt:
        # The engine continues token ids and an empty prompt has none (which start token a model knows,
        # a bos or the eos that ends orthon's documents, depends on how it was trained): said before loading.
        raise OrthonError("--prompt: empty; give some text to continue, e.g. --prompt \"def \"")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OrthonError(f"{run_dir}: no such run directory (give the train.run_dir of a finished run, "
                          f"e.g. runs/tiny after `orthon pretrain -c configs/tiny.yaml`)")
    weights = run_dir  # a weights directory
    if not (run_dir / "config.json").is_file():
        for need in ("config.yaml", "final"):
            if not (run_dir / need).exists():
                raise OrthonError(f"{run_dir}: not a finished run directory (no {need}) nor a weights "
                                  f"directory (no config.json)")
        weights = run_dir / "final"
    check_weights_fit(load_config(weights), "generate")
    tokenizer = tokenizer or weights_tokenizer(weights)
    if tokenizer is None:
        raise OrthonError(f"{weights}: no tokenizer in the weights directory or named by its run; pass --tokenizer")
    tokenizer = load_tokenizer(tokenizer)
    eos = tokenizer.eos_id
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=() if eos is None else (eos,), seed=seed, stop=tuple(stop))
    shown = 0  # characters of the continuation handed to on_text

    def show(tokens):
        nonlocal shown
        text = settled_text(tokenizer.decode(tokens), stop)
        if len(text) > shown:
            on_text(text[shown:])
            shown = len(text)

    control = None if on_text is None else RequestControl(on_tokens=show)
    engine = InProcessEngine(load_weights(weights), tokenizer=tokenizer)
    result = engine.generate([tokenizer.encode(prompt)], params, controls=[control])[0]
    if not result.ok:
        raise OrthonError(f"--prompt: {result.error.removeprefix('prompt 0: ')}")
    text = response_text(result, tokenizer.decode)  # the eos or the stop string is not text
    if on_text is not None:
        on_text(text[shown:])
    return prompt + text


def run(args, name):
    """Prints the prompt, then the continuation as it is generated."""
    started = False

    def show(piece):
        nonlocal started
        if not started:  # once the model has loaded: an error before that prints nothing
            print(args.prompt, end="", flush=True)
            started = True
        print(piece, end="", flush=True)

    sample_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                args.seed, args.tokenizer, tuple(args.stop), on_text=show)
    print()
    return 0
