"""Gram Newton-Schulz against standard Newton-Schulz and the exact iteration, on GLM-5-shaped blocks.

The exact iteration: Newton-Schulz maps each singular value s of the Frobenius-normalised input
through the scalar quintic s <- a s + b s^3 + c s^5 (5 times) and keeps the singular vectors, so its
fp64 result is U f(S) V^T from an fp64 SVD. Standard bf16 Newton-Schulz (torch.optim.Muon's
arithmetic) is itself some distance from it; gram must be no farther (within a margin), its singular
values must lie in the same band, and in fp32 it must be the same map to fp32 round-off.
"""
import pytest
import torch
from torch import nn

from orthon.core.errors import ConfigError
from orthon.optim import Muon, OptimConfig
from orthon.optim.gram_newton_schulz import (
    block_flops,
    default_restarts,
    gram_compute_dtype,
    gram_method_restarts,
    gram_newton_schulz,
    gram_newton_schulz_flops,
    gram_pays,
    orthogonalise_gram_or_standard,
)
from orthon.optim.symmetric_products import symmetric_matmul, symmetric_panels, symmetric_product_flops
from orthon.optim.newton_schulz import DEFAULT_COEFFICIENTS, bf16_gemm_is_native, newton_schulz, newton_schulz_flops

pytestmark = pytest.mark.usefixtures("one_thread")

# GLM-5 (configs/glm5.yaml): W_QB per head 256 x 2048 (qk head 192 + 64 rows, q_lora 2048 columns),
# W_KVB per head 448 x 512 (192 + 256 rows, kv_lora 512), routed expert gate/up 2048 x 6144 (down is its
# transpose: gram works on the transpose, tested on the smaller tall blocks).
QB_HEAD, KVB_HEAD, EXPERT_UP = (256, 2048), (448, 512), (2048, 6144)


