"""The edits that put our kernels' dispatch into ggml-cuda.cu (native/build.py) and the kernels'
version the Python side asks for: checked here on any machine (no device needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import native_build

ROOT = Path(__file__).resolve().parents[1]


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
