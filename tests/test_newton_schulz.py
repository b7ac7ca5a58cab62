"""Newton-Schulz: torch's reference bit for bit (bf16), the quintic map on singular values (fp32)."""
import sys

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

from orthon.optim.newton_schulz import DEFAULT_COEFFICIENTS, newton_schulz, newton_schulz_flops

A, B, C = DEFAULT_COEFFICIENTS


pytestmark = pytest.mark.usefixtures("one_thread")


def quintic(x: float, steps: int = 5) -> float:
    for _ in range(steps):
        x = A * x + B * x**3 + C * x**5
    return x


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_batched_bf16_equals_torch_reference_bit_for_bit(shape):
    mats = torch.randn(3, *shape)
    expected = torch.stack([torch_newton_schulz(m, DEFAULT_COEFFICIENTS, 5, 1e-7) for m in mats])
    out = newton_schulz(mats, emulate_bf16=False)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_fp32_applies_the_quintic_to_each_singular_value():
    # G = U diag(s) V^T: every step maps singular value x to a x + b x^3 + c x^5 after the
    # Frobenius normalisation, with the singular vectors unchanged.
    torch.manual_seed(1)
    rows, cols = 6, 10
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64))
    s = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.25, 0.1], dtype=torch.float64)
    g = u @ torch.diag(s) @ v[:rows]
    out = newton_schulz(g.float(), dtype="fp32")
    assert out.dtype == torch.float32
    mapped = torch.tensor([quintic(x) for x in (s / s.norm()).tolist()], dtype=torch.float64)
    expected = u @ torch.diag(mapped) @ v[:rows]
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    # hand check of one step of the map: 3/sqrt(14.3225) = 0.7927 -> 2.7305 - 2.3785 + 0.6360 = 0.988
    assert quintic(3.0 / 14.3225**0.5, steps=1) == pytest.approx(0.988, abs=1e-3)


def test_output_singular_values_are_near_one_and_transpose_commutes():
    g = torch.randn(4, 48, 96)
    out = newton_schulz(g, dtype="fp32")
    sv = torch.linalg.svdvals(out)
    assert sv.min() > 0.6 and sv.max() < 1.25
    torch.testing.assert_close(newton_schulz(g.mT, dtype="fp32"), out.mT, atol=1e-6, rtol=0)


def test_emulated_bf16_is_as_close_to_fp32_as_native_bf16():
    g = torch.randn(2, 32, 80)
    exact = newton_schulz(g, dtype="fp32")
    native = newton_schulz(g, emulate_bf16=False).float()
    emulated = newton_schulz(g, emulate_bf16=True)
    assert emulated.dtype == torch.bfloat16
    err_native = (native - exact).norm() / exact.norm()
    err_emulated = (emulated.float() - exact).norm() / exact.norm()
    assert err_native < 0.03
    assert err_emulated < 1.5 * err_native


def test_zero_matrix_leading_dims_and_input_untouched():
    g = torch.randn(2, 3, 8, 12)
    before = g.clone()
    out = newton_schulz(g, dtype="fp32")
    assert out.shape == g.shape and torch.equal(g, before)
    torch.testing.assert_close(out[1, 2], newton_schulz(g[1, 2], dtype="fp32"), atol=1e-6, rtol=0)
    zero = newton_schulz(torch.zeros(5, 7), dtype="fp32")
    assert torch.equal(zero, torch.zeros(5, 7))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(matrices=torch.randn(5)), "rows, cols"),
        (dict(matrices=torch.randn(4, 4), steps=100), "steps"),
        (dict(matrices=torch.randn(4, 4), dtype="fp16"), "bf16"),
        (dict(matrices=torch.randn(4, 4), coefficients=(1.0, 2.0)), "3 coefficients"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        newton_schulz(**kwargs)


def test_flops_count():
    # 2x3, one step: X X^T (2*2*2*3) + gram^2 (2*2^3) + poly X (2*2*2*3) = 24 + 16 + 24
    assert newton_schulz_flops(2, 3, steps=1) == 64
    assert newton_schulz_flops(3, 2, steps=5) == 5 * 64


def test_fp32_and_emulated_bf16_compute_their_symmetric_products_by_halves(monkeypatch):
    # X X^T and b R + c R^2 by orthon.optim.symmetric_products (on CPUs whose fp32 GEMM is AVX2 code, the fp32
    # kernel: half the FLOPs): torch's full products' map up to fp32 summation order (which flips bf16
    # roundings, and five steps spread them), as near fp32's result as native bf16.
    import orthon.optim.symmetric_products as symmetric

    g = torch.randn(3, 64, 160, generator=torch.Generator().manual_seed(3))
    calls = []
    matmul = symmetric.symmetric_matmul
    monkeypatch.setattr(sys.modules["orthon.optim.newton_schulz"], "symmetric_matmul",
                        lambda *a, **k: calls.append(a[2]) or matmul(*a, **k))
    by_halves = newton_schulz(g, emulate_bf16=True)
    panels = symmetric.symmetric_panels(64, "cpu", torch.float32)
    assert calls == [panels] * 10  # two a step
    calls.clear()
    newton_schulz(g, dtype="fp32")  # fp32 too; native bf16 keeps torch.optim.Muon's full products
    newton_schulz(g, emulate_bf16=False)
    assert calls == [panels] * 10 + [1] * 10
    monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: None)
    monkeypatch.setattr(symmetric, "SYMMETRIC_MIN_ROWS", 10**9)
    full = newton_schulz(g, emulate_bf16=True)  # torch's full products
    exact = newton_schulz(g, dtype="fp32")
    native = newton_schulz(g, emulate_bf16=False).float()
    err = [(out.float() - exact).norm() / exact.norm() for out in (by_halves, full, native)]
    assert err[0] < 1.5 * err[2] and err[0] < 1.5 * err[1], err
    # ...and nearer torch's full products than either is to fp32 (0.004 against 0.015 measured).
    assert (by_halves.float() - full.float()).norm() / full.float().norm() < 0.5 * err[2]
    # FLOPs with 16-row panels (the kernel's tiles at n = 64): each symmetric product over K costs
    # 2 K 16 (64 + 48 + 32 + 16) = 5,120 K; a step X X^T (K = 160), R^2 (K = 64) and P X in full.
    assert newton_schulz_flops(64, 160, 5, panels=4) == 5 * (5120 * 160 + 5120 * 64 + 2 * 64 * 64 * 160)
    assert newton_schulz_flops(64, 160, 5) == 5 * (4 * 64 * 64 * 160 + 2 * 64**3)  # torch.optim.Muon's
