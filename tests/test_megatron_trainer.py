"""`orthon pretrain ... backend=megatron`: the one Trainer over megatron-core's GPTModel.

Run through the CLI in fresh processes (no test patch: the backend points megatron's CUDA device at the CPU
itself). From the same seed both backends start from the same weights, so the same recipe must give the
torch backend's losses, MoE loads and final weights (megatron's MLA, MoE and fused cross-entropy against
orthon's, float summation order apart); a resumed megatron run must repeat the straight one bit for bit;
what the Trainer cannot yet drive on megatron is refused by name before anything is built."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

from orthon.pretrain import GLMForCausalLM, ModelConfig, RuntimeOptions
from orthon.pretrain.weights import load_weights, save_weights
from orthon.rl.tasks import ArithmeticTask
from pretrain_support import MODEL, losses, make_stores, orthon, resumed_from, write_recipe
from test_data_support import train_tiny_tokenizer

pytest.importorskip("megatron.core")

STEPS = 6


def _even_length(response: str, label: str) -> float:
    return float(len(response) % 2 == 0)


class EvenLengthTask(ArithmeticTask):
    """Arithmetic prompts rewarded for an even number of characters: about half of a random policy's
    answers pass, so most groups have mixed rewards and every update moves the weights."""

    reward_fn = staticmethod(_even_length)


def _records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_megatron_backend_trains_as_the_torch_backend(tmp_path):
    stores = make_stores(tmp_path / "data")
    runs = {}
    for backend in ("torch", "megatron"):
        runs[backend] = tmp_path / backend
        recipe = write_recipe(tmp_path / f"{backend}.yaml", stores, runs[backend], train={"max_steps": STEPS})
        # Newton-Schulz in fp32: in bf16 the two backends' float-order differences would flip roundings
        orthon("pretrain", "-c", recipe, f"backend={backend}", "optim.ns_dtype=fp32")
    ref, got = ([r for r in _records(run) if "loss" in r] for run in (runs["torch"], runs["megatron"]))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-6)  # 2e-7 measured; the losses move by ~1.8
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["moe_load_max_over_mean"] == pytest.approx(a["moe_load_max_over_mean"], abs=1e-6)  # same routing
        assert b["max_attn_logit"] == pytest.approx(a["max_attn_logit"], rel=1e-5)  # orthon's SDPA core attention
        assert b["batch_tokens"] == a["batch_tokens"] and b["lr"] == a["lr"]  # the same ramp and schedule
    assert got[-1]["loss"] < got[0]["loss"] - 0.3
    evals = [json.loads(line).get("eval_loss") for run in runs.values()
             for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 4 and evals[2] == pytest.approx(evals[0], abs=2e-6) and evals[3] == pytest.approx(evals[1], abs=2e-6)
    # final/ is orthon's weights format whatever trained it: orthon's model loads both, and they agree,
    # the untrained DSA indexer (which megatron's dense model carries beside it) included, bit for bit.
    ours, theirs = load_weights(runs["torch"] / "final"), load_weights(runs["megatron"] / "final")
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    indexer = [k for k in a if ".indexer." in k]
    assert indexer and all(torch.equal(a[k], b[k]) for k in indexer)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst


def test_megatron_run_resumes_and_recomputes_bit_for_bit(tmp_path):
    """A resumed megatron run repeats the straight one bit for bit; so does one that recomputes each layer in
    the backward (runtime.activation_checkpointing: megatron's full recompute, on the CPU too)."""
    stores = make_stores(tmp_path / "data")
    ref_dir, run_dir, recomputed = tmp_path / "ref", tmp_path / "run", tmp_path / "recomputed"
    orthon("pretrain", "-c", write_recipe(tmp_path / "ref.yaml", stores, ref_dir, train={"max_steps": STEPS}),
           "backend=megatron")
    orthon("pretrain", "-c", write_recipe(tmp_path / "recomputed.yaml", stores, recomputed, train={"max_steps": STEPS}),
           "backend=megatron", "runtime.activation_checkpointing=true")
    assert losses(recomputed) == losses(ref_dir)
    orthon("pretrain", "-c", write_recipe(tmp_path / "run.yaml", stores, run_dir, train={"max_steps": 4}),
           "backend=megatron")
    out = orthon("pretrain", "--resume", run_dir, f"train.max_steps={STEPS}")
    assert resumed_from(out.stdout + out.stderr) == (run_dir / "checkpoints" / "step_00000004", 4)
    assert losses(run_dir) == losses(ref_dir)  # the same floats, not merely close
    a, b = (load_weights(d / "final").state_dict() for d in (ref_dir, run_dir))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("override, message", [
    ("megatron.tensor_parallel=2", "megatron.tensor_parallel = 2 does not divide the 1 rank (start it under"),
    ("megatron.pipeline_parallel=2", "megatron.pipeline_parallel = 2 does not divide the 1 rank"),
    ("megatron.virtual_pipeline_parallel=2", "megatron.virtual_pipeline_parallel = 2: model chunks interleave over "
                                             "pipeline stages; set megatron.pipeline_parallel > 1 too"),
    ("megatron.pipeline_parallel=2 model.tie_word_embeddings=true",
     "megatron.pipeline_parallel = 2 with model.tie_word_embeddings: the first and last stages' copies"),
    ("train.parallel=fsdp", "train.parallel = fsdp: the megatron backend runs data parallel (DDP) with megatron's own"),
    ("runtime.sparse_attention=true", "runtime.sparse_attention: the megatron backend runs dense MLA"),
    ("data.document_mask=true", "data.document_mask: megatron-core's local attention is plainly causal"),
])
def test_what_the_trainer_cannot_drive_on_megatron_is_refused_by_name(tmp_path, override, message):
    stores = make_stores(tmp_path / "data")
    recipe = write_recipe(tmp_path / "r.yaml", stores, tmp_path / "run")
    out = orthon("pretrain", "-c", recipe, "backend=megatron", *override.split(), check=False)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def _policy(tmp_path, layers: int = MODEL["num_hidden_layers"]):
    """A random policy with a tokenizer, as `orthon rl --from` takes it (dense MLA: pretraining's runtime)."""
    pre = tmp_path / "pre"
    tok = train_tiny_tokenizer(tmp_path / "tok", vocab_size=512)
    torch.manual_seed(0)
    config = ModelConfig(**{**MODEL, "vocab_size": 512, "num_hidden_layers": layers})
    save_weights(GLMForCausalLM(config, runtime=RuntimeOptions(sparse_attention=False)), pre / "final")
    (pre / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(tok)}}))
    return pre


