"""The memory plan (toyharness/engine/memory_plan.py): equal to ggml's buffers, within 10% of the measured
RSS growth of a run, a run that cannot fit refused before it allocates (exit 2), and an allocation
that fails anyway one line, exit 1, no run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import needs
from plan_cases import stepped_model

from toyharness.cli import main
from toyharness.discovery import get_recipe
from toyharness.engine import get_engine
from toyharness.engine.memory_plan import ALLOCATION_GRANULARITY, plan_model, rounding_to_pages
from toyharness.hookspecs import plugin_manager
from toyharness.lm import seeded_model_file
from toyharness.runner import load_data, resolve_options

# The configuration: ~2.4 G parameters, attention over 4096 positions, 64 sequences a batch.
HUGE = ["n_layer=48", "d_model=2048", "n_head=16", "t_seq=4096", "t_batch=64"]


@pytest.fixture(scope="module")
def base_sets() -> list[str]:
    base = seeded_model_file("llama", ["n_layer=2", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128"])
    return [f"base={base}"]


def _realized(recipe: str, sets: list[str]):
    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {})
    pm = plugin_manager(obj)
    data = load_data(pm, options)
    engine = get_engine("cpu")
    engine.set_portable(options.portable)
    return pm, engine, options, data


@pytest.mark.parametrize("recipe", ["gpt2", "llama", "warm_start", "vit_tiny", "lora"])
def test_plan_equals_ggml_buffers(recipe, base_sets):
    """Persistent tensors (padded to the buffer's alignment) and both compute buffers, to the byte,
    after a step, an evaluation and a step after it (the training graph back in its placement)."""
    sets = base_sets if recipe == "lora" else []
    pm, engine, options, data = _realized(recipe, sets)
    plan = plan_model(recipe, pm, engine, options, data)
    prog = stepped_model(pm, engine, options, data).trainer.prog
    persistent = sum(plan.rows[k] for k in ("params", "moments", "grads", "frozen_uploaded", "inputs"))
    assert persistent == prog.persistent_bytes()
    assert plan.rows["compute"] + plan.rows["compute_eval"] == prog.compute_buffer_bytes()
    assert plan.ggml_bytes == prog.persistent_bytes() + prog.compute_buffer_bytes()
    # buffer by buffer too: a driver rounds each one up to its pages (the cuda plan's granularity row)
    assert sorted(plan.buffers) == sorted(prog.buffer_sizes())
    if recipe == "lora":     # the base is mapped from its file, not copied
        assert plan.rows["frozen_mapped"] > 0 and plan.rows["frozen_uploaded"] == 0
    prog.close()


@pytest.mark.parametrize("recipe,sets", [
    pytest.param("llama", [], marks=needs("cuda")),
    pytest.param("lora", ["precision=bf16"], marks=needs("cuda")),
    pytest.param("lora", ["recompute_blocks=true"], marks=needs("cuda")),
])
def test_the_cuda_plan_equals_ggml_buffers_the_training_graph_reserved_as_rewritten(recipe, sets, base_sets):
    """On cuda the Trainer reserves the training graph's buffer after the rewrite (iss-32f): the plan
    measures the same, to the byte (bench-lora-bf16 measures what it saves)."""
    sets = sets + (base_sets if recipe == "lora" else [])
    pm, _, options, data = _realized(recipe, sets)
    engine = get_engine("cuda")
    plan = plan_model(recipe, pm, engine, options, data)
    model = stepped_model(pm, engine, options, data)
    prog = model.trainer.prog
    assert plan.rows["compute"] + plan.rows["compute_eval"] == prog.compute_buffer_bytes()
    assert sorted(plan.buffers) == sorted(prog.buffer_sizes())
    prog.close()


def test_the_plan_reads_a_graph_rewritten_for_cuda_as_its_buffer_holds_it(programs_built_as):
    """What the plan says the buffer keeps, read from a training graph after the cuda rewrite (as the
    cuda Trainer reserves it; built here on the cpu): the fused attention's forward node holds O
    and L, so ggml's (B*H, T, T) probabilities (2 layers x 32 MiB) are no longer counted, and the
    largest tensors named hold memory of their own (not the NONE views of dS the rewrite leaves,
    as large as dS)."""
    from toyharness._ffi import ffi, lib
    from toyharness.engine.memory_plan import Planner

    sets = ["n_layer=2", "d_model=64", "n_head=4", "t_seq=1024", "t_batch=2"]
    # its kv heads repeated, as cuda's graph has them (the rewrite reads the repeats)
    programs_built_as(kv_in_place=False)
    pm, engine, options, data = _realized("llama", sets)
    trainer = pm.hook.realize(engine=engine, options=options, data=data).trainer
    planner, probabilities = Planner(engine), 2 * 2 * 4 * 1024 * 1024 * 4
    planner._describe(trainer)
    before = planner.activations
    assert lib.th_cuda_rewrite(trainer.gb_opt, 3) > 0
    planner._describe(trainer)
    assert before >= probabilities > planner.activations > 0
    galloc, size = lib.ggml_gallocr_new(planner.buft), ffi.new("size_t[1]")
    lib.ggml_gallocr_reserve_n_size(galloc, trainer.gb_opt, ffi.NULL, ffi.NULL, size)
    lib.ggml_gallocr_free(galloc)
    assert before > size[0] >= planner.activations     # the reading before says more than the buffer holds
    assert planner.largest and all(n.op != "NONE" for n in planner.largest), planner.largest
    trainer.prog.close()


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_the_cuda_plans_activations_are_what_the_rewritten_buffer_holds(backend):
    """On cuda the plan reads what the backward keeps after the rewrite, as the Trainer reserves
    the buffer: the probabilities (3 layers x 128 MiB), all of which a reading before the rewrite
    counts, are not kept, and what is kept fits in the training buffer."""
    sets = ["n_layer=3", "d_model=64", "n_head=4", "t_seq=1024", "t_batch=8"]
    pm, _, options, data = _realized("llama", sets)
    plan = plan_model("llama", pm, get_engine(backend), options, data)
    probabilities = 3 * 8 * 4 * 1024 * 1024 * 4
    assert 0 < plan.activations < probabilities
    assert plan.activations <= plan.rows["compute"]
    assert plan.largest and all(n.op != "NONE" for n in plan.largest), plan.largest


def test_rounding_to_pages_counts_each_buffer_up_to_its_page():
    """The cuda plan's "driver's 2 MiB pages" row: a buffer of 1 MiB or more takes whole pages of its
    own (exactly 2 MiB nothing more, 2 MiB + 1 a second page, 1.5 MiB half a page more); smaller
    ones share pages and count at their sizes."""
    page = ALLOCATION_GRANULARITY["cuda"]
    assert page == 2 << 20
    assert rounding_to_pages([page, page + 1, 0], page) == page - 1
    assert rounding_to_pages([page * 3 // 4], page) == page // 4
    assert rounding_to_pages([page // 2], page) == page // 2
    assert rounding_to_pages([page // 2 - 1, 128, 1], page) == 0
    assert rounding_to_pages([1, page + 1], 0) == 0


def test_plan_cli_prints_a_table_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "gpt2", "--plan", "--set", "t_batch=4"]) == 0
    out = capsys.readouterr().out
    for label in ("parameters", "AdamW moments", "activations kept for the backward", "logits and their gradient",
                  "compute buffer of the training graph", "total on cpu", "free (cpu"):
        assert label in out
    assert "t_batch 4" in out
    assert not (tmp_path / "runs").exists()


def test_a_run_that_cannot_fit_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["run", "gpt2", "--no-progress", *[a for s in HUGE for a in ("--set", s)]])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("toyharness: error: gpt2 needs ") and " GiB on cpu, " in err and " free " in err
    # the two options that shrink it most, each with what it saves
    assert "shrink it most with recompute_blocks=true (-" in err and " or t_seq=2048 (-" in err
    assert err.count(" GiB)") == 2
    assert not (tmp_path / "runs").exists()


def test_a_recipe_declares_the_sizes_the_plan_shows_and_may_halve(base_sets):
    """The plan names no recipe: lora's adapter rank is one of its sizes because its options class
    says so (`plan_sizes`); a recipe without one gets the common sizes only."""
    from toyharness.engine.memory_plan import shrink_suggestions

    pm, engine, options, data = _realized("lora", base_sets + ["rank=64"])
    assert type(options).plan_sizes == ("rank",)
    plan = plan_model("lora", pm, engine, options, data)
    assert plan.sizes == {"t_batch": 16, "t_seq": 64, "rank": 64, "recompute_blocks": False}
    tried = []

    def replan(change):
        tried.append(change)
        return plan

    shrink_suggestions(plan, replan, options)
    assert {"rank": 32} in tried and {"t_batch": 8} in tried
    pm, engine, options, data = _realized("gpt2", ["n_layer=1"])
    assert "rank" not in plan_model("gpt2", pm, engine, options, data).sizes


def test_refusal_can_be_turned_off_by_name_only(monkeypatch):
    monkeypatch.setenv("TOYHARNESS_MEMORY_CHECK", "maybe")
    assert main(["run", "gpt2", "--steps", "1", "--no-progress"]) == 2


ALLOC_FAILS = textwrap.dedent("""
    import resource, sys
    from toyharness.cli import main
    import toyharness.runner  # everything imported before the limit is set
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc to read the address space size")
def test_an_allocation_that_fails_is_one_line_and_leaves_no_folder(tmp_path):
    """The plan fits (the check is off: as if another process took the memory after it), the
    address space is limited to 3 GiB more than the process has: the training graph's 4.3 GiB
    compute buffer cannot be had."""
    env = {**os.environ, "TOYHARNESS_MEMORY_CHECK": "off"}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", ALLOC_FAILS, "run", "gpt2", "--set", "t_seq=1024", "--set", "t_batch=64",
                        "--steps", "1", "--no-progress", "--out", str(out)], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 1, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("toyharness: error: cpu: could not allocate the training graph's compute buffer: 4.")
    assert "GiB needed" in err and "free" in err
    assert not out.exists()


