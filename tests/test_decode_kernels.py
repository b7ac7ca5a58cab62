"""The decode step's C kernels (orthon.engine.decode_kernels) compute what the torch ops they replace do:
RMSNorm alone and folded into a linear, RoPE, the DSA indexer's deterministic top-k, absorbed-MLA
attention over the cache, and an MoE block's routing, experts and shared expert."""
import pytest
import torch
import torch.nn.functional as F

from orthon.engine import decode_kernels
from orthon.pretrain.attention import latent_attention
from orthon.pretrain.layers import RMSNorm, apply_rope
from orthon.pretrain.moe import route
from orthon.engine.decode_kernels import MAX_ROWS, PackedLinear, PackedMoE, index_topk, latent_attention_step, rms_norm, rope_rows
from orthon.pretrain.topk import deterministic_topk

pytestmark = [pytest.mark.skipif(decode_kernels.library() is None, reason=f"decode kernels: {decode_kernels.native.why_unavailable}"),
              pytest.mark.usefixtures("one_thread")]


def _norm(dim, seed):
    norm = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm


@pytest.mark.parametrize("rows", [1, 3, 8, 64, MAX_ROWS])
def test_rms_norm_equals_torch_on_rows_of_a_wider_tensor(rows):
    norm = _norm(40, rows)
    wide = torch.randn(rows, 100) * 3
    x = wide[:, :40]  # rows 100 apart
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, norm), F.rms_norm(x, (40,), norm.weight, norm.eps), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rms_norm(wide[:, :40].contiguous(), norm), norm(wide[:, :40]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 8, 37, 64])
def test_linear_with_its_norm_folded_in_equals_norm_then_linear(rows):
    norm, w = _norm(64, 1), torch.randn(70, 64)
    x = torch.randn(rows, 64) * 2
    packed = PackedLinear(w, norm)
    with torch.no_grad():
        ref = F.linear(norm(x), w)
        torch.testing.assert_close(packed(x), ref, atol=1e-5, rtol=1e-5)
        many = torch.randn(MAX_ROWS + 1, 64)  # past the kernel's rows: the torch path, same function
        torch.testing.assert_close(packed(many), F.linear(norm(many), w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,rope_dim", [((3, 16), None), ((2, 4, 16), None), ((2, 4, 32), 16), ((1, 24), 8)])
def test_rope_rows_equals_apply_rope(shape, rope_dim):
    B, dim = shape[0], shape[-1]
    r = rope_dim or dim
    wide = torch.randn(*shape[:-1], dim + 6)
    x = wide[..., 2:2 + dim]  # vectors inside a wider tensor, as a split leaves them
    angles = torch.rand(B, r // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    with torch.no_grad():
        got = rope_rows(x, cos, sin, rope_dim)
    c, s = (cos, sin) if x.dim() == 2 else (cos[:, None], sin[:, None])
    want = torch.cat([apply_rope(x[..., :r].contiguous(), c, s), x[..., r:]], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # one row of angles shared by every batch row
        shared = rope_rows(x, cos[:1].contiguous(), sin[:1].contiguous(), rope_dim)
    torch.testing.assert_close(shared[0], got[0])


def _index_inputs(B=3, S=50, n=4, d=8, capacity=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, capacity, d, generator=g)
    q = torch.randn(B, n, d, generator=g)
    w = torch.randn(B, n, generator=g)
    # Exact ties: zero keys score exactly 0 (amid positive and negative scores, w having both signs),
    # duplicated keys score alike.
    keys[:, 10:20] = 0.0
    keys[:, 30:35] = keys[:, 25:26]
    return keys, q, w


@pytest.mark.parametrize("masked", [False, True])
def test_index_topk_is_deterministic_topk_of_the_indexer_scores(masked):
    keys, q, w = _index_inputs()
    B, S, k, scale = 3, 50, 12, 0.3
    visible = None
    if masked:
        visible = torch.ones(B, S, dtype=torch.bool)
        visible[0, :30] = False  # left padding
        visible[2, 5:45] = False  # only 10 visible: the top-k then holds masked positions, best first
    with torch.no_grad():
        got = index_topk(keys, S, q, w, scale, k, visible)
    scores = (torch.relu(torch.einsum("bsd,bnd->bsn", keys[:, :S], q) * scale) * w[:, None]).sum(-1)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    want = deterministic_topk(scores, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("sparse", [False, True])
def test_latent_attention_step_equals_latent_attention(sparse):
    g = torch.Generator().manual_seed(3)
    B, H, D, rank, S, capacity = 2, 4, 24, 16, 40, 48
    q, cache = torch.randn(B, H, D, generator=g), torch.randn(B, capacity, D, generator=g)
    visible = torch.ones(B, S, dtype=torch.bool)
    visible[1, :7] = False
    chosen = torch.stack([torch.randperm(S, generator=g)[:12] for _ in range(B)]) if sparse else None
    with torch.no_grad():
        got = latent_attention_step(q, cache, S, 0.2, rank, chosen, visible)
    keys, mask = cache[:, :S], visible
    if sparse:
        keys = torch.stack([cache[b, chosen[b]] for b in range(B)])
        mask = visible.gather(1, chosen)
    torch.testing.assert_close(got, latent_attention(q, keys, 0.2, rank, mask[:, None]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 8, 64, MAX_ROWS])
@pytest.mark.parametrize("groups,shared,normalise", [(1, True, True), (4, True, True), (1, False, False)])
def test_moe_block_equals_route_then_experts(rows, groups, shared, normalise):
    g = torch.Generator().manual_seed(rows + groups)
    E, H, I, Is, k = 8, 32, 24, 16, 2
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / 6, torch.randn(E, H, I, generator=g) / 5
    shared_gate_up, shared_down = torch.randn(2 * Is, H, generator=g) / 6, torch.randn(H, Is, generator=g) / 4
    router, bias = torch.randn(E, H, generator=g) / 3, torch.randn(E, generator=g) / 10
    routing = dict(top_k=k, n_group=groups, topk_group=2 if groups > 1 else 1, norm_topk_prob=normalise, scaling=2.5)
    moe = PackedMoE(gate_up, down, PackedLinear(shared_down) if shared else None, routing)
    x = torch.randn(rows, H, generator=g)
    mlp_in = torch.cat([router, shared_gate_up]) if shared else router
    logits_and_shared = F.linear(x, mlp_in)
    logits, shared_in = logits_and_shared.split([E, mlp_in.shape[0] - E], dim=-1)
    assert moe.applies(x)
    with torch.no_grad():
        y, chosen, weights = moe(x, logits, bias, shared_in if shared else None)

    want_w, want_idx = route(logits, bias, k, groups, routing["topk_group"], normalise, 2.5)
    assert torch.equal(chosen.sort(-1).values, want_idx.sort(-1).values)
    torch.testing.assert_close(weights.gather(1, chosen.argsort(-1)), want_w.gather(1, want_idx.argsort(-1)))

    def swiglu(h):
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b

    want = torch.zeros(rows, H)
    for r in range(rows):
        for j in range(k):
            e = int(want_idx[r, j])
            want[r] += want_w[r, j] * F.linear(swiglu(F.linear(x[r], gate_up[e])), down[e])
    if shared:
        want += F.linear(swiglu(shared_in), shared_down)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
