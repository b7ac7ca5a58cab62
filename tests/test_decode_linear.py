"""The decode kernels' thin-batch matmul equals F.linear, and every kernel falls back to torch where it cannot run."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from orthon.core import native
from orthon.core.native import cpu_has_avx2_fma
from orthon.engine import decode_kernels
from orthon.engine.decode_kernels import MAX_ROWS, PackedLinear

needs_kernel = pytest.mark.skipif(decode_kernels.library() is None, reason=f"decode kernels: {decode_kernels.native.why_unavailable}")


def assert_is_the_product(got, x, w):
    """got = x @ w.T to fp32 summation error in any order: |got - exact| <= n * eps * sum_i |x_i w_i| (the
    bound of n-term sums; AVX-512 and MKL add in different orders). A missing or doubled term breaks it."""
    exact = F.linear(x.double(), w.double())
    bound = w.shape[1] * torch.finfo(torch.float32).eps * F.linear(x.double().abs(), w.double().abs())
    assert bool(((got.double() - exact).abs() <= bound).all()), float(((got.double() - exact).abs() / bound).max())


def test_the_kernel_builds_where_it_can():
    """A C error in the kernel source would otherwise only show as every kernel test skipping."""
    import shutil

    if not (cpu_has_avx2_fma() and shutil.which("cc")) or decode_kernels.native.why_unavailable == "disabled by ORTHON_DECODE_KERNELS=0":
        pytest.skip("no AVX2 / FMA or no C compiler here")
    assert decode_kernels.library() is not None, decode_kernels.native.why_unavailable


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Each kernel test on both instruction sets (AVX-512 only where the CPU has it)."""
    lib = decode_kernels.library()
    lib.thin_use_avx512(1 if request.param == "avx512" else 0)
    yield request.param
    lib.thin_use_avx512(1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 64, MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (37, 13), (448, 128), (3, 256)])
def test_kernel_equals_linear(rows, out_features, in_features, isa):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = PackedLinear(w)
    assert packed.panels is not None
    got = packed(x)
    assert got.shape == (rows, out_features)
    assert_is_the_product(got, x, w)
    # Leading dims are kept; a non-contiguous input is read correctly.
    x3 = torch.randn(in_features, rows, generator=g).t()[None]
    assert_is_the_product(packed(x3), x3, w)


@needs_kernel
@pytest.mark.parametrize("rows", [64, MAX_ROWS])
def test_threads_split_the_panels_without_changing_a_bit(rows, isa):
    """A large product's 16-column panels go to different threads; each output's sum is the same one."""
    w, x = torch.randn(448, 128), torch.randn(rows, 128)
    packed = PackedLinear(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = packed(x)
        torch.set_num_threads(2)
        threaded = packed(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(serial, threaded)
    assert_is_the_product(threaded, x, w)


@needs_kernel
def test_outside_its_range_it_is_f_linear():
    w = torch.randn(24, 32)
    packed = PackedLinear(w)
    many = torch.randn(MAX_ROWS + 1, 32)
    assert torch.equal(packed(many), F.linear(many, w))  # the same call, bit for bit
    assert packed(torch.randn(0, 32)).shape == (0, 24)
    bf16 = PackedLinear(w.bfloat16())
    assert bf16.panels is None
    x = torch.randn(2, 32).bfloat16()
    assert torch.equal(bf16(x), F.linear(x, w.bfloat16()))


def _probe(env: dict) -> str:
    code = ("from orthon.engine import decode_kernels; import torch; lib = decode_kernels.library();"
            "p = decode_kernels.PackedLinear(torch.ones(4, 4)); print(lib is None, p.panels is None, p(torch.ones(1, 4)).tolist());"
            "print(decode_kernels.native.why_unavailable)")
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return out.stdout


def test_disabled_or_unbuildable_falls_back(tmp_path):
    out = _probe({"ORTHON_DECODE_KERNELS": "0"})
    assert out.splitlines()[0] == "True True [[4.0, 4.0, 4.0, 4.0]]" and "ORTHON_DECODE_KERNELS=0" in out
    # No compiler: a fresh cache, CC pointing at a program that fails.
    out = _probe({"ORTHON_CACHE": str(tmp_path / "cache"), "CC": "false"})
    if cpu_has_avx2_fma():
        assert out.splitlines()[0] == "True True [[4.0, 4.0, 4.0, 4.0]]" and "could not build" in out
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left behind


def test_fallback_is_logged_once_with_its_reason(monkeypatch, caplog, request):
    import logging

    monkeypatch.setattr(native, "cpu_has_avx2_fma", lambda: False)
    decode_kernels.native.reset()
    request.addfinalizer(decode_kernels.native.reset)  # later tests build the real library again
    monkeypatch.delenv("ORTHON_DECODE_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger="orthon.engine.decode_kernels"):
        assert decode_kernels.library() is None
        assert decode_kernels.library() is None
        PackedLinear(torch.ones(4, 4))
    records = [r for r in caplog.records if r.name == "orthon.engine.decode_kernels"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "AVX2" in records[0].getMessage() and "torch ops" in records[0].getMessage()


def test_unbuildable_kernel_says_so_on_stderr(tmp_path):
    import os

    if not cpu_has_avx2_fma():
        pytest.skip("the CPU lacks AVX2 / FMA: the build is never tried")
    code = ("from orthon.engine import decode_kernels; import torch;"
            "[decode_kernels.PackedLinear(torch.ones(4, 4)) for _ in range(3)]")
    env = {**os.environ, "ORTHON_CACHE": str(tmp_path / "cache"), "CC": "false"}
    env.pop("ORTHON_DECODE_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if "decode kernels unavailable" in line]
    assert len(lines) == 1 and "could not build the kernel" in lines[0]
