"""Every environment variable toyharness reads, declared once, and the one way to read them.

Each switch has a name, the values it takes, its default, its purpose and its kind:

- build: chooses what native/build.py compiles (read while the package is built);
- runtime: changes where a run reads or writes, or how long it waits (never a computed bit);
- debugging: makes the process say more;
- testing: for the test suite and its sessions (nox), or for proving a path the tests check.

`switch(name)` returns a switch's value (its default where the variable is unset or empty) and
refuses a value the switch does not take, by name (SwitchError: an InputError inside the package,
exit 2 from the CLI). `check_all()` checks every switch that is set (the CLI does, before any
command). Nothing else in toyharness, native/ or the tests reads a TOYHARNESS_ variable: native code
gets what it needs from Python at load (toyharness/_ffi.py), and tests/test_switches.py holds the
sources to that.

This module imports the standard library alone: native/build.py loads it by its path before the
package can be imported. `python -m toyharness.switches --markdown` writes docs/environment.md.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    from .errors import InputError as _Base
except ImportError:     # loaded by its path (native/build.py): no package around it
    _Base = ValueError


class SwitchError(_Base):
    """A switch set to a value it does not take, or a name that is not a switch."""


KINDS = ("build", "runtime", "debugging", "testing")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str
    purpose: str
    default: str
    # the values it takes; empty: any value of its `form`
    values: tuple[str, ...] = ()
    # how a free value reads: "folder", "file", "seconds", "list" (comma-separated `values`), "folders"
    form: str = ""

    def check(self, raw: str) -> str:
        """`raw` as the switch takes it (stripped; a list lower-cased), or SwitchError naming it."""
        value = raw.strip()
        if self.form == "list":
            items = [v.strip().lower() for v in value.split(",") if v.strip()]
            bad = [v for v in items if v not in self.values]
            if bad or not items:
                raise SwitchError(f"{self.name}={raw}: not a comma list of {', '.join(self.values)}")
            return ",".join(items)
        if self.form == "seconds":
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not (seconds >= 0 and math.isfinite(seconds)):
                raise SwitchError(f"{self.name}={raw}: not a number of seconds >= 0")
            return value
        if self.values and value not in self.values:
            # a folder list may stand in for the named values (TOYHARNESS_CUDNN)
            if not (self.form == "folders" and (os.sep in value or value.startswith("~"))):
                extra = " or folders (DIR[:DIR])" if self.form == "folders" else ""
                raise SwitchError(f"{self.name}={raw}: not one of {', '.join(self.values)}{extra}")
        return value

    def value(self) -> str:
        raw = os.environ.get(self.name, "")
        return self.default if raw.strip() == "" else self.check(raw)


SWITCHES: tuple[Switch, ...] = (
    # --- build: native/build.py, while the package is built ---------------------------------------
    Switch("TOYHARNESS_BACKENDS", "build",
           "Backends to build beside cpu (always built); metal is ggml's default on macOS.",
           "cpu", ("cpu", "cuda", "vulkan", "metal"), "list"),
    Switch("TOYHARNESS_SIMD", "build",
           "SIMD level of ggml-cpu and toyharness's cpu kernels: native (this CPU's), avx2 (x86-64 with AVX2 "
           "and FMA) or none (no SIMD code of ggml's, the baseline ISA). For proving the portable goldens "
           "and building for other machines.",
           "native", ("native", "avx2", "none")),
    Switch("TOYHARNESS_CUDA_ARCH", "build",
           "CMAKE_CUDA_ARCHITECTURES of a cuda build (e.g. 90 for H100 and H200, 80 for A100); the cuda "
           "goldens' fingerprint names it (cuda-sm90).",
           "90", form="text"),
    Switch("TOYHARNESS_GGML_SRC", "build",
           "A ggml source folder to build instead of fetching the pinned ggml (offline builds).",
           "", form="folder"),
    Switch("TOYHARNESS_CACHE", "build",
           "Where the fetched ggml, its builds, downloaded models and tokenized JSONL data are kept (default "
           "$XDG_CACHE_HOME/toyharness, else ~/.cache/toyharness).",
           "", form="folder"),
    Switch("TOYHARNESS_CUDNN", "build",
           "cuda builds: bf16 attention on cuDNN's fused attention. auto: where cuDNN (the nvidia-cudnn-cu13 "
           "or -cu12 package) and its frontend's headers (nvidia-cudnn-frontend) are installed; on: an error "
           "where they are not; off: without; or folders (DIR[:DIR]) searched first for include/cudnn.h "
           "with lib/libcudnn.so.9 and for cudnn_frontend.h (in DIR or DIR/include), which means on.",
           "auto", ("auto", "on", "off"), "folders"),
    # --- runtime ----------------------------------------------------------------------------------
    Switch("TOYHARNESS_NATIVE_DIR", "runtime",
           "Load the native libraries from this folder instead of the package's toyharness/_native "
           "(another build of them: another SIMD level, a vulkan build).",
           "", form="folder"),
    Switch("TOYHARNESS_GOLDENS", "runtime",
           "The goldens folder of `toyharness golden` when --dir is not given (default ./goldens).",
           "", form="folder"),
    Switch("TOYHARNESS_MEMORY_CHECK", "runtime",
           "off: a run skips the check of its memory plan against the backend's free memory (for a "
           "machine whose free memory is misreported); the plan is still made when asked for.",
           "on", ("on", "off")),
    Switch("TOYHARNESS_OBSERVER_WAIT_S", "runtime",
           "Seconds the end of a run waits for observers' queued events (trackers) before it reports the "
           "ones left.",
           "30", form="seconds"),
    Switch("TOYHARNESS_CUDNN_ATTENTION", "testing",
           "cuda builds with cuDNN: 1 runs bf16 attention on cuDNN's where it takes the shape; 0 on "
           "toyharness's own kernels (the bits of a build without cuDNN: different bits, both paths in "
           "use); refuse acts as if cuDNN refused every plan (the fallback the tests check: said once on "
           "stderr, then toyharness's kernels).",
           "1", ("1", "0", "refuse")),
    # --- debugging --------------------------------------------------------------------------------
    Switch("TOYHARNESS_GGML_LOG", "debugging",
           "The least level of ggml's log messages shown: 1 debug, 2 info, 3 warnings, 4 errors, 5 continued "
           "lines.",
           "3", ("1", "2", "3", "4", "5")),
    # --- testing ----------------------------------------------------------------------------------
    Switch("TOYHARNESS_TEST_BACKEND", "testing",
           "The backend tests/test_engine_ops.py and tests/test_metal_lowering.py check (nox -s tests-cuda, "
           "tests-vulkan).",
           "cpu", ("cpu", "cuda", "vulkan", "metal")),
    Switch("TOYHARNESS_REALMODEL", "testing",
           "1: run tests/test_realmodel.py, which downloads real models and trains them (nox -s realmodel).",
           "0", ("0", "1")),
    Switch("TOYHARNESS_LLAMACPP_TOOL", "testing",
           "Path of llama.cpp's th_logits tool, built by `python native/build.py --llamacpp-tool` (its "
           "th_tokenize and th_generate lie beside it): the tests that compare with llama.cpp run with it "
           "(nox -s llamacpp, realmodel); tools/number_words.py, sample_speed.py and preference_demo.py "
           "use it too.",
           "", form="file"),
)

BY_NAME: dict[str, Switch] = {s.name: s for s in SWITCHES}

# Variables that are not toyharness's own but that it reads (their owners document them).
FOREIGN = {
    "XDG_CACHE_HOME": "the cache's base folder where TOYHARNESS_CACHE is not set",
    "OPENBLAS_CORETYPE": "OpenBLAS's forced kernel, named in bench's header",
    "NVIDIA_TF32_OVERRIDE": "cuBLAS's TF32 override: precision tf32 is refused where it is 0",
    "GGML_CUDA_GRAPH_OPT": "ggml-cuda's several-stream graphs: bf16 operand copies are not reused under them",
    "MLFLOW_EXPERIMENT_NAME": "the MLflow observer's experiment",
    "RAY_AUTH_MODE": "Ray's authentication, named in a sweep's connection error",
    "CUDA_VISIBLE_DEVICES": "the GPUs a cuda sweep places its points on, one each (set per point by the sweep)",
    "PMI_RANK": "MPICH's launcher's rank of a process: a data-parallel run's process (launcher.py)",
    "PMI_SIZE": "MPICH's launcher's process count: set, a run with devices > 1 does not start a launcher",
    "OMPI_COMM_WORLD_RANK": "Open MPI's rank of a process (as PMI_RANK)",
    "OMPI_COMM_WORLD_SIZE": "Open MPI's process count (as PMI_SIZE)",
    "PMIX_RANK": "a PMIx launcher's rank of a process (as PMI_RANK)",
}


def cache_root() -> Path:
    """The per-user cache (native/build.py keeps ggml there too; tokenized data, seeded models):
    $TOYHARNESS_CACHE, else $XDG_CACHE_HOME/toyharness, else ~/.cache/toyharness."""
    if switch("TOYHARNESS_CACHE"):
        return Path(switch("TOYHARNESS_CACHE")).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "toyharness"


def switch(name: str) -> str:
    """The value of switch `name` (its default where unset or empty), or SwitchError naming a value it
    does not take."""
    found = BY_NAME.get(name)
    if found is None:
        raise SwitchError(f"{name} is not a toyharness switch (toyharness/switches.py declares them)")
    return found.value()


def check_all() -> None:
    """Every switch that is set holds a value it takes (SwitchError naming the first that does not)."""
    for s in SWITCHES:
        s.value()


def markdown() -> str:
    """docs/environment.md: the switches by kind, then the other variables read."""
    lines = ["# Environment variables", "",
             "Generated from `toyharness/switches.py` by `python -m toyharness.switches --markdown`; "
             "tests/test_switches.py checks that this page is current. A value a switch does not take is "
             "refused by name (exit 2).", ""]
    titles = {"build": "Build (read by native/build.py while the package is built)",
              "runtime": "Runtime", "debugging": "Debugging", "testing": "Testing"}
    for kind in KINDS:
        lines += [f"## {titles[kind]}", "", "| Variable | Values | Default | Purpose |", "|---|---|---|---|"]
        for s in SWITCHES:
            if s.kind != kind:
                continue
            if s.form == "list":
                values = "comma list of " + ", ".join(f"`{v}`" for v in s.values)
            elif s.values:
                values = ", ".join(f"`{v}`" for v in s.values) + (", folders" if s.form == "folders" else "")
            else:
                values = s.form
            default = f"`{s.default}`" if s.default else "unset"
            lines.append(f"| `{s.name}` | {values} | {default} | {s.purpose} |")
        lines.append("")
    lines += ["## Other variables read", "", "| Variable | Why |", "|---|---|"]
    lines += [f"| `{name}` | {why} |" for name, why in FOREIGN.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--markdown"]:
        print("usage: python -m toyharness.switches --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
