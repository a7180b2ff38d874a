"""Golden files: each recipe's first N losses, bit for bit, per backend fingerprint.

``goldens/<fingerprint>/<recipe>.yml`` holds the recipe, its resolved options, the ggml
version, N, and each step's loss as float32 hex bits plus a readable decimal. A check is
exact on the bits; a mismatch names the first diverging step, both values, the distance in
ULPs, and how many later steps differ.

Two modes on cpu. The fast path's goldens hold for one fingerprint (SIMD level and OpenBLAS
kernel): the bits of its products and sums differ from CPU to CPU. The portable mode
(`--set portable=true`, native/portable_kernels.c) computes every op with the same float32
operations on every CPU, so its goldens, `goldens/cpu-portable/`, hold anywhere. A check
(`mode="auto"`) uses the fast golden of this machine's fingerprint where there is one, else the
portable one, and says which it used.
"""

from __future__ import annotations

import shlex
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ._ffi import blas
from .atomic import atomic_write
from .engine.backend import PORTABLE_FINGERPRINT
from .errors import InputError
from .lm import cache_root
from .recipe import GOLDEN_CONFIG, GOLDEN_STEPS
from .runner import GGML_VERSION, float_hex, train
from .switches import switch

MODES = ("auto", "fast", "portable")


def golden_root() -> Path:
    folder = switch("TOYHARNESS_GOLDENS")
    if folder:
        return Path(folder)
    return Path.cwd() / "goldens"


# A precision other than fp32 is a golden variant of every recipe (docs/design.md, "Determinism and goldens"):
# ``gpt2@tf32``, ``lora@q4_k@bf16``; the backends that compute it (cuda) list them.
PRECISION_VARIANTS = ("tf32", "bf16")


def split_name(name: str) -> tuple[str, str | None]:
    """A golden's name: a recipe, or ``recipe@variant`` for one of the recipe's extra golden
    configs (its ``golden_variants``: variant name -> options added to its golden config, e.g.
    lora over a quantized base, ``lora@q4_k``), either followed by ``@tf32`` or ``@bf16`` for a
    precision (`split_precision`)."""
    recipe, _, variant = name.partition("@")
    return recipe, variant or None


def split_precision(name: str) -> tuple[str, str]:
    """``gpt2@tf32`` -> (``gpt2``, ``tf32``); a name without a precision variant is fp32's."""
    base, _, last = name.rpartition("@")
    return (base, last) if base and last in PRECISION_VARIANTS else (name, "fp32")


def golden_names(recipe: str, backend: str = "cpu") -> list[str]:
    """The recipe's golden, then one per variant it declares; on cuda each again per precision."""
    from .discovery import get_recipe

    _, obj = get_recipe(recipe)
    names = [recipe] + [f"{recipe}@{v}" for v in getattr(obj, "golden_variants", {}) or {}]
    if backend == "cuda":
        names += [f"{n}@{p}" for p in PRECISION_VARIANTS for n in names]
    return names


def known_variants(recipe: str, variant: str | None, obj) -> dict:
    """The recipe's golden variants; InputError naming `variant` if it is not one of them."""
    variants = getattr(obj, "golden_variants", {}) or {}
    if variant is not None and variant not in variants:
        raise InputError(f"recipe {recipe} has no golden variant {variant!r}"
                         + (f" (it has: {', '.join(variants)})" if variants else ""))
    return variants


def check_name(name: str, backend: str = "cpu") -> None:
    """A golden name a user typed (RECIPE, RECIPE@VARIANT, either @tf32 or @bf16): an unknown
    recipe, variant or a precision the backend does not compute is an InputError naming it, before
    anything runs (a missing golden file of a known name is a SKIP, not this)."""
    from .discovery import get_recipe
    from .engine.backend import check_precision

    base, precision = split_precision(name)
    recipe, variant = split_name(base)
    _, obj = get_recipe(recipe)
    known_variants(recipe, variant, obj)
    try:
        check_precision(backend, precision)
    except InputError as exc:
        raise InputError(f"golden {name}: {exc}") from None


def _as_set(key: str, value) -> str:
    """A golden_config entry as a --set item."""
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    if isinstance(value, (list, tuple)):
        return f"{key}={','.join(map(str, value))}"
    return f"{key}={value}"


def golden_steps(recipe: str) -> int:
    """How many steps the recipe's golden holds: its ``golden_steps`` (`toyharness.Recipe`)."""
    from .discovery import get_recipe

    _, obj = get_recipe(recipe)
    steps = getattr(obj, "golden_steps", GOLDEN_STEPS)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InputError(f"recipe {recipe}: golden_steps must be a count >= 1, got {steps!r}")
    return steps


