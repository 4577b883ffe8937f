"""Image folders on disk (ImageNet's layout, ``train/<class>/<image>`` and ``val/<class>/<image>``), decoded and
augmented by torchvision's DataLoader path, in batches that depend neither on the worker count nor on the ranks.
See docs/data.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from qtrain.data.base import GlobalBatches
from qtrain.errors import DataError
from qtrain.task import CLASSIFICATION, Task

SHOWN = 5  # class names a mismatch names before it counts the rest


@dataclass
class FileSplit:
    """Image files and their int64 labels (the index of the class folder in sorted order)."""

    paths: tuple[str, ...]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.paths)

    def take(self, index: torch.Tensor) -> FileSplit:
        """The files at ``index``, in its order."""
        return FileSplit(tuple(self.paths[i] for i in index.tolist()), self.labels[index])


@dataclass
class FolderData:
    """A classification dataset of image files: splits, class count, image size, normalization, loader workers."""

    name: str
    train: FileSplit
    test: FileSplit
    num_classes: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    workers: int
    task: Task = CLASSIFICATION

    def model_inputs(self) -> dict[str, Any]:
        return {"in_channels": 3, "num_classes": self.num_classes, "input_size": (self.image_size, self.image_size)}

    def streams(self, cfg: DictConfig, device: torch.device, rank: int, world: int) -> tuple[LoaderStream, LoaderStream]:
        """Shuffled, randomly cropped and flipped training batches and in-order, centre-cropped evaluation batches."""
        return (LoaderStream(self, self.train, True, cfg.train.batch_size, cfg.seed, device, rank, world),
                LoaderStream(self, self.test, False, cfg.train.eval_batch_size, cfg.seed, device, rank, world))

    def transform(self, train: bool) -> Callable[[Any], torch.Tensor]:
        """torchvision's standard training (``train``) or evaluation transform, from a PIL image to a normalized tensor."""
        from torchvision import transforms  # torchvision takes seconds to import: only with real data

        size = self.image_size
        if train:
            steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
        else:
            steps = [transforms.Resize(round(size * 256 / 224)), transforms.CenterCrop(size)]
        return transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])


def _scan(folder: Path) -> tuple[list[str], FileSplit]:
    """The class folders of ``folder`` and its image files."""
    from torchvision.datasets import ImageFolder

    if not folder.is_dir():
        raise DataError(f"image folder not found: {folder} (data.root must hold train/<class>/ and val/<class>/)")
    try:
        found = ImageFolder(str(folder))
    except FileNotFoundError as err:  # no class folder, or a class folder without images
        raise DataError(f"no images in {folder}: {err}") from None
    paths, labels = zip(*found.samples)
    return found.classes, FileSplit(paths, torch.tensor(labels, dtype=torch.int64))


def _names(names: list[str]) -> str:
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def load_folder(name: str, root: str | Path, image_size: int, mean: list[float], std: list[float],
                workers: int) -> FolderData:
    """The image folders ``root/train`` and ``root/val``; their images are read only as batches are loaded."""
    root = Path(root).expanduser()
    classes, train = _scan(root / "train")
    val_classes, test = _scan(root / "val")
    if val_classes != classes:
        missing = sorted(set(classes) - set(val_classes))
        extra = sorted(set(val_classes) - set(classes))
        difference = "; ".join(([f"val/ lacks {_names(missing)}"] if missing else [])
                               + ([f"val/ has {_names(extra)}, which train/ lacks"] if extra else []))
        raise DataError(f"{root}: val/ must hold the class folders of train/ ({difference})")
    return FolderData(name, train, test, len(classes), image_size, tuple(map(float, mean)), tuple(map(float, std)),
                      workers)


def _open(path: str) -> Any:
    from torchvision.datasets.folder import default_loader

    try:
        return default_loader(path)
    except OSError as err:  # PIL's UnidentifiedImageError included
        raise DataError(f"unreadable image {path}: {err}") from None


class _Images(Dataset):
    """A split's images: key ``(index, seed)`` gives image ``index`` transformed under ``seed``, and its label."""

    def __init__(self, split: FileSplit, transform: Callable[[Any], torch.Tensor]) -> None:
        self.split, self.transform = split, transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        image = _open(self.split.paths[index])
        with torch.random.fork_rng(devices=[]):  # torchvision's random transforms draw from the global CPU generator
            torch.default_generator.manual_seed(seed)
            return self.transform(image), int(self.split.labels[index])


class LoaderStream(GlobalBatches):
    """Batches of one split of image files, loaded by a DataLoader: augmented and shuffled for training, else in order."""

    def __init__(self, data: FolderData, split: FileSplit, train: bool, batch_size: int, seed: int, device: torch.device,
                 rank: int = 0, world: int = 1) -> None:
        super().__init__(len(split), batch_size, seed, train, rank, world)
        self.data, self.split, self.device = data, split, device
        self.images = _Images(split, data.transform(train))

    def example(self, n: int) -> torch.Tensor:
        """The first ``n`` images under the evaluation transform."""
        images = _Images(self.split, self.data.transform(False))
        return torch.stack([images[i, 0][0] for i in range(min(n, len(images)))]).to(self.device)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order, gen = self.order(epoch)
        seeds = torch.randint(1 << 62, (self.size,), generator=gen)  # one per sample, whichever rank and worker loads it
        parts = [batch[part].tolist() for batch, part in self.parts(torch.stack([order, seeds], 1))][start:]
        loader = DataLoader(self.images, batch_sampler=[keys for keys in parts if keys], num_workers=self.data.workers,
                            pin_memory=self.device.type == "cuda", generator=gen)
        loaded = iter(loader)
        size = self.data.image_size
        for keys in parts:
            if not keys:  # this rank's slice of a batch with fewer samples than ranks
                yield (torch.empty(0, 3, size, size, device=self.device),
                       torch.empty(0, dtype=torch.int64, device=self.device))
                continue
            try:
                x, y = next(loaded)
            except DataError as err:  # from a worker, it carries the worker's traceback: keep its last line, the error
                raise DataError(str(err).splitlines()[-1].removeprefix(f"{DataError.__module__}.DataError: ")) from None
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
