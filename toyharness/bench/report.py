"""`toyharness bench`'s command: which recipes run and how (checked before any worker starts), the
table it prints and the bench JSON it writes; `--profile`'s table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ..errors import InputError
from .config import TORCH_MODES, bench_options, fits_size, has_twin, size_sets

NO_TWIN = "no PyTorch reference (the recipe has no torch_reference)"
NO_TORCH = "PyTorch not installed (pip install torch)"


def default_bench_out(fingerprint: str, size: str) -> str:
    """`bench`'s output without --out: under runs/ (ignored by git: a bench output is a measurement
    of one machine, never a file of the repository), named by build and size so that the AVX2 and
    AVX-512 builds' runs side by side do not overwrite each other."""
    return f"runs/bench-{fingerprint}" + ("" if size == "default" else f"-{size}") + ".json"


def build_line(backend: str) -> str:
    """", SIMD avx2, BLAS OpenBLAS Haswell (...)" for the cpu: the build and kernel every figure of
    a bench header ran on (an AVX2 build on an AVX-512 CPU differs from the native one); "" off it."""
    from ..engine.backend import blas_kernel, build_simd

    return f", SIMD {build_simd()}, BLAS {blas_kernel()}" if backend == "cpu" else ""


def _checked_sets(args) -> dict[str, list[str]]:
    """Each recipe `bench` runs (those named, else every installed one that has the --size's
    options) with its --set list; every bad argument refused here, in one line."""
    from ..discovery import discover
    from ..engine import get_engine
    from ..engine.backend import check_precision

    known = list(discover())
    unknown = [n for n in args.recipes if n not in known]
    if unknown:
        raise InputError(f"unknown recipe(s) {', '.join(unknown)}; installed: {', '.join(known)}")
    if args.profile:
        unused = [flag for flag, value in (("--warmup", args.warmup), ("--torch-device", args.torch_device),
                                           ("--torch-modes", args.torch_modes), ("--out", args.out))
                  if value is not None]
        if unused:
            raise InputError(f"{', '.join(unused)}: not used by --profile (it times steps node by node, without "
                             "PyTorch, and writes nothing)")
        if args.steps is not None and args.steps < 1:
            raise InputError(f"--steps {args.steps}: --profile times at least 1 step node by node")
    else:
        args.steps = 20 if args.steps is None else args.steps
        args.warmup = 3 if args.warmup is None else args.warmup
        if args.steps < 10:
            raise InputError(f"--steps {args.steps}: use at least 10 timed steps for a median")
    if args.size != "default" and not args.recipes:
        known = [n for n in known if fits_size(n, args.size)]
    if any(item.split("=", 1)[0].strip() == "precision" for item in args.set):
        raise InputError("--set precision=...: use --precision, which sets PyTorch's side too")
    get_engine(args.backend)    # fails early on a backend this build lacks
    check_precision(args.backend, args.precision)
    return {n: size_sets(n, args.size, args.set + [f"precision={args.precision}"]) for n in args.recipes or known}


def _torch_sides(sets: dict[str, list[str]]) -> dict[str, str | None]:
    """Per recipe, why PyTorch's side does not run (NO_TWIN, NO_TORCH), or None where it does: its
    twin is made and checked here (a module it lacks is one line before any worker starts)."""
    torch_installed = importlib.util.find_spec("torch") is not None
    absent: dict[str, str | None] = {}
    for name, recipe_sets in sets.items():
        obj, opts = bench_options(name, recipe_sets)
        if not has_twin(obj):
            absent[name] = NO_TWIN
        elif not torch_installed:
            absent[name] = NO_TORCH
        else:
            from .torch_side import twin_for  # fails here, not in a worker, if torch is broken

            twin_for(obj, opts).check()
            absent[name] = None
    return absent


