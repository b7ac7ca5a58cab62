"""The MindSpore backend against the torch model on CPU: the same logits, the same optimizer step, the
same weights format in both directions, and `orthon pretrain ... backend=mindspore` end to end."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("mindspore", reason="MindSpore is not installed (extra: pip install 'orthon[mindspore]')")

from hf_reference import randomize_router_bias, small_config  # noqa: E402
from orthon.backends.mindspore import build, from_hf, save_hf  # noqa: E402
from orthon.backends.mindspore.attention import deterministic_topk as ms_topk  # noqa: E402
from orthon.backends.mindspore.newton_schulz import newton_schulz as ms_newton_schulz  # noqa: E402
from orthon.backends.mindspore.optim import HybridOptimizer, plan_for_cell  # noqa: E402
from orthon.backends.mindspore.runtime import ms  # noqa: E402
from orthon.optim import OptimConfig, ScheduleConfig, build_for_model, plan_for_model  # noqa: E402
from orthon.optim.newton_schulz import newton_schulz as torch_newton_schulz  # noqa: E402
from orthon.pretrain import GLMForCausalLM, RuntimeOptions, load_weights, save_weights  # noqa: E402
from orthon.pretrain.topk import deterministic_topk as torch_topk  # noqa: E402

SEQ = 24  # longer than index_topk (8) in the DSA cases
CASES = {  # hf_reference's configurations, with sparse attention on where the model has DSA
    "dense": False, "moe": False, "moe_groups": False, "dsa": True, "indexshare": True,
}


def pair(case, sparse=False, seed=0, **overrides):
    """The torch model of hf_reference's ``case`` (random router biases) and a MindSpore cell holding
    its weights."""
    runtime = RuntimeOptions(sparse_attention=sparse)
    torch.manual_seed(seed)
    model = GLMForCausalLM(small_config(case, **overrides), runtime=runtime).eval()
    randomize_router_bias(model, seed)
    return model, build(model.config, runtime, model.state_dict())


def ids_for(model, shape=(2, SEQ), seed=1):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, shape)


def ms_ids(ids):
    return ms.Tensor(np.asarray(ids, np.int32))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_torch(case):
    model, cell = pair(case, sparse=CASES[case])
    ids = ids_for(model)
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).logits.numpy()
    ours = cell(ms_ids(ids)).asnumpy()
    assert ours.shape == (2, SEQ, model.config.vocab_size) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    if CASES[case]:  # the top-k selection matters here: dense attention gives other logits
        model.runtime.sparse_attention = False
        with torch.no_grad():
            dense = model(torch.from_numpy(ids)).logits.numpy()
        assert np.abs(dense - reference).max() > 1e-2


def test_packed_documents_match_torch():
    model, cell = pair("dsa", sparse=True)
    ids = ids_for(model)
    docs = np.repeat(np.array([[0] * 10 + [1] * 14, [0] * 3 + [1] * 21]), 1, axis=0)
    with torch.no_grad():
        reference = model(torch.from_numpy(ids), doc_ids=torch.from_numpy(docs)).logits.numpy()
    ours = cell.head(cell.hidden_states(ms_ids(ids), *cell.rope(SEQ), ms_ids(docs))[0]).asnumpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.abs(ours - cell(ms_ids(ids)).asnumpy()).max() > 1e-3  # the documents change the result


def test_dense_experts_equal_grouped():
    _, cell = pair("moe")
    ids = ms_ids(ids_for(cell))
    grouped = cell(ids).asnumpy()
    cell.set_grouped_experts(False)
    np.testing.assert_allclose(cell(ids).asnumpy(), grouped, atol=1e-5, rtol=0)


def test_deterministic_topk_matches_torch():
    rng = np.random.default_rng(0)
    # ReLU-like scores: many exact zeros, signed zeros, -inf (masked keys), a few repeated values.
    scores = np.maximum(rng.standard_normal((3, 5, 40)).astype(np.float32), 0)
    scores[0, 0, ::3] = -0.0
    scores[1, :, 30:] = -np.inf
    scores[2, 1] = 0.1
    scores[2, 1, 20:28] = 0.5
    expected = torch_topk(torch.from_numpy(scores), 12).numpy()
    ours = ms_topk(ms.Tensor(scores), 12).asnumpy()
    np.testing.assert_array_equal(ours, expected)
    # Ties go to the lower positions: the eight 0.5s in order, then the first four 0.1s.
    assert ours[2, 1].tolist() == list(range(20, 28)) + [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_newton_schulz_matches_torch(dtype):
    g = np.random.default_rng(0).standard_normal((6, 16, 40)).astype(np.float32)
    expected = torch_newton_schulz(torch.from_numpy(g), dtype=dtype, emulate_bf16=True).float().numpy()
    ours = ms_newton_schulz(ms.Tensor(g), dtype=dtype).asnumpy()
    if dtype == "fp32":
        np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)
    else:  # the same bf16 values but where fp32 summation order flips a rounding: one bf16 ulp
        assert (ours == expected).mean() > 0.999
        np.testing.assert_allclose(ours, expected, atol=2**-8, rtol=0)
    # Orthogonalised: singular values near 1 (the quintic's band), not the input's.
    singular = np.linalg.svd(ours, compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.3


def test_routing_is_the_torch_models():
    model, cell = pair("moe")
    cfg = OptimConfig()
    ours = [(r.name, r.optimizer, r.kind, r.split_rows) for r in plan_for_cell(cell, cfg).routes]
    theirs = [(r.name, r.optimizer, r.kind, r.split_rows) for r in plan_for_model(model, cfg).routes]
    assert sorted(ours) == sorted(theirs)
    split = {name for name, _, _, rows in ours if rows > 1}
    assert split == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(3) for p in ("q_b_proj", "kv_b_proj")}
    assert {o for n, o, _, _ in ours if n == "model.embed_tokens.weight" or n.endswith("norm.weight")} == {"adamw"}


def one_step(model, cell, cfg, schedule, ids, steps=2):
    """``steps`` optimizer steps of the mean next-token loss on both backends; the losses per step."""
    x, y = ids[:, :-1], ids[:, 1:].copy()
    y[0, :3] = -100
    count = int((y != -100).sum())
    torch_opt, ms_opt = build_for_model(model, cfg, schedule), HybridOptimizer(cell, cfg, schedule)
    cell.set_indexers_trainable(False)
    params = cell.trainable_params()
    cos, sin = cell.rope(x.shape[1])
    grad_fn = ms.value_and_grad(lambda a, b: cell.loss_and_loads(a, b, cos, sin)[0] / count, None, params)
    losses = []
    model.train()
    for step in range(steps):
        torch_opt.set_tokens(1000 * step)
        ms_opt.set_tokens(1000 * step)
        loss = model(torch.from_numpy(x), labels=torch.from_numpy(y), loss_reduction="sum").loss / count
        loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        ms_loss, grads = grad_fn(ms_ids(x), ms_ids(y))
        ms_opt.step({p.name: g for p, g in zip(params, grads)})
        losses.append((loss.item(), float(ms_loss)))
    return losses


def max_weight_difference(model, cell):
    state = model.state_dict()
    return max(float(np.abs(p.asnumpy() - state[p.name].numpy()).max()) for p in cell.get_parameters())


@pytest.mark.parametrize("ns_dtype,peak_lr", [("fp32", 0.02), ("bf16", 2e-4)])
def test_muon_split_step_matches_torch(ns_dtype, peak_lr):
    """Muon + Split on the hidden matrices (experts included), AdamW on the rest, two steps with a
    momentum: the same losses, and in fp32 the same weights to 1e-4. bf16 Newton-Schulz runs at GLM-5's
    peak LR: where float round-off in the gradients flips a bf16 rounding, the flip is amplified in the
    directions a low-rank gradient (an expert that saw few tokens) barely spans, and moves a few entries
    by up to a step's LR; so in bf16 all but 0.1% of the entries agree to 1e-5 and none is off by more
    than the peak LR (measured: 0.05% past 1e-5, the largest 0.7 of it)."""
    model, cell = pair("moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = OptimConfig(ns_dtype=ns_dtype, bf16_matmul="emulated")
    schedule = ScheduleConfig(peak_lr=peak_lr, floor_lr=peak_lr / 10, warmup_tokens=0, total_tokens=10**6)
    for torch_loss, ms_loss in one_step(model, cell, cfg, schedule, ids_for(model, (2, 17))):
        assert abs(torch_loss - ms_loss) < 1e-4
    if ns_dtype == "fp32":
        assert max_weight_difference(model, cell) < 1e-4
    else:
        state = model.state_dict()
        diff = np.concatenate([np.abs(p.asnumpy() - state[p.name].numpy()).ravel() for p in cell.get_parameters()])
        assert (diff > 1e-5).mean() < 1e-3 and diff.max() < peak_lr
    moved = max(float((model.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert moved > 50 * peak_lr * 1e-2  # the steps did move the weights, far beyond the tolerance's share


def test_checkpoints_cross_backends(tmp_path):
    model, _ = pair("indexshare", sparse=True)
    save_weights(model, tmp_path / "torch")
    cell = from_hf(tmp_path / "torch")
    assert cell.runtime.sparse_attention  # the sidecar's runtime travels too
    ids = ids_for(model)
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(cell(ms_ids(ids)).asnumpy(), reference, atol=1e-4, rtol=0)
    save_hf(cell, tmp_path / "ms")
    back = load_weights(tmp_path / "ms")
    for name, tensor in model.state_dict().items():  # bit-identical after a trip through MindSpore
        assert torch.equal(back.state_dict()[name], tensor), name
    assert json.loads((tmp_path / "ms" / "config.json").read_text())["indexer_types"] == ["full", "shared", "full", "shared"]


def test_bad_input_is_named():
    _, cell = pair("dense")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cell(ms_ids([[1, cell.config.vocab_size]]))
    with pytest.raises(ValueError, match=r"expected shape \(batch, seq\)"):
        cell(ms_ids([1, 2, 3]))


def test_missing_extra_names_it():
    code = ("import sys; sys.modules['mindspore'] = None\n"
            "from orthon.core.errors import ConfigError\n"
            "try:\n    import orthon.backends.mindspore\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "backend mindspore: MindSpore is not installed" in out and "orthon[mindspore]" in out


def test_recipe_backend_field():
    from orthon.core.errors import ConfigError
    from orthon.pretrain.recipe import load_recipe

    recipe = load_recipe(None, ["backend=mindspore", "mindspore.device_target=Ascend", "mindspore.mode=graph"])
    assert (recipe.backend, recipe.mindspore.device_target, recipe.mindspore.mode) == ("mindspore", "Ascend", "graph")
    assert load_recipe(None, []).backend == "torch"
    with pytest.raises(ConfigError, match="backend"):
        load_recipe(None, ["backend=jax"])
    with pytest.raises(ConfigError, match="mindspore.device_target"):
        load_recipe(None, ["mindspore.device_target=TPU"])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_pretrain_mindspore_tracks_torch_and_resumes(tmp_path):
    """`orthon pretrain ... backend=mindspore` (graph mode) on the loop tests' stores: the same first
    loss as the torch backend (same initial weights, same batch), then the same curve to float round-off
    (fp32 Newton-Schulz); a run resumed from its step-3 checkpoint logs what the uninterrupted one did;
    the final weights load in the torch backend and give the MindSpore cell's logits."""
    from pretrain_support import make_stores, write_recipe

    from orthon.launch.cli import main

    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "recipe.yaml", stores, tmp_path / "unused",
                          train={"max_steps": 5, "checkpoint_interval": 3, "eval_interval": 0, "log_sample_ids": False},
                          optim={"ns_dtype": "fp32"})
    runs = {}
    for backend in ("torch", "mindspore"):
        runs[backend] = tmp_path / backend
        assert main(["pretrain", "-c", str(recipe), f"backend={backend}", "mindspore.mode=graph",
                     f"train.run_dir={runs[backend]}", "--sample", ""]) == 0
    theirs, ours = ([r["loss"] for r in _metrics(runs[b]) if "loss" in r] for b in ("torch", "mindspore"))
    assert len(ours) == 5 and abs(ours[0] - theirs[0]) < 1e-4
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)
    assert ours[-1] < ours[0] - 0.3

    first = _metrics(runs["mindspore"])
    import shutil

    shutil.rmtree(runs["mindspore"] / "checkpoints" / "step_5")
    assert main(["pretrain", "--resume", str(runs["mindspore"]), "--sample", ""]) == 0
    resumed = _metrics(runs["mindspore"])
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in resumed if "loss" in r], [r["loss"] for r in first if "loss" in r],
                               atol=1e-6, rtol=0)

    model, cell = load_weights(runs["mindspore"] / "final"), from_hf(runs["mindspore"] / "final")
    ids = ids_for(model, (1, 32))
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(cell(ms_ids(ids)).asnumpy(), reference, atol=1e-4, rtol=0)
