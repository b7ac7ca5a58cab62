"""Muon against torch.optim.Muon, Muon Split and expert stacks, and the hybrid optimizer."""
import io
import math

import pytest
import torch
from torch import nn

from orthon.optim import HybridOptimizer, Muon, OptimConfig, ScheduleConfig, build_for_model, update_scale
from orthon.optim.fused import FusedPasses
from orthon.optim.muon import orthogonalise_local
from orthon.optim.newton_schulz import newton_schulz
from orthon.optim.param_spec import ParamSpec

SHAPES = [(24, 40), (40, 24), (24, 40), (32, 32), (16, 56)]


pytestmark = pytest.mark.usefixtures("one_thread")


def run(make_opt, inits, grads):
    """Apply make_opt(params) to copies of ``inits`` with the given gradient sequence; return params."""
    params = [nn.Parameter(t.clone()) for t in inits]
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def random_problem(shapes, steps):
    inits = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(steps)]
    return inits, grads


@pytest.mark.parametrize("nesterov", [True, False])
def test_unsplit_equals_torch_muon_over_10_steps(nesterov):
    inits, grads = random_problem(SHAPES, 10)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5)
    ref = run(lambda ps: torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **kwargs), inits, grads)
    # Same bf16 Newton-Schulz kernel as torch: identical to the last bit.
    ours = run(lambda ps: Muon(ps, bf16_matmul="native", **kwargs), inits, grads)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
    # bf16 emulated on the fp32 kernel: bf16 round-off (one step moves entries by ~lr*scale*|O| ~ 1e-2).
    emulated = run(lambda ps: Muon(ps, bf16_matmul="emulated", **kwargs), inits, grads)
    for a, b in zip(ref, emulated):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=0)
    assert max((a - i).abs().max() for a, i in zip(ref, inits)) > 0.05  # the parameters did move


def test_fp32_step_matches_the_spec_formula():
    # W <- W - lr * (0.2 * sqrt(max(A, B)) * O + wd * W), O = NS(Nesterov momentum), by hand.
    inits, grads = random_problem([(12, 20), (20, 12)], 3)
    lr, wd, mu = 0.05, 0.1, 0.95
    ours = run(lambda ps: Muon(ps, lr=lr, weight_decay=wd, momentum=mu, ns_dtype="fp32"), inits, grads)
    for w0, shape_index in zip(inits, range(2)):
        w, buf = w0.clone(), torch.zeros_like(w0)
        for step_grads in grads:
            g = step_grads[shape_index]
            buf = mu * buf + (1 - mu) * g
            o = newton_schulz((1 - mu) * g + mu * buf, dtype="fp32")
            w = w - lr * (0.2 * math.sqrt(max(w.shape)) * o + wd * w)
        torch.testing.assert_close(ours[shape_index], w, atol=1e-6, rtol=0)


def test_split_equals_orthogonalising_each_block_alone():
    heads, block_rows, cols = 4, 12, 20
    full_init = torch.randn(heads * block_rows, cols)
    full_grads = [[torch.randn(heads * block_rows, cols)] for _ in range(4)]
    kwargs = dict(lr=0.03, weight_decay=0.1, bf16_matmul="native")
    split = run(lambda ps: Muon([{"params": ps, "split_rows": heads}], **kwargs), [full_init], full_grads)[0]
    # n separate unsplit optimizers on the blocks: same numbers (scale 0.2*sqrt(max(12, 20)), not of 48x20).
    blocks = run(lambda ps: Muon(ps, **kwargs), list(full_init.chunk(heads)), [list(g[0].chunk(heads)) for g in full_grads])
    assert torch.equal(split, torch.cat(blocks))
    unsplit = run(lambda ps: Muon(ps, **kwargs), [full_init], full_grads)[0]
    assert not torch.allclose(split, unsplit, atol=1e-3)
    one_head = run(lambda ps: Muon([{"params": ps, "split_rows": 1}], **kwargs), [full_init], full_grads)[0]
    assert torch.equal(one_head, unsplit)


def test_expert_stack_is_a_batch_of_independent_matrices():
    experts = 3
    init = torch.randn(experts, 16, 24)
    grads = [[torch.randn(experts, 16, 24)] for _ in range(3)]
    kwargs = dict(lr=0.02, bf16_matmul="native")
    stacked = run(lambda ps: Muon(ps, **kwargs), [init], grads)[0]
    separate = run(lambda ps: Muon(ps, **kwargs), list(init.unbind(0)), [list(g[0].unbind(0)) for g in grads])
    assert torch.equal(stacked, torch.stack(separate))
    # A split expert stack: each expert cut into 2 row blocks of 8x24.
    split = run(lambda ps: Muon([{"params": ps, "split_rows": 2}], **kwargs), [init], grads)[0]
    halves = run(
        lambda ps: Muon(ps, **kwargs),
        list(init.reshape(experts * 2, 8, 24).unbind(0)),
        [list(g[0].reshape(experts * 2, 8, 24).unbind(0)) for g in grads],
    )
    assert torch.equal(split, torch.stack(halves).reshape(experts, 16, 24))