def _rl_recipe(tmp_path, run_dir):
    recipe = tmp_path / f"{run_dir.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "train": {"run_dir": str(run_dir), "progress": False, "micro_batch_size": 6},
        "schedule": {"peak_lr": 1e-3, "floor_lr": 1e-3, "warmup_steps": 1},
        "rl": {"iterations": 3, "prompts_per_iteration": 3, "max_new_tokens": 8, "eval_interval": 3,
               "task": "test_megatron_trainer.EvenLengthTask",
               "engine": {"logprobs": "decode"}, "task_args": {"difficulty": 1, "eval_size": 6},
               "buffer": {"num_repeat_per_sample": 4}}}))
    return recipe


def test_rl_on_megatron_samples_and_trains_as_on_torch(tmp_path):
    """`orthon rl ... backend=megatron`: the policy trains on megatron-core (in one process; tensor parallel
    over two ranks, whose micro-batches, sized by their samples, are padded to a multiple of TP for sequence
    parallelism; expert parallel over two ranks, whose micro-batches are padded to one shape for megatron's
    allgather dispatcher; pipeline parallel over two ranks, megatron's schedule running RL's micro-batches
    of any shape, the policy loss on the second stage), the in-process engine (orthon's own) generates with
    the weights it hands over.
    The engine's log-probs of its samples against megatron's forward of them (logp_abs_diff, what IcePop
    guards) stay at float round-off, and every iteration samples, rewards and trains as the torch backend
    does, its KL to a frozen reference (megatron's model, placed as the policy) too."""
    pre = _policy(tmp_path)
    runs = {"torch": (1, ["backend=torch"]), "megatron": (1, ["backend=megatron"]),
            # two ranks of one tensor-parallel replica: both train on every sample, each counted once
            "megatron_tp": (2, ["backend=megatron", "megatron.tensor_parallel=2"]),
            # two data-parallel ranks holding half the experts each, micro-batches padded to one shape
            "megatron_ep": (2, ["backend=megatron", "megatron.expert_parallel=2"]),
            # two pipeline stages: the policy loss on the second, the rescoring forward-only through both
            "megatron_pp": (2, ["backend=megatron", "megatron.pipeline_parallel=2"])}
    for name, (ranks, overrides) in runs.items():
        out = orthon("rl", "-c", _rl_recipe(tmp_path, tmp_path / name), "--from", pre, *overrides, "optim.ns_dtype=fp32",
                     "rl.loss.kl_coef=0.5", nproc=ranks)
        # the KL reference is megatron's model too, each rank holding the policy's parts of it
        placed = f"KL reference: {pre / 'final'}, placed as the policy" + (": sharded" if ranks > 1 else "\n")
        assert placed in out.stdout + out.stderr, name
    ref = [r for r in _records(tmp_path / "torch") if "reward_mean" in r]
    assert len(ref) == 3 and all(r["groups_all_equal"] < 1 for r in ref)  # groups of mixed rewards: real updates
    for name in ("megatron", "megatron_tp", "megatron_ep", "megatron_pp"):
        got = [r for r in _records(tmp_path / name) if "reward_mean" in r]
        assert len(got) == 3
        for a, b in zip(ref, got):
            assert b["trained_ids"] == a["trained_ids"] and b["reward_mean"] == a["reward_mean"]
            assert b["trained_tokens"] == a["trained_tokens"]
            assert b["logp_abs_diff"] < 1e-5 and b["logp_mismatch_max"] < 1e-4  # engine (orthon) vs trainer (megatron)
            assert b["entropy"] == pytest.approx(a["entropy"], abs=1e-5)
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-9)  # to the reference, placed as the policy
    assert ref[0]["kl"] == 0 and ref[-1]["kl"] > 1e-5  # the first update starts from the reference
    evals = [[r["eval_reward"] for r in _records(tmp_path / name) if "eval_reward" in r] for name in runs]
    assert all(e == evals[0] for e in evals) and len(evals[0]) == 2


