"""The golden gate: every recipe checked bit for bit, and mutations that must fail it."""

import copy
from pathlib import Path

import pytest

from toyharness import goldens

ROOT = Path(__file__).resolve().parent.parent / "goldens"


BUILT_IN = ["gpt2", "llama", "lora", "lora@q4_k", "lora@q8_0", "lora@llama3", "lora@qwen3", "lora@gemma3",
            "lora@phi3", "vit_tiny", "warm_start", "gpt2@dropout", "lora@dropout", "gpt2@dp2", "lora@dp2"]


@pytest.mark.parametrize("recipe", BUILT_IN)
def test_recipe_matches_its_golden(recipe, toyharness_golden):
    toyharness_golden(recipe, root=ROOT)


@pytest.mark.parametrize("recipe", ["gpt2", "lora"])
def test_the_two_process_goldens_hold_the_bits_of_two_micro_batches_in_one(recipe):
    """RECIPE@dp2 (devices=2) and RECIPE@accum (accumulate=2), recorded apart, in every folder
    that has both, at each precision (cuda's @bf16 too): the same losses, bit for bit."""
    pairs = [(d / f"{recipe}@dp2{p}.yml", d / f"{recipe}@accum{p}.yml") for d in sorted(ROOT.iterdir())
             for p in ("", "@tf32", "@bf16")]
    pairs = [(a, b) for a, b in pairs if a.is_file() and b.is_file()]
    assert pairs, f"no folder holds both {recipe}@dp2 and {recipe}@accum"
    for dp2, accum in pairs:
        assert goldens.load(dp2)["losses"] == goldens.load(accum)["losses"], dp2.parent.name


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


@pytest.mark.parametrize("args,message", [
    (["check", "nosuch"], "unknown recipe 'nosuch'; installed: "),
    (["check", "gpt2@nosuch"], "recipe gpt2 has no golden variant 'nosuch'"),
    (["check", "lora@nosuch"], "recipe lora has no golden variant 'nosuch' (it has: q4_k, q8_0,"),
    (["check", "gpt2@bf16"], "golden gpt2@bf16: precision bf16 is for the cuda backend"),
    (["check", "gpt2", "--dir", "NOWHERE"], "--dir NOWHERE: no such folder"),
])
def test_a_name_or_folder_that_is_not_there_exits_2(args, message, tmp_path, capsys):
    """These were 'SKIP ...: record one with `toyharness golden record nosuch`', exit 0."""
    from toyharness.cli import main

    where = str(tmp_path / "nowhere")
    assert main(["golden", *[where if a == "NOWHERE" else a for a in args]]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("toyharness: error: " + message.replace("NOWHERE", where)), out.err
    if "nosuch" in args:     # the built-ins, in order, wherever a plugin installed beside them sorts
        assert "dpo, gpt2, llama, lora, orpo, vit_tiny, warm_start" in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1 and out.out == ""
