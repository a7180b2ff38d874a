"""The example plugin's own tests, run from this folder: they use the harness's golden
fixture exactly as any third-party plugin would."""

from pathlib import Path

from toyharness import train

GOLDENS = Path(__file__).resolve().parent.parent / "goldens"


def test_bigram_matches_its_golden(toyharness_golden):
    # the portable mode's golden: the same bits on any CPU, so this gate holds on every CI runner
    toyharness_golden("bigram", root=GOLDENS, mode="portable")


def test_bigram_learns(tmp_path):
    summary = train("bigram", steps=60, sets=["eval_every=60"], out=str(tmp_path / "run"), progress=False)
    # A uniform guess over 256 bytes costs ln(256) = 5.55 nats; English bigrams are far cheaper.
    assert summary["eval_loss"] < 3.5, summary
    assert (tmp_path / "run" / "model.gguf").is_file()


def test_losscsv_observer_writes_the_runs_losses(tmp_path):
    import json

    out = tmp_path / "run"
    train("bigram", steps=20, sets=["eval_every=10"], out=str(out), progress=False, log="losscsv")
    rows = [line.split(",") for line in (out / "losses.csv").read_text().splitlines()]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == ["step", "loss", "eval_loss"]
    assert [(int(r[0]), float(r[1])) for r in rows[1:]] == [(m["step"], m["loss"]) for m in metrics]
    assert [(int(r[0]), float(r[2])) for r in rows[1:] if r[2]] == \
        [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m] and len(metrics) == 20