def _torch_modes(args, any_torch: bool, why_not: str) -> tuple[str, ...]:
    modes = TORCH_MODES[args.precision]
    if args.torch_modes:
        modes = tuple(m.strip() for m in args.torch_modes.split(",") if m.strip())
        if not modes or any(m not in ("eager", "compile") for m in modes) or len(set(modes)) != len(modes):
            raise InputError(f"--torch-modes {args.torch_modes}: name eager and/or compile, each once")
    unused = [flag for flag, value in (("--torch-modes", args.torch_modes), ("--torch-device", args.torch_device))
              if value is not None]
    if unused and not any_torch:
        raise InputError(f"{', '.join(unused)}: no recipe here runs beside PyTorch ({why_not})")
    return modes


def run_bench(args) -> int:
    """`toyharness bench` (parsed arguments as cli.py's parser makes them): the table, and the bench
    JSON written atomically; 0, or an InputError before anything runs."""
    from ..atomic import atomic_write
    from ..engine import get_engine
    from ..engine.backend import blas_kernel, build_simd, default_threads
    from .run import bench_recipe, matmul_ceiling

    sets = _checked_sets(args)
    if args.profile:
        return profile_report(args, list(sets), sets)
    absent = _torch_sides(sets)
    any_torch = any(why is None for why in absent.values())
    why_not = NO_TORCH if NO_TORCH in absent.values() else NO_TWIN
    modes = _torch_modes(args, any_torch, why_not)
    threads = args.threads or default_threads()
    engine = get_engine(args.backend, threads)
    ceiling = matmul_ceiling(threads) if args.backend == "cpu" else None
    size = "" if args.size == "default" else f", size {args.size}"
    if any_torch:
        torch_side = " and ".join(f"PyTorch {m}" for m in modes) + ("" if len(modes) == 1 else " (the first "
                                                                      "is PyTorch's column)")
    else:
        torch_side = f"toyharness alone: {why_not}"
    print(f"{args.backend}, {threads} threads{size}{build_line(args.backend)}, precision {args.precision} "
          f"({torch_side}); ms/step medians over {args.steps} steps per side"
          + (f"; FP32 sgemm ceiling {ceiling:.0f} GFLOP/s" if ceiling else ""))
    print(f"{'recipe':<11}{'toyharness':>12}{'PyTorch':>10}{'speedup':>9}{'items/s':>11}{'RSS MB':>8}"
          f"{'torch RSS':>10}{'GFLOP/s':>9}{'ceiling':>8}{'host':>7}")
    results = {}
    for name in sets:
        r = bench_recipe(name, args.backend, threads, args.steps, args.warmup, torch_device=args.torch_device,
                         sets=sets[name], torch_modes=modes, torch_absent=absent[name])
        results[name] = doc = r.to_json(ceiling)
        for line in table_rows(r, doc, modes):
            print(line)
    doc = {"backend": args.backend, "threads": threads, "size": args.size, "precision": args.precision,
           "torch_modes": list(modes) if any_torch else [], "fingerprint": engine.fingerprint(),
           **({"simd": build_simd(), "blas": blas_kernel()} if args.backend == "cpu" else {}),
           "steps": args.steps, "warmup": args.warmup,
           "fp32_ceiling_gflops": None if ceiling is None else round(ceiling, 1),
           "recipes": results}
    out = Path(args.out or default_bench_out(doc["fingerprint"], args.size))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def table_rows(r, doc: dict, modes: tuple[str, ...]) -> list[str]:
    """A recipe's lines of the table: its row (dashes where PyTorch's side did not run, and one
    line saying why), PyTorch's other modes, GPU memory, and a note where the machine drifted."""
    def col(value, width: int, fmt: str) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"

    theirs = r.torch_ms_per_step is not None
    torch_ms = f"{r.torch_ms_per_step:8.2f}ms" if theirs else f"{'-':>10}"
    ceil = f"{doc['ceiling_pct']:7.0f}%" if "ceiling_pct" in doc else f"{'-':>8}"
    host = f"{r.host_overhead_pct:6.1f}%" if r.host_overhead_pct is not None else f"{'-':>7}"
    speedup = f"{r.speedup:8.2f}x" if theirs else f"{'-':>9}"
    lines = [f"{r.recipe:<11}{r.ms_per_step:10.2f}ms{torch_ms}{speedup}"
             f"{r.items_per_s:11,.0f}{r.peak_rss_mb:8.0f}{col(r.torch_peak_rss_mb, 10, '.0f')}"
             f"{col(r.gflops, 9, '.1f')}{ceil}{host}"]
    if not theirs:
        lines.append(f"  no PyTorch side: {doc['torch_absent']}")
    for mode in modes[1:] if theirs else ():
        lines.append(f"  PyTorch {mode}: {doc[f'torch_{mode}_ms_per_step']:.2f} ms, "
                     f"speedup {doc[f'speedup_vs_torch_{mode}']:.2f}x")
    if "device_mb" in doc or "torch_device_mb" in doc:
        gib = {k: f"{doc[k] / 1024:.2f} GiB" if doc.get(k) is not None else "-"
               for k in ("device_mb", "bf16_copies_mb", "bf16_copies_peak_mb", "torch_device_mb",
                         "torch_device_peak_mb")}
        lines.append(f"  GPU memory (the driver's, per process): toyharness {gib['device_mb']}"
                     + (f" (bf16 copies {gib['bf16_copies_mb']}, at most {gib['bf16_copies_peak_mb']} of it in use)"
                        if "bf16_copies_mb" in doc else "")
                     + (f", PyTorch {gib['torch_device_mb']} (its allocator's peak {gib['torch_device_peak_mb']})"
                        if theirs else ""))
    drift = r.drift()
    if drift:
        spans = ", ".join(f"{side} rounds {lo:.2f}-{hi:.2f} ms" for side, (lo, hi) in drift.items())
        trips = doc.get("cpu_round_trip_ns")
        if trips:
            spans += f"; CPU round trip {trips[0]:.0f} ns before, {trips[1]:.0f} after"
        lines.append(f"  note: the machine's speed moved during {r.recipe} ({spans}); compare several runs")
    return lines