def golden_sets_for(name: str) -> list[str]:
    """The golden run's options as --set items: the recipe's ``golden_config`` (default
    `toyharness.recipe.GOLDEN_CONFIG`) less the keys its options do not have, ``data=synthetic``
    for a recipe on the core text data, its ``golden_sets`` (e.g. sizes only it has), then a
    variant's, then a precision's."""
    from .discovery import get_recipe
    from .runner import resolve_options

    name, precision = split_precision(name)
    recipe, variant = split_name(name)
    _, obj = get_recipe(recipe)
    variants = known_variants(recipe, variant, obj)
    defaults = resolve_options(obj, None, [], {})
    fields = set(defaults.__class__.__dataclass_fields__)
    config = getattr(obj, "golden_config", GOLDEN_CONFIG)
    if not isinstance(config, dict):
        raise InputError(f"recipe {recipe}: golden_config must be a dict of option values, got {type(config).__name__}")
    extra = getattr(obj, "golden_sets", [])
    if extra is None:
        raise FileNotFoundError(f"recipe {recipe} has no golden config (it needs inputs such as a base model)")
    # Recipes on the core text loader (their own, or the language models' shared one) train on
    # the synthetic corpus: the default one (pydoc_data.topics) differs between Python versions,
    # and goldens must not.
    from .lm import LMRecipe

    own_loader = getattr(type(obj), "load_data", None) not in (None, LMRecipe.load_data)
    text = ["data=synthetic"] if "data" in fields and "data" not in config and not own_loader else []
    return ([_as_set(k, v) for k, v in config.items() if k in fields] + text + list(extra)
            + (list(variants[variant]) if variant else [])
            + ([] if precision == "fp32" else [f"precision={precision}"]))


def compute(name: str, backend: str = "cpu", threads: int | None = None, extra_sets: list[str] | None = None,
            portable: bool = False) -> dict:
    """Run the golden config of a recipe (or ``recipe@variant``), in the portable mode if asked;
    return the golden document (not written)."""
    from .engine import get_engine

    seen: list[float] = []

    class Collect:
        from .hookspecs import hookimpl

        @hookimpl
        def step_end(self, run, step, loss, lr, ms, tokens_per_s):
            seen.append(loss)
            self.options = run.options

    collector = Collect()
    sets = golden_sets_for(name) + (["portable=true"] if portable else []) + list(extra_sets or [])
    steps = golden_steps(split_name(name)[0])
    engine = get_engine(backend)
    try:
        devices = _devices(split_name(name)[0], sets)
        if devices > 1:
            collector.options, losses = _spread_losses(split_name(name)[0], steps, backend, threads, sets, devices)
            seen.extend(losses)
        else:
            train(split_name(name)[0], steps=steps, backend=backend, threads=threads, sets=sets,
                  observers=(collector,), progress=False, write_files=False)
        fp = engine.fingerprint()
    finally:
        engine.set_portable(False)   # the run set it: later programs of this process are fast again
        engine.set_precision("fp32")   # likewise, and in fp32
    return {"recipe": name, "fingerprint": fp, "ggml_version": GGML_VERSION, "steps": steps,
            "blas": blas.tag() if blas is not None and backend == "cpu" and not portable else None,
            "options": _portable(collector.options.to_dict()),
            "losses": [{"step": i, "hex": float_hex(x), "value": float(np.float32(x))} for i, x in enumerate(seen)]}


def _devices(recipe: str, sets: list[str]) -> int:
    from .discovery import get_recipe
    from .runner import resolve_options

    return getattr(resolve_options(get_recipe(recipe)[1], None, sets, {}), "devices", 1)


