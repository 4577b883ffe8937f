"""Image datasets: embedded digits, synthetic, CIFAR-10/100 (python pickle layout, read by :class:`_CifarUnpickler`),
MNIST (idx files), in the layouts torchvision downloads; nothing here downloads. The checksums and errors:
docs/data.md."""

from __future__ import annotations

import codecs
import logging
import pickle
from pathlib import Path

import numpy as np
import torch

from qtrain.data.batches import ImageData, ImageSplit, channel_stats
from qtrain.errors import DataError

log = logging.getLogger(__name__)

# Standard normalization constants (per-channel mean/std of the training images).
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
MNIST_STATS = ((0.1307,), (0.3081,))
# MD5 of the uncompressed idx files of the official MNIST release.
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{what} file not found: {path}")
    return path


_warned: set[Path] = set()  # files whose checksum warning this process gave already (a sweep loads them per job)


def _check_md5(path: Path, md5: str, what: str) -> None:
    from torchvision.datasets.utils import check_integrity  # torchvision takes seconds to import: only with real data

    if path.resolve() in _warned:
        return
    if not check_integrity(str(path), md5):
        _warned.add(path.resolve())
        log.warning("%s file %s differs from the official release (MD5 %s expected); loading it anyway", what, path, md5)


def load_digits_data(test_fraction: float = 0.2) -> ImageData:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, values 0..16), split by class."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)[:, None]
    x_tr, x_te, y_tr, y_te = train_test_split(images, digits.target, test_size=test_fraction,
                                              stratify=digits.target, random_state=0)
    train = ImageSplit(torch.from_numpy(x_tr), torch.from_numpy(y_tr).long())
    mean, std = channel_stats(train.images, 16.0)
    return ImageData("digits", train, ImageSplit(torch.from_numpy(x_te), torch.from_numpy(y_te).long()),
                     10, mean, std, pixel_max=16.0)


def make_synthetic_data(n_train: int, n_test: int, num_classes: int, channels: int, size: int, seed: int) -> ImageData:
    """Noisy copies of one random prototype image per class: learnable in a few steps, for tests."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(num_classes, channels, size, size, generator=gen) * 255

    def split(n: int) -> ImageSplit:
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        noise = torch.randn(n, channels, size, size, generator=gen) * 40
        return ImageSplit((prototypes[labels] + noise).clamp(0, 255).to(torch.uint8), labels)

    train = split(n_train)
    mean, std = channel_stats(train.images, 255.0)
    return ImageData("synthetic", train, split(n_test), num_classes, mean, std)


def _cifar_globals() -> dict[tuple[str, str], object]:
    """The callables a CIFAR pickle may name, under the module names numpy 1 and 2 (and Python 2) write."""
    from numpy._core import multiarray, numeric

    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                                              ("_codecs", "encode"): codecs.encode}
    for core in ("numpy.core", "numpy._core"):
        allowed[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{core}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that makes only the objects CIFAR's batches hold (dicts, lists, strings, bytes, numbers, numpy
    arrays, scalars and dtypes); any other is refused before it is made. Unpickling can call any importable function,
    so this is what keeps a tampered file from running code."""

    allowed = _cifar_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch does not hold "
                                         "(refused: unpickling it could run code)") from None


def _read_cifar_batch(path: Path, label_key: bytes, what: str) -> ImageSplit:
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="bytes").load()
        rows = np.asarray(entry[b"data"], dtype=np.uint8)
        labels = np.asarray(entry[label_key], dtype=np.int64)
        images = rows.reshape(len(rows), 3, 32, 32)
    except Exception as err:  # noqa: BLE001 - any unpickling or shape failure means a corrupt file
        raise DataError(f"corrupt {what} file {path}: {type(err).__name__}: {err}") from None
    if len(images) != len(labels):
        raise DataError(f"corrupt {what} file {path}: {len(images)} images but {len(labels)} labels")
    return ImageSplit(torch.from_numpy(images), torch.from_numpy(labels))


def load_cifar(root: str | Path, num_classes: int) -> ImageData:
    """CIFAR-10 (``cifar-10-batches-py/``) or CIFAR-100 (``cifar-100-python/``) under ``root``."""
    from torchvision.datasets import CIFAR10, CIFAR100

    if num_classes == 10:
        spec, label_key, stats = CIFAR10, b"labels", CIFAR10_STATS
    else:
        spec, label_key, stats = CIFAR100, b"fine_labels", CIFAR100_STATS
    what = f"CIFAR-{num_classes}"
    folder = Path(root).expanduser() / spec.base_folder

    def read(files: list[list[str]]) -> ImageSplit:
        parts = []
        for name, md5 in files:
            path = _existing(folder / name, what)
            _check_md5(path, md5, what)
            parts.append(_read_cifar_batch(path, label_key, what))
        return ImageSplit(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))

    train, test = read(spec.train_list), read(spec.test_list)
    for split in (train, test):
        if len(split) and (split.labels.min() < 0 or split.labels.max() >= num_classes):
            raise DataError(f"corrupt {what} data under {folder}: labels outside 0..{num_classes - 1}")
    return ImageData(f"cifar{num_classes}", train, test, num_classes, *stats)


def load_mnist(root: str | Path) -> ImageData:
    """MNIST from the four idx files in ``root/MNIST/raw`` (the layout torchvision writes)."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    folder = Path(root).expanduser() / "MNIST" / "raw"

    def read(prefix: str) -> ImageSplit:
        tensors = []
        for kind, reader in (("images-idx3-ubyte", read_image_file), ("labels-idx1-ubyte", read_label_file)):
            path = _existing(folder / f"{prefix}-{kind}", "MNIST")
            _check_md5(path, MNIST_MD5[path.name], "MNIST")
            try:
                tensors.append(reader(str(path)))
            except Exception as err:  # noqa: BLE001 - torchvision raises assorted errors on bad idx files
                reason = f"{type(err).__name__}: {err}" if str(err) else "its idx header or size is not that of an MNIST file"
                raise DataError(f"corrupt MNIST file {path}: {reason}") from None
        images, labels = tensors
        if images.ndim != 3 or len(images) != len(labels):
            raise DataError(f"corrupt MNIST files under {folder}: {tuple(images.shape)} images, {len(labels)} labels")
        return ImageSplit(images[:, None].contiguous(), labels.long())

    return ImageData("mnist", read("train"), read("t10k"), 10, *MNIST_STATS)
