"""The Engine protocol on the in-process engine: weight updates from a state dict, an HF-layout directory,
a safetensors file and a delta payload (each changes weight_version and makes generation that of the
new weights), flush, health; rl's mapping of finish reasons; `orthon generate` through the engine."""
import pytest
import torch
import yaml

from hf_reference import small_config
from orthon.core.errors import CheckpointError
from orthon.engine import Engine, GenerationResult, InProcessEngine, SamplingParams, WeightDelta
from orthon.engine.protocol import FINISH_REASONS
from orthon.pretrain import GLMForCausalLM
from orthon.pretrain.weights import save_weights
from orthon.pretrain.logprobs import sequence_log_probs
from orthon.rl.sample import FINISH_STATUS, Sample, SampleStatus, to_sample

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 14, 3], [7, 7, 30, 41, 2, 19, 100], [60]]
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11, stop_token_ids=())


def _pair(case="moe", **overrides):
    """(model, other): two models of one config with different weights."""
    torch.manual_seed(0)
    model = GLMForCausalLM(small_config(case, **overrides)).eval()
    other = GLMForCausalLM(model.config).eval()
    other.reset_parameters(seed=123)
    return model, other


def _assert_results_of(engine, results, model):
    """The results are what a fresh engine on ``model`` generates, and their log-probs are model's."""
    fresh = InProcessEngine(model).generate(PROMPTS, SAMPLED)
    assert [r.tokens for r in results] == [r.tokens for r in fresh]
    for a, b in zip(results, fresh):
        assert torch.equal(a.log_probs, b.log_probs)
    with torch.no_grad():
        scored = sequence_log_probs(model, [p + r.tokens for p, r in zip(PROMPTS, results)],
                                    [len(r.tokens) for r in results])
    for row, r in enumerate(results):
        torch.testing.assert_close(scored.log_probs[row, : len(r.tokens)], r.log_probs, atol=1e-5, rtol=0)


def test_in_process_engine_is_an_engine_and_reports_health():
    model, _ = _pair()
    engine = InProcessEngine(model)
    assert isinstance(engine, Engine)
    assert not isinstance(object(), Engine)

    class NoFlush:
        weight_version = 0

        def generate(self, prompts, sampling=None):
            return []

        def update_weights(self, weights, version=None):
            return 0

        def health(self):
            return {}

    assert not isinstance(NoFlush(), Engine)
    health = engine.health()
    assert health["ok"] is True and health["weight_version"] == 0 and health["max_length"] == model.config.max_position_embeddings
    assert health["fused_decode"] is False and health["stats"]["requests"] == 0
    engine.generate(PROMPTS, SAMPLED)
    health = engine.health()
    assert health["fused_decode"] is True and health["stats"]["requests"] == 3
    assert health["stats"]["generated_tokens"] == 36 and health["stats"]["finished"] == {"length": 3}


def test_update_weights_from_a_state_dict():
    model, other = _pair()
    engine = InProcessEngine(model)
    before = engine.generate(PROMPTS, SAMPLED)
    assert all(r.weight_version == 0 for r in before)
    assert engine.update_weights(other.state_dict()) == 1 == engine.weight_version
    after = engine.generate(PROMPTS, SAMPLED)
    assert all(r.weight_version == 1 for r in after)
    _assert_results_of(engine, after, other)
    # Same request, same seed: only the weights changed, and with them the log-probs.
    assert all((a.log_probs[:1] - b.log_probs[:1]).abs().max() > 1e-3 for a, b in zip(before, after))
    # An explicit version is taken as given, also one below the current; the next update counts on from it.
    assert engine.update_weights({"lm_head.weight": other.lm_head.weight}, version=7) == 7
    assert engine.update_weights({"lm_head.weight": other.lm_head.weight}, version=3) == 3
    assert engine.update_weights({}) == 4
    with pytest.raises(ValueError, match="int >= 0"):
        engine.update_weights({}, version=-1)
    assert engine.weight_version == 4