def test_rl_on_megatron_runs_the_interleaved_pipeline(tmp_path):
    """RL's micro-batches, sized by their samples, through megatron's interleaved schedule (two pipeline ranks of
    two model chunks each, four layers): each padded to the step's largest shape (the schedule exchanges one),
    a step of fewer micro-batches than stages given an empty one (a weight-0 forward). Every iteration
    samples, rewards and trains as one megatron process does."""
    pre = _policy(tmp_path, layers=4)
    # (ranks, samples a micro-batch): 12 samples an update as 5 + 5 + 2 (rows padded to 5), or as one
    # micro-batch (an empty one added for the second stage)
    runs = {"one": (1, 4), "vp": (2, 5), "vp_single": (2, 12)}
    for name, (ranks, size) in runs.items():
        layout = ["megatron.pipeline_parallel=2", "megatron.virtual_pipeline_parallel=2"] if ranks > 1 else []
        orthon("rl", "-c", _rl_recipe(tmp_path, tmp_path / name), "--from", pre, "backend=megatron",
               "optim.ns_dtype=fp32", f"train.micro_batch_size={size}", *layout, nproc=ranks)
    ref, got, single = ([r for r in _records(tmp_path / name) if "reward_mean" in r] for name in runs)
    assert len(ref) == len(got) == len(single) == 3 and all(r["groups_all_equal"] < 1 for r in ref)
    assert {r["micro_batches"] for r in got} == {3} and {r["micro_batches"] for r in single} == {1}
    for a, b, c in zip(ref, got, single):
        for other in (b, c):
            assert other["trained_ids"] == a["trained_ids"] and other["reward_mean"] == a["reward_mean"]
            assert other["trained_tokens"] == a["trained_tokens"]
            assert other["entropy"] == pytest.approx(a["entropy"], abs=1e-5)
            assert other["logp_abs_diff"] == pytest.approx(a["logp_abs_diff"], abs=1e-6)


@pytest.mark.slow  # about 60 s: runs of 1, 2 and three of 4 ranks on 2 cores
def test_megatron_pipeline_with_data_tensor_and_expert_parallelism_over_four_ranks(tmp_path):
    """Four torchrun ranks (gloo), two pipeline stages each with two data-parallel replicas (the stages
    average their own gradients: no DDP wraps a pipelined model), two tensor-parallel ranks, or two
    expert-parallel ranks: the losses of the same layout without the pipeline."""
    stores = make_stores(tmp_path / "data")
    runs = {"one": ([], 1), "dp": ([], 2), "pp_dp": (["megatron.pipeline_parallel=2"], 4),
            "pp_tp": (["megatron.pipeline_parallel=2", "megatron.tensor_parallel=2"], 4),
            "pp_ep": (["megatron.pipeline_parallel=2", "megatron.expert_parallel=2"], 4)}
    for name, (overrides, ranks) in runs.items():
        orthon("pretrain", "-c", write_recipe(tmp_path / f"{name}.yaml", stores, tmp_path / name, train={"max_steps": STEPS}),
               "backend=megatron", "optim.ns_dtype=fp32", *overrides, nproc=ranks)
    # TP x PP over four ranks is one data-parallel replica (one process's batches); the others two
    for name, reference in (("pp_dp", "dp"), ("pp_tp", "one"), ("pp_ep", "dp")):
        got, want = losses(tmp_path / name), losses(tmp_path / reference)
        assert sorted(got) == list(range(1, STEPS + 1))
        assert all(got[s] == pytest.approx(want[s], abs=2e-6) for s in want), (name, got, want)
        # final/, gathered a part at a time from the first rank holding each piece
        a, b = (load_weights(tmp_path / run / "final").state_dict() for run in (reference, name))
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5, name


