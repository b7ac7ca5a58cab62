"""Long-context evaluation: prompt construction, scoring, perplexity by position against a direct
computation, and the report (table, JSON, heat map) from `orthon midtrain --eval`."""
import json
import math
import re
import urllib.request

import pytest
import torch
import torch.nn.functional as F
import yaml

from hf_reference import small_config
from plot_support import colormap_colour, cycle_colour, pixels_of, read_png
from test_data_support import corpus_texts, make_store, run_cli, train_tiny_tokenizer
from orthon.core.config import to_dict
from orthon.pretrain.recipe import Recipe
from orthon.midtrain.config import LongEvalConfig
from orthon.midtrain.eval import (answer_matches, answer_nll, copy_nll, evaluate_run, greedy_continuations,
                                  needle_answer, place_needle, repeated_sequences, resolve_run)
from orthon.engine.in_process import EngineConfig, InProcessEngine
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.weights import save_weights


pytestmark = pytest.mark.usefixtures("one_thread")


def test_place_needle_length_and_depth():
    filler = list(range(100, 200))
    needle, question = [1, 2, 3], [7, 8]
    for length in (20, 57):
        room = length - 5
        for depth, at in ((0.0, 0), (1.0, room), (0.5, round(room / 2))):
            prompt = place_needle(filler, needle, question, length, depth)
            assert len(prompt) == length
            assert prompt[at : at + 3] == needle and prompt[-2:] == question
            assert prompt[:at] + prompt[at + 3 : -2] == filler[:room]  # filler kept in order
    with pytest.raises(ValueError, match="too short"):
        place_needle(filler, needle, question, 4, 0.5)


def test_answer_matching():
    assert answer_matches(" 71432\n", "71432") and answer_matches("71432)", "71432")
    assert not answer_matches(" 7143", "71432") and not answer_matches(" 71433", "71432")


def test_needle_answer_is_the_needle_after_the_shared_prefix():
    assert needle_answer([5, 6, 7, 8, 9], [5, 6, 7]) == (3, [8, 9])
    # A tokenizer may merge the question's last piece with the key: the answer starts where they part.
    assert needle_answer([5, 6, 11, 8, 9], [5, 6, 7]) == (2, [11, 8, 9])
    assert needle_answer([4, 5], [5]) == (0, [4, 5])


def test_answer_nll_matches_direct_cross_entropy():
    model = GLMForCausalLM(small_config("dsa", vocab_size=64, initializer_range=0.2)).eval()
    g = torch.Generator().manual_seed(0)
    filler = torch.randint(3, 64, (200,), generator=g).tolist()
    question = [40, 41]
    # Three needles: the question as prefix (answer of 3), a shorter shared prefix (answer of 4, the
    # scored sequence one token shorter) and an answer of 2: rows of different lengths.
    needles = [[40, 41, 7, 8, 9], [40, 50, 7, 8, 9], [40, 41, 7, 2]]
    prompts = [place_needle(filler[i:], n, question, 30, 0.3) for i, n in enumerate(needles)]
    got = answer_nll(model, prompts, question, needles, chunk=7)
    for prompt, needle, value in zip(prompts, needles, got):
        n, answer = needle_answer(needle, question)
        seq = torch.tensor([prompt[: 30 - 2 + n] + answer])
        with torch.no_grad():
            nll = F.cross_entropy(model(seq).logits[0, :-1], seq[0, 1:], reduction="none")
        assert value == pytest.approx(float(nll[-len(answer):].sum()), rel=1e-5)
    assert got[0] != pytest.approx(got[2])


def _greedy_by_full_forward(model, prompt, n):
    """n greedy tokens, each from a full uncached forward over everything so far."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_batched_greedy_equals_single_prompt_full_forward():
    torch.manual_seed(0)
    model = GLMForCausalLM(small_config("dsa", index_topk=8, initializer_range=0.2)).eval()
    prompts = torch.randint(0, model.config.vocab_size, (3, 20)).tolist() + [list(range(40, 53))]  # mixed lengths
    batched = greedy_continuations(InProcessEngine(model), prompts, 6)
    assert batched == [_greedy_by_full_forward(model, p, 6) for p in prompts]
    assert all(len(a) == 6 for a in batched) and len({tuple(a) for a in batched}) == 4
    with pytest.raises(ValueError, match="20 tokens leave no room"):
        greedy_continuations(InProcessEngine(model, EngineConfig(max_length=20)), prompts[:1], 6)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as pretraining leaves one: config.yaml naming a tokenizer and a held-out store,
    and final/ weights."""
    from orthon.data.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("eval_run")
    tok_path = train_tiny_tokenizer(tmp)
    tok = load_tokenizer(tok_path)
    docs = [tok.encode(t) + [tok.eos_id] for t in corpus_texts(n_arith_docs=10, code_mb=0.02)]
    store = make_store(tmp / "valid", [docs], vocab=tok.vocab_size, eos_id=tok.eos_id)
    recipe = Recipe(model=small_config("dsa", vocab_size=tok.vocab_size, index_topk=16))
    data = to_dict(recipe)
    data["data"].update(tokenizer=str(tok_path), valid=[{"path": str(store), "name": "valid"}], seq_len=32)
    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    save_weights(GLMForCausalLM(recipe.model), run / "final")
    return run


