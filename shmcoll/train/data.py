"""MNIST for the training demo: the bundled 5,000-image subset, or the full IDX files.

The bundled file (``shmcoll/data/mnist_5k.npz``, see the README next to it for its origin and
licence) is sorted by label, so :func:`load_bundled` shuffles it with a fixed seed before holding
out the evaluation images: every run, whatever its training seed, evaluates on the same images.

IDX is the format the MNIST files are distributed in: two zero bytes, a type code, the number of
dimensions, each dimension as a big-endian uint32, then the values, big-endian, row-major.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import struct

import numpy as np

BUNDLED_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "mnist_5k.npz")
BUNDLED_HOLDOUT = 1000
SPLIT_SEED = 20240607  # fixes which bundled images are held out; independent of the training seed

# IDX type code -> numpy dtype (big-endian where it matters)
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Images (uint8, ``(n, 28, 28)``) and labels (uint8, ``(n,)``) for training and evaluation."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    def describe(self) -> str:
        return f"{self.name}: {len(self.train_labels):,} training images, {len(self.test_labels):,} held out"


def _open(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        raw = gzip.decompress(raw)
    return raw


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a native-endian numpy array.

    Raises:
        ValueError: the file is not a well-formed IDX file.
    """
    raw = _open(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_TYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02x}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX file with zero dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _IDX_TYPES[code]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header says {shape} ({expected} bytes of data) but the file has {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed if ``path`` ends in ``.gz``)."""
    array = np.asarray(array)
    found = [(c, d) for c, d in _IDX_TYPES.items() if d.newbyteorder("=") == array.dtype.newbyteorder("=")]
    if not found:
        raise TypeError(f"IDX cannot store dtype {array.dtype}")
    code, dtype = found[0]
    if array.ndim == 0 or array.ndim > 255:
        raise ValueError("IDX needs 1 to 255 dimensions")
    payload = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += np.ascontiguousarray(array, dtype=dtype).tobytes()
    if path.endswith(".gz"):
        payload = gzip.compress(payload)
    with open(path, "wb") as f:
        f.write(payload)


def _find(data_dir: str, stem: str) -> str:
    # The files go around as train-images-idx3-ubyte and as train-images.idx3-ubyte, gzipped or not.
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{data_dir}: no {stem}[.gz] (the MNIST IDX files are named train-images-idx3-ubyte etc.)")


def load_idx_dir(data_dir: str) -> Dataset:
    """The full MNIST from the four IDX files in ``data_dir`` (training set and the t10k test set).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is malformed, or images and labels do not match.
    """
    parts = []
    for split in ("train", "t10k"):
        images = read_idx(_find(data_dir, f"{split}-images-idx3-ubyte"))
        labels = read_idx(_find(data_dir, f"{split}-labels-idx1-ubyte"))
        if images.ndim != 3 or images.dtype != np.uint8:
            raise ValueError(f"{data_dir}: {split} images must be uint8 of shape (n, rows, cols), got {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(f"{data_dir}: {len(images)} {split} images but labels of shape {labels.shape}")
        if labels.size and labels.max() > 9:
            raise ValueError(f"{data_dir}: {split} labels outside 0-9")
        parts.append((images, labels.astype(np.uint8)))
    (tr_x, tr_y), (te_x, te_y) = parts
    if tr_x.shape[1:] != te_x.shape[1:]:
        raise ValueError(f"{data_dir}: training images are {tr_x.shape[1:]} but test images {te_x.shape[1:]}")
    return Dataset(f"MNIST from {data_dir}", tr_x, tr_y, te_x, te_y)


def load_bundled(holdout: int = BUNDLED_HOLDOUT, path: str = BUNDLED_PATH) -> Dataset:
    """The bundled 5,000-image MNIST subset, shuffled with a fixed seed, ``holdout`` images held out."""
    with np.load(path) as f:
        images, labels = f["images"], f["labels"]
    if not 0 < holdout < len(labels):
        raise ValueError(f"holdout must be between 1 and {len(labels) - 1}, got {holdout}")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    images, labels = images[order], labels[order]
    return Dataset(
        "bundled MNIST subset (5,000 images)",
        images[holdout:],
        labels[holdout:],
        images[:holdout],
        labels[:holdout],
    )


def as_features(images: np.ndarray) -> np.ndarray:
    """uint8 images ``(n, rows, cols)`` -> float32 rows ``(n, rows * cols)`` scaled to [0, 1]."""
    return (images.reshape(len(images), -1).astype(np.float32)) * np.float32(1.0 / 255.0)
