"""orthon.core.native.NativeLibrary: a C source built on first use, from the text it had when the module
declaring its functions was imported."""
import logging
import os
import shutil

import pytest

from orthon.core.native import NativeLibrary, cpu_has_avx2_fma


def _library(source):
    return NativeLibrary(source, "ORTHON_TEST_KERNEL", "the test kernel", "nothing", logging.getLogger(__name__),
                         lambda lib: None)


def test_the_source_is_the_one_read_at_construction(tmp_path, monkeypatch):
    # A source changed between the import and the first load (an upgrade under a running job) must not be
    # built: its functions could take other arguments than the module declares. The next process builds it.
    if not (cpu_has_avx2_fma() and shutil.which(os.environ.get("CC", "cc"))):
        pytest.skip("no C compiler or no AVX2 / FMA: nothing is built")
    monkeypatch.setenv("ORTHON_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 1; }\n")
    imported = _library(source)
    source.write_text("int answer(void) { return 2; }\n")
    assert imported.load().answer() == 1
    assert _library(source).load().answer() == 2
    assert len(list((tmp_path / "cache").glob("answer_*.so"))) == 2  # one per text


def test_an_unreadable_source_is_unavailable_with_its_reason(tmp_path):
    library = _library(tmp_path / "missing.c")
    if not cpu_has_avx2_fma():
        pytest.skip("the CPU lacks AVX2 / FMA: the build is never tried")
    assert library.load() is None and "could not build" in library.why_unavailable
