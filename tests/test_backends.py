"""The gpu backends against the cpu goldens. `nox -s tests-cuda` / `tests-vulkan` / `tests-metal` run
these where the backend is built and a device is present; elsewhere they skip and say why
(tests/test_vulkan.py runs the vulkan ones on Mesa's lavapipe in the default suite)."""

from pathlib import Path

import numpy as np
import pytest
from helpers import needs

from toyharness import goldens

ROOT = Path(__file__).resolve().parent.parent / "goldens"
RECIPES = ["gpt2", "llama", "lora", "vit_tiny", "warm_start", "dpo", "orpo"]
# lora over a seeded base of each architecture beyond llama's (toyharness/architectures)
ARCH_LORA = ["lora@llama3", "lora@qwen3", "lora@gemma3", "lora@phi3"]
# vulkan's: every golden config, lora over the quantized bases included
VULKAN_GOLDENS = [*RECIPES, "lora@q4_k", "lora@q8_0", *ARCH_LORA, "gpt2@dropout", "lora@dropout",
                  "gpt2@accum", "gpt2@clip", "lora@packed", "llama@packed", "gpt2@nanogpt", "dpo@q4_k", "orpo@q4_k"]
# how far each backend's losses may be from the cpu golden's (relative, any of the 16 steps)
TOLERANCE = {"cuda": 1e-4, "metal": 1e-4, "vulkan": 1e-5}
GPUS = ("cuda", "vulkan", "metal")
# The cpu goldens the other backends are held against: the ones recorded on the project's
# reference machine (AVX-512, OpenBLAS's SkylakeX kernels), whatever cpu runs this test.
CPU_REFERENCE = "cpu-avx512-openblas-skylakex"


# Each backend's first run of a golden config, kept for the check against that backend's own golden
# below: a run on lavapipe takes seconds, and the own-golden check needs no third one.
FIRST_RUNS: dict[tuple[str, str], dict] = {}


def first_run(backend: str, recipe: str) -> dict:
    if (backend, recipe) not in FIRST_RUNS:
        FIRST_RUNS[backend, recipe] = goldens.compute(recipe, backend)
    return FIRST_RUNS[backend, recipe]


def backend_goldens():
    return [pytest.param(b, recipe, marks=needs(b), id=f"{b}-{recipe}")
            for b in GPUS for recipe in (VULKAN_GOLDENS if b == "vulkan" else [*RECIPES, *ARCH_LORA])]


@pytest.mark.parametrize("backend,recipe", backend_goldens())
def test_backend_agrees_with_cpu_golden_and_repeats_bit_for_bit(backend, recipe):
    cpu = goldens.load(goldens.path_for(recipe, CPU_REFERENCE, ROOT))
    first, second = first_run(backend, recipe), goldens.compute(recipe, backend)
    assert goldens.compare(first, second) is None, f"{recipe} on {backend} is not run-to-run deterministic"
    ours = np.array([x["value"] for x in first["losses"]], np.float64)
    ref = np.array([x["value"] for x in cpu["losses"]], np.float64)
    worst = float(np.max(np.abs(ours - ref) / np.abs(ref)))
    print(f"{recipe} {backend}: largest relative difference to the cpu golden {worst:.3g}")
    assert len(ours) == len(ref) == 16
    assert worst < TOLERANCE[backend]


@pytest.mark.parametrize("backend,recipe", backend_goldens())
def test_backend_matches_its_own_golden(backend, recipe):
    """Bit for bit against goldens/<backend fingerprint>/, recorded on that device (the run is the
    one the test above made, where it ran; `goldens.check` less its second computation)."""
    path, portable = goldens.resolve(recipe, backend, ROOT)
    assert not portable
    if not path.is_file():
        pytest.skip(f"no golden for {recipe} at {path}; record one with `toyharness golden record {recipe} "
                    f"--backend {backend}`")
    mismatch = goldens.compare(goldens.load(path), first_run(backend, recipe))
    assert mismatch is None, str(mismatch)