def test_a_sweep_point_that_cannot_fit_fails_while_the_others_run(tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "gpt2", "--grid", "t_batch=2,100000", "--steps", "1", "--workers", "1", "--threads", "1",
               "--no-progress", "--out", str(out)])
    assert rc == 1
    doc = json.loads((out / "sweep.json").read_text())
    status = {p["options"]["t_batch"]: (p["status"], p["message"]) for p in doc["points"]}
    assert status[2][0] == "done"
    state, message = status[100000]
    assert state == "failed" and "gpt2 needs" in message
    # the two options that save most (the products folded into their ADDs left the evaluation
    # graph's buffer at half, so halving t_batch now saves more than recompute_blocks)
    assert "shrink it most with t_seq=32 (-" in message and " or t_batch=50000 (-" in message


# --- the plan against the process's memory --------------------------------------------------------
RSS_CHILD = textwrap.dedent("""
    import json, sys
    from toyharness.discovery import get_recipe
    from toyharness.runner import train, plan_run, resolve_options
    recipe, sets, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    plan = plan_run(recipe, sets=sets)
    keys = set(resolve_options(get_recipe(recipe)[1], None, [], {}).to_dict())
    def ours(items):     # vit_tiny has no t_seq or eval_batches (a recipe's options are the keys it reads)
        return [s for s in items if s.split("=")[0] in keys]
    # A tiny run first loads what any run loads (matplotlib for loss.png, the GGUF writer, rich,
    # OpenMP's and OpenBLAS's threads): what the run adds is measured from after it
    train(recipe, steps=1, sets=[s for s in sets if s.startswith("base=")] + ours(["t_batch=1", "t_seq=8"]),
          out=out + "-warmup", progress=False)
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
    base = rss()
    train(recipe, steps=2, sets=sets + ours(["eval_every=1", "eval_batches=1", "checkpoint_every=2"]), out=out,
          progress=False)
    # VmHWM, this process's own peak: ru_maxrss keeps the parent's RSS at fork across the exec
    peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    print(json.dumps({"plan": plan.total, "growth": peak - base}))
""")