@pytest.mark.slow  # about 40 s: two 2-rank runs
def test_megatron_backend_data_parallel_over_two_ranks(tmp_path):
    """Two torchrun ranks (gloo): DDP over megatron's model gives the torch backend's two-rank losses."""
    stores = make_stores(tmp_path / "data")
    got = {}
    for backend in ("torch", "megatron"):
        run = tmp_path / backend
        orthon("pretrain", "-c", write_recipe(tmp_path / f"{backend}.yaml", stores, run, train={"max_steps": STEPS}),
               f"backend={backend}", "optim.ns_dtype=fp32", nproc=2)
        got[backend] = losses(run)
    assert sorted(got["megatron"]) == list(range(1, STEPS + 1))
    assert all(got["megatron"][s] == pytest.approx(got["torch"][s], abs=2e-6) for s in got["torch"])


def test_rl_with_megatron_expert_parallel_needs_every_forward_on_every_rank(tmp_path):
    """Each MoE layer's exchange waits for every expert-parallel rank: a DP schedule that may leave a rank
    fewer micro-batches than another (rl.dp_schedule.equal_micro_batches=false) is refused by name before
    the first iteration."""
    out = orthon("rl", "-c", _rl_recipe(tmp_path, tmp_path / "rl"), "--from", _policy(tmp_path), "backend=megatron",
                 "megatron.expert_parallel=2", "rl.dp_schedule.equal_micro_batches=false", nproc=2, check=False)
    assert out.returncode != 0
    assert "megatron.expert_parallel = 2: PolicyStep does not run every forward on every rank" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("override, reference_ranks, stored", [
    # rank 1 numbers its experts 0 and 1: the model's 2 and 3
    ("megatron.expert_parallel=2", 2, "model.gpt.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"),
    ("megatron.tensor_parallel=2", 1, "model.gpt.decoder.layers.0.self_attention.linear_proj.weight@tp1"),
    # the second stage numbers its one layer 0: the model's 1
    ("megatron.pipeline_parallel=2", 1, "model.gpt.decoder.layers.1.self_attention.linear_proj.weight"),
])
def test_megatron_model_parallel_over_two_ranks_resumes(tmp_path, override, reference_ranks, stored):
    """Two torchrun ranks (gloo) of megatron's model parallelism give what plain data parallelism (or one
    process) gives, losses and weights:
    - expert parallelism (megatron's allgather dispatcher): each rank holds half the experts; DDP leaves them
      to the backend, which averages them over the ranks holding the same ones; the clipping norm adds both
      ranks' experts;
    - tensor parallelism with megatron's sequence parallelism: both ranks read the same batches, the norms'
      and routers' partial gradients are summed over TP, the clipping norm counts every element once;
    - pipeline parallelism: each rank holds one layer, megatron's 1F1B schedule runs the micro-batches
      (the loss on the second stage), the MoE balancing step and the clipping norm cover both stages.
    Stopped at step 4 and resumed, each goes on as the reference: the checkpoint keys each rank's part
    apart (an expert by its index in the model, a TP slice with its rank, a stage's layers by their
    number in the model, each stage's optimizer param groups under their own key); resumed at the
    reference's layout, it goes on as the reference too."""
    stores = make_stores(tmp_path / "data")
    ref, run = tmp_path / "ref", tmp_path / "run"
    orthon("pretrain", "-c", write_recipe(tmp_path / "ref.yaml", stores, ref, train={"max_steps": STEPS}),
           "backend=megatron", "optim.ns_dtype=fp32", nproc=reference_ranks)
    orthon("pretrain", "-c", write_recipe(tmp_path / "run.yaml", stores, run, train={"max_steps": 4}),
           "backend=megatron", "optim.ns_dtype=fp32", override, nproc=2)
    moved = tmp_path / "moved"  # its step-4 checkpoint, to resume at another layout
    shutil.copytree(run, moved)
    import torch.distributed.checkpoint as dcp

    assert stored in dcp.FileSystemReader(str(run / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    out = orthon("pretrain", "--resume", run, f"train.max_steps={STEPS}", nproc=2)
    assert resumed_from(out.stdout + out.stderr)[1] == 4
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == pytest.approx(want[s], abs=2e-6) for s in want), (got, want)
    # the largest attention logit over every rank's heads, experts' tokens, or stages
    logits = [{r["step"]: r["max_attn_logit"] for r in _records(d) if "max_attn_logit" in r} for d in (ref, run)]
    assert sorted(logits[1]) == list(range(1, STEPS + 1))
    assert all(logits[1][s] == pytest.approx(logits[0][s], rel=1e-5) for s in logits[0])
    a, b = (load_weights(d / "final").state_dict() for d in (ref, run))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    # final/ was gathered and written a safetensors shard at a time (HF's 5 GB: one file for this model)
    assert (run / "final" / "model.safetensors").is_file()
    # `orthon export` reads the last checkpoint on one process, whatever layout wrote it: final/ bit for bit
    orthon("export", run, "--step", "latest", "--out", tmp_path / "exported")
    exported = load_weights(tmp_path / "exported").state_dict()
    assert exported.keys() == b.keys() and all(torch.equal(exported[k], b[k]) for k in b)
    # the step-4 checkpoint resumed at the reference's layout (each rank's weights and optimizer state rebuilt
    # from the other layout's pieces) goes on as the reference
    out = orthon("pretrain", "--resume", moved, f"train.max_steps={STEPS}", f"{override.split('=')[0]}=1",
                 nproc=reference_ranks)
    assert "each rank's weights and optimizer state rebuilt for" in out.stdout + out.stderr
    got = losses(moved)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == pytest.approx(want[s], abs=2e-6) for s in want), (got, want)


