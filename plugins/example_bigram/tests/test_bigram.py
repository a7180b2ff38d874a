"""The example plugin's own tests, run from this folder: they use the harness's golden
fixture exactly as any third-party plugin would."""

from pathlib import Path

from toyharness.runner import train

GOLDENS = Path(__file__).resolve().parent.parent / "goldens"


def test_bigram_matches_its_golden(toyharness_golden):
    # the portable mode's golden: the same bits on any CPU, so this gate holds on every CI runner
    toyharness_golden("bigram", root=GOLDENS, mode="portable")


def test_bigram_learns(tmp_path):
    summary = train("bigram", steps=60, sets=["eval_every=60"], out=str(tmp_path / "run"), progress=False)
    # A uniform guess over 256 bytes costs ln(256) = 5.55 nats; English bigrams are far cheaper.
    assert summary["eval_loss"] < 3.5, summary
    assert (tmp_path / "run" / "model.gguf").is_file()
