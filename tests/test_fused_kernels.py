"""The fused RMSNorm and SwiGLU kernels equal the torch ops they replace (values and gradients, to float
rounding), take strided rows, give the same bits at any thread count, and step aside where they do not
apply; a model trained through them equals the same model on the torch path."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from orthon.core.native import cpu_has_avx2_fma
from orthon.pretrain import fused_kernels as FK
from orthon.pretrain.layers import _RMSNorm
from kernel_support import assert_falls_back_with_one_message, loss_and_grads, tiny_dsa_model

needs_kernel = pytest.mark.skipif(FK.native.load() is None, reason=f"fused kernels: {FK.native.why_unavailable}")


def test_the_kernels_build_where_they_can():
    if not (cpu_has_avx2_fma() and shutil.which("cc")) or os.environ.get("ORTHON_FUSED_KERNELS") == "0":
        pytest.skip("no AVX2 / FMA or no C compiler here")
    assert FK.native.load() is not None, FK.native.why_unavailable


def _grads(fn, *inputs, grad):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [t.grad.clone() for t in inputs]


@needs_kernel
@pytest.mark.parametrize("rows,width,strided", [(150, 256, False), (7, 20, False), (130, 64, True)])
def test_rms_norm_equals_the_torch_ops(rows, width, strided):
    """Rows that leave a partial block of the weight's gradient, a width with a tail past the vectors, and
    rows that are a slice of wider ones (c_kv out of kv_a_proj's output)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, rows, width + (16 if strided else 0), generator=g) * 3
    x = base[..., :width] if strided else base
    x.requires_grad_()
    w = (1 + 0.3 * torch.randn(width, generator=g)).requires_grad_()
    grad = torch.randn(2, rows, width, generator=g)
    got, got_grads = _grads(lambda a, b: FK.rms_norm(a, b, 1e-6), x, w, grad=grad)
    want, want_grads = _grads(lambda a, b: _RMSNorm.apply(a, b, 1e-6), x, w, grad=grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without a weight gradient (a frozen norm) the input's gradient is the same.
    w.requires_grad_(False)
    x.grad = None
    FK.rms_norm(x, w, 1e-6).backward(grad)
    torch.testing.assert_close(x.grad, got_grads[0], rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("width", [768, 20])
def test_swiglu_equals_the_torch_ops(width):
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(3, 50, width, generator=g) * 4)
    gate[0, 0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # where exp over- and underflows
    gate.requires_grad_()
    up = torch.randn(3, 50, width, generator=g).requires_grad_()
    grad = torch.randn(3, 50, width, generator=g)
    got, got_grads = _grads(FK.swiglu, gate, up, grad=grad)
    want, want_grads = _grads(lambda a, b: F.silu(a) * b, gate, up, grad=grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_swiglu_on_strided_halves_of_one_buffer():
    """The routed experts' form: gate and up side by side in one (rows, 2I) buffer, results written into
    slices of preallocated ones."""
    g = torch.Generator().manual_seed(2)
    h, grad = torch.randn(40, 2 * 24, generator=g), torch.randn(40, 24, generator=g)
    gate, up = h.chunk(2, dim=-1)
    act = torch.empty(40, 24)
    FK.swiglu_into(gate, up, act)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    out = torch.empty(40, 48)
    FK.swiglu_grads_into(grad, gate, up, out[:, :24], out[:, 24:])
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(a) * b).backward(grad)
    torch.testing.assert_close(out, torch.cat([a.grad, b.grad], dim=-1), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_expert_backward_between_the_products_equals_the_torch_ops():
    """One expert's rows: the routing weights' gradient (d act . act), the activations scaled by the
    weights (for the down weight's gradient) and the SwiGLU gradient of d act * weights."""
    g = torch.Generator().manual_seed(6)
    M, n = 37, 20
    h, grad_act = torch.randn(M, 2 * n, generator=g) * 3, torch.randn(M, n, generator=g)
    weights = torch.rand(M, generator=g)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    grad_h, grad_w, scaled = torch.empty(M, 2 * n), torch.empty(M), act.clone()
    FK.native.load()
    FK.expert_act_backward_(grad_act, scaled, weights, h, grad_h, grad_w)
    torch.testing.assert_close(grad_w, (grad_act * act).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled, act * weights[:, None], rtol=0, atol=0)
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(a) * b).backward(grad_act * weights[:, None])
    torch.testing.assert_close(grad_h, torch.cat([a.grad, b.grad], dim=-1), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 64, generator=g).requires_grad_()
    w = torch.randn(64, generator=g).requires_grad_()
    gate, up = torch.randn(300, 40, generator=g).requires_grad_(), torch.randn(300, 40, generator=g).requires_grad_()
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            norm, norm_grads = _grads(lambda a, b: FK.rms_norm(a, b, 1e-6), x, w, grad=torch.ones(300, 64))
            act, act_grads = _grads(FK.swiglu, gate, up, grad=torch.ones(300, 40))
            results.append([norm, *norm_grads, act, *act_grads])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(*results):
        assert torch.equal(one, three)


def test_they_step_aside_where_they_do_not_apply():
    bf16 = torch.ones(4, 8, dtype=torch.bfloat16)
    assert FK.rms_norm(bf16, torch.ones(8), 1e-6) is None
    assert FK.swiglu(bf16, bf16) is None
    assert FK.swiglu(torch.ones(8, 4).t(), torch.ones(4, 8)) is None  # not contiguous


@needs_kernel
def test_training_through_the_kernels_equals_the_torch_path(monkeypatch):
    model = tiny_dsa_model()
    ids = torch.randint(0, 64, (2, 49), generator=torch.Generator().manual_seed(4))
    loss, grads = loss_and_grads(model, ids)
    monkeypatch.setattr(FK.native, "lib", None)  # as if unbuildable: every caller takes its torch path
    ref_loss, ref_grads = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_disabled_kernels_fall_back_with_one_message():
    assert_falls_back_with_one_message(
        "from orthon.pretrain import fused_kernels as FK;"
        "print(FK.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6), FK.swiglu(torch.ones(2, 8), torch.ones(2, 8)))",
        "ORTHON_FUSED_KERNELS", "fused elementwise kernels")


@needs_kernel
@pytest.mark.parametrize("vocab", [4096, 37])
def test_cross_entropy_and_its_logit_gradient_equal_torch(vocab):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(30, vocab, generator=g) * 5
    labels = torch.randint(0, vocab, (30,), generator=g)
    labels[[3, 17]] = -100
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref, labels, ignore_index=-100, reduction="sum")
    want.backward()
    grad = logits.clone()
    got = FK.cross_entropy_grad_(grad, labels, -100)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-7)
    assert grad[3].abs().max() == 0 and grad[17].abs().max() == 0
    with pytest.raises(ValueError, match="-5 is outside the vocabulary"):
        FK.cross_entropy_grad_(logits.clone(), torch.full((30,), -5), -100)


def test_a_shared_header_is_built_into_each_source(tmp_path):
    """Both kernel sources include simd_math.h: the build inlines a header beside the source (it compiles
    one file in a scratch directory), so the cache key changes with the header."""
    from orthon.core.native import _inline_local_headers

    (tmp_path / "k.c").write_text('#include <math.h>\n#include "h.h"\nint f(void) { return G; }\n')
    (tmp_path / "h.h").write_text("#define G 1\n")
    first = _inline_local_headers(tmp_path / "k.c")
    assert first == "#include <math.h>\n#define G 1\n\nint f(void) { return G; }\n"
    (tmp_path / "h.h").write_text("#define G 2\n")
    assert _inline_local_headers(tmp_path / "k.c") != first
    assert "exp_ps" in _inline_local_headers(FK.native.source) and '#include "' not in _inline_local_headers(FK.native.source)