def test_megatron_draws_its_own_initial_weights_when_asked(tmp_path):
    """megatron.init=megatron: megatron-core draws each rank's part (no rank builds the whole model), the
    carried DSA indexer by orthon's rule: normal(0, initializer_range) matrices, unit norm scales, zero
    biases. Another start than orthon's draw, so another first loss, near ln(vocab) as any random start."""
    stores = make_stores(tmp_path / "data")
    runs = {}
    for init in ("orthon", "megatron"):
        runs[init] = tmp_path / init
        orthon("pretrain", "-c", write_recipe(tmp_path / f"{init}.yaml", stores, runs[init], train={"max_steps": 2}),
               "backend=megatron", f"megatron.init={init}")
    first = {init: losses(run)[1] for init, run in runs.items()}
    assert first["megatron"] != first["orthon"]
    assert abs(first["megatron"] - math.log(MODEL["vocab_size"])) < 0.1
    weights = load_weights(runs["megatron"] / "final").state_dict()
    indexer = "model.layers.1.self_attn.indexer."
    assert torch.equal(weights[indexer + "k_norm.weight"], torch.ones_like(weights[indexer + "k_norm.weight"]))
    assert torch.equal(weights[indexer + "k_norm.bias"], torch.zeros_like(weights[indexer + "k_norm.bias"]))
    assert float(weights[indexer + "wk.weight"].std()) == pytest.approx(0.02, rel=0.1)


def test_the_memory_check_weighs_megatrons_layout_and_its_initial_draw(monkeypatch):
    """GLM-5 on 1,024 GPUs of 80 GB as megatron lays it out (TP 8, EP 64: 60.9 GB of training state a
    rank) fits; drawing orthon's initial weights whole in every process (2,975.6 GB) does not, and the
    refusal names the way out."""
    import orthon.launch.args as args
    from orthon.core.errors import ConfigError
    from orthon.pretrain.model_info import BYTES_PER_PARAM, parameter_counts, rank_parameters
    from orthon.pretrain.recipe import load_recipe
    from pretrain_support import ROOT

    monkeypatch.setattr(args, "machine_memory", lambda: (80e9, "GPU memory"))
    monkeypatch.setattr("orthon.core.allocator.physical_memory", lambda: 80e9)
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("ORTHON_NO_MEMORY_CHECK", raising=False)
    layout = ["backend=megatron", "megatron.tensor_parallel=8", "megatron.expert_parallel=64"]
    # pipelined: 6 stages of 13 layers (17.23B parameters outside the routed experts, embedding and head),
    # each with the larger end (the 0.95B embedding or head), TP 8; the 724.78B routed experts over
    # 6 stages x EP 16 x the experts' TP 8: (17.23 / 6 + 0.95) / 8 + 724.78 / 768 = 1.4217B, 22.75 GB a rank
    pipelined = load_recipe(ROOT / "configs/glm5.yaml", ["backend=megatron", "megatron.tensor_parallel=8",
                                                         "megatron.pipeline_parallel=6", "megatron.expert_parallel=16"])
    share = rank_parameters(parameter_counts(pipelined.model), 1536, pipelined.train, pipelined.megatron)
    assert share * BYTES_PER_PARAM / 1e9 == pytest.approx(22.75, abs=0.01)
    args.check_recipe_fits(load_recipe(ROOT / "configs/glm5.yaml", [*layout, "megatron.init=megatron"]))
    with pytest.raises(ConfigError, match=r"2,975\.6 GB .* set megatron\.init=megatron"):
        args.check_recipe_fits(load_recipe(ROOT / "configs/glm5.yaml", layout))


