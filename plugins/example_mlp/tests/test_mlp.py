"""The char_mlp plugin's own tests, run from this folder (`pytest`): they use the harness's golden
fixture exactly as any third-party plugin would."""

from pathlib import Path

import pytest

from toyharness import InputError, train

GOLDENS = Path(__file__).resolve().parent.parent / "goldens"


def test_mlp_matches_its_portable_golden(toyharness_golden):
    # the portable mode's golden: the same bits on any CPU, so this gate holds on every CI runner
    toyharness_golden("char_mlp", root=GOLDENS, mode="portable")


def test_mlp_learns(tmp_path):
    summary = train("char_mlp", steps=80, sets=["eval_every=80"], out=str(tmp_path / "run"), progress=False)
    # A uniform guess over 256 bytes costs ln(256) = 5.55 nats; four bytes of context do far better.
    assert summary["eval_loss"] < 3.0, summary
    assert (tmp_path / "run" / "model.gguf").is_file()


@pytest.mark.parametrize("sets,message", [
    (["context=0"], "context"),
    (["hidden=-1"], "hidden"),
    (["context=9", "t_seq=8"], "must be at most t_seq (8), got 9"),
])
def test_bad_options_are_refused_by_name(sets, message, tmp_path):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train("char_mlp", steps=1, sets=sets, out=str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()
