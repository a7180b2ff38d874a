"""The edits that put our kernels' dispatch into ggml-cuda.cu (native/build.py), the kernels' version
the Python side asks for, and the cuda switches checked by name.

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import native_build

from toyharness.engine import get_engine

ROOT = Path(__file__).resolve().parents[1]
# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


def test_the_dispatch_edits_apply_once_to_the_pinned_ggml():
    build = native_build()
    text = (build.ggml_source() / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    edited = build.cuda_dispatch_source(text)
    assert edited.count('#include "ggml-cuda/th-custom.cuh"') == 1
    assert edited.count("if (!th_cuda_custom(ctx.stream(), ctx.cublas_handle(), dst))") == 1
    assert edited.count("return th_cuda_custom_supported(op);") == 1
    # the bf16 operand copies' pass over a graph's nodes, begun before the loop and ended after it
    assert edited.count("th_cuda_graph_begin(cgraph);") == 1 and edited.count("th_cuda_graph_end();") == 1
    assert edited.index("th_cuda_graph_begin(cgraph);") < edited.index("th_cuda_graph_end();")
    # 3 of them the precision's (test_precision), 2 the bf16 copies' pass
    assert len(edited.splitlines()) == len(text.splitlines()) + 13


def test_python_asks_for_the_kernels_version_the_native_side_declares():
    """A ggml-cuda built before this version lacks stand-ins blocks now build: _ffi must refuse it."""
    import re

    from toyharness import _ffi

    header = (ROOT / "native" / "custom_ops.h").read_text()
    assert int(re.search(r"#define TH_CUDA_KERNELS_VERSION (\d+)", header).group(1)) == _ffi.CUDA_KERNELS_VERSION


def test_a_ggml_without_the_anchor_is_refused_by_name():
    build = native_build()
    with pytest.raises(build.BuildError, match=r"'#include \"ggml-cuda/common.cuh\"' found 0 times"):
        build.cuda_dispatch_source("int main(void) { return 0; }\n")


@pytest.mark.parametrize("name, bad, message", [
    ("TOYHARNESS_CUDA_ATTN_BWD", "row", "TOYHARNESS_CUDA_ATTN_BWD='row': use chunks or rows"),
    ("TOYHARNESS_CUDA_GROUP_SUM", "no", "TOYHARNESS_CUDA_GROUP_SUM='no': use 1 or 0"),
    ("TOYHARNESS_CUDA_TF32_ATTENTION", "tf32", "TOYHARNESS_CUDA_TF32_ATTENTION='tf32': use tensor or fp32"),
    ("TOYHARNESS_CUDA_SWIGLU", "GGML", "TOYHARNESS_CUDA_SWIGLU='GGML': use ours or ggml"),
    ("TOYHARNESS_BF16_REUSE", "off", "TOYHARNESS_BF16_REUSE='off': use 1 or 0"),
])
def test_every_cuda_comparison_switch_is_checked_by_name(monkeypatch, name, bad, message):
    """A switch the native side reads (th_env_is) only compares with one value: any other would
    silently mean the default, so a program refuses it, naming the variable and its values."""
    from toyharness.engine.program import CUDA_SWITCHES
    from toyharness.errors import InputError

    monkeypatch.setenv(name, bad)
    with pytest.raises(InputError, match=re.escape(message)):
        get_engine("cpu").program()
    for value in CUDA_SWITCHES[name]:
        monkeypatch.setenv(name, value)
        get_engine("cpu").program()


def test_the_native_side_reads_no_switch_the_table_does_not_check():
    """Every TOYHARNESS_ variable that native/ compares with th_env_is is in CUDA_SWITCHES, with
    the value it compares against among the allowed ones."""
    from toyharness.engine.program import CUDA_SWITCHES

    native = Path(__file__).resolve().parents[1] / "native"
    read = set()
    for path in list(native.rglob("*.c")) + list(native.rglob("*.cu")) + list(native.rglob("*.h")):
        read |= set(re.findall(r'th_env_is\("(TOYHARNESS_[A-Z0-9_]+)", "([^"]*)"\)', path.read_text()))
    assert read, "no th_env_is call found under native/"
    for name, value in sorted(read):
        assert name in CUDA_SWITCHES and value in CUDA_SWITCHES[name], (name, value)