def test_pipelined_gradients_are_averaged_in_buckets():
    """A pipelined model averages its data-parallel gradients itself, a bucket of tensors an all-reduce:
    over one rank the average is each gradient divided by the size given, whichever bucket holds it."""
    import torch.distributed as dist

    from orthon.backends.megatron.grads import average as _average

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = [torch.randn(shape) for shape in ((3, 4), (5,), (2, 2, 2), (7, 1))]
        want = [g / 4 for g in grads]
        _average(grads, None, 4, bucket=12)  # buckets: [12], [5, 8] (a tensor beyond the bucket starts a new one), [7]
        assert all(torch.equal(g, w) for g, w in zip(grads, want))
    finally:
        dist.destroy_process_group()


def test_megatron_interleaved_pipeline_trains_resumes_and_exports(tmp_path):
    """megatron.virtual_pipeline_parallel=2 over two pipeline ranks (four layers: rank 0 holds layers 0 and 2,
    rank 1 layers 1 and 3; megatron's interleaved 1F1B, the batch ramp's 4, 5 and 6 micro-batches a step, an
    odd number in one group) gives one process's losses and final/ bit for bit; its checkpoint names every
    chunk's layers by their number in the model; resumed at step 4 it repeats the straight run; `orthon
    export` reads its checkpoint. A step of fewer micro-batches than stages is refused by name."""
    stores = make_stores(tmp_path / "data")
    sections = dict(model={**MODEL, "num_hidden_layers": 4}, train={"max_steps": STEPS, "micro_batch_size": 2})
    layout = ["megatron.pipeline_parallel=2", "megatron.virtual_pipeline_parallel=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    orthon("pretrain", "-c", write_recipe(tmp_path / "ref.yaml", stores, ref, **sections), "backend=megatron",
           "optim.ns_dtype=fp32")
    assert {r["micro_batches"] for r in _records(ref) if "micro_batches" in r} >= {4, 5}
    sections["train"] = {**sections["train"], "max_steps": 4}
    orthon("pretrain", "-c", write_recipe(tmp_path / "run.yaml", stores, run, **sections), "backend=megatron",
           "optim.ns_dtype=fp32", *layout, nproc=2)
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(run / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    assert all(f"model.gpt.decoder.layers.{i}.self_attention.linear_proj.weight" in stored for i in range(4))
    assert not any(key.startswith("model.gpt_chunk") for key in stored)
    orthon("pretrain", "--resume", run, f"train.max_steps={STEPS}", nproc=2)
    assert losses(run) == losses(ref)
    a, b = (load_weights(d / "final").state_dict() for d in (ref, run))
    assert all(torch.equal(a[k], b[k]) for k in a)
    orthon("export", run, "--step", "latest", "--out", tmp_path / "exported")
    exported = load_weights(tmp_path / "exported").state_dict()
    assert all(torch.equal(exported[k], b[k]) for k in b)
    # one micro-batch a step (64 tokens of 2 x 32) cannot fill two stages
    out = orthon("pretrain", "-c", write_recipe(tmp_path / "one.yaml", stores, tmp_path / "one", **{
        **sections, "batch": {"start_batch_tokens": 64, "end_batch_tokens": 64}}), "backend=megatron", *layout,
        nproc=2, check=False)
    assert out.returncode != 0 and "megatron's interleaved schedule runs at least 2 micro-batches (the pipeline " \
                                   "stages); this step has 1" in out.stderr, out.stderr[-2000:]
