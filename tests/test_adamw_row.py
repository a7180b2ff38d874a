"""Every slot of the AdamW row, both conventions, at steps 0, 1 and 9."""

import pytest

from toyharness.adamw import AdamWRow, Schedule, bias_corrected, check_convention, constant_betas
from toyharness.errors import InputError


@pytest.mark.parametrize("step", [0, 1, 9])
def test_bias_corrected_slots(step):
    row = bias_corrected(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1).hp_for_step(step)
    t = step + 1
    assert row == pytest.approx([2e-3, 0.9, 0.999, 1e-8, 0.1, 1 / (1 - 0.9**t), 1 / (1 - 0.999**t)], rel=1e-15)
    assert row.convention == "bias_corrected"


def test_bias_corrected_pinned_values():
    assert bias_corrected().hp_for_step(0)[5:] == pytest.approx([10.0, 1000.0], rel=1e-12)
    assert bias_corrected().hp_for_step(1)[5:] == pytest.approx([1 / 0.19, 1 / (1 - 0.999**2)], rel=1e-12)


@pytest.mark.parametrize("step", [0, 1, 9])
def test_constant_betas_slots(step):
    row = constant_betas().hp_for_step(step)
    assert list(row) == [1e-3, 0.9, 0.95, 1e-8, 0.0, 0.9, 0.95]


def test_cosine_schedule_sets_slot_zero_only():
    row = constant_betas(lr=1.0, schedule=Schedule("cosine", warmup=2, total=10, min_lr_ratio=0.0))
    assert [row.hp_for_step(s)[0] for s in (0, 1, 2, 6, 10)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0], abs=1e-12)
    assert row.hp_for_step(9)[1:] == row.hp_for_step(0)[1:]


def test_no_declared_convention_is_an_error():
    with pytest.raises(InputError, match="is not declared"):
        AdamWRow(None, 1e-3, 0.9, 0.95, 1e-8, 0.0)


def test_convention_must_match_the_graph():
    with pytest.raises(InputError, match="row is 'bias_corrected' but the recipe's graph declares 'constant_betas'"):
        check_convention(bias_corrected().hp_for_step(0), "constant_betas")
