"""The thin-batch matmul kernel equals F.linear, and falls back to it where it cannot run."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from orthon.pretrain import thin_gemm
from orthon.pretrain.thin_gemm import MAX_ROWS, PackedLinear

needs_kernel = pytest.mark.skipif(thin_gemm.library() is None, reason=f"thin GEMM kernel: {thin_gemm.why_unavailable}")


def test_the_kernel_builds_where_it_can():
    """A C error in the kernel source would otherwise only show as every kernel test skipping."""
    import shutil

    if not (thin_gemm._cpu_has_avx2_fma() and shutil.which("cc")) or thin_gemm.why_unavailable == "disabled by ORTHON_THIN_GEMM=0":
        pytest.skip("no AVX2 / FMA or no C compiler here")
    assert thin_gemm.library() is not None, thin_gemm.why_unavailable


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Each kernel test on both instruction sets (AVX-512 only where the CPU has it)."""
    lib = thin_gemm.library()
    lib.thin_use_avx512(1 if request.param == "avx512" else 0)
    yield request.param
    lib.thin_use_avx512(1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (37, 13), (448, 128), (3, 256)])
def test_kernel_equals_linear(rows, out_features, in_features, isa):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = PackedLinear(w)
    assert packed.panels is not None
    got = packed(x)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    # Leading dims are kept; a non-contiguous input is read correctly.
    x3 = torch.randn(in_features, rows, generator=g).t()[None]
    torch.testing.assert_close(packed(x3), F.linear(x3, w), atol=1e-5, rtol=1e-5)


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
    code = ("from orthon.pretrain import thin_gemm; import torch; lib = thin_gemm.library();"
            "p = thin_gemm.PackedLinear(torch.ones(4, 4)); print(lib is None, p.panels is None, p(torch.ones(1, 4)).tolist());"
            "print(thin_gemm.why_unavailable)")
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return out.stdout


def test_disabled_or_unbuildable_falls_back(tmp_path):
    out = _probe({"ORTHON_THIN_GEMM": "0"})
    assert out.splitlines()[0] == "True True [[4.0, 4.0, 4.0, 4.0]]" and "ORTHON_THIN_GEMM=0" in out
    # No compiler: a fresh cache, CC pointing at a program that fails.
    out = _probe({"ORTHON_CACHE": str(tmp_path / "cache"), "CC": "false"})
    if thin_gemm._cpu_has_avx2_fma():
        assert out.splitlines()[0] == "True True [[4.0, 4.0, 4.0, 4.0]]" and "could not build" in out
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left behind


def test_fallback_is_logged_once_with_its_reason(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(thin_gemm, "_tried", False)
    monkeypatch.setattr(thin_gemm, "_lib", None)
    monkeypatch.setattr(thin_gemm, "why_unavailable", None)
    monkeypatch.setattr(thin_gemm, "_cpu_has_avx2_fma", lambda: False)
    monkeypatch.delenv("ORTHON_THIN_GEMM", raising=False)
    with caplog.at_level(logging.INFO, logger="orthon.pretrain.thin_gemm"):
        assert thin_gemm.library() is None
        assert thin_gemm.library() is None
        PackedLinear(torch.ones(4, 4))
    records = [r for r in caplog.records if r.name == "orthon.pretrain.thin_gemm"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "AVX2" in records[0].getMessage() and "F.linear" in records[0].getMessage()


def test_unbuildable_kernel_says_so_on_stderr(tmp_path):
    import os

    if not thin_gemm._cpu_has_avx2_fma():
        pytest.skip("the CPU lacks AVX2 / FMA: the build is never tried")
    code = ("from orthon.pretrain import thin_gemm; import torch;"
            "[thin_gemm.PackedLinear(torch.ones(4, 4)) for _ in range(3)]")
    env = {**os.environ, "ORTHON_CACHE": str(tmp_path / "cache"), "CC": "false"}
    env.pop("ORTHON_THIN_GEMM", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if "thin-GEMM" in line]
    assert len(lines) == 1 and "could not build the kernel" in lines[0]
