"""`toyharness bench`: bad arguments exit 2 naming the problem; any recipe benches without PyTorch
(ours alone, the PyTorch columns absent and the reason said); a real side-by-side run writes
bench.json with both sides' figures (needs torch: skipped, saying so, where it is absent)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_GPT2 = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2", "--set", "t_seq=16",
             "--set", "t_batch=2"]
TORCH_COLUMNS = ("torch_ms_per_step", "speedup", "torch_peak_rss_mb", "torch_optimizer", "torch_version",
                 "torch_mode")


def bench(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "toyharness.cli", "bench", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_unknown_recipe_exits_2():
    res = bench("nosuchrecipe")
    assert res.returncode == 2
    assert "unknown recipe(s) nosuchrecipe" in res.stderr + res.stdout


def test_too_few_steps_exits_2():
    res = bench("llama", "--steps", "5")
    assert res.returncode == 2
    assert "--steps 5" in res.stderr + res.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch not installed: the check of transformers comes after PyTorch's")
def test_a_base_that_needs_transformers_without_it_is_one_line(tmp_path, monkeypatch, capsys):
    """bench lora over a qwen3 base without transformers ended in a worker's ModuleNotFoundError traceback;
    transformers' absence is simulated, so the test runs where it is installed too."""
    from toyharness import cli
    from toyharness.architectures import example_shape, write_example

    base = write_example(tmp_path / "q.gguf", example_shape("qwen3", n_layer=1, d_model=32, n_head=2, n_kv_head=1,
                                                            d_ff=64, vocab=300))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert cli.main(["bench", "lora", "--set", f"base={base}", "--steps", "10"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"toyharness: error: lora over {base}: its PyTorch twin is transformers' model of that architecture "
        "(toyharness/architectures/hf.py): pip install transformers")


def without_torch(monkeypatch):
    """PyTorch's absence, simulated (the test runs where it is installed too)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))


def test_a_recipe_with_a_twin_benches_alone_without_pytorch_and_says_so(tmp_path, monkeypatch, capsys):
    from toyharness import cli
    from toyharness.bench.report import NO_TORCH

    without_torch(monkeypatch)
    out = tmp_path / "b.json"
    assert cli.main(["bench", "gpt2", "--steps", "10", "--warmup", "1", *TINY_GPT2, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"(toyharness alone: {NO_TORCH})" in lines[0], lines[0]
    row = lines[2].split()
    assert row[0] == "gpt2" and row[2:4] == ["-", "-"] and row[6] == "-", lines[2]     # PyTorch, speedup, torch RSS
    assert lines[3] == f"  no PyTorch side: {NO_TORCH}"
    doc = json.loads(out.read_text())
    assert doc["torch_modes"] == []
    r = doc["recipes"]["gpt2"]
    assert not set(TORCH_COLUMNS) & set(r), r
    assert r["torch_absent"] == NO_TORCH and r["item"] == "tokens"
    assert r["ms_per_step"] > 0 and r["peak_rss_mb"] > 0 and r["timed_steps"] == 10
    # 2 x 16 tokens a step
    assert r["tokens_per_s"] == pytest.approx(32 / r["ms_per_step"] * 1e3, rel=1e-2)   # ms rounded to 1 us
    assert r["config"]["d_model"] == 32 and r["config"]["t_seq"] == 16
    assert list(r["round_medians_ms"]) == ["toyharness"]


@pytest.fixture
def bigram_installed(tmp_path, monkeypatch):
    """The example third-party plugin (no PyTorch twin) as a distribution on sys.path: its module
    from plugins/example_bigram and a dist-info naming its entry point (spawned workers inherit
    sys.path)."""
    dist = tmp_path / "site" / "toyharness_example_bigram-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyharness-example-bigram\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[toyharness.recipes]\nbigram = toyharness_bigram:recipe\n")
    monkeypatch.syspath_prepend(str(REPO / "plugins" / "example_bigram"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_a_plugin_without_a_twin_benches_with_no_torch_columns(bigram_installed, tmp_path, capsys):
    from toyharness import cli
    from toyharness.bench.report import NO_TWIN

    out = tmp_path / "b.json"
    assert cli.main(["bench", "bigram", "--steps", "10", "--warmup", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"(toyharness alone: {NO_TWIN})" in lines[0], lines[0]
    assert lines[2].split()[0] == "bigram" and lines[3] == f"  no PyTorch side: {NO_TWIN}"
    r = json.loads(out.read_text())["recipes"]["bigram"]
    assert not set(TORCH_COLUMNS) & set(r), r
    assert r["torch_absent"] == NO_TWIN
    assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
    assert r["config"]["t_batch"] == 16


def test_every_installed_recipe_is_benched_by_default(bigram_installed):
    import argparse

    from toyharness.bench.report import _checked_sets
    from toyharness.discovery import discover

    args = argparse.Namespace(recipes=[], profile=False, steps=None, warmup=None, torch_device=None,
                              torch_modes=None, out=None, size="default", set=[], backend="cpu", precision="fp32")
    names = list(_checked_sets(args))
    assert "bigram" in names and names == list(discover())


def test_torch_flags_where_no_recipe_runs_beside_pytorch_exit_2(bigram_installed, capsys):
    from toyharness import cli
    from toyharness.bench.report import NO_TWIN

    assert cli.main(["bench", "bigram", "--torch-modes", "eager"]) == 2
    assert capsys.readouterr().err.strip() == (f"toyharness: error: --torch-modes: no recipe here runs beside PyTorch "
                                               f"({NO_TWIN})")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed (nox -s bench installs it)")
def test_side_by_side_run_writes_both_sides(tmp_path):
    # no --out: the default lands under runs/ of the working folder (ignored by git), named by build
    res = bench("llama", "--steps", "10", "--warmup", "1", "--threads", "2", "--set", "n_layer=1", "--set",
                "d_model=64", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    written = list((tmp_path / "runs").glob("bench-cpu-*.json"))
    assert len(written) == 1 and f"wrote {written[0].relative_to(tmp_path)}" in res.stdout
    doc = json.loads(written[0].read_text())
    assert written[0].name == f"bench-{doc['fingerprint']}.json"
    # the header names the build's SIMD level and the BLAS kernel; bench.json keeps both
    from toyharness.engine.backend import blas_kernel, build_simd

    header = res.stdout.splitlines()[0]
    assert f"SIMD {build_simd()}, BLAS {blas_kernel()}" in header, header
    assert (doc["simd"], doc["blas"]) == (build_simd(), blas_kernel())
    assert doc["fingerprint"].startswith(f"cpu-{build_simd()}")
    r = doc["recipes"]["llama"]
    assert r["ms_per_step"] > 0 and r["torch_ms_per_step"] > 0
    assert r["speedup"] == pytest.approx(r["torch_ms_per_step"] / r["ms_per_step"], rel=1e-2)
    assert r["timed_steps"] >= 10 and r["config"]["d_model"] == 64
    assert doc["fp32_ceiling_gflops"] > 0 and 0 < r["ceiling_pct"] < 100
    rounds = r["round_medians_ms"]                 # 10 steps in rounds of 5: 2 rounds a side
    assert len(rounds["toyharness"]) == len(rounds["pytorch"]) == 2
    assert min(rounds["toyharness"]) <= r["ms_per_step"] <= max(rounds["toyharness"])
    if len(os.sched_getaffinity(0)) >= 2:           # before and after the rounds, both timed
        assert len(r["cpu_round_trip_ns"]) == 2 and all(ns > 0 for ns in r["cpu_round_trip_ns"])


def test_size_presets_lay_under_set_and_pick_the_recipes_that_have_their_options():
    from toyharness.bench import SIZES, bench_options, fits_size, size_sets

    sets = size_sets("gpt2", "nano", ["t_batch=8"])
    assert sets == [*SIZES["nano"], "t_batch=8"]                 # --set comes last, and wins
    _, opts = bench_options("gpt2", sets)
    assert (opts.n_layer, opts.d_model, opts.n_head, opts.t_seq, opts.t_batch) == (6, 384, 6, 256, 8)
    _, opts = bench_options("llama", size_sets("llama", "gpt2-small"))
    assert (opts.n_layer, opts.d_model, opts.n_head, opts.t_seq, opts.t_batch) == (12, 768, 12, 1024, 8)
    assert size_sets("lora", "default") == []
    assert fits_size("gpt2", "nano") and fits_size("llama", "gpt2-small") and not fits_size("lora", "nano")


def test_size_a_recipe_lacks_the_options_of_exits_2():
    res = bench("lora", "--size", "nano")
    assert res.returncode == 2
    assert "--size nano: recipe lora has no option n_layer, d_model, n_head" in res.stderr


def test_unknown_size_exits_2():
    res = bench("gpt2", "--size", "huge")
    assert res.returncode == 2
    assert "--size: invalid choice: 'huge'" in res.stderr


def test_drift_names_the_side_whose_rounds_moved():
    from toyharness.bench import Result

    def result(ours, theirs):
        return Result("gpt2", 20.0, 25.0, 1024, "tokens", 200.0, 300.0, None, None, {},
                      {"round_medians_ms": {"toyharness": ours, "pytorch": theirs}})

    assert result([20.0, 21.0, 23.5], [25.0, 26.0, 25.5]).drift() == {}
    assert result([20.0, 32.0, 21.0], [25.0, 26.0, 25.5]).drift() == {"toyharness": (20.0, 32.0)}


def test_profile_names_ops_and_kernels_without_torch(tmp_path):
    """--profile times the toyharness step node by node; it needs no PyTorch and writes nothing."""
    res = bench("--profile", "gpt2", "--threads", "2", "--set", "n_layer=1", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    from toyharness.engine.backend import blas_kernel, build_simd

    assert lines[0].startswith(f"gpt2: cpu, 2 threads, SIMD {build_simd()}, BLAS {blas_kernel()}; nodes timed one "
                               "at a time:"), lines[0]
    rows = {tuple(line.split()[:2]): line for line in lines[2:] if len(line.split()) == 5}
    assert ("OUT_PROD", "sgemm") in rows     # the weights' gradients: always large
    assert "a node that computes nothing (a view) takes" in res.stdout
    slowest = lines[lines.index("  slowest nodes (graph index, op, shape in ggml order, ms):") + 1:]
    assert len(slowest) == 10 and all(line.split()[0].startswith("#") for line in slowest)
    shares = [float(line.split()[-1].rstrip("%")) for line in lines[2:] if line.rstrip().endswith("%")]
    assert 99.0 <= sum(shares) <= 101.0, shares
    assert not list(tmp_path.iterdir())


def test_profile_names_the_kernel_that_took_each_op():
    """Every op's row, however small (the printed table folds ops under 0.5% of the step into one
    line, and which ones fall under it moves with the machine's load)."""
    from toyharness import bench as bench_module

    prof = bench_module.profile_recipe("gpt2", "cpu", 2, ["n_layer=1"], repeats=1)
    rows = {(o.op, o.kernel) for o in prof.ops}
    assert ("OPT_STEP_ADAMW", "adamw") in rows
    # the kernel of native/cpu_kernels.c that took each op, by name
    assert {("OUT_PROD", "sgemm"), ("SOFT_MAX", "softmax causal"), ("SILU", "gelu+slope")} <= rows
    assert {("CROSS_ENTROPY_LOSS", "cross_entropy"), ("CROSS_ENTROPY_LOSS_BACK", "cross_entropy_back")} <= rows
    assert ("SILU_BACK", "gelu_back (kept slope)") in rows    # GELU's slope, kept from the forward
    assert ("ADD", "add_rows") in rows                       # a bias, its ones @ b product fused away
    # attention's products, apart; causal ones contract only over what the mask leaves (th_mark_causal)
    assert ("OUT_PROD[heads]", "sgemm causal") in rows
    assert abs(sum(o.ms for o in prof.ops) - prof.total_ms) <= 1e-6 * prof.total_ms


def test_cpu_round_trip_probe_measures_pinned_pairs_and_restores_affinity():
    """th_cpu_round_trip_ns (tools/machine_drift.py's "trip"): a pair of distinct CPUs gives a
    time, a bad pair gives -1, and the caller's own CPU set is left as it was."""
    from toyharness._ffi import lib

    if not sys.platform.startswith("linux"):
        pytest.skip("pinning threads to CPUs is Linux-only here; the probe returns -1 elsewhere")
    cpus = sorted(os.sched_getaffinity(0))
    assert lib.th_cpu_round_trip_ns(cpus[0], cpus[0], 100) == -1.0       # one CPU: no trip to time
    assert lib.th_cpu_round_trip_ns(cpus[0], 1 << 20, 100) == -1.0       # no such CPU
    assert sorted(os.sched_getaffinity(0)) == cpus
    if len(cpus) < 2:
        pytest.skip("one CPU available: no pair to time")
    ns = lib.th_cpu_round_trip_ns(cpus[0], cpus[1], 2000)
    assert 0.0 < ns < 1e6, ns
    assert sorted(os.sched_getaffinity(0)) == cpus