def _spread_losses(recipe: str, steps: int, backend: str, threads: int | None, sets: list[str],
                   devices: int) -> tuple:
    """A golden of `devices` processes (engine/data_parallel.py): the run started by MPI's launcher
    beside this Python (`mpiexec -n N`, the mpich wheel's) or else on PATH, one thread a process unless
    told; its options and losses (metrics.jsonl's bits)."""
    import json
    import subprocess
    import sys
    import tempfile

    from .discovery import get_recipe
    from .launcher import find_mpiexec
    from .runner import resolve_options

    mpiexec = find_mpiexec(f"{recipe} with devices={devices}")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpiexec, "-n", str(devices), sys.executable, "-m", "toyharness.cli", "run", recipe, "--steps",
               str(steps), "--backend", backend, "--threads", str(threads or 1), "--no-progress", "--out",
               str(Path(tmp) / "run"), *[a for s in sets for a in ("--set", s)]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = [x for x in done.stderr.splitlines() if x.strip()][-1:] or [f"exit {done.returncode}"]
            raise InputError(f"{recipe} with devices={devices}: {tail[0]}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [hex_to_f32(json.loads(x)["loss_hex"]) for x in lines]
    return resolve_options(get_recipe(recipe)[1], None, sets, {"steps": steps}), losses


def _portable(options: dict) -> dict:
    """Paths into the user cache (e.g. lora's seeded base) written as <cache>/..., the same on every machine."""
    root = str(cache_root())
    return {k: "<cache>" + v[len(root):] if isinstance(v, str) and v.startswith(root) else v
            for k, v in options.items()}


def path_for(recipe: str, fingerprint: str, root: Path | None = None) -> Path:
    return (root or golden_root()) / fingerprint / f"{recipe}.yml"


def resolve(recipe: str, backend: str = "cpu", root: Path | None = None, mode: str = "auto") -> tuple[Path, bool]:
    """The golden file a check compares with (or a record writes), and whether it is the portable
    mode's: "fast" this build's fingerprint; "portable" cpu-portable; "auto" the fast one where it
    exists, else (cpu) the portable one."""
    from .engine import get_engine

    if mode not in MODES:
        raise InputError(f"golden mode {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "portable" and backend != "cpu":
        raise InputError(f"the portable golden mode is for the cpu backend, not {backend}")
    fast = path_for(recipe, get_engine(backend).fast_fingerprint(), root)
    if mode == "fast" or backend != "cpu" or (mode == "auto" and fast.is_file()):
        return fast, False
    return path_for(recipe, PORTABLE_FINGERPRINT, root), True


def describe(path: Path) -> str:
    """Which mode a check of this golden file used, for its report line."""
    return f"{'portable' if path.parent.name == PORTABLE_FINGERPRINT else 'fast'} mode: {path}"


def record(recipe: str, backend: str = "cpu", root: Path | None = None, mode: str = "auto") -> Path:
    path, portable = resolve(recipe, backend, root, mode)
    doc = compute(recipe, backend, portable=portable)
    atomic_write(path, yaml.safe_dump(doc, sort_keys=False))
    return path


def hex_to_f32(h: str) -> np.float32:
    return np.frombuffer(struct.pack("<I", int(h, 16)), dtype=np.float32)[0]


def ulp_distance(a_hex: str, b_hex: str) -> int:
    """Distance in float32 units in the last place (sign-magnitude mapped to a line)."""
    def ordinal(h: str) -> int:
        bits = int(h, 16)
        return bits if bits < 0x80000000 else 0x80000000 - bits
    return abs(ordinal(a_hex) - ordinal(b_hex))


@dataclass
class Mismatch:
    recipe: str
    fingerprint: str
    step: int
    expected_hex: str
    actual_hex: str
    later_differing: int
    total: int

    def __str__(self) -> str:
        e, a = hex_to_f32(self.expected_hex), hex_to_f32(self.actual_hex)
        return (f"golden mismatch: recipe {self.recipe} on {self.fingerprint}: first diverging step {self.step}: "
                f"expected {self.expected_hex} ({e!r}) got {self.actual_hex} ({a!r}), "
                f"{ulp_distance(self.expected_hex, self.actual_hex)} ULP apart; "
                f"{self.later_differing} of the {self.total - self.step - 1} later steps differ too")


def compare(expected: dict, actual: dict) -> Mismatch | None:
    exp = [x["hex"] for x in expected["losses"]]
    act = [x["hex"] for x in actual["losses"]]
    if len(exp) != len(act):
        raise InputError(f"golden for {expected['recipe']} holds {len(exp)} steps, the run made {len(act)}")
    for i, (e, a) in enumerate(zip(exp, act)):
        if e != a:
            later = sum(1 for x, y in zip(exp[i + 1:], act[i + 1:]) if x != y)
            return Mismatch(expected["recipe"], expected["fingerprint"], i, e, a, later, len(exp))
    return None


def load(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InputError(f"golden {path}: not valid YAML ({exc})") from None
    if not isinstance(doc, dict) or "losses" not in doc:
        raise InputError(f"golden {path}: no 'losses' list")
    return doc


class GoldenMissing(FileNotFoundError):
    """No golden file for a name here; `fingerprints` names the folders a check looked in
    ("cuda-sm90"; "cpu-avx2-... nor cpu-portable" in the auto mode), for a check's summary line."""

    def __init__(self, message: str, fingerprints: str):
        super().__init__(message)
        self.fingerprints = fingerprints


def check(recipe: str, backend: str = "cpu", root: Path | None = None,
          mode: str = "auto") -> tuple[Path, Mismatch | None]:
    """Compare a fresh run with the stored golden that `resolve` picks (its folder names the mode:
    cpu-portable or the fast fingerprint). Missing golden: GoldenMissing (a FileNotFoundError)."""
    from .engine import get_engine

    path, portable = resolve(recipe, backend, root, mode)
    if not path.is_file():
        fast = get_engine(backend).fast_fingerprint()
        both = portable and mode == "auto"
        also = f" (nor one for {fast})" if both else ""
        flag = (" --mode portable" if portable else "") + (f" --dir {shlex.quote(str(root))}" if root else "")
        raise GoldenMissing(f"no golden for {recipe} at {path}{also}; record one with "
                            f"`toyharness golden record {recipe}{flag}`",
                            f"{fast} nor {path.parent.name}" if both else path.parent.name)
    return path, compare(load(path), compute(recipe, backend, portable=portable))