def gradient_like(count, rows, cols, seed=0):
    """Matrices with a power-law spectrum (s_k ~ 1/k), as momentum of gradients has: harder for half
    precision than Gaussian noise, whose singular values are all of one size."""
    gen = torch.Generator().manual_seed(seed)
    n = min(rows, cols)
    u = torch.linalg.qr(torch.randn(count, rows, n, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(count, cols, n, generator=gen, dtype=torch.float64)).Q
    s = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
    return (u * s) @ v.mT, (u, s, v)


def exact_newton_schulz(factors, steps=5):
    """The fp64 result of ``steps`` quintic iterations from the SVD (u, s, v) of the input."""
    u, s, v = factors
    a, b, c = DEFAULT_COEFFICIENTS
    s = s / s.norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ v.mT


def relative(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def singular_band(x):
    s = torch.linalg.svdvals(x.double())
    return s.min().item(), s.max().item()


def compare(rows, cols, count, dtype):
    x, factors = gradient_like(count, rows, cols)
    exact = exact_newton_schulz(factors)
    standard = newton_schulz(x.float())  # bf16, torch.optim.Muon's arithmetic
    gram = gram_newton_schulz(x.float(), dtype=dtype)
    return exact, standard, gram


@pytest.mark.parametrize("rows, cols, count", [
    (*QB_HEAD, 4),  # Muon Split's per-head W_QB blocks (ratio 8)
    (48, 128, 8),  # the tiny model's W_QB head blocks
    (512, 256, 8),  # the tiny model's expert stack (gate/up; Muon runs standard on it, gram_pays)
    (768, 256, 2),  # a tall dense MLP matrix: gram works on the transpose
])
def test_gram_bf16_stays_within_bf16_round_off_of_the_exact_iteration(rows, cols, count):
    exact, standard, gram = compare(rows, cols, count, torch.bfloat16)
    err_standard, err_gram = relative(standard, exact), relative(gram, exact)
    # Both are bf16 round-off away from the exact iteration: standard (torch.optim.Muon's numbers) by
    # 1.5-4% on these spectra, gram (one restart) by 2.9-6.4% (largest on the 48-row heads, where one
    # bf16 rounding of R weighs most). Bound both at 0.08: a wrong coefficient, transpose or restart
    # puts gram 0.3 or more away (see test_restarts_keep_bf16_stable), so does skipping an iteration.
    assert err_standard < 0.08 and err_gram < 0.08, (err_gram, err_standard)
    assert relative(gram, standard.double()) <= err_gram + err_standard < 0.12
    # The same band of singular values: the exact iteration maps this spectrum into [0.36, 1.21];
    # both bf16 results stay within 0.05 of the exact band (and of each other's).
    lo, hi = singular_band(exact)
    for out in (standard, gram):
        out_lo, out_hi = singular_band(out)
        assert lo - 0.05 <= out_lo and out_hi <= hi + 0.05, (out_lo, out_hi, lo, hi)
    assert 0.3 < lo and hi < 1.25


@pytest.mark.parametrize("rows, cols", [(256, 1024), (768, 256)])
def test_a_lone_matrix_has_its_normalisation_folded_into_the_gemms(rows, cols, monkeypatch):
    # One matrix in bf16: X is not divided by its norm; the scale rides in the GEMMs that read X (R_0 and
    # the first Q X), rounded once. Same map as the divided form (a batch of two), to bf16 round-off.
    import orthon.optim.gram_newton_schulz as gram_module

    scales, alphas = [], []
    product, matmul = gram_module.scaled_product, gram_module.symmetric_matmul
    monkeypatch.setattr(gram_module, "scaled_product", lambda u, v, s: scales.append(s) or product(u, v, s))

    def spy(u, v, panels, alpha=1.0, addend=None, beta=0.0, v_symmetric=False):
        if addend is None:  # X X^T and the products of R, P, Q
            alphas.append(alpha)
        return matmul(u, v, panels, alpha, addend, beta, v_symmetric)

    monkeypatch.setattr(gram_module, "symmetric_matmul", spy)
    x, factors = gradient_like(2, rows, cols)
    exact = exact_newton_schulz(factors)
    divided = gram_newton_schulz(x.float())
    assert scales and all(s is None for s in scales) and set(alphas) == {1.0}
    scales.clear(), alphas.clear()
    lone = [gram_newton_schulz(x[i: i + 1].float()) for i in range(2)]
    first_alphas = alphas[: len(alphas) // 2]
    lone = torch.cat(lone)
    norm = x[0].float().bfloat16().float().norm().item()
    # Per matrix: R_0 with 1/|X|^2, the first Q X (at the restart before step 3) with 1/|X|.
    assert first_alphas[0] == pytest.approx(1 / norm**2, rel=1e-2) and set(first_alphas[1:]) == {1.0}
    assert scales[0] == pytest.approx(1 / norm, rel=1e-2)
    assert [s is not None for s in scales] == [True, False] * 2  # the last Q X: X already scaled
    # Measured: 0.033-0.034 from the exact iteration against 0.039-0.040 divided (one rounding fewer).
    # A scale left out of R_0 or of Q X, or applied once too often, is far off (a wrong polynomial or
    # an output scaled by |X|).
    assert relative(lone, exact) < 0.05 and relative(lone, exact) <= relative(divided, exact) + 0.005
    assert relative(lone, divided.double()) < 0.05
    # Beyond FOLD_MAX_NORM the matrix is divided first (X X^T of the raw matrix would near bf16's range).
    scales.clear()
    huge = gram_newton_schulz(x[:1].float() * 1e13)
    assert all(s is None for s in scales)
    assert relative(huge, exact[:1]) < 0.08


@pytest.mark.parametrize("rows, cols", [QB_HEAD, (128, 48), (256, 768)])
def test_gram_fp32_is_the_same_map_as_standard_fp32(rows, cols):
    # In fp32 both forms compute the same polynomial in X X^T: only fp32 round-off apart.
    x, factors = gradient_like(3, rows, cols)
    exact = exact_newton_schulz(factors)
    gram = gram_newton_schulz(x.float(), dtype=torch.float32, input_dtype=None)
    standard = newton_schulz(x.float(), dtype=torch.float32)
    assert gram.dtype == torch.float32 and gram.shape == (3, rows, cols)
    # ~2e-4 measured (fp32 round-off through 5 steps); bf16 would be ~100x farther.
    assert relative(gram, exact) < 5e-4 and relative(standard, exact) < 5e-4
    assert relative(gram, standard.double()) < 5e-4


def test_gram_fp16_is_closer_than_bf16():
    # fp16 (the GPU compute dtype) has 3 more mantissa bits than bf16: from an unrounded input, gram in
    # fp16 lands ~8x closer to the exact iteration (measured 0.004 against 0.034).
    x, factors = gradient_like(4, 128, 512)
    exact = exact_newton_schulz(factors)
    gram16 = gram_newton_schulz(x.float(), dtype=torch.float16, input_dtype=None)
    gram_bf16 = gram_newton_schulz(x.float(), dtype=torch.bfloat16, input_dtype=None)
    assert gram16.dtype == torch.float16 and gram_bf16.dtype == torch.bfloat16
    assert relative(gram16, exact) < 0.3 * relative(gram_bf16, exact)
    assert relative(gram16, exact) < 0.01


def test_restarts_keep_bf16_stable():
    # Without a restart, bf16 round-off in R = X X^T leaves eigenvalues slightly below 0, which the
    # iteration multiplies by ~a^2 = 11.9 per step: on a near-low-rank input the output's largest
    # singular value leaves the band (measured ~25). The default restart (before step 3) keeps it in.
    gen = torch.Generator().manual_seed(1)
    n = 256
    u = torch.linalg.qr(torch.randn(2, 256, n, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(2, 768, n, generator=gen, dtype=torch.float64)).Q
    s = torch.cat([torch.logspace(0, -1, n // 8, dtype=torch.float64),
                   torch.full((n - n // 8,), 1e-6, dtype=torch.float64)])
    x = ((u * s) @ v.mT).float()
    assert default_restarts(5, torch.bfloat16) == (3,)
    unrestarted = gram_newton_schulz(x, dtype=torch.bfloat16, restarts=())
    restarted = gram_newton_schulz(x, dtype=torch.bfloat16)
    assert singular_band(unrestarted)[1] > 2.0
    assert singular_band(restarted)[1] < 1.25


@pytest.mark.parametrize("kernel", [True, False])
def test_symmetric_products_are_the_full_products_mirrored(kernel, monkeypatch):
    # An n x n product known to be symmetric, computed in row panels (each from its diagonal block on) and
    # mirrored: the full product's values (fp32 round-off), the blocks below the diagonal ones exactly the
    # transposes of those above. 100 rows in 3 panels of 33, 33, 34: uneven bounds. The mirror by the C
    # kernel (fp32 and bf16 words) and by torch's copies.
    import orthon.optim.symmetric_products as symmetric

    if not kernel:
        monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: None)
    elif symmetric.symmetric_kernels.load() is None:
        pytest.skip(f"mirror kernel unavailable: {symmetric.symmetric_kernels.why_unavailable}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 100, 70, generator=gen)
    r = torch.bmm(x, x.mT)
    r = (r + r.mT) / 2  # exactly symmetric, as the iteration's R is
    p = 0.5 * r + 0.1 * torch.bmm(r, r)  # a polynomial in R: commutes with it
    b, c = DEFAULT_COEFFICIENTS[1:]
    cases = [
        (symmetric_matmul(x, x.mT, 3), torch.bmm(x, x.mT)),  # X X^T
        (symmetric_matmul(x, x.mT, 3, alpha=0.25), 0.25 * torch.bmm(x, x.mT)),  # with the folded scale
        (symmetric_matmul(r, r, 3, alpha=c, addend=r, beta=b), b * r + c * torch.bmm(r, r)),  # P's b R + c R^2
        (symmetric_matmul(r, p, 3), torch.bmm(r, p)),  # R P, Q P
    ]
    for panelled, full in cases:
        for lo, hi in ((33, 66), (66, 100)):
            assert torch.equal(panelled[:, lo:hi, :lo], panelled[:, :lo, lo:hi].mT)
        torch.testing.assert_close(panelled, full, rtol=1e-5, atol=1e-4 * full.abs().max().item())
    half = symmetric_matmul(x.bfloat16(), x.bfloat16().mT, 3)
    for lo, hi in ((33, 66), (66, 100)):
        assert torch.equal(half[:, lo:hi, :lo], half[:, :lo, lo:hi].mT)
    torch.testing.assert_close(half.float(), torch.bmm(x, x.mT), rtol=0.02, atol=0.3)
    # One panel is the plain batched GEMM.
    assert torch.equal(symmetric_matmul(r, p, 1), torch.bmm(r, p))
    assert symmetric_product_flops(100, 70, 3) == 2 * 70 * (33 * 100 + 33 * 67 + 34 * 34)


@pytest.mark.parametrize("bf16_kernel", [True, False])
def test_gram_with_symmetric_products_is_the_same_map(bf16_kernel, monkeypatch):
    # A 1024-row block (where the CPU has no AMX: 4 panels of torch's GEMMs, or in bf16 with AVX512-BF16 the
    # kernel's 32 column tiles), in this CPU's compute dtype: the symmetric products' iteration and the full
    # products' agree to round-off and are as near the exact iteration.
    import orthon.optim.symmetric_products as symmetric

    if not bf16_kernel:
        monkeypatch.setattr(symmetric, "cpu_has_avx512_bf16", lambda: False)
    x, factors = gradient_like(1, 1024, 1536)
    exact = exact_newton_schulz(factors)
    dtype = gram_compute_dtype("auto", "cpu")
    outs = {}
    for amx in (True, False):
        monkeypatch.setattr(symmetric, "cpu_has_amx", lambda amx=amx: amx)
        outs[amx] = gram_newton_schulz(x.float(), dtype=dtype)
    full, panelled = outs[True], outs[False]
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-4
    assert relative(panelled, full.double()) < tolerance
    assert relative(panelled, exact) <= relative(full, exact) + tolerance / 4
    lo, hi = singular_band(exact)
    out_lo, out_hi = singular_band(panelled)
    assert lo - 0.05 <= out_lo and out_hi <= hi + 0.05, (out_lo, out_hi, lo, hi)


@pytest.mark.slow
@pytest.mark.skipif(not bf16_gemm_is_native("cpu"), reason="bf16 GEMM emulated on this CPU (about 1 GFLOP/s): "
                    "these blocks would take over 20 minutes; the fast suite checks the same numerics on smaller ones")
@pytest.mark.parametrize("rows, cols, count", [(1024, 4096, 2), (*EXPERT_UP, 1)])  # ~30 s, ~60-120 s
def test_gram_bf16_on_large_glm5_blocks(rows, cols, count):
    exact, standard, gram = compare(rows, cols, count, torch.bfloat16)
    err_standard, err_gram = relative(standard, exact), relative(gram, exact)
    assert err_standard < 0.08 and err_gram < 0.08, (err_gram, err_standard)
    lo, hi = singular_band(exact)
    for out in (standard, gram):
        out_lo, out_hi = singular_band(out)
        assert lo - 0.05 <= out_lo and out_hi <= hi + 0.05


@pytest.mark.slow
@pytest.mark.parametrize("rows, cols", [(1024, 4096), EXPERT_UP])  # ~20 s, ~60 s
def test_gram_fp32_on_large_glm5_blocks(rows, cols):
    # fp32 Gram (no restarts; the emulated-bf16 kind's compute dtype), its symmetric products by the fp32
    # kernel where it applies: fp32 round-off from the exact iteration, however long its sums (k = 6,144).
    x, factors = gradient_like(1, rows, cols)
    exact = exact_newton_schulz(factors)
    gram = gram_newton_schulz(x.float(), dtype=torch.float32, input_dtype=None)
    assert relative(gram, exact) < 1e-3
    lo, hi = singular_band(exact)
    out_lo, out_hi = singular_band(gram)
    assert lo - 0.01 <= out_lo and out_hi <= hi + 0.01


def test_flop_counts_by_hand(monkeypatch):
    import orthon.optim.symmetric_products as symmetric

    monkeypatch.setattr(symmetric, "cpu_has_amx", lambda: True)  # full products (as on GPUs)
    monkeypatch.setattr(symmetric, "_fp32_gemm_is_avx2", lambda: False)  # an Intel Xeon's AVX-512 MKL
    n, m = 1024, 4096
    # Standard: 5 x (X X^T, R^2, P X) = 5 (4 n^2 m + 2 n^3) = 90 n^3 here.
    assert newton_schulz_flops(n, m) == 90 * n**3
    # Gram, restart before step 3: X X^T, then steps 0-2 on n x n (R^2, R P, P R P; Q P from step 1;
    # none of R's after step 2), restart (Q X, X X^T), steps 3-4, Q X: 8 n^2 m + 28 n^3 = 60 n^3.
    assert gram_newton_schulz_flops(n, m, 5, (3,)) == 60 * n**3 == gram_newton_schulz_flops(m, n, 5, (3,))
    # No restart (fp32): 4 n^2 m + 34 n^3.
    assert gram_newton_schulz_flops(n, m, 5, ()) == 50 * n**3
    # Fewer FLOPs above aspect ratio 1.5 (8 n^2 m + 28 n^3 < 20 n^2 m + 10 n^3); chosen from 0.8 of
    # standard's FLOPs on, aspect ratio 2.5 (48 / 60).
    assert gram_newton_schulz_flops(64, 96, 5, (3,)) == newton_schulz_flops(64, 96)
    assert gram_pays(*QB_HEAD, 5, (3,)) and gram_pays(*EXPERT_UP, 5, (3,)) and gram_pays(64, 160, 5, (3,))
    assert not gram_pays(64, 159, 5, (3,)) and not gram_pays(512, 256, 5, (3,))  # ratio 2: 0.88, not yet faster
    assert not gram_pays(*KVB_HEAD, 5, (3,)) and not gram_pays(1024, 1024, 5, (3,))  # standard
    ratio = gram_newton_schulz_flops(*QB_HEAD, 5, (3,)) / newton_schulz_flops(*QB_HEAD)
    assert ratio == pytest.approx((8 * 8 + 28) / (20 * 8 + 10))  # 0.54 on GLM-5's W_QB heads
    # What Muon spends per block (distributed Muon balances ranks by it): the method, the dtype's restarts.
    assert block_flops(n, m, 5, "gram", "bf16") == 60 * n**3 and block_flops(n, m, 5, "gram", "fp32") == 50 * n**3
    assert block_flops(n, m, 5, "standard") == 90 * n**3 == block_flops(n, m, 5, "gram", "fp16", "cuda") + 30 * n**3
    assert block_flops(n, n, 5, "gram", "bf16") == 30 * n**3  # square: standard
    assert block_flops(256, 512, 5, "gram", "bf16") == newton_schulz_flops(256, 512)  # below the threshold
    # Symmetric products in 4 row panels of 256 (CPUs without AMX, n >= 1024): an n x n product over K costs
    # 2 K (256 n + 256 (3n/4) + 256 (n/2) + 256 (n/4)) = 2 K n^2 (10/16). Gram at 1024 x 4096: its two X X^T
    # and 14 n x n products at 10/16, its two Q X in full: 2 (2 n^2 m) (10/16 + 1) + 14 (2 n^3) (10/16).
    bf16 = torch.bfloat16
    assert symmetric_panels(n, "cpu", bf16) == 1 and symmetric_panels(n, "cuda", torch.float16) == 1
    monkeypatch.setattr(symmetric, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(symmetric, "cpu_has_avx512_bf16", lambda: False)
    assert [symmetric_panels(k, "cpu", bf16) for k in (512, 1023, 1024, 2048, 6144)] == [1, 1, 4, 8, 8]
    assert symmetric_panels(n, "cuda", bf16) == 1
    assert symmetric_product_flops(n, m, 4) == 2 * m * n * n * 10 // 16
    assert gram_newton_schulz_flops(n, m, 5, (3,), panels=4) == 87 * n**3 // 2  # 43.5 n^3, was 60
    assert block_flops(n, m, 5, "gram", "bf16") == 87 * n**3 // 2
    # The square block's standard products (restarted every step): X X^T and R^2 in panels, P X full.
    assert block_flops(n, n, 5, "gram", "bf16") == 5 * (2 * n**3) * (10 + 10 + 16) // 16  # 22.5 n^3, was 30
    assert block_flops(n, n, 5, "standard") == 30 * n**3  # standard: torch.optim.Muon's products
    # The bf16 kernel (AVX512-BF16, no AMX): 32-column tiles, each from row 0 to its diagonal tile, for n a
    # multiple of 32 in bf16 only. At 1024: 2 K * 32 * (1024 + 992 + ... + 32) = 2 K n^2 (33/64); Gram at
    # 1024 x 4096: 2 (2 n^2 m) (33/64 + 1) + 14 (2 n^3) (33/64) = 38.6875 n^3.
    monkeypatch.setattr(symmetric, "cpu_has_avx512_bf16", lambda: True)
    monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: object())  # built, wherever this runs
    assert [symmetric_panels(k, "cpu", bf16) for k in (32, 48, 256, 1024)] == [1, 1, 8, 32]
    assert symmetric_panels(1024, "cpu", torch.float32) == 4 and symmetric_panels(256, "cuda", bf16) == 1
    assert symmetric_product_flops(n, m, 32) == 2 * m * n * n * 33 // 64
    assert block_flops(n, m, 5, "gram", "bf16") == 2476 * n**3 // 64
    assert block_flops(n, m, 5, "gram", "fp32") == gram_newton_schulz_flops(n, m, 5, (), panels=4)
    # The fp32 kernel (where MKL's fp32 GEMM is AVX2 code): 16-column tiles, for n a multiple of 16. At 1024:
    # 2 K n^2 (65/128); Gram at 1024 x 4096 without restarts: 2 n^2 m (65/128 + 1) + 17 (2 n^3) (65/128).
    monkeypatch.setattr(symmetric, "_fp32_gemm_is_avx2", lambda: True)
    assert [symmetric_panels(k, "cpu", torch.float32) for k in (16, 40, 256, 1024)] == [1, 1, 16, 64]
    assert symmetric_product_flops(n, m, 64) == 2 * m * n * n * 65 // 128
    assert block_flops(n, m, 5, "gram", "fp32") == 3754 * n**3 // 128  # 29.3 n^3, was 50 (4 panels: 38.2)


def test_where_gram_pays_by_dtype_and_device(monkeypatch):
    # With full products: from 0.8 of standard's FLOPs (aspect ratio 2.5), or 0.9 (ratio 2) in bf16 on a CPU
    # without AMX, where the 512 x 256 expert blocks measured 0.81-0.87 of standard's time (1.12 on the AMX
    # Xeon).
    import orthon.optim.symmetric_products as symmetric

    expert, tall, near_square = (512, 256), (768, 256), (384, 256)  # 0.88, 0.74, 0.97 of standard's FLOPs
    bf16, fp32, every_step = torch.bfloat16, torch.float32, (1, 2, 3, 4)
    monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: None)  # no kernels: full products
    for amx in (True, False):
        monkeypatch.setattr(symmetric, "cpu_has_amx", lambda amx=amx: amx)
        assert gram_method_restarts(*tall, 5, bf16, "cpu") == (3,)
        assert gram_method_restarts(*expert, 5, bf16, "cpu") == (every_step if amx else (3,))
        assert gram_method_restarts(*near_square, 5, bf16, "cpu") == every_step
        assert gram_method_restarts(*expert, 5, fp32, "cpu") == every_step  # fp32: 0.84, 1.07 measured
        assert gram_method_restarts(*expert, 5, torch.float16, "cuda") == every_step
        assert block_flops(*expert, 5, "gram", "bf16") == gram_newton_schulz_flops(
            *expert, 5, (3,) if not amx else every_step)
    x = torch.randn(3, *expert)  # the method runs what the rule says
    assert torch.equal(orthogonalise_gram_or_standard(x, gram_dtype="bf16"),
                       gram_newton_schulz(x, dtype=bf16, restarts=(3,)))
    # With the kernels' half-FLOP symmetric products (fractions of the every-step form's FLOPs, both with
    # them; 0.9 in either dtype): Gram has more symmetric products, so it pays from lower aspect ratios.
    # Measured (Zen 4, one thread; time of Gram over the every-step form): fp32 384 x 256 (0.80) 0.84,
    # 512 x 256 (0.68) 0.70, 256^2 (1.02) 1.04; bf16 384 x 256 (0.85) 0.91, 256^2 (1.02) 1.06.
    monkeypatch.setattr(symmetric.symmetric_kernels, "load", lambda: object())
    monkeypatch.setattr(symmetric, "cpu_has_avx512_bf16", lambda: True)
    monkeypatch.setattr(symmetric, "_fp32_gemm_is_avx2", lambda: True)
    assert gram_method_restarts(*near_square, 5, bf16, "cpu") == (3,)
    assert gram_method_restarts(256, 256, 5, bf16, "cpu") == every_step
    assert gram_method_restarts(*expert, 5, fp32, "cpu") == gram_method_restarts(*near_square, 5, fp32, "cpu") == ()
    assert gram_method_restarts(256, 256, 5, fp32, "cpu") == every_step
    assert block_flops(*expert, 5, "gram", "fp32") == gram_newton_schulz_flops(*expert, 5, (), 16)
    assert gram_pays(*near_square, 5, (), 0.81, 16) and not gram_pays(*near_square, 5, (), 0.8, 16)  # 0.8011


def test_compute_dtype_and_restarts_per_device():
    assert gram_compute_dtype("auto", "cuda") == torch.float16
    assert gram_compute_dtype("auto", "cpu") == (torch.bfloat16 if bf16_gemm_is_native("cpu") else torch.float32)
    assert gram_compute_dtype("fp32", "cuda") == torch.float32
    assert default_restarts(5, torch.float32) == () and default_restarts(7, torch.float16) == (3, 6)
    with pytest.raises(ValueError, match="fp8"):
        gram_compute_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="restarts"):
        gram_newton_schulz(torch.randn(4, 8), restarts=(5,))


@pytest.mark.parametrize("rows, cols, count", [(*KVB_HEAD, 4), (256, 256, 6), (512, 256, 4)])
def test_gram_method_runs_standard_products_restarted_every_step_where_gram_does_not_save(rows, cols, count,
                                                                                         monkeypatch):
    # Where gram_pays says no, the gram method restarts before every step: standard Newton-Schulz's
    # products with P = aI + bR + cR^2 formed once (no addend copied per product).
    import orthon.optim.symmetric_products as symmetric

    monkeypatch.setattr(symmetric, "cpu_has_amx", lambda: True)  # Gram from 0.8 of standard's FLOPs
    assert not gram_pays(rows, cols, 5, default_restarts(5, torch.bfloat16))
    x, factors = gradient_like(count, rows, cols)
    out = orthogonalise_gram_or_standard(x.float(), gram_dtype="bf16")
    assert torch.equal(out, gram_newton_schulz(x.float(), dtype=torch.bfloat16, restarts=(1, 2, 3, 4)))
    # ...which is standard's map up to bf16 round-off: as near the exact iteration as standard
    # (torch.optim.Muon's numbers) within bf16's margin, and in the same band of singular values.
    exact, standard = exact_newton_schulz(factors), newton_schulz(x.float())
    err_out, err_standard = relative(out, exact), relative(standard, exact)
    assert err_out < 1.5 * err_standard + 0.01 and err_out < 0.08, (err_out, err_standard)
    lo, hi = singular_band(exact)
    out_lo, out_hi = singular_band(out)
    assert lo - 0.05 <= out_lo and out_hi <= hi + 0.05, (out_lo, out_hi, lo, hi)
    # In fp32 the same products are the standard map to fp32 round-off.
    fp32 = orthogonalise_gram_or_standard(x.float(), gram_dtype="fp32", ns_dtype=torch.float32)
    assert relative(fp32, newton_schulz(x.float(), dtype=torch.float32).double()) < 5e-4
    wide = torch.randn(3, 64, 256)  # where gram pays: no restart in fp32
    assert torch.equal(orthogonalise_gram_or_standard(wide, gram_dtype="fp32"),
                       gram_newton_schulz(wide, dtype=torch.float32, restarts=()))


def test_config_and_optimizer_validate_the_method():
    with pytest.raises(ConfigError, match="ns_method"):
        OptimConfig(ns_method="fast")
    with pytest.raises(ConfigError, match="gram_dtype"):
        OptimConfig(gram_dtype="fp8")
    assert OptimConfig().ns_method == "standard"
    p = nn.Parameter(torch.randn(8, 16))
    with pytest.raises(ValueError, match="ns_method"):
        Muon([p], ns_method="fast")
    with pytest.raises(ValueError, match="gram_dtype"):
        Muon([p], ns_method="gram", gram_dtype="int8")


class WideMLP(nn.Module):
    """Rectangular hidden matrices (48 -> 192 -> 48, ratio 4: gram runs) on a fixed regression task."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(48, 192, bias=False)
        self.down = nn.Linear(192, 48, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def train_wide_mlp(method, steps=40):
    torch.manual_seed(0)
    model, target = WideMLP(), WideMLP()
    x = torch.randn(256, 48)
    with torch.no_grad():
        y = target(x)
    opt = Muon(model.parameters(), lr=0.02, weight_decay=0.0, ns_method=method)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_gram_trains_a_model_like_standard():
    standard, gram = train_wide_mlp("standard"), train_wide_mlp("gram")
    assert standard[0] == gram[0]  # same start
    assert gram[-1] < 0.3 * gram[0] and standard[-1] < 0.3 * standard[0]
    # Same map up to bf16 round-off: the curves stay within 5% of each other.
    assert abs(gram[-1] - standard[-1]) <= 0.05 * standard[-1], (gram[-1], standard[-1])
    assert gram != standard  # and gram did run (bf16 round-off differs)