def test_perplexity_by_position_matches_direct_computation(run_dir):
    from orthon.data.loader import ValidData
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.weights import load_weights

    cfg = LongEvalConfig(lengths=[48], depths=[0.0, 1.0], trials=2, ppl_length=48, ppl_buckets=4, ppl_samples=3)
    result = evaluate_run(run_dir, cfg, log=lambda *_: None)
    assert set(result["passkey"]) == {48} and set(result["passkey"][48]) == {0.0, 1.0}
    assert all(a in (0.0, 0.5, 1.0) for a in result["passkey"][48].values())
    # An untrained model's answer costs about ln(vocab) nats per token, well above ln 10 per digit.
    nats = result["passkey_answer_nll"][48]
    assert set(nats) == {0.0, 1.0} and all(v > math.log(10) for v in nats.values())

    recipe = load_recipe(run_dir / "config.yaml")
    model = load_weights(run_dir / "final").eval()
    from dataclasses import replace

    batch = next(ValidData(replace(recipe.data, seq_len=48), max_samples=3).batches(3))
    with torch.no_grad():
        nll = F.cross_entropy(model(batch.input_ids).logits.transpose(1, 2), batch.labels, reduction="none",
                              ignore_index=-100)
    keep = (batch.labels != -100).float()
    for b, (lo, hi) in zip(result["ppl_by_position"], [(0, 12), (12, 24), (24, 36), (36, 48)]):
        assert (b["start"], b["end"]) == (lo, hi)
        expected = math.exp(float((nll[:, lo:hi] * keep[:, lo:hi]).sum() / keep[:, lo:hi].sum()))
        assert b["ppl"] == pytest.approx(expected, rel=1e-4)