@pytest.mark.parametrize("case", ["moe", "dsa"])  # moe: HF's per-expert tensors stack back into orthon's
def test_update_weights_from_an_hf_directory_and_a_safetensors_file(case, tmp_path):
    model, other = _pair(case)
    save_weights(other, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    engine = InProcessEngine(model)
    before = engine.generate(PROMPTS, SAMPLED)
    assert engine.update_weights(tmp_path / "hf", version=5) == 5 == engine.weight_version
    after = engine.generate(PROMPTS, SAMPLED)
    assert all(r.weight_version == 5 for r in after)
    _assert_results_of(engine, after, other)
    assert all((a.log_probs[:1] - b.log_probs[:1]).abs().max() > 1e-3 for a, b in zip(before, after))

    # Back to the first weights from one safetensors file (a str path this time).
    first = GLMForCausalLM(model.config).eval()
    first.reset_parameters(seed=7)
    save_weights(first, tmp_path / "first")
    assert engine.update_weights(str(tmp_path / "first" / "model.safetensors")) == 6
    _assert_results_of(engine, engine.generate(PROMPTS, SAMPLED), first)


def test_bad_weight_paths_change_nothing(tmp_path):
    model, _ = _pair()
    engine = InProcessEngine(model)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FileNotFoundError, match="no such weights"):
        engine.update_weights(tmp_path / "nosuch")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        engine.update_weights(tmp_path / "empty")
    wider = GLMForCausalLM(small_config("moe", hidden_size=model.config.hidden_size * 2))
    save_weights(wider, tmp_path / "wider")
    with pytest.raises(CheckpointError, match="shape"):
        engine.update_weights(tmp_path / "wider")
    smaller = GLMForCausalLM(small_config("moe", num_hidden_layers=model.config.num_hidden_layers - 1))
    save_weights(smaller, tmp_path / "smaller")
    with pytest.raises(CheckpointError, match="missing tensors"):
        engine.update_weights(tmp_path / "smaller")
    assert engine.weight_version == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())


class ScaleHead:
    """A delta payload: lm_head scaled by a factor."""

    def __init__(self, factor):
        self.factor = factor
        self.seen = None

    def apply_to(self, state_dict):
        self.seen = state_dict["lm_head.weight"].clone()
        return {"lm_head.weight": state_dict["lm_head.weight"] * self.factor}


class BadDelta:
    def apply_to(self, state_dict):
        return [("lm_head.weight", torch.zeros(3))]


def test_update_weights_from_a_delta_payload():
    model, _ = _pair()
    engine = InProcessEngine(model)
    head = model.lm_head.weight.detach().clone()
    delta = ScaleHead(2.0)
    assert isinstance(delta, WeightDelta) and not isinstance({}, WeightDelta)
    assert engine.update_weights(delta) == 1
    assert torch.equal(delta.seen, head) and torch.equal(model.lm_head.weight, head * 2)
    scaled = GLMForCausalLM(model.config).eval()
    scaled.load_state_dict(model.state_dict())
    _assert_results_of(engine, engine.generate(PROMPTS, SAMPLED), scaled)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(BadDelta())
    assert engine.weight_version == 1 and torch.equal(model.lm_head.weight, head * 2)


def test_flush_then_generate_gives_the_same_results():
    model, other = _pair("dsa", index_topk=8)  # decoding runs past index_topk
    engine = InProcessEngine(model)
    first = engine.generate(PROMPTS, SAMPLED)
    engine.flush()
    assert engine.health()["fused_decode"] is False
    again = engine.generate(PROMPTS, SAMPLED)
    assert [r.tokens for r in again] == [r.tokens for r in first]
    assert all(torch.equal(a.log_probs, b.log_probs) for a, b in zip(first, again))
    assert engine.weight_version == 0  # flushing is not a weight change


def test_finish_reasons_map_to_sample_statuses():
    assert set(FINISH_STATUS) == set(FINISH_REASONS)
    prompt = [4, 5, 6]
    expected = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "context": SampleStatus.TRUNCATED,
                "abort": SampleStatus.ABORTED, "rejected": SampleStatus.FAILED}
    for reason, status in expected.items():
        tokens = [] if reason == "rejected" else [8, 9]
        result = GenerationResult(prompt, tokens, torch.tensor([-0.5, -1.0])[: len(tokens)], reason, weight_version=3,
                                  error="bad" if reason == "rejected" else None)
        sample = to_sample(result, Sample("a", prompt))
        assert sample.status is status and sample.policy_version == 3
        assert sample.tokens == prompt + tokens and sample.response_length == len(tokens)
    assert to_sample(result, Sample("a", prompt)).metadata["error"] == "bad"
    with pytest.raises(ValueError, match="not this result's prompt"):
        to_sample(result, Sample("a", [4, 5]))
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult(prompt, [], torch.zeros(0), "done", weight_version=0)