# Sizes whose plan is >= 60 MB, where the process's own memory (~100 MB of libraries, allocator
# slack) no longer dominates the growth.
RSS_CASES = [
    ("gpt2", ["t_seq=256", "t_batch=16", "d_model=128", "n_layer=2"]),
    ("gpt2", ["t_seq=128", "t_batch=16", "d_model=256", "n_head=8", "n_layer=4"]),
    ("llama", ["t_seq=256", "t_batch=16"]),
    ("warm_start", ["t_seq=256", "t_batch=16"]),
    ("vit_tiny", ["t_batch=256"]),
    ("lora", ["t_seq=256", "t_batch=16"]),
    # recompute's rebuilt graphs once left no-ops as leafs that ggml's allocator placed and nothing
    # wrote: 63.4 MiB reserved, 18.9 MiB touched, RSS at 0.61 of the plan
    ("gpt2", ["n_layer=8", "recompute_blocks=true"]),
]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc for the resident set size")
@pytest.mark.parametrize("recipe,sets", RSS_CASES, ids=[f"{r}-{'-'.join(s)}" for r, s in RSS_CASES])
def test_plan_is_within_10_percent_of_rss_growth(recipe, sets, base_sets, tmp_path):
    sets = sets + (base_sets if recipe == "lora" else [])
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, recipe, json.dumps(sets), str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["plan"] >= 60 << 20, f"plan {got['plan'] / 2**20:.1f} MiB: too small to measure against RSS"
    ratio = got["growth"] / got["plan"]
    assert 0.9 <= ratio <= 1.1, f"RSS grew {got['growth'] / 2**20:.1f} MiB for a plan of {got['plan'] / 2**20:.1f} MiB"


