"""The training step's fast paths compute what the plain paths do: the fused output-head loss, the
windowed top-k selection and the flash-padded SDPA."""
import pytest
import torch
import torch.nn.functional as F

from hf_reference import small_model
from orthon.pretrain.attention import sdpa
import orthon.pretrain.loss as loss_module
from orthon.pretrain.loss import chunked_cross_entropy


def _reference(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.t()).flatten(0, -2), labels.flatten(), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn-logits", "mkl-logits"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_fused_loss_matches_cross_entropy(chunk, grads, onednn, monkeypatch):
    """Either way of making a chunk's logits (oneDNN's linear where torch has it, MKL's GEMM into one
    buffer otherwise) gives cross_entropy's value and gradients."""
    if onednn and not loss_module._HAS_ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN fp32 linear")
    monkeypatch.setattr(loss_module, "_HAS_ONEDNN_LINEAR", onednn)
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, requires_grad=grads[0])
    weight = torch.randn(40, 16, requires_grad=grads[1])
    labels = torch.randint(0, 40, (3, 11))
    labels[0, :4] = -100
    labels[2, -1] = -100
    wanted = [t for t in (hidden, weight) if t.requires_grad]
    ref = _reference(hidden, weight, labels)
    ours = chunked_cross_entropy(hidden, weight, labels, chunk)
    torch.testing.assert_close(ours, ref)
    for g, r in zip(torch.autograd.grad(ours * 0.5, wanted), torch.autograd.grad(ref * 0.5, wanted)):
        torch.testing.assert_close(g, r)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, labels, chunk), ref.detach())


def test_fused_loss_ignored_rows_get_no_gradient():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.tensor([3, -100, 1, -100, -100, 9])
    chunked_cross_entropy(hidden, weight, labels, 4).backward()
    assert hidden.grad[[1, 3, 4]].abs().sum() == 0
    assert hidden.grad[[0, 2, 5]].abs().min() > 0


def test_fused_loss_under_bf16_autocast_matches_bf16_matmuls():
    """Under autocast the logits come from bf16 matmuls (as lm_head would give), the softmax in fp32;
    the gradients come back in the inputs' dtypes."""
    torch.manual_seed(1)
    hidden = torch.randn(20, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_cross_entropy(hidden, weight, labels, 7)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    ours.backward()
    g_ours = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref.backward()
    assert g_ours[0].dtype == torch.float32 and g_ours[1].dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=0.5)
    for g, r in zip(g_ours, (hidden.grad, weight.grad)):
        assert (g - r).norm() / r.norm() < 0.02


@pytest.mark.parametrize("impl", ["mask", "gather"])
def test_model_loss_without_logits_equals_loss_from_logits(impl):
    """return_logits=False (the fused chunked head) gives the loss and every gradient of the plain path."""
    torch.manual_seed(0)
    model = small_model("dsa", sparse_impl=impl)
    ids = torch.randint(0, 257, (2, 30))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = model(ids, labels=labels, return_logits=True)
    ref = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    fused = model(ids, labels=labels, return_logits=False)
    ours = torch.autograd.grad(fused.loss, list(model.parameters()), allow_unused=True)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, out.loss)
    for (name, _), g, r in zip(model.named_parameters(), ours, ref):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("docs", [False, True])
def test_windowed_selection_equals_full_width_selection(docs):
    """The index-only selection scores each query chunk against its visible keys; the indices equal those
    of the full (T, T) selection that mid-training's scored path runs, rows shorter than k included."""
    model = small_model("dsa", index_topk=20, query_chunk=300)
    attn = model.model.layers[0].self_attn
    B, T = 2, 300  # more than SELECT_CHUNK queries, so several windows
    torch.manual_seed(0)
    x = torch.randn(B, T, model.config.hidden_size)
    from orthon.pretrain.layers import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(T), model.config.qk_rope_head_dim, model.config.rope_theta, x.dtype)
    q_resid = attn.project(x, cos, sin)[0]
    keys = attn.indexer.keys(x, cos, sin)
    slots = torch.arange(T)
    doc_ids = torch.tensor([[0] * 130 + [1] * 170, [0] * 7 + [1] * 293]) if docs else None
    fast, none = attn._select(x, q_resid, cos, sin, keys, slots, None, False, doc_ids, doc_ids)
    full, scores = attn._select(x, q_resid, cos, sin, keys, slots, None, True, doc_ids, doc_ids)
    assert none is None and scores.shape == (B, T, T)
    assert fast.shape == (B, T, 20)
    assert torch.equal(fast, full)
    unordered, _ = attn._select(x, q_resid, cos, sin, keys, slots, None, False, doc_ids, doc_ids, ordered=False)
    assert torch.equal(unordered.sort(-1).values, full.sort(-1).values)