# ---------------------------------------------------------------- orthon generate
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from orthon.core.config import to_dict
    from orthon.pretrain.recipe import Recipe
    from test_data_support import train_tiny_tokenizer

    tmp = tmp_path_factory.mktemp("generate_run")
    tok_path = train_tiny_tokenizer(tmp)
    from orthon.data.tokenizer import load_tokenizer

    recipe = Recipe(model=small_config("dsa", vocab_size=load_tokenizer(tok_path).vocab_size, initializer_range=0.2))
    data = to_dict(recipe)
    data["data"].update(tokenizer=str(tok_path))
    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    torch.manual_seed(0)
    save_weights(GLMForCausalLM(recipe.model), run / "final")
    return run


def test_generate_cli_greedy_is_the_models_greedy_continuation(run_dir, capsys):
    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.weights import load_weights
    from test_data_support import run_cli

    assert run_cli("generate", [str(run_dir), "--prompt", "def f(x):", "--temperature", "0",
                                "--max-new-tokens", "10"]) == 0
    printed = capsys.readouterr().out
    tokenizer = load_tokenizer(load_recipe(run_dir / "config.yaml").data.tokenizer)
    model = load_weights(run_dir / "final").eval()
    ids = tokenizer.encode("def f(x):")
    with torch.no_grad():
        for _ in range(10):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == tokenizer.eos_id:
                break
            ids.append(nxt)
    continuation = tokenizer.decode(ids[len(tokenizer.encode("def f(x):")):])
    assert printed == "def f(x):" + continuation + "\n"
    # --stop: the same continuation, cut before the first occurrence of the string.
    stop = continuation[len(continuation) // 2:][:2]
    assert run_cli("generate", [str(run_dir), "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens", "10",
                                "--stop", "@@", "--stop", stop]) == 0
    assert capsys.readouterr().out == "def f(x):" + continuation[:continuation.index(stop)] + "\n"
    # The command prints the continuation as it is generated: pieces that add up to it.
    from orthon.launch.cmd_generate import sample_text

    pieces = []
    whole = sample_text(run_dir, "def f(x):", 10, temperature=0.0, on_text=pieces.append)
    assert whole == "def f(x):" + continuation and "".join(pieces) == continuation and len(pieces) > 2

    def sampled(seed):
        run_cli("generate", [str(run_dir), "--prompt", "x = ", "--temperature", "1.0", "--top-k", "20",
                             "--top-p", "0.9", "--seed", str(seed), "--max-new-tokens", "12"])
        return capsys.readouterr().out

    assert sampled(0) == sampled(0) != sampled(1)


def test_generate_cli_names_a_missing_run_directory(tmp_path):
    from test_data_support import run_cli

    from orthon.core.errors import OrthonError

    with pytest.raises(OrthonError, match="nosuch: no such run directory"):
        run_cli("generate", [str(tmp_path / "nosuch")])
    (tmp_path / "half").mkdir()
    with pytest.raises(OrthonError, match="no config.yaml.* nor a weights directory"):
        run_cli("generate", [str(tmp_path / "half")])


def test_an_exported_model_carries_its_tokenizer_and_generates_as_the_run(run_dir, tmp_path, capsys):
    """`orthon export RUN` copies the run's tokenizer into the weights directory; `orthon generate` on that
    directory samples what it samples from the run; `orthon import` keeps the tokenizer; a weights
    directory without one asks for --tokenizer."""
    import shutil

    from test_data_support import run_cli

    from orthon.core.errors import OrthonError
    from orthon.pretrain.recipe import load_recipe

    tokenizer = load_recipe(run_dir / "config.yaml").data.tokenizer
    assert run_cli("export", [str(run_dir), "--out", str(tmp_path / "pub")]) == 0
    assert "tokenizer tiny.model" in capsys.readouterr().out
    assert (tmp_path / "pub" / "tokenizer.model").read_bytes() == open(tokenizer, "rb").read()
    assert run_cli("import", [str(tmp_path / "pub"), "--out", str(tmp_path / "imp")]) == 0
    capsys.readouterr()

    def sampled(source, *extra):
        assert run_cli("generate", [str(source), "--prompt", "x = ", "--seed", "3", "--max-new-tokens", "12",
                                    *extra]) == 0
        return capsys.readouterr().out

    from_run = sampled(run_dir)
    assert sampled(tmp_path / "pub") == sampled(tmp_path / "imp") == from_run
    assert sampled(run_dir / "final") == from_run  # its run names the tokenizer
    shutil.copytree(run_dir / "final", tmp_path / "bare")
    assert sampled(tmp_path / "bare", "--tokenizer", tokenizer) == from_run
    with pytest.raises(OrthonError, match="bare: no tokenizer in the weights directory or named by its run"):
        run_cli("generate", [str(tmp_path / "bare")])
