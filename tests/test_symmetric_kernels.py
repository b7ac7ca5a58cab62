"""The kernels of the symmetric products (orthon.optim.symmetric_products, optim/symmetric_kernels.c)
against fp64 products of the same inputs, on layouts the iteration hands them (batches, strided rows, odd
inner sizes, the addend form), each result exactly symmetric. bf16: fp32 accumulation and one rounding to
bf16. fp32: within the fp32 sums' error bound."""
import pytest
import torch

import orthon.optim.symmetric_products as symmetric
from orthon.optim.gram_newton_schulz import gram_newton_schulz
from orthon.optim.symmetric_products import symmetric_kernel_applies, symmetric_matmul, symmetric_panels

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernel_or_skip(dtype=torch.bfloat16):
    if not symmetric_kernel_applies(64, "cpu", dtype):
        why = symmetric.symmetric_kernels.why_unavailable or (
            "this CPU lacks AVX512-BF16 or has AMX" if dtype == torch.bfloat16
            else "MKL's fp32 GEMM is AVX-512 code on this CPU (Intel)")
        pytest.skip(f"the {dtype} symmetric kernel does not run here: {why}")


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _assert_one_rounding(out, exact, bound):
    """``out`` (bf16) is the fp64 ``exact`` rounded once, up to fp32 accumulation: within half a bf16 ulp
    (at most 2^-8 of it: bf16 keeps 8 significant bits) plus ``bound`` (the fp32 sums' error, elementwise)."""
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * 2.0**-8 + bound).all(), (err - exact.abs() * 2.0**-8 - bound).max().item()


