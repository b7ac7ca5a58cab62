"""The bf16 kernel of Gram Newton-Schulz's symmetric products (optim/symmetric_kernels.c) against fp64
products of the same bf16 inputs: fp32 accumulation and one rounding to bf16, the result exactly
symmetric, on layouts the iteration hands it (batches, strided rows, odd inner sizes, the addend form)."""
import pytest
import torch

import orthon.optim.gram_newton_schulz as gram_module
from orthon.optim.gram_newton_schulz import symmetric_kernel_applies, symmetric_matmul, symmetric_panels

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernel_or_skip():
    if not symmetric_kernel_applies(64, "cpu", torch.bfloat16):
        why = gram_module.symmetric_kernels.why_unavailable or "this CPU lacks AVX512-BF16 or has AMX"
        pytest.skip(f"the bf16 symmetric kernel does not run here: {why}")


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


def test_the_kernel_serves_bf16_multiples_of_its_tile_only(monkeypatch):
    # fp32, and n not a multiple of 32, go to torch's GEMMs; so does everything when the library is off.
    _kernel_or_skip()
    assert symmetric_panels(256, "cpu", torch.bfloat16) == 8
    assert symmetric_panels(256, "cpu", torch.float32) == 1 and symmetric_panels(250, "cpu", torch.bfloat16) == 1
    calls = []
    product = gram_module._kernel_product
    monkeypatch.setattr(gram_module, "_kernel_product", lambda *a: calls.append(1) or product(*a))
    x = _bf16(2, 96, 64, seed=2)
    symmetric_matmul(x, x.mT, 3)
    symmetric_matmul(x.float(), x.float().mT, 3)
    assert calls == [1]
    monkeypatch.setattr(gram_module.symmetric_kernels, "load", lambda: None)
    assert symmetric_panels(256, "cpu", torch.bfloat16) == 1 and symmetric_panels(1024, "cpu", torch.bfloat16) == 4