@pytest.mark.parametrize("chunk", [4, 1 << 30])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_with_narrower_values_matches_softmax_attention(masked, chunk, monkeypatch):
    """Also in causal query chunks (each over the keys it can see): the same values and gradients."""
    import orthon.pretrain.attention as attention

    monkeypatch.setattr(attention, "CAUSAL_QUERY_CHUNK", chunk)
    torch.manual_seed(0)
    B, T, H, D, Dv = 2, 9, 3, 8, 5
    q, k = torch.randn(B, T, H, D, requires_grad=True), torch.randn(B, T, H, D, requires_grad=True)
    v = torch.randn(B, T, H, Dv, requires_grad=True)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    mask = None
    if masked:
        allowed = allowed & (torch.rand(B, 1, T, T) < 0.6) | torch.eye(T, dtype=torch.bool)
        mask = allowed
    logits = torch.einsum("bthd,bshd->bhts", q, k) * 0.3
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("bhts,bshv->bthv", probs, v)
    out = sdpa(q, k, v, mask, True, 0.3)
    assert out.shape == (B, T, H, Dv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 12)])
def test_rms_norm_matches_autograd_of_the_plain_formula(shape):
    from orthon.pretrain.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(shape, requires_grad=True) * 3
    out = norm(x)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref)
    g = torch.randn(shape)
    ours = torch.autograd.grad(out, (x, norm.weight), g)
    theirs = torch.autograd.grad(ref, (x, norm.weight), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _autograd_expert_loop(xs, gate_up, down, weights, counts):
    pieces = []
    for part, w_gu, w_down in zip(xs.split(counts), gate_up.unbind(0), down.unbind(0)):
        g, u = F.linear(part, w_gu).chunk(2, dim=-1)
        pieces.append(F.linear(F.silu(g) * u, w_down))
    return torch.cat(pieces) * weights[:, None]


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0]])
def test_expert_loop_matches_autograd_including_empty_experts(counts):
    from orthon.pretrain.moe import _ExpertLoop

    torch.manual_seed(0)
    E, H, I = 4, 6, 5
    xs = torch.randn(sum(counts), H, requires_grad=True)
    gate_up = torch.randn(E, 2 * I, H, requires_grad=True)
    down = torch.randn(E, H, I, requires_grad=True)
    weights = torch.rand(sum(counts), requires_grad=True)
    g = torch.randn(sum(counts), H)
    ours = _ExpertLoop.apply(xs, gate_up, down, weights, counts)
    ref = _autograd_expert_loop(xs, gate_up, down, weights, counts)
    torch.testing.assert_close(ours, ref)
    got = torch.autograd.grad(ours, (xs, gate_up, down, weights), g)
    want = torch.autograd.grad(ref, (xs, gate_up, down, weights), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert got[1][empty].abs().sum() == 0 and got[2][empty].abs().sum() == 0


def test_expert_loop_under_bf16_autocast_runs_in_bf16_and_returns_fp32_grads():
    from orthon.pretrain.moe import _ExpertLoop

    torch.manual_seed(0)
    xs = torch.randn(7, 8, requires_grad=True)
    gate_up = torch.randn(2, 6, 8, requires_grad=True)
    down = torch.randn(2, 8, 3, requires_grad=True)
    weights = torch.rand(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _ExpertLoop.apply(xs, gate_up, down, weights, [4, 3])
        ref = _autograd_expert_loop(xs, gate_up, down, weights.bfloat16(), [4, 3])
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref)
    ours.float().sum().backward()
    assert xs.grad.dtype == gate_up.grad.dtype == down.grad.dtype == torch.float32


def test_padded_expert_rows_keep_each_token_in_its_experts_run():
    from orthon.pretrain.moe import pad_expert_rows

    # Sorted rows of experts 0 (3 rows), 1 (none), 2 (5 rows) padded to multiples of 4: runs [0, 4), [4, 12).
    token = torch.tensor([7, 2, 9, 1, 1, 3, 0, 5])
    weights = torch.arange(1.0, 9.0, requires_grad=True)
    padded_token, padded_weights, counts = pad_expert_rows(token, weights, torch.tensor([3, 0, 5]), 4)
    assert counts.tolist() == [4, 0, 8]
    assert padded_token.tolist() == [7, 2, 9, 0, 1, 1, 3, 0, 5, 0, 0, 0]
    assert padded_weights.tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    padded_weights.sum().backward()  # the real rows' weights keep their gradient
    assert weights.grad.tolist() == [1.0] * 8


def test_padding_expert_rows_changes_no_bit_of_the_moe_under_bf16_autocast(monkeypatch):
    import orthon.pretrain.moe as moe

    torch.manual_seed(0)
    config = small_model().config
    layer = moe.MoE(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 37, config.hidden_size, requires_grad=True)
    g = torch.randn(3, 37, config.hidden_size)
    results = {}
    for multiple in (1, 16):  # 1: no padding, the rows as sort_by_expert leaves them
        monkeypatch.setattr(moe, "EXPERT_ROW_MULTIPLE", multiple)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert moe._pads_expert_rows(x)
            y = layer(x)
        params = [p for p in layer.parameters() if p.requires_grad]
        results[multiple] = (y, *torch.autograd.grad(y, (x, *params), g))
    counts = torch.bincount(layer.gate(x.detach().reshape(-1, config.hidden_size))[1].reshape(-1),
                            minlength=config.n_routed_experts)
    assert (counts % 16 != 0).any()  # the padded run really pads
    for a, b in zip(results[1], results[16]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("autocast", [False, True])
def test_gathered_attention_backward_matches_autograd_of_gather_then_attention(autocast):
    from orthon.pretrain.attention import _GatheredLatentAttention, gather_rows, latent_attention

    torch.manual_seed(0)
    B, S, C, H, D, k, rank = 2, 11, 5, 3, 8, 4, 6
    q = torch.randn(B, C, H, D, requires_grad=True)
    latent = torch.randn(B, S, D, requires_grad=True)
    idx = torch.randint(0, S, (B, C, k))  # queries share keys: their gradients must add up
    visible = torch.rand(B, C, 1, k) > 0.3
    visible[..., 0] = True
    g = torch.randn(B, C, H, rank)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # backward inside, as the Trainer runs it
        ours = _GatheredLatentAttention.apply(q, latent, idx, visible, 0.3, rank)
        ref = latent_attention(q, gather_rows(latent, idx), 0.3, rank, visible)
        assert ours.dtype == ref.dtype
        got = torch.autograd.grad(ours, (q, latent), g)
        want = torch.autograd.grad(ref, (q, latent), g)
    tol = dict(atol=3e-2, rtol=3e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, **tol)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, **tol)
    selected = torch.zeros(B, S, dtype=torch.bool).scatter_(1, idx.reshape(B, -1), True)
    assert (~selected).any() and not got[1][~selected].any()  # a latent no query selected gets no gradient


@pytest.mark.parametrize("docs", [False, True])
def test_additive_topk_mask_opens_exactly_the_visible_selected_keys(docs):
    from orthon.pretrain.attention import attention_mask, causal_mask, document_mask, max_attention_logit

    torch.manual_seed(0)
    B, T, k = 2, 12, 5
    slots = torch.arange(T)
    indices = torch.stack([torch.randperm(T)[:k] for _ in range(B * T)]).view(B, T, k)
    q_docs = k_docs = torch.tensor([[0] * 4 + [1] * 8, [0] * 12]) if docs else None
    mask = attention_mask(indices, slots, T, q_docs, k_docs)
    assert mask.dtype == torch.float32 and mask.shape == (B, 1, T, T)
    chosen = torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, indices, True)
    allowed = (document_mask(q_docs, k_docs, slots) if docs else causal_mask(slots, T)[None]) & chosen
    assert torch.equal(mask[:, 0] == 0, allowed)
    assert torch.all(mask[:, 0][~allowed] == float("-inf"))
    q, key = torch.randn(B, T, 3, 4), torch.randn(B, T, 3, 4)
    assert max_attention_logit(q, key, mask, 0.5) == max_attention_logit(q, key, allowed.unsqueeze(1), 0.5)


def test_metric_sums_on_the_device_are_the_float_sums_bit_for_bit():
    """The step adds its micro-batches' metrics as float64 tensors (read once, at the step's end): the
    floats it logs are those of adding the values one by one as Python floats, in the same order."""
    from orthon.pretrain.trainer import _add_metric, _all_reduce_dict

    g = torch.Generator().manual_seed(0)
    losses = (torch.rand(7, generator=g) * 1000).tolist()  # fp32 values, as a summed loss is
    losses = [torch.tensor(v, dtype=torch.float32) for v in losses]
    sums, expected = {}, 0.0
    for i, value in enumerate(losses):
        _add_metric(sums, "loss", value)
        _add_metric(sums, "count", i + 1)  # a plain number beside the tensors
        expected += float(value)
    assert torch.is_tensor(sums["loss"]) and sums["loss"].dtype == torch.float64
    out = _all_reduce_dict(sums, torch.device("cpu"))
    assert out == {"count": 28.0, "loss": expected} and isinstance(out["loss"], float)
    # In float32 the same sum rounds differently: the float64 accumulation is what keeps the old bits.
    assert float(torch.stack(losses).sum()) != expected or float(sum(losses)) != expected
