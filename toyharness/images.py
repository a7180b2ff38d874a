"""Image classification data: the embedded default and user arrays, with deterministic batches.

- ``default``: the 8x8 handwritten digits that scikit-learn ships (1,797 real images, 10
  classes), split once with a fixed seed into 80% train / 20% test.
- ``PATH.npz`` with ``images`` (N, H, W) or (N, H, W, C) and ``labels`` (N,) class ids, e.g.
  MNIST or CIFAR-10 arrays; an npz that also holds ``test_images``/``test_labels`` uses them
  as the test split, else the same fixed 80/20 split applies.

Pixels become float32 in [0, 1] (integer images are divided by their dtype's range, or by 16
for the digits), then are standardised with the train split's mean and std. Training batch
``i`` is a pure function of (seed, i); evaluation walks the whole test split in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arrays import load_npz
from .errors import InputError

SPLIT_SEED = 20241121
TEST_FRACTION = 0.2


@dataclass
class ImageData:
    train_x: np.ndarray   # float32 (N, H, W, C), standardised
    train_y: np.ndarray   # int32 (N,)
    test_x: np.ndarray
    test_y: np.ndarray
    n_classes: int
    source: str

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.train_x.shape[1:])

    def check(self, options) -> None:
        h, w, _ = self.image_shape
        p = options.patch
        if p <= 0 or h % p or w % p:
            raise InputError(f"data {self.source}: images are {h}x{w}, not divisible into {p}x{p} patches "
                             f"(option 'patch')")
        wanted = getattr(options, "n_classes", 0)
        if wanted:
            top = int(max(self.train_y.max(), self.test_y.max()))
            if top >= wanted:
                raise InputError(f"data {self.source}: label {top} out of range [0, {wanted}) (option 'n_classes')")
            self.n_classes = wanted
        if len(self.train_y) < options.t_batch:
            # `options` are a step's (toyharness/training_loop.py): t_batch * accumulate rows
            what = "t_batch * accumulate" if getattr(options, "accumulate", 1) > 1 else "t_batch"
            raise InputError(f"data {self.source}: {len(self.train_y)} training images, fewer than {what} "
                             f"{options.t_batch}")

    def items_per_batch(self, options) -> int:
        return options.t_batch

    def eval_batches(self, options) -> int:
        return -(-len(self.test_y) // options.t_batch)

    def step_batch(self, split: str, index: int, options) -> dict[str, np.ndarray]:
        """images (B, H, W, C), cls_index (B,) and labels (B,). An eval batch walks the test split
        in order; the last one is padded by wrapping around and says how many rows count."""
        b = options.t_batch
        if split == "train":
            rng = np.random.default_rng([options.seed, 0, index])
            idx = rng.choice(len(self.train_y), size=b, replace=False)
            x, y, valid = self.train_x[idx], self.train_y[idx], b
        elif split == "eval":
            n = len(self.test_y)
            start = (index * b) % n
            idx = (start + np.arange(b)) % n
            x, y, valid = self.test_x[idx], self.test_y[idx], min(b, n - start)
        else:
            raise InputError(f"unknown split {split!r}; allowed: train, eval")
        n_tokens = (x.shape[1] // options.patch) * (x.shape[2] // options.patch) + 1
        out = {"images": np.ascontiguousarray(x), "cls_index": (np.arange(b) * n_tokens).astype(np.int32),
               "labels": y.astype(np.int32)}
        if split == "eval":
            out["valid"] = np.int32(valid)
        return out

    def micro_batches(self, batch: dict[str, np.ndarray], k: int, options) -> list[dict[str, np.ndarray]]:
        """A batch of t_batch * k rows (`step_batch` at that size) as k micro-batches of t_batch rows
        (option ``accumulate``): each its own class-token rows and, held out, its own count of
        valid rows."""
        b = len(batch["labels"]) // k
        out = []
        for j in range(k):
            rows = slice(j * b, (j + 1) * b)
            part = {"images": np.ascontiguousarray(batch["images"][rows]),
                    "cls_index": batch["cls_index"][:b].copy(), "labels": np.ascontiguousarray(batch["labels"][rows])}
            if "valid" in batch:
                part["valid"] = np.int32(min(b, max(0, int(batch["valid"]) - j * b)))
            out.append(part)
        return out


def load_image_data(spec: str = "default") -> ImageData:
    if spec in ("", "default"):
        x, y, source = _digits()
        return _split_and_normalise(x, y, None, None, source, scale=16.0)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise InputError(f"data {spec!r}: no such file")
    if path.suffix != ".npz":
        raise InputError(f"data {spec!r}: image data is an .npz with 'images' and 'labels'")
    arrays = load_npz(path, "data")
    for key in ("images", "labels"):
        if key not in arrays:
            raise InputError(f"data {spec!r}: no {key!r} array (found: {', '.join(arrays) or 'none'})")
    test = (arrays.get("test_images"), arrays.get("test_labels"))
    if (test[0] is None) != (test[1] is None):
        raise InputError(f"data {spec!r}: 'test_images' and 'test_labels' come together")
    scale = float(np.iinfo(arrays["images"].dtype).max) if arrays["images"].dtype.kind in "iu" else 1.0
    return _split_and_normalise(arrays["images"], arrays["labels"], *test, str(path), scale=scale)


def _digits() -> tuple[np.ndarray, np.ndarray, str]:
    """scikit-learn's digits (1797 8x8 images, 10 classes), read from the CSV its package carries,
    as `sklearn.datasets.load_digits` reads it, without importing scikit-learn: its compiled
    modules bring their own OpenMP runtime, and where ggml's was loaded first that import ended
    the process ("free(): invalid pointer", seen on the GPU host with torch beside it)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    csv = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if csv is None or not csv.is_file():
        raise InputError("the default image data is scikit-learn's digits: pip install scikit-learn")
    with gzip.open(csv, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int), "scikit-learn's digits.csv.gz"