def test_repeated_sequences_and_copy_nll_match_direct_computation():
    ids = repeated_sequences(3, 11, vocab_size=50, seed=0)
    assert ids.shape == (3, 11) and int(ids.min()) >= 3 and int(ids.max()) < 50
    assert torch.equal(ids[:, 1:6], ids[:, 6:])  # odd length: one random id, then the half twice
    assert not torch.equal(ids[0], ids[1])
    assert torch.equal(repeated_sequences(3, 11, 50, seed=0), ids)

    model = GLMForCausalLM(small_config("dsa", vocab_size=64)).eval()
    cfg = LongEvalConfig(lengths=[16, 21])
    result = copy_nll(model, cfg, n=2)
    for length in (16, 21):
        x = repeated_sequences(2, length, 64, cfg.seed)
        with torch.no_grad():
            nll = F.cross_entropy(model(x).logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        h0, half = length % 2, length // 2
        # Targets x[h0 + 1 .. h0 + half - 1] (the first half after its first token) and
        # x[h0 + half + 1 ..] (the repeat after its first token).
        assert result[length]["first"] == pytest.approx(float(nll[:, h0 : h0 + half - 1].mean()), rel=1e-5)
        assert result[length]["repeat"] == pytest.approx(float(nll[:, h0 + half :].mean()), rel=1e-5)


def test_cli_eval_writes_table_json_and_heat_map(run_dir, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"stages": [{"name": "a", "seq_len": 32, "tokens": 64}],
                                    "eval": {"lengths": [32, 64], "depths": [0.0, 0.5, 1.0], "trials": 2,
                                             "ppl_length": 64, "ppl_buckets": 2, "ppl_samples": 2}}))
    assert run_cli("midtrain", ["--eval", str(run_dir), "-c", str(plan), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert list(report) == ["run"] and list(report["run"]["passkey"]) == ["32", "64"]
    r = report["run"]
    table = (tmp_path / "out" / "eval.txt").read_text()
    assert "L=32" in table and "L=64" in table and "perplexity by position" in table and "copying" in table
    # The table prints the report's numbers (2 decimals): passkey rows (2 trials a cell: 0, 1/2 or 1) with
    # their mean, perplexity by position over 2 buckets of 64, and copying NLLs.
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if "passkey accuracy" in line)
    for line, (length, row) in zip(lines[at + 1 : at + 3], r["passkey"].items()):
        assert set(row) == {"0.0", "0.5", "1.0"} and all(a in (0.0, 0.5, 1.0) for a in row.values())
        values = [*row.values(), sum(row.values()) / 3]
        assert line.split() == [f"L={length}", *(f"{a:.2f}" for a in values)]
    assert [(b["start"], b["end"]) for b in r["ppl_by_position"]] == [(0, 32), (32, 64)]
    ppl = next(line for line in lines if "perplexity by position" in line)
    assert re.findall(r"\[(\d+),(\d+)\): (\S+)", ppl) == [(str(b["start"]), str(b["end"]), f"{b['ppl']:.2f}")
                                                         for b in r["ppl_by_position"]]
    copying = next(line for line in lines if "copying" in line)
    assert re.findall(r"L=(\d+): (\S+) / (\S+)", copying) == [(L, f"{c['first']:.2f}", f"{c['repeat']:.2f}")
                                                              for L, c in r["copy_nll"].items()]
    assert "nats per key digit" in table and set(report["run"]["passkey_answer_nll"]) == {"32", "64"}
    assert set(report["run"]["copy_nll"]) == {"32", "64"}
    heads = report["run"]["heads"]
    assert set(heads) == {"32", "64"} and "previous-token" in table and "induction" in table
    for h in heads.values():
        assert len(h["layers"]) == 3 and all(0 <= x[key] <= 1 for x in h["layers"] for key in x)
    # The tiny test model is untrained: its attention is near uniform, as the uniform levels say.
    assert heads["64"]["uniform_previous_token"] == pytest.approx(sum(1 / (t + 1) for t in range(1, 64)) / 63)
    # The figure: one heat map and the perplexity panel, (4.2 * 2) x 3.8 inches at 110 dpi. Every passkey
    # accuracy in the report is painted in its viridis colour, and the perplexity curve in the first line colour.
    image = read_png(tmp_path / "out" / "eval.png")
    assert image.shape == (418, 924, 3)
    for accuracy in {a for row in r["passkey"].values() for a in row.values()}:
        assert pixels_of(image, colormap_colour("viridis", accuracy)) > 500, accuracy
    assert pixels_of(image, cycle_colour(0)) > 20


def test_resolve_run_errors_name_the_directory(tmp_path):
    from orthon.core.errors import CheckpointError  # an OrthonError: the CLI prints it as one line

    with pytest.raises(CheckpointError, match="not a run directory"):
        resolve_run(tmp_path)


def test_eval_of_a_served_model_answers_as_the_in_process_one(run_dir, tmp_path):
    """`--eval RUN --engine URL`: the passkey prompts of RUN go to `orthon serve` of RUN's weights; the
    greedy answers, so the accuracy grid, are the in-process evaluation's; what needs the weights is left
    out, and the report says where the model was served."""
    from server_support import ServerProcess

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"stages": [{"name": "a", "seq_len": 32, "tokens": 64}],
                                    "eval": {"lengths": [32, 64], "depths": [0.0, 1.0], "trials": 3,
                                             "ppl_length": 64, "ppl_buckets": 2, "ppl_samples": 2}}))
    server = ServerProcess(run_dir / "final", tmp_path / "server.log").wait()
    try:
        assert run_cli("midtrain", ["--eval", str(run_dir), "-c", str(plan), "--engine", server.url,
                                    "--out", str(tmp_path / "served")]) == 0
        with urllib.request.urlopen(f"{server.url}/get_server_info") as answer:
            assert json.load(answer)["batching"]["requests"] == 2 * 2 * 3  # lengths x depths x trials, all served
    finally:
        server.stop()
    assert run_cli("midtrain", ["--eval", str(run_dir), "-c", str(plan), "--out", str(tmp_path / "local")]) == 0
    served, local = (json.loads((tmp_path / d / "eval.json").read_text())["run"] for d in ("served", "local"))
    assert served["passkey"] == local["passkey"] and served["served_by"] == server.url
    assert set(served) == {"run", "served_by", "train_seq_len", "passkey"}
    table = (tmp_path / "served" / "eval.txt").read_text()
    assert f"served at {server.url}" in table and "perplexity" not in table
    assert read_png(tmp_path / "served" / "eval.png").shape == (418, 462, 3)  # the heat map alone
    from orthon.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--engine URL goes with --eval and one RUN"):
        run_cli("midtrain", ["--eval", str(run_dir), str(run_dir), "--engine", server.url])
