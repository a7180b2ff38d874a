"""The portable golden mode (native/portable_kernels.c): every node of each golden graph on a
portable kernel or a pure data move (tests/test_engine_ops.py checks each op and block in the
mode), an op without a portable kernel refused by name, the thread count irrelevant, and the golden
check's fallback from this machine's fast fingerprint to goldens/cpu-portable/."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from toyharness import cli, goldens
from toyharness._ffi import ffi, lib
from toyharness.engine import get_engine
from toyharness.engine.backend import PORTABLE_FINGERPRINT
from toyharness.errors import BackendError

ROOT = Path(__file__).resolve().parent.parent / "goldens"
BUILT_IN = ["gpt2", "llama", "lora", "vit_tiny", "warm_start"]
QUANTIZED_BASES = ["lora@q4_k", "lora@q8_0"]     # lora over a quantized base (tests/test_portable_quant.py)
ARCH_BASES = ["lora@llama3", "lora@qwen3", "lora@gemma3", "lora@phi3"]   # over each base architecture
DROPOUT = ["gpt2@dropout", "lora@dropout"]       # dropout's mask node (native/dropout_mask.c)
# ggml ops that may stay ggml's in the portable mode: they move data and compute nothing
DATA_MOVES = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "CONT", "CPY", "DUP", "REPEAT", "GET_ROWS"}


def test_an_op_without_a_portable_kernel_is_refused_by_name():
    """refused when the graph is built (before any compute), naming the op and the line that made it"""
    engine = get_engine("cpu")
    engine.set_portable(True)
    try:
        prog = engine.program()
        x = prog.param("x", np.random.default_rng(0).normal(size=(3, 3)))
        masked = x._new(lib.ggml_diag_mask_inf(prog._ctx_compute, x.ptr, 0))    # no portable kernel takes it
        with pytest.raises(BackendError, match=r"portable mode cannot run op DIAG_MASK_INF \(made at "
                                               r"\S*test_portable.py:\d+\)"):
            prog.forward({"y": masked.sum()})
    finally:
        engine.set_portable(False)


def test_the_mode_has_its_fingerprint_and_is_cpu_only():
    engine = get_engine("cpu")
    fast = engine.fingerprint()
    engine.set_portable(True)
    try:
        assert engine.fingerprint() == PORTABLE_FINGERPRINT and engine.fast_fingerprint() == fast
    finally:
        engine.set_portable(False)
    assert engine.fingerprint() == fast != PORTABLE_FINGERPRINT


# --- the golden graphs ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", BUILT_IN + QUANTIZED_BASES + ARCH_BASES + DROPOUT)
def test_every_node_of_a_golden_graph_is_portable_or_moves_data(recipe):
    from toyharness.bench import realize_for_bench
    from toyharness.runner import batch_for

    pm, opts, data, engine, model = realize_for_bench(goldens.split_name(recipe)[0], "cpu", 2,
                                                      goldens.golden_sets_for(recipe) + ["portable=true"])
    try:
        pm.hook.step(model=model, batch=batch_for(data, "train", 0, opts), hp=pm.hook.hp(options=opts, step=0))
    finally:
        engine.set_portable(False)
    graph = model.trainer.gb_opt
    kinds = Counter()
    for i in range(lib.ggml_graph_n_nodes(graph)):
        node = lib.ggml_graph_node(graph, i)
        ours = lib.th_portable_kernel_name(node) != ffi.NULL
        kinds["portable" if ours else ffi.string(lib.ggml_op_desc(node)).decode()] += 1
    assert kinds["portable"] > 0
    assert set(kinds) - {"portable"} <= DATA_MOVES, kinds


def test_portable_losses_are_the_fast_paths_within_rounding():
    """The same model and math as the fast path: only the rounding of sums and of exp/log differs."""
    fast, port = goldens.compute("gpt2"), goldens.compute("gpt2", portable=True)
    assert port["fingerprint"] == PORTABLE_FINGERPRINT and port["blas"] is None
    assert port["options"]["portable"] is True
    for a, b in zip(fast["losses"], port["losses"]):
        assert abs(a["value"] - b["value"]) <= 1e-5 * abs(a["value"]), (a, b)


def test_thread_count_changes_no_bit_in_the_portable_mode():
    ref = goldens.compute("llama", threads=2, portable=True)
    for threads in (1, 3):
        assert goldens.compare(ref, goldens.compute("llama", threads=threads, portable=True)) is None, threads


# --- the check's fallback -------------------------------------------------------------------------
def test_check_falls_back_to_the_portable_golden_and_says_so(tmp_path, capsys):
    (tmp_path / PORTABLE_FINGERPRINT).mkdir()
    shutil.copy(ROOT / PORTABLE_FINGERPRINT / "llama.yml", tmp_path / PORTABLE_FINGERPRINT / "llama.yml")
    path, mismatch = goldens.check("llama", root=tmp_path)
    assert path == tmp_path / PORTABLE_FINGERPRINT / "llama.yml" and mismatch is None
    assert cli.main(["golden", "check", "llama", "--dir", str(tmp_path)]) == 0
    assert f"ok   llama (portable mode: {path})" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="record one with `toyharness golden record llama --dir "):
        goldens.check("llama", root=tmp_path, mode="fast")


def test_check_prefers_the_fast_golden_of_this_fingerprint(tmp_path, capsys):
    fast_path = goldens.record("llama", root=tmp_path, mode="fast")
    assert fast_path.parent.name == get_engine("cpu").fast_fingerprint()
    portable_path = tmp_path / PORTABLE_FINGERPRINT / "llama.yml"
    stored = yaml.safe_load((ROOT / PORTABLE_FINGERPRINT / "llama.yml").read_text())
    stored["losses"][3]["hex"] = "0x%08x" % (int(stored["losses"][3]["hex"], 16) ^ 1)    # a wrong portable one
    portable_path.parent.mkdir()
    portable_path.write_text(yaml.safe_dump(stored, sort_keys=False))
    assert goldens.check("llama", root=tmp_path) == (fast_path, None)
    path, mismatch = goldens.check("llama", root=tmp_path, mode="portable")
    assert path == portable_path and mismatch.step == 3
    assert cli.main(["golden", "check", "llama", "--dir", str(tmp_path), "--mode", "portable"]) == 1
    assert "first diverging step 3" in capsys.readouterr().out


def test_no_golden_in_either_mode_names_both(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"nor one for {get_engine('cpu').fast_fingerprint()}"):
        goldens.check("llama", root=tmp_path)


@pytest.mark.parametrize("recipe", BUILT_IN + QUANTIZED_BASES + ARCH_BASES + DROPOUT)
def test_recipe_matches_its_portable_golden(recipe, toyharness_golden):
    """The gate that holds on any CPU."""
    assert toyharness_golden(recipe, root=ROOT, mode="portable").parent.name == PORTABLE_FINGERPRINT


# --- the SIMD build option (the AVX2 and no-SIMD builds of the proof) ---------------------------------
def test_simd_build_option_sets_ggmls_switches(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_build", ROOT.parent / "native" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    monkeypatch.delenv("TOYHARNESS_SIMD", raising=False)
    native = build.cmake_options(["cpu"])
    assert "-DGGML_NATIVE=ON" in native and not any(o.startswith("-DTOYHARNESS_SIMD") for o in native)
    monkeypatch.setenv("TOYHARNESS_SIMD", "avx2")
    avx2 = build.cmake_options(["cpu"])
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF",
            "-DTOYHARNESS_SIMD=avx2"} <= set(avx2)
    monkeypatch.setenv("TOYHARNESS_SIMD", "none")
    none = build.cmake_options(["cpu"])
    assert "-DGGML_AVX=OFF" in none and "-DGGML_SSE42=OFF" in none
    assert not [o for o in none if o.startswith(("-DGGML_AVX", "-DGGML_FMA", "-DGGML_F16C")) and o.endswith("=ON")]
    monkeypatch.setenv("TOYHARNESS_SIMD", "sse9")
    with pytest.raises(build.BuildError, match="TOYHARNESS_SIMD=sse9: not one of native, avx2, none"):
        build.cmake_options(["cpu"])
