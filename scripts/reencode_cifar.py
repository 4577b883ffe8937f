"""Re-encode a CIFAR-10 copy (the python pickle layout) as JPEG at a chosen quality: how far a training curve moves
with the images' compression (results/reference_runs/README.md, "The images' compression").

    python scripts/reencode_cifar.py SRC DST --quality 50

SRC and DST are ``data.root`` folders (each holds ``cifar-10-batches-py/``). Every training and test image is encoded
by Pillow at ``--quality`` (its default 4:2:0 chroma subsampling) and decoded again; labels, order, batch files and
``batches.meta`` are kept, so a run on DST draws the same batches and random numbers as the same seed on SRC and
differs in its pixels alone. Prints the peak signal-to-noise ratio of DST's images against SRC's.
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

FOLDER = "cifar-10-batches-py"
BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def reencode(rows: np.ndarray, quality: int) -> np.ndarray:
    """CIFAR rows (N x 3072 uint8: the red plane, then green, then blue, each 32x32) through JPEG at ``quality``."""
    images = rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    out = np.empty_like(images)
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        out[i] = np.asarray(Image.open(buffer).convert("RGB"))
    return out.transpose(0, 3, 1, 2).reshape(len(rows), -1)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays, in dB (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="data.root of the copy to re-encode")
    parser.add_argument("dst", type=Path, help="data.root to write (must not hold a CIFAR-10 copy yet)")
    parser.add_argument("--quality", type=int, required=True, help="JPEG quality, 1-95")
    args = parser.parse_args(argv)
    if not 1 <= args.quality <= 95:
        parser.error(f"--quality {args.quality} is not allowed: Pillow's JPEG qualities are 1-95")
    source, target = args.src / FOLDER, args.dst / FOLDER
    missing = [name for name in [*BATCHES, "batches.meta"] if not (source / name).is_file()]
    if missing:
        parser.error(f"{source} lacks {', '.join(missing)}: SRC must hold CIFAR-10 in the python pickle layout")
    if target.exists():
        parser.error(f"{target} exists: choose an empty DST")
    staging = args.dst / f".{FOLDER}.partial"  # renamed into place once every file is written
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    before, after = [], []
    for name in BATCHES:
        with open(source / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        before.append(batch[b"data"])
        batch[b"data"] = reencode(batch[b"data"], args.quality)
        after.append(batch[b"data"])
        with open(staging / name, "wb") as f:
            pickle.dump(batch, f)
    shutil.copy(source / "batches.meta", staging / "batches.meta")
    staging.rename(target)
    print(f"{target}: JPEG quality {args.quality}, PSNR against {source}: "
          f"{psnr(np.concatenate(before), np.concatenate(after)):.2f} dB")


if __name__ == "__main__":
    main()