# Class ids index the classifier's output rows: a larger id would size the model by a number.
MAX_CLASSES = 2**16


def _check_pair(images: np.ndarray, labels: np.ndarray, source: str, what: str) -> np.ndarray:
    if images.dtype.kind not in "biuf":
        raise InputError(f"data {source}: {what}images are {images.dtype}; expected integer or float pixels")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise InputError(f"data {source}: {what}images must be (N, H, W) or (N, H, W, C), got shape {images.shape}")
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise InputError(f"data {source}: {what}labels must be 1-D integer class ids, got {labels.dtype} "
                         f"with shape {labels.shape}")
    if len(labels) != len(images):
        raise InputError(f"data {source}: {len(images)} {what}images (shape {images.shape}) but {len(labels)} "
                         f"{what}labels (shape {labels.shape})")
    if 0 in images.shape[1:]:
        raise InputError(f"data {source}: {what}images have shape {images.shape}: no pixels")
    if len(labels) and (labels.min() < 0 or labels.max() >= MAX_CLASSES):
        bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
        raise InputError(f"data {source}: {what}label {bad} out of range (class ids are 0 to {MAX_CLASSES - 1})")
    if not np.isfinite(images.astype(np.float32)).all():
        raise InputError(f"data {source}: {what}images contain NaN or inf")
    return images


def _split_and_normalise(x, y, test_x, test_y, source: str, scale: float) -> ImageData:
    x = _check_pair(np.asarray(x), np.asarray(y), source, "")
    y = np.asarray(y)
    if test_x is None:
        order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
        n_test = int(round(len(y) * TEST_FRACTION))
        test_idx, train_idx = order[:n_test], order[n_test:]
        test_x, test_y, x, y = x[test_idx], y[test_idx], x[train_idx], y[train_idx]
    else:
        test_x = _check_pair(np.asarray(test_x), np.asarray(test_y), source, "test_")
        test_y = np.asarray(test_y)
        if test_x.shape[1:] != x.shape[1:]:
            raise InputError(f"data {source}: test_images are {test_x.shape[1:]}, images are {x.shape[1:]}")
    if len(y) == 0 or len(test_y) == 0:
        raise InputError(f"data {source}: the train or test split is empty")
    n_classes = int(max(y.max(), test_y.max())) + 1
    x = x.astype(np.float32) / np.float32(scale)
    test_x = test_x.astype(np.float32) / np.float32(scale)
    mean, std = np.float32(x.mean()), np.float32(x.std() or 1.0)
    return ImageData(((x - mean) / std).astype(np.float32), y.astype(np.int32),
                     ((test_x - mean) / std).astype(np.float32), test_y.astype(np.int32), n_classes, source)
