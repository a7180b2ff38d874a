"""The golden gate: every recipe checked bit for bit, and mutations that must fail it."""

import copy
from pathlib import Path

import pytest

from toyharness import goldens

ROOT = Path(__file__).resolve().parent.parent / "goldens"


BUILT_IN = ["gpt2", "llama", "lora", "lora@q4_k", "lora@q8_0", "lora@llama3", "lora@qwen3", "lora@gemma3",
            "lora@phi3", "vit_tiny", "warm_start"]


@pytest.mark.parametrize("recipe", BUILT_IN)
def test_recipe_matches_its_golden(recipe, toyharness_golden):
    toyharness_golden(recipe, root=ROOT)


@pytest.fixture(scope="module")
def stored():
    """llama's golden that a check here uses (this fingerprint's, else the portable one), and its mode."""
    path, portable = goldens.resolve("llama", root=ROOT)
    if not path.is_file():
        pytest.skip(f"no llama golden at {path}; record with `toyharness golden record llama`")
    return goldens.load(path), portable


def test_flipped_bit_in_golden_fails_at_that_step(stored):
    stored, portable = stored
    actual = goldens.compute("llama", portable=portable)
    assert goldens.compare(stored, actual) is None
    mutated = copy.deepcopy(stored)
    h = int(mutated["losses"][7]["hex"], 16) ^ 1
    mutated["losses"][7]["hex"] = "0x%08x" % h
    m = goldens.compare(mutated, actual)
    assert m is not None and m.step == 7 and m.later_differing == 0
    assert "first diverging step 7" in str(m) and "1 ULP apart" in str(m)


def test_changed_eps_fails_the_gate(stored):
    stored, portable = stored
    m = goldens.compare(stored, goldens.compute("llama", extra_sets=["eps=1e-6"], portable=portable))
    assert m is not None and m.step >= 1, "eps only acts from the first update on"


def test_changed_seed_fails_at_step_zero(stored):
    stored, portable = stored
    m = goldens.compare(stored, goldens.compute("llama", extra_sets=["seed=8"], portable=portable))
    assert m is not None and m.step == 0


def test_ulp_distance():
    assert goldens.ulp_distance("0x3f800000", "0x3f800001") == 1
    assert goldens.ulp_distance("0x00000001", "0x80000001") == 2


def test_ten_runs_and_three_thread_counts_give_the_same_bits():
    """Determinism evidence at the golden config: 10 runs in a row at 2 threads, then 1 and 4."""
    ref = goldens.compute("llama", threads=2)
    for _ in range(9):
        assert goldens.compare(ref, goldens.compute("llama", threads=2)) is None
    for threads in (1, 4):
        assert goldens.compare(ref, goldens.compute("llama", threads=threads)) is None, f"{threads} threads"