def test_same_block_shapes_share_one_newton_schulz_call():
    calls = []

    def counting(work, ns):
        return orthogonalise_local(work, lambda stack, item: calls.append(tuple(stack.shape)) or ns(stack, item))

    params = [nn.Parameter(torch.randn(s)) for s in [(8, 16), (8, 16), (16, 8), (32, 16), (2, 8, 16)]]
    opt = Muon([{"params": params[:4]}, {"params": params[4:], "split_rows": 1}], lr=0.01, orthogonaliser=counting)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # (8,16) x2 and the 2-expert stack in one call; (16,8) and (32,16) alone.
    assert sorted(calls) == sorted([(4, 8, 16), (1, 16, 8), (1, 32, 16)])


def test_fused_passes_equal_the_eager_ones_to_round_off_and_never_recompile_for_a_new_lr():
    # Muon(fused=True) compiles the momentum and apply passes; the numbers are the eager ones up to
    # fp32 round-off (lerp's and the update's roundings), through splits, expert stacks, no Nesterov
    # and an LR that changes every step (as a schedule does) without compiling again.
    from torch._dynamo.utils import counters

    inits, grads = random_problem([(24, 40), (40, 24), (3, 16, 24), (32, 32)], 6)

    def make(fused, nesterov):
        def build(ps):
            opt = Muon([{"params": ps[:2], "split_rows": 2}, {"params": ps[2:]}], lr=0.02, weight_decay=0.1,
                       nesterov=nesterov, fused=fused, bf16_matmul="native")
            step = opt.step

            def step_with_new_lr():
                for group in opt.param_groups:
                    group["lr"] *= 0.9
                step()
            opt.step = step_with_new_lr
            return opt
        return build

    for nesterov in (True, False):
        optimizers = {}
        for fused in (False, True):
            params = [nn.Parameter(t.clone()) for t in inits]
            opt = optimizers[fused] = make(fused, nesterov)(params)
            graphs = []
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
                opt.step()
                graphs.append(counters["stats"]["unique_graphs"])
        eager, fused = optimizers[False], optimizers[True]
        assert fused.passes.failed is None, fused.passes.failed
        assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), graphs  # compiled in the first two steps only
        eager_params, fused_params = (opt.param_groups[0]["params"] + opt.param_groups[1]["params"]
                                      for opt in (eager, fused))
        for a, b in zip(eager_params, fused_params):
            # Momentum depends on the gradients only: fp32 round-off apart.
            torch.testing.assert_close(fused.state[b]["momentum_buffer"], eager.state[a]["momentum_buffer"],
                                       atol=1e-6, rtol=1e-6)
            # The weights: a last-bit difference in an update can flip its bf16 rounding before Newton-
            # Schulz, so bf16 round-off of the orthogonalised steps (~1e-4 over 6 steps measured, of
            # steps of ~1e-2; a missing weight decay alone would be ~1e-2).
            torch.testing.assert_close(b.detach(), a.detach(), atol=1e-3, rtol=0)
        assert max((a.detach() - i).abs().max() for a, i in zip(eager_params, inits)) > 0.03


def test_fused_passes_fall_back_to_eager_when_compiling_fails(caplog, monkeypatch):
    from orthon.optim import fused

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")
    inits, grads = random_problem([(24, 40), (40, 24)], 2)
    opts = []

    def build(ps):
        opt = Muon(ps, lr=0.02, fused=True, bf16_matmul="native")
        monkeypatch.setattr(opt.passes, "_momentum", broken)
        opts.append(opt)
        return opt
    with caplog.at_level("WARNING", logger=fused.__name__):
        out = run(build, inits, grads)
    # The eager passes ran: the numbers of an unfused Muon to the bit, and one warning naming the cause.
    assert all(torch.equal(a, b) for a, b in zip(out, run(lambda ps: Muon(ps, lr=0.02, bf16_matmul="native"),
                                                           inits, grads)))
    assert opts[0].passes.failed == "RuntimeError: no C++ compiler"
    assert [r.getMessage() for r in caplog.records].count(
        "Muon fused passes: torch.compile failed (RuntimeError: no C++ compiler); running them eagerly") == 1