SCRIPTS = Path(__file__).resolve().parent.parent / "tools"


def test_gpu_memory_plan_script_runs_on_cpu(tmp_path):
    """tools/gpu_memory_plan.py, which gpu_memory_plan.sh runs on the GPU machine, end to end on
    cpu (RSS for the driver's used memory) at its quick sizes; the shell script parses."""
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_memory_plan.sh")]).returncode == 0
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_memory_plan.py"), str(tmp_path), "--backend", "cpu",
                        "--quick", "--recipes", "gpt2,lora"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tmp_path / "memory_plan_cpu.json").read_text())
    assert [c["recipe"] for c in doc["cases"]] == ["gpt2", "lora"]
    for case in doc["cases"]:
        assert 0.9 <= case["ratio"] <= 1.1 and case["plan"]["rows"]["compute"] > 0
    assert "gpt2" in (tmp_path / "memory_plan_cpu.txt").read_text()
    bad = subprocess.run([sys.executable, str(SCRIPTS / "gpu_memory_plan.py"), str(tmp_path), "--recipes", "gtp2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown recipe(s) gtp2" in bad.stderr


def test_a_recipe_that_reads_values_while_realized_is_run_unplanned(capsys):
    """A plugin whose realize reads a value back cannot be planned without allocating: a note says
    so and the check is skipped (its run goes on as before); the planned tensor is never touched."""
    import numpy as np

    from toyharness.engine.memory_plan import check_fits
    from toyharness.hookspecs import hookimpl
    from toyharness.options import Options

    class ReadsBack:
        @hookimpl
        def realize(self, engine, options, data):
            prog = engine.program()
            prog.read(prog.param("w", np.zeros((2, 2), np.float32)))

    assert check_fits("reads_back", plugin_manager(ReadsBack()), get_engine("cpu"), Options(), None) is None
    assert "no memory plan for reads_back (a program made for a memory plan holds no values (read))" in \
        capsys.readouterr().err
