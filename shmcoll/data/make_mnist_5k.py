"""Convert the MNIST 5k CSV subset into the compact file shmcoll ships: ``mnist_5k.npz``.

Usage (from the repository root)::

    python shmcoll/data/make_mnist_5k.py /work/shared/data/mnist_5k.csv.gz shmcoll/data/mnist_5k.npz

The input has one image per row: 784 pixel values 0-255 (28x28, row-major) then the label, rows
sorted by label, no header. The output is a compressed ``.npz`` with ``images`` (uint8, shape
``(5000, 28, 28)``) and ``labels`` (uint8, shape ``(5000,)``) in the input's order; shuffling and
the train/held-out split happen when the data is loaded (``shmcoll.train.data.load_bundled``).
See ``README.md`` next to this script for where the data comes from and its licence.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

PIXELS = 28 * 28


def convert(src: str, dst: str) -> tuple[int, ...]:
    """Read the CSV (optionally gzipped) at ``src``, check it, write ``dst``; return the class counts."""
    rows = np.loadtxt(src, delimiter=",", dtype=np.int64, ndmin=2)
    if rows.shape[1] != PIXELS + 1:
        raise ValueError(f"{src}: expected {PIXELS + 1} columns (784 pixels + label), got {rows.shape[1]}")
    pixels, labels = rows[:, :PIXELS], rows[:, PIXELS]
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"{src}: pixel values outside 0-255")
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{src}: labels outside 0-9")
    images = pixels.astype(np.uint8).reshape(-1, 28, 28)
    np.savez_compressed(dst, images=images, labels=labels.astype(np.uint8))
    return tuple(int(c) for c in np.bincount(labels, minlength=10))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="mnist_5k.csv.gz (784 pixels then the label per row)")
    parser.add_argument("dst", help="output .npz")
    args = parser.parse_args(argv)
    counts = convert(args.src, args.dst)
    print(f"wrote {args.dst}: {sum(counts)} images, per class {list(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
