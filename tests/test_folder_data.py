"""Image folders read from disk through torchvision: a tiny train/val tree of PNG and JPEG files written here."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from qtrain.config import validate
from qtrain.data import folder, load_data
from qtrain.data.folder import load_folder
from qtrain.errors import ConfigError, DataError
from qtrain.run import run

from .conftest import make_config, run_cli

CLASSES = ["dog", "ant", "cat"]  # written unsorted: the labels follow the sorted names ant, cat, dog
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 32


def _colour(label: int, k: int) -> tuple[int, int, int]:
    return 40 * label + 10 * k, 200 - 30 * label, 17 + k


def _write_tree(root: Path, per_class: int = 4, val_per_class: int = 2) -> Path:
    """train/: 40x30 noise images, half PNG and half JPEG, and a text file torchvision skips; val/: flat-colour PNGs."""
    rng = np.random.default_rng(0)
    for name in CLASSES:
        label = sorted(CLASSES).index(name)
        (root / "train" / name).mkdir(parents=True)
        (root / "val" / name).mkdir(parents=True)
        for k in range(per_class):
            pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "train" / name / f"{name}{k}.{'png' if k % 2 else 'jpg'}")
        (root / "train" / name / "notes.txt").write_text("not an image")
        for k in range(val_per_class):
            Image.new("RGB", (40, 30), _colour(label, k)).save(root / "val" / name / f"{name}{k}.png")
    return root


@pytest.fixture
def tree(tmp_path):
    return _write_tree(tmp_path / "tiny")


def _load(root: Path, workers: int = 0):
    return load_folder("imagefolder", root, SIZE, list(MEAN), list(STD), workers)


def _config(root: Path, *overrides: str):
    return make_config("data=imagefolder", f"data.root={root}", f"data.image_size={SIZE}", "data.workers=0",
                       "progress=false", "fused=false", *overrides)


def _streams(data, batch_size=5, eval_batch_size=4, seed=0, rank=0, world=1, device="cpu"):
    cfg = _config(Path("."), f"train.batch_size={batch_size}", f"train.eval_batch_size={eval_batch_size}", f"seed={seed}")
    return data.streams(cfg, torch.device(device), rank, world)


def _all(stream, epoch=0):
    return [(x.clone(), y.clone()) for x, y in stream.epoch(epoch)]


def test_classes_are_the_sorted_train_folders_and_label_every_image_file(tree):
    data = _load(tree)
    assert (data.num_classes, len(data.train), len(data.test)) == (3, 12, 6)
    assert data.model_inputs() == {"in_channels": 3, "num_classes": 3, "input_size": (SIZE, SIZE)}
    for split in (data.train, data.test):
        assert all(Path(p).suffix in (".png", ".jpg") for p in split.paths)  # notes.txt is no image
        assert split.labels.dtype == torch.int64
        assert split.labels.tolist() == [["ant", "cat", "dog"].index(Path(p).parent.name) for p in split.paths]
    assert torch.bincount(data.train.labels).tolist() == [4, 4, 4]


def test_batches_have_the_model_input_shape_and_evaluation_is_in_order(tree):
    train, test = _streams(_load(tree))
    assert (len(train), train.samples, [train.global_size(i) for i in range(len(train))]) == (3, 12, [5, 5, 2])
    batches = _all(train)
    assert [tuple(x.shape) for x, _ in batches] == [(5, 3, SIZE, SIZE)] * 2 + [(2, 3, SIZE, SIZE)]
    assert all(x.dtype == torch.float32 and y.dtype == torch.int64 for x, y in batches)
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == [0] * 4 + [1] * 4 + [2] * 4
    assert torch.cat([y for _, y in _all(test)]).tolist() == [0, 0, 1, 1, 2, 2]
    assert train.example(2).shape == (2, 3, SIZE, SIZE)


def test_evaluation_transform_of_a_flat_colour_is_its_normalized_value(tree):
    _, test = _streams(_load(tree))
    x = torch.cat([x for x, _ in _all(test)])
    for i, (label, k) in enumerate((label, k) for label in range(3) for k in range(2)):
        # resizing and cropping a flat image keeps it flat: every pixel is (colour / 255 - mean) / std
        expected = [(c / 255 - m) / s for c, m, s in zip(_colour(label, k), MEAN, STD)]
        assert torch.allclose(x[i], torch.tensor(expected).view(3, 1, 1).expand(3, SIZE, SIZE), atol=1e-5)
    assert torch.equal(test.example(3), x[:3])


@pytest.mark.slow
def test_the_seed_and_epoch_fix_the_batches_whatever_the_worker_count_and_device(tree, device, monkeypatch):
    data = _load(tree)
    train, _ = _streams(data)
    state = torch.get_rng_state()
    first = _all(train, 0)
    assert torch.equal(torch.get_rng_state(), state)  # the run's own random numbers (stochastic rounding) are untouched
    again = _all(_streams(data)[0], 0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    for other in (_all(train, 1), _all(_streams(data, seed=1)[0], 0)):
        assert not torch.equal(torch.cat([x for x, _ in first]), torch.cat([x for x, _ in other]))
    pinned = []

    class Recorded(folder.DataLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pinned.append(self.pin_memory)

    monkeypatch.setattr(folder, "DataLoader", Recorded)
    two_workers = _all(_streams(_load(tree, workers=2), device=device)[0], 0)
    assert pinned == [device.type == "cuda"]  # page-locked host batches, copied to the GPU without blocking
    assert all(x.device.type == y.device.type == device.type for x, y in two_workers)
    assert all(torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu()) for a, b in zip(first, two_workers))


@pytest.mark.slow
def test_each_epoch_crops_and_flips_an_image_anew(tmp_path):
    data = _load(_write_tree(tmp_path / "one", per_class=1))  # one image a class: a batch of 3 holds each once

    def by_label(epoch):
        (x, y), = _all(_streams(data, batch_size=3)[0], epoch)
        return x[y.argsort()]

    assert torch.equal(by_label(0), by_label(0))
    assert all(not torch.equal(a, b) for a, b in zip(by_label(0), by_label(1)))


@pytest.mark.slow
def test_rank_slices_cover_every_global_batch_exactly(tree):
    data = _load(tree)
    for which, world in ((0, 3), (1, 4)):  # training batches of 5, 5, 2; evaluation batches of 4, 2 (some ranks get none)
        alone = _all(_streams(data)[which], 1)
        parts = [_all(_streams(data, rank=r, world=world)[which], 1) for r in range(world)]
        assert all(len(p) == len(alone) for p in parts)
        for i, (x, y) in enumerate(alone):
            sizes = [len(p[i][1]) for p in parts]
            assert sizes == [(r + 1) * len(y) // world - r * len(y) // world for r in range(world)]
            assert torch.equal(torch.cat([p[i][0] for p in parts]), x) and torch.equal(torch.cat([p[i][1] for p in parts]), y)
    assert _streams(data, rank=0, world=3)[0].smallest_part() == 0  # the last batch of 2 leaves rank 0 nothing


@pytest.mark.slow
def test_sample_and_subset_choose_files(tree):
    full = load_data(_config(tree).data)
    sample = load_data(_config(tree, "data.sample={train: 7, test: 3}").data)
    # 7 over 3 classes: 2 each and one more for the first class; 3 over 3: 1 each
    assert torch.bincount(sample.train.labels).tolist() == [3, 2, 2] and torch.bincount(sample.test.labels).tolist() == [1] * 3
    assert set(sample.train.paths) <= set(full.train.paths)
    again = load_data(_config(tree, "data.sample={train: 7, test: 3}", "seed=5").data)
    assert (again.train.paths, again.test.paths) == (sample.train.paths, sample.test.paths)
    labels = dict(zip(full.train.paths, full.train.labels.tolist()))
    assert all(labels[p] == y for p, y in zip(sample.train.paths, sample.train.labels.tolist()))

    upper = load_data(_config(tree, "data.subset={by: classes, part: 1}").data)  # 3 // 2: class 0, then classes 1 and 2
    assert upper.num_classes == 2 and upper.model_inputs()["num_classes"] == 2
    for split in (upper.train, upper.test):
        assert {Path(p).parent.name for p in split.paths} == {"cat", "dog"}
        assert split.labels.tolist() == [["cat", "dog"].index(Path(p).parent.name) for p in split.paths]

    halves = [load_data(_config(tree, f"data.subset={{by: samples, part: {p}}}").data) for p in (0, 1)]
    assert set(halves[0].train.paths).isdisjoint(halves[1].train.paths)
    assert set(halves[0].train.paths) | set(halves[1].train.paths) == set(full.train.paths)
    assert all(torch.bincount(h.train.labels).tolist() == [2, 2, 2] and h.test.paths == full.test.paths for h in halves)


def test_missing_or_empty_folders_and_other_classes_are_one_line_data_errors(tmp_path):
    root = tmp_path / "tree"
    with pytest.raises(DataError, match=f"image folder not found: {root / 'train'}"):
        _load(root)
    (root / "train").mkdir(parents=True)
    with pytest.raises(DataError, match=f"no images in {root / 'train'}: Couldn't find any class folder"):
        _load(root)
    (root / "train" / "ant").mkdir()
    (root / "train" / "ant" / "readme.txt").write_text("no image")
    with pytest.raises(DataError, match=f"no images in {root / 'train'}: Found no valid file for the classes ant"):
        _load(root)

    other = _write_tree(tmp_path / "other")
    (other / "val" / "dog").rename(other / "val" / "emu")
    with pytest.raises(DataError) as err:
        _load(other)
    assert str(err.value) == (f"{other}: val/ must hold the class folders of train/ "
                              "(val/ lacks dog; val/ has emu, which train/ lacks)")
    (other / "val" / "emu").rename(other / "val" / "dog")
    for name in ("ant", "cat", "dog"):
        for path in (other / "val" / name).iterdir():
            path.unlink()
    with pytest.raises(DataError, match=f"no images in {other / 'val'}"):
        _load(other)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_image_is_a_one_line_data_error_naming_it(tree, workers):
    bad = tree / "train" / "cat" / "cat1.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataError) as err:
        _all(_streams(_load(tree, workers))[0])
    assert str(err.value).startswith(f"unreadable image {bad}: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("override,message", [
    ("data.image_size=0", "data.image_size=0 is not allowed: it must be an integer >= 1"),
    ("data.workers=-1", "data.workers=-1 is not allowed: it must be an integer >= 0"),
    ("data.std=[0.2,0,0.2]", "data.std=[0.2, 0, 0.2] is not allowed: it must be a list of 3 numbers > 0, one per RGB channel"),
    ("data.mean=[0.5,0.5]", "data.mean=[0.5, 0.5] is not allowed: it must be a list of 3 numbers, one per RGB channel"),
])
def test_bad_folder_keys_are_refused_before_any_work(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        validate(_config(tmp_path, override))
    assert str(err.value) == message


def test_imagenet_needs_a_root_and_stands_in_synthetically_at_smoke_scale():
    with pytest.raises(ConfigError, match="data.root is not set"):
        validate(make_config("data=imagenet"))
    cfg = make_config("data=imagenet", "scale=smoke")
    validate(cfg)
    data = load_data(cfg.data)
    assert (data.name, data.num_classes, cfg.data.stand_in_for) == ("synthetic", 1000, "imagenet")


@pytest.mark.slow
def test_resnet18_trains_an_epoch_on_an_image_folder(tree, tmp_path):
    summary = run(_config(tree, "model=resnet18", "train.epochs=1", "train.batch_size=4"), tmp_path / "run")
    assert summary["status"] == "completed" and summary["epochs_completed"] == 1
    assert summary["data"] == "imagefolder" and summary["identity"]["data"]["root"] == str(tree)
    assert 0 <= summary["final"]["test_acc"] <= 1 and (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
def test_a_run_that_meets_an_unreadable_image_leaves_nothing_behind(tree, tmp_path):
    (tree / "val" / "dog" / "dog0.png").write_bytes(b"not a png")  # read only when the first epoch is evaluated
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli("data=imagefolder", f"data.root={tree}", f"data.image_size={SIZE}", "data.workers=0",
                     "progress=false", "fused=false", "model=resnet18", "train.epochs=1", "train.batch_size=4", cwd=work)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"qtrain: error: unreadable image {tree / 'val' / 'dog' / 'dog0.png'}: cannot identify")
    assert list(work.iterdir()) == []  # the run directory, its .hydra/ included, is gone