def profile_report(args, names: list[str], sets: dict[str, list[str]]) -> int:
    """`bench --profile`: each recipe's step node by node (toyharness/bench/profile.py), printed."""
    from ..engine.backend import default_threads
    from .profile import profile_recipe

    threads = args.threads or default_threads()
    for name in names:
        prof = profile_recipe(name, args.backend, threads, sets[name],
                              **({"repeats": args.steps} if args.steps is not None else {}))
        total, ops = prof.total_ms, prof.ops
        size = "" if args.size == "default" else f", size {args.size}"
        print(f"{name}: {args.backend}, {threads} threads{size}{build_line(args.backend)}; nodes timed one at a "
              f"time: {total:.2f} ms per step "
              f"(a whole step: {prof.step_ms:.2f} ms)")
        print("  " + ", ".join(f"{phase} {ms:.2f} ms" for phase, ms in prof.phases.items()))
        print(f"  {'op':<26}{'kernel':<14}{'nodes':>6}{'ms':>9}{'share':>8}")
        for o in ops:
            if o.ms >= 0.005 * total:
                print(f"  {o.op:<26}{o.kernel:<14}{o.nodes:6d}{o.ms:9.3f}{100 * o.ms / total:7.1f}%")
        rest = [o for o in ops if o.ms < 0.005 * total]
        if rest:
            print(f"  {f'{len(rest)} more ops':<38}{sum(o.nodes for o in rest):6d}{sum(o.ms for o in rest):9.3f}"
                  f"{100 * sum(o.ms for o in rest) / total:7.1f}%")
        if prof.floor_us is not None:
            n = sum(o.nodes for o in ops)
            print(f"  a node that computes nothing (a view) takes {prof.floor_us:.1f} us: {n} nodes, "
                  f"{n * prof.floor_us / 1e3:.2f} ms of the total is that floor")
        print("  slowest nodes (graph index, op, shape in ggml order, ms):")
        for t in prof.slowest:
            print(f"    #{t.index} {t.op} {'x'.join(map(str, t.shape))} {t.ms:.3f}")
    return 0