def test_update_scale_by_hand():
    # 0.2 * sqrt(max(A, B)) of the block: a 192x128 W_QB split into 4 heads scales by 0.2*sqrt(128).
    assert update_scale(48, 128) == pytest.approx(0.2 * 128**0.5) == pytest.approx(2.2627, abs=1e-4)
    assert update_scale(192, 128) == pytest.approx(0.2 * 192**0.5)
    assert update_scale(256, 2048) == pytest.approx(9.0510, abs=1e-4)
    assert update_scale(48, 128, "original") == 1.0 and update_scale(256, 64, "original") == 2.0


def test_bad_split_and_shapes_name_the_parameter():
    w = nn.Parameter(torch.randn(10, 4))
    with pytest.raises(ValueError, match=r"layers.0.q_b_proj.weight has 10 rows, which 4 blocks do not divide"):
        Muon([{"params": [("layers.0.q_b_proj.weight", w)], "split_rows": 4}])
    with pytest.raises(ValueError, match="needs a matrix"):
        Muon([nn.Parameter(torch.randn(5))])


# ---------------------------------------------------------------- hybrid optimizer


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.q_b = nn.Linear(16, 24, bias=False)  # 4 heads x 6 rows
        self.up = nn.Linear(16, 40)
        self.experts = nn.Parameter(torch.randn(3, 16, 40) * 0.1)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)

    def param_specs(self):
        return {
            "embed.weight": ParamSpec("embedding"),
            "q_b.weight": ParamSpec("matrix", split_rows=4),
            "up.weight": ParamSpec("matrix"),
            "up.bias": ParamSpec("bias"),
            "experts": ParamSpec("expert_stack"),
            "norm.weight": ParamSpec("norm"),
            "norm.bias": ParamSpec("bias"),
            "head.weight": ParamSpec("output_head"),
        }

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.q_b(x)[..., :16] + torch.einsum("btf,ehf->bth", self.up(x), self.experts).tanh()
        return self.head(self.norm(x))


SCHEDULE = ScheduleConfig(peak_lr=1e-2, floor_lr=1e-3, warmup_tokens=64, total_tokens=640)


def make(model, **cfg):
    return build_for_model(model, OptimConfig(**cfg), SCHEDULE)


def train(model, opt, batches, tokens=0):
    for ids in batches:
        opt.set_tokens(tokens)
        opt.zero_grad()
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        tokens += ids.numel()
    return tokens


def test_hybrid_groups_and_one_schedule_for_both():
    model = Toy()
    opt = make(model, muon_lr=2e-2)
    # named_parameters order: a module's own parameters ("experts") before its submodules'.
    assert [g["param_names"] for g in opt.muon.param_groups] == [["experts", "up.weight"], ["q_b.weight"]]
    assert [g["split_rows"] for g in opt.muon.param_groups] == [1, 4]
    assert [g["param_names"] for g in opt.adamw.param_groups] == [
        ["embed.weight", "head.weight"], ["up.bias", "norm.weight", "norm.bias"]]
    assert [g["weight_decay"] for g in opt.adamw.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 0 for g in opt.param_groups)  # warmup starts at zero
    assert opt.set_tokens(32) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.muon.param_groups] == pytest.approx([1e-2, 1e-2])
    assert [g["lr"] for g in opt.adamw.param_groups] == pytest.approx([5e-3, 5e-3])
    opt.set_tokens(640)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3, 2e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("fused", [False, True])
def test_hybrid_state_dict_resume_is_bit_identical(fused):
    # fused: Muon's compiled passes and AdamW's fused kernel resume to the bit as well.
    batches = [torch.randint(0, 32, (2, 9)) for _ in range(6)]
    torch.manual_seed(3)
    model = Toy()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = train(model, make(model, fused=fused), batches)

    resumed = Toy()
    resumed.load_state_dict(initial)
    opt = make(resumed, fused=fused)
    mid_tokens = train(resumed, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    fresh = Toy()
    fresh.load_state_dict(saved["model"])
    fresh_opt = make(fresh, fused=fused)
    fresh_opt.load_state_dict(saved["optim"])
    assert all(isinstance(o.passes, FusedPasses) == fused for o in (opt.muon, fresh_opt.muon))
    assert all(g["fused"] == (fused or None) for g in fresh_opt.adamw.param_groups)
    # The LRs come back with the state (set for the last step's start); the loop owns the token clock.
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert train(fresh, fresh_opt, batches[3:], tokens=mid_tokens) == tokens
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.q_b.weight, initial["q_b.weight"])


def test_hybrid_adamw_only_and_mismatched_state():
    model = Toy()
    adamw_only = make(model, algorithm="adamw")
    assert adamw_only.muon is None and sum(len(g["params"]) for g in adamw_only.param_groups) == 8
    with pytest.raises(ValueError, match="muon"):
        make(Toy()).load_state_dict(adamw_only.state_dict())
    with pytest.raises(ValueError, match="at least one"):
        HybridOptimizer(None, None)
