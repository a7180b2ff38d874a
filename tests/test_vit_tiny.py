"""vit_tiny: image data validation, the classifier's reports, and the export."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from helpers import cli

from toyharness.images import load_image_data

SMALL = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "d_ff=64", "--set", "t_batch=16",
         "--set", "eval_every=10", "--set", "checkpoint_every=10", "--set", "warmup=2", "--set", "lr=3e-3"]


def test_default_data_is_the_digits_with_a_fixed_split():
    a, b = load_image_data(), load_image_data()
    assert a.image_shape == (8, 8, 1) and a.n_classes == 10
    assert len(a.train_y) + len(a.test_y) == 1797 and len(a.test_y) == 359
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert abs(float(a.train_x.mean())) < 1e-5


def test_run_reports_accuracy_and_writes_a_confusion_matrix(tmp_path):
    out = tmp_path / "run"
    res = cli("run", "vit_tiny", "--steps", "80", "--set", "t_batch=32", "--set", "eval_every=40", "--set", "warmup=5",
              "--set", "lr=3e-3", "--out", str(out), "--save-batches", "--no-progress")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert 0.2 < summary["accuracy"] <= 1.0, summary        # 10 classes: chance is 0.1
    evals = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "accuracy" in m]
    assert [m["step"] for m in evals] == [39, 79]
    assert (out / "confusion.png").stat().st_size > 1000 and "accuracy" in res.stdout
    batches = np.load(out / "batches.npz")
    assert batches["images"].shape == (80, 32, 8, 8, 1) and batches["images"].dtype == np.float32
    assert batches["labels"].shape == (80, 32) and batches["labels"].dtype == np.int32
    model = gguf.GGUFReader(out / "model.gguf")
    names = {t.name for t in model.tensors}
    assert {"patch_embd.weight", "cls_token.weight", "position_embd.weight", "blk.0.attn_q.weight",
            "output_norm.weight", "output.weight"} <= names
    assert model.fields["general.architecture"].contents() == "vit"
    assert model.fields["vit.num_classes"].contents() == 10


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("arrays,extra,message", [
    (dict(images=np.zeros((10, 8, 8), np.uint8), labels=np.zeros(9, np.int64)), [],
     "10 images (shape (10, 8, 8, 1)) but 9 labels (shape (9,))"),
    (dict(images=np.zeros((10, 8), np.uint8), labels=np.zeros(10, np.int64)), [],
     "images must be (N, H, W) or (N, H, W, C), got shape (10, 8)"),
    (dict(images=np.zeros((40, 8, 8), np.uint8), labels=np.full(40, -1)), [], "label -1 out of range"),
    (dict(images=np.zeros((40, 8, 8), np.uint8), labels=np.arange(40) % 12), ["--set", "n_classes=10"],
     "label 11 out of range [0, 10) (option 'n_classes')"),
    (dict(images=np.zeros((40, 9, 9), np.uint8), labels=np.zeros(40, np.int64)), [],
     "images are 9x9, not divisible into 2x2 patches"),
    (dict(pixels=np.zeros((4, 8, 8))), [], "no 'images' array (found: pixels)"),
])
def test_bad_image_data_exits_2_naming_the_shapes(tmp_path, arrays, extra, message):
    data = write_npz(tmp_path / "d.npz", **arrays)
    res = cli("run", "vit_tiny", "--steps", "2", *SMALL, *extra, "--set", f"data={data}", "--out", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r").exists()


def test_user_npz_with_color_images_and_its_own_test_split(tmp_path):
    rng = np.random.default_rng(0)
    data = write_npz(tmp_path / "c.npz", images=rng.integers(0, 256, (64, 8, 8, 3), dtype=np.uint8),
                     labels=rng.integers(0, 3, 64), test_images=rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8),
                     test_labels=rng.integers(0, 3, 20))
    res = cli("run", "vit_tiny", "--steps", "10", *SMALL, "--set", f"data={data}", "--out", str(tmp_path / "r"),
              "--no-progress")
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["accuracy"] is not None


def test_default_digits_are_read_without_importing_scikit_learn():
    """scikit-learn's compiled modules bring their own OpenMP runtime, which ended the process when
    ggml's was loaded first (the GPU host): the digits come from the CSV its package carries."""
    code = ("import sys; from toyharness._ffi import lib; from toyharness.images import load_image_data; "
            "d = load_image_data(); print(len(d.train_y) + len(d.test_y), 'sklearn' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["1797", "False"]
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is not installed: nothing to compare with")
    from toyharness.images import _digits

    images, labels, _ = _digits()
    reference = datasets.load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