@pytest.mark.parametrize("n, k, threads", [(64, 77, 1), (96, 256, 2), (256, 512, 1)])
def test_gram_products_round_once_and_mirror_exactly(n, k, threads):
    # X X^T for a batch of three, the rows of X read from a wider tensor (row stride > k): the kernel's
    # tiles above the diagonal and the mirrored ones below. Odd k pairs its last element with zero.
    _kernel_or_skip()
    torch.set_num_threads(threads)
    wide = _bf16(3, n, k + 5, seed=n)
    x = wide[..., 2: k + 2]
    exact = x.double() @ x.double().mT
    sums = x.double().abs() @ x.double().abs().mT * k * 2.0**-24
    out = symmetric_matmul(x, x.mT, n // 32)
    assert out.dtype == torch.bfloat16 and out.shape == (3, n, n)
    assert torch.equal(out, out.mT)
    _assert_one_rounding(out, exact, sums)
    # alpha inside the product, before its one rounding (the folded normalisation of a lone matrix)
    scaled = symmetric_matmul(x, x.mT, n // 32, alpha=0.37)
    _assert_one_rounding(scaled, 0.37 * exact, 0.37 * sums)


def test_products_of_symmetric_factors_with_an_addend():
    # P = b R + c R^2 and R P with v given as itself (v_symmetric: its rows are its columns); against the
    # same products with v's columns read from its transpose, and against fp64.
    _kernel_or_skip()
    n = 128
    x = _bf16(2, n, 200, seed=1)
    r = symmetric_matmul(x, x.mT, n // 32, alpha=1 / 200)
    b, c = -4.775, 2.0315
    p = symmetric_matmul(r, r, n // 32, alpha=c, addend=r, beta=b, v_symmetric=True)
    assert torch.equal(p, symmetric_matmul(r, r.mT.contiguous().mT, n // 32, alpha=c, addend=r, beta=b))
    rd = r.double()
    exact = b * rd + c * rd @ rd
    bound = (abs(b) * rd.abs() + abs(c) * rd.abs() @ rd.abs()) * n * 2.0**-24
    _assert_one_rounding(p, exact, bound)
    # R P is symmetric only as far as P commutes with R (P holds R^2's rounding): its upper triangle is the
    # product, the lower the mirror.
    rp = symmetric_matmul(r, p, n // 32, v_symmetric=True)
    assert torch.equal(rp, rp.mT)
    upper = torch.ones(n, n, dtype=torch.bool).triu()
    bound = rd.abs() @ p.double().abs() * n * 2.0**-24
    _assert_one_rounding(rp[:, upper], (rd @ p.double())[:, upper], bound[:, upper])


@pytest.mark.parametrize("n, k, threads", [(32, 5, 1), (48, 300, 2), (96, 131, 1), (256, 512, 2)])
def test_fp32_products_within_the_sums_bound_and_mirror_exactly(n, k, threads):
    # X X^T in fp32 for a batch of two read from wider rows: n = 32, 48 and 96 end column blocks with a
    # 4- or 2-row tile, k = 5, 131 and 300 leave a remainder after the 8 x 8 packing transposes and after the
    # 128-product chains. Within (k + 2) units of fp32 round-off of the sums of |products| (any summation
    # order is; the alpha scaling is one more rounding).
    _kernel_or_skip(torch.float32)
    torch.set_num_threads(threads)
    wide = torch.randn(2, n, k + 3, generator=torch.Generator().manual_seed(n))
    x = wide[..., 1: k + 1]
    xd = x.double()
    bound = xd.abs() @ xd.abs().mT * (k + 2) * 2.0**-24
    for alpha in (1.0, 0.37):
        out = symmetric_matmul(x, x.mT, n // 16, alpha=alpha)
        assert out.dtype == torch.float32 and out.shape == (2, n, n) and torch.equal(out, out.mT)
        assert ((out.double() - alpha * xd @ xd.mT).abs() <= alpha * bound).all()
    # The addend form with a symmetric right factor given as itself: P = b R + c R^2.
    r = symmetric_matmul(x, x.mT, n // 16, alpha=1 / k)
    b, c = -4.775, 2.0315
    p = symmetric_matmul(r, r, n // 16, alpha=c, addend=r, beta=b, v_symmetric=True)
    assert torch.equal(p, p.mT)
    rd = r.double()
    bound = (abs(b) * rd.abs() + abs(c) * rd.abs() @ rd.abs()) * (n + 3) * 2.0**-24
    assert ((p.double() - (b * rd + c * rd @ rd)).abs() <= bound).all()


def test_gram_fp32_by_the_kernel_is_as_near_the_exact_iteration_as_by_torch(monkeypatch):
    # fp32 Gram runs without restarts, so X X^T's round-off carries through all five steps: the kernel's
    # products (chains of 128 products added up, as blocked GEMMs sum) keep it as near the exact (fp64)
    # iteration as MKL's full products do. One chain over all of k measured up to 3.3x farther.
    from test_gram_newton_schulz import exact_newton_schulz, gradient_like, relative

    _kernel_or_skip(torch.float32)
    x, factors = gradient_like(2, 256, 2048)
    exact = exact_newton_schulz(factors)
    x = x.float()
    by_kernel = gram_newton_schulz(x, dtype=torch.float32, input_dtype=None)
    monkeypatch.setattr(symmetric, "_fp32_gemm_is_avx2", lambda: False)
    by_torch = gram_newton_schulz(x, dtype=torch.float32, input_dtype=None)
    assert relative(by_kernel, exact) <= 1.2 * relative(by_torch, exact)


def test_each_kernel_serves_its_dtype_at_multiples_of_its_tile(monkeypatch):
    # bf16 at multiples of 32 where the CPU has AVX512-BF16 and no AMX; fp32 at multiples of 16 where MKL's
    # fp32 GEMM is AVX2 code (not Intel's AVX-512); torch's GEMMs elsewhere, and when the library is off.
    calls = []
    product = symmetric._kernel_product
    monkeypatch.setattr(symmetric, "_kernel_product", lambda *a: calls.append(a[0].dtype) or product(*a))
    if symmetric_kernel_applies(64, "cpu", torch.bfloat16):
        assert symmetric_panels(256, "cpu", torch.bfloat16) == 8 and symmetric_panels(240, "cpu", torch.bfloat16) == 1
        x = torch.randn(2, 96, 64).bfloat16()
        symmetric_matmul(x, x.mT, 3)
        assert calls == [torch.bfloat16]
    calls.clear()
    monkeypatch.setattr(symmetric, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(symmetric, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert not symmetric_kernel_applies(256, "cpu", torch.float32) and symmetric_panels(256, "cpu", torch.float32) == 1
    monkeypatch.setattr(symmetric, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # Intel without AVX-512
    if symmetric.symmetric_kernels.load() is not None:
        assert symmetric_panels(256, "cpu", torch.float32) == 16 and symmetric_panels(248, "cpu", torch.float32) == 1
        x = torch.randn(2, 96, 64)
        symmetric_matmul(x, x.mT, 6)
        assert calls == [torch.float32]
    monkeypatch.setattr(symmetric, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(symmetric, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))  # Zen 4
    assert symmetric_kernel_applies(256, "cpu", torch.float32) == (symmetric.symmetric_kernels.load() is not None)
    monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: None)
    assert symmetric_panels(256, "cpu", torch.bfloat16) == 1 and symmetric_panels(256, "cpu", torch.float32) == 1
    assert symmetric_panels(1024, "cpu", torch.float32) == 4 or symmetric.cpu_has_amx()
