"""Dataset loaders on tiny files written in the real layouts, and the batch stream's augmentation."""

import collections
import dataclasses
import logging
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.nn import functional as F
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import check_integrity

from qtrain.config import schema, validate
from qtrain.data import BatchStream, load_data
from qtrain.data.base import Periods
from qtrain.data.registry import REGISTRY, Kind
from qtrain.data.vision import load_cifar, load_digits_data, load_mnist, make_synthetic_data
from qtrain.errors import ConfigError, DataError
from qtrain.resources import conf_dir

from .conftest import REAL_DATA, TINY, make_config, run_cli


def _write_cifar(root, num_classes=10, per_file=6):
    rng = np.random.default_rng(0)
    if num_classes == 10:
        folder, files, key = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels"
    else:
        folder, files, key = root / "cifar-100-python", ["train", "test"], b"fine_labels"
    folder.mkdir(parents=True)
    for name in files:
        data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, key: rng.integers(0, num_classes, per_file).tolist()}, f)
    return folder


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_pickle_layout_loads_with_checksum_warning(tmp_path, caplog, num_classes):
    folder = _write_cifar(tmp_path, num_classes)
    with caplog.at_level(logging.WARNING):
        data = load_cifar(tmp_path, num_classes)
    assert data.train.images.shape == ((30 if num_classes == 10 else 6), 3, 32, 32)
    assert data.train.images.dtype == torch.uint8 and data.num_classes == num_classes
    first = pickle.load(open(folder / ("data_batch_1" if num_classes == 10 else "train"), "rb"))
    assert torch.equal(data.train.images[0].flatten(), torch.from_numpy(first[b"data"][0]))
    assert "differs from the official release" in caplog.text


def test_cifar_missing_and_corrupt_files_name_the_path(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py/data_batch_1"):
        load_cifar(tmp_path, 10)
    folder = _write_cifar(tmp_path)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match=r"corrupt CIFAR-10 file .*data_batch_3"):
        load_cifar(tmp_path, 10)


class _Exploit:
    """An object whose unpickling runs a shell command (what a tampered data file could hold)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.slow
def test_cifar_batch_that_would_run_code_is_refused_in_one_line(tmp_path, protocol):
    folder = _write_cifar(tmp_path / "data")
    created = tmp_path / "pwned"
    batch = {b"data": np.zeros((6, 3072), np.uint8), b"labels": [0] * 6, b"batch_label": _Exploit(f"touch {created}")}
    (folder / "data_batch_2").write_bytes(pickle.dumps(batch, protocol=protocol))
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli(*TINY, "data=cifar10", f"data.root={tmp_path / 'data'}", cwd=work)
    assert not created.exists()
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "differs from the official release" not in line]
    assert line.startswith(f"qtrain: error: corrupt CIFAR-10 file {folder / 'data_batch_2'}: ")
    assert f"{os.system.__module__}.system" in line and "refused" in line
    assert list(work.iterdir()) == []  # the run directory made for the run is gone


def test_cifar_loader_builds_what_numpy_pickles_and_nothing_else(tmp_path):
    folder = _write_cifar(tmp_path)
    rows = np.arange(6 * 3072, dtype=np.uint8).reshape(6, 3072)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # every protocol names numpy's reconstructors differently
        batch = {b"data": rows, b"labels": [np.int64(3)] * 6, b"batch_label": b"x", b"mean": np.float32(0.5)}
        (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=protocol))
        data = load_cifar(tmp_path, 10)
        assert torch.equal(data.train.images[:6].flatten(1), torch.from_numpy(rows)), protocol
        assert data.train.labels[:6].tolist() == [3] * 6
    for refused in (collections.OrderedDict(a=1), Path("x"), np.random.default_rng(0)):
        (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": rows, b"labels": [0] * 6, b"x": refused}))
        with pytest.raises(DataError, match="refused"):
            load_cifar(tmp_path, 10)


def test_checksum_warning_once_per_file_per_process(tmp_path, caplog):
    _write_cifar(tmp_path)
    with caplog.at_level(logging.WARNING):
        load_cifar(tmp_path, 10)
        first = caplog.text.count("differs from the official release")
        load_cifar(tmp_path, 10)
    assert first == 6 and caplog.text.count("differs from the official release") == 6


def _write_idx(path, array):
    # idx magic: 0x08 (unsigned byte) in the third byte, the number of dimensions in the fourth
    header = struct.pack(">I", 0x800 + array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _write_mnist(root, n=5):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix in ("train", "t10k"):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return raw


def test_mnist_idx_layout_loads_and_bad_files_fail_clearly(tmp_path):
    raw = _write_mnist(tmp_path)
    data = load_mnist(tmp_path)
    assert data.train.images.shape == (5, 1, 28, 28) and data.test.labels.shape == (5,)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match="corrupt MNIST file .*t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)
    (raw / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="not found: .*t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


@pytest.mark.slow
def test_digits_are_the_scikit_learn_set_split_by_class():
    data = load_digits_data()
    assert len(data.train) + len(data.test) == 1797 and data.image_shape == (1, 8, 8)
    assert len(data.train) == REGISTRY["digits"].train_images  # the config checks bound a run's steps by it
    assert set(data.test.labels.tolist()) == set(range(10))
    assert int(data.train.images.max()) == 16


def _stream(data, **kw):
    return BatchStream(data, data.train, 16, seed=3, train=True, **kw)


def test_batch_stream_normalizes_and_is_deterministic_per_epoch():
    data = make_synthetic_data(64, 8, 4, 3, 8, seed=0)
    batches = list(_stream(data).epoch(0))
    x = torch.cat([b[0] for b in batches])
    assert x.shape == (64, 3, 8, 8)
    assert x.mean((0, 2, 3)).abs().max() < 1e-4 and (x.std((0, 2, 3)) - 1).abs().max() < 1e-2
    again = torch.cat([b[0] for b in _stream(data).epoch(0)])
    other = torch.cat([b[0] for b in _stream(data).epoch(1)])
    assert torch.equal(x, again) and not torch.equal(x, other)


def test_random_crop_and_flip_are_shifted_and_mirrored_windows():
    data = make_synthetic_data(32, 8, 4, 3, 8, seed=0)
    stream = _stream(data, crop_padding=2, flip=True)
    plain = BatchStream(data, data.train, 32, seed=3, train=False)
    originals = next(plain.epoch(0))[0]
    # invert the normalization so padding zeros are recognisable, then find each crop in its padded source
    x, y = next(stream.epoch(0))
    gen = torch.Generator().manual_seed(3 * 1_000_003)
    order = torch.randperm(32, generator=gen)[:16]
    flipped_seen = 0
    for crop, idx in zip(x, order):
        source = originals[idx]
        raw = source / stream.inv_std[0] + stream.mean[0]
        padded = (F.pad(raw, (2, 2, 2, 2)) - stream.mean[0]) * stream.inv_std[0]
        matches = []
        for candidate, flipped in ((crop, False), (crop.flip(2), True)):
            for dy in range(5):
                for dx in range(5):
                    if torch.allclose(padded[:, dy:dy + 8, dx:dx + 8], candidate, atol=1e-4):
                        matches.append(flipped)
        assert matches, "every augmented image is a window of its padded source, maybe mirrored"
        flipped_seen += all(matches)
    assert 0 < flipped_seen < 16
    assert torch.equal(y, data.train.labels[order])


def test_data_registry_and_missing_root(tmp_path):
    assert load_data(make_config("data=synthetic").data).name == "synthetic"
    cfg = make_config("data=cifar10", f"data.root={tmp_path}")
    with pytest.raises(DataError, match="not found"):
        load_data(cfg.data)


def test_the_registry_names_every_data_config_and_what_it_reads():
    configs = {path.stem: OmegaConf.load(path) for path in (conf_dir() / "data").glob("*.yaml")}
    assert set(configs) == set(REGISTRY)
    for name, cfg in configs.items():
        entry = REGISTRY[name]
        assert cfg.name == name
        assert entry.needs_root == ("root" in cfg.keys()), name
        assert (entry.kind is Kind.TEXT) == ("level" in cfg) and (entry.kind is Kind.FOLDER) == ("image_size" in cfg)


def test_the_data_schema_of_each_kind_reads_keys_of_its_configs():
    for path in (conf_dir() / "data").glob("*.yaml"):
        keys = set(OmegaConf.load(path).keys())
        assert {item.name for item in dataclasses.fields(schema.DATA[REGISTRY[path.stem].kind])} <= keys, path.stem


def test_the_registry_and_the_config_checks_import_no_torch():
    code = "import sys, qtrain.config, qtrain.data.registry; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr == ""


def test_an_unknown_dataset_is_refused_by_the_config_checks():
    cfg = make_config("data=synthetic")
    cfg.data.name = "svhn"
    with pytest.raises(ConfigError, match=r"^unknown dataset 'svhn' \(choose from: cifar10, cifar100, corpus, digits, "):
        validate(cfg)


@pytest.mark.realdata
@pytest.mark.skipif(REAL_DATA is None, reason="QTRAIN_DATA (a folder of real datasets) is not set")
def test_real_cifar10_copy_loads(caplog):
    with caplog.at_level(logging.WARNING):
        data = load_cifar(REAL_DATA, 10)
    assert data.train.images.shape == (50_000, 3, 32, 32) and len(data.test) == 10_000
    assert torch.bincount(data.train.labels).tolist() == [5000] * 10
    # a copy that is not the official release (e.g. re-encoded images) is loaded with a warning, by torchvision's MD5s
    folder = REAL_DATA / CIFAR10.base_folder
    official = all(check_integrity(str(folder / name), md5) for name, md5 in CIFAR10.train_list + CIFAR10.test_list)
    assert ("differs from the official release" in caplog.text) == (not official)
    mean = data.train.images.double().mean((0, 2, 3)) / 255
    assert torch.allclose(mean, torch.tensor(data.mean, dtype=torch.float64), atol=5e-3)
    mnist = load_mnist(REAL_DATA)
    assert len(mnist.train) == 60_000 and len(mnist.test) == 10_000


@pytest.mark.slow
def test_class_halves_split_both_splits_and_relabel_from_zero():
    full = load_data(make_config("data=digits").data)
    first = load_data(make_config("data=digits", "data.subset={by: classes, part: 0}").data)
    second = load_data(make_config("data=digits", "data.subset={by: classes, part: 1}").data)
    assert first.num_classes == second.num_classes == 5
    assert set(first.train.labels.tolist()) == set(second.test.labels.tolist()) == set(range(5))
    assert len(first.train) + len(second.train) == len(full.train)
    assert len(first.test) + len(second.test) == len(full.test)
    upper = full.train.labels >= 5
    assert torch.equal(second.train.images, full.train.images[upper])
    assert torch.equal(second.train.labels, full.train.labels[upper] - 5)


@pytest.mark.slow
def test_sample_halves_keep_every_class_and_the_whole_test_set():
    full = load_data(make_config("data=digits").data)
    halves = [load_data(make_config("data=digits", f"data.subset={{by: samples, part: {p}}}", f"seed={p}").data)
              for p in (0, 1)]
    assert len(halves[0].train) + len(halves[1].train) == len(full.train)
    for half in halves:
        assert torch.equal(half.test.images, full.test.images) and half.num_classes == 10
        counts = torch.bincount(half.train.labels, minlength=10)
        assert (abs(counts * 2 - torch.bincount(full.train.labels, minlength=10)) <= 1).all()
    rows = {tuple(x.flatten().tolist()) for half in halves for x in half.train.images}
    assert len(rows) == len({tuple(x.flatten().tolist()) for x in full.train.images})  # disjoint, covering


@pytest.mark.slow
def test_fixed_size_sample_is_class_balanced_the_same_for_every_run_and_applies_after_the_halves():
    full = load_data(make_config("data=digits").data)
    sample = load_data(make_config("data=digits", "data.sample={train: 53, test: 20}").data)
    again = load_data(make_config("data=digits", "data.sample={train: 53, test: 20}", "seed=1").data)
    assert (len(sample.train), len(sample.test)) == (53, 20)
    # 53 over 10 classes: 5 each, and the 3 left over go to the first 3 classes; 20 over 10: 2 each
    assert torch.bincount(sample.train.labels, minlength=10).tolist() == [6, 6, 6, 5, 5, 5, 5, 5, 5, 5]
    assert torch.bincount(sample.test.labels, minlength=10).tolist() == [2] * 10
    assert torch.equal(sample.train.images, again.train.images) and torch.equal(sample.test.labels, again.test.labels)
    full_rows = {tuple(x.flatten().tolist()) for x in full.train.images}
    assert all(tuple(x.flatten().tolist()) in full_rows for x in sample.train.images)
    half = load_data(make_config("data=digits", "data.subset={by: classes, part: 1}", "data.sample={train: 10, test: 5}").data)
    assert half.num_classes == 5 and torch.bincount(half.train.labels, minlength=5).tolist() == [2] * 5
    assert len(half.test) == 5


def _rows(images: torch.Tensor) -> list[tuple]:
    return [tuple(x.flatten().tolist()) for x in images]


@pytest.mark.slow
def test_folds_partition_the_training_split():
    full = load_data(make_config("data=digits").data)
    assert len(set(_rows(full.train.images))) == len(full.train)  # the digits images are distinct: rows name them
    everything = set(_rows(full.train.images))
    held_out = []
    for fold in range(10):
        part = load_data(make_config("data=digits", f"data.fold={fold}", f"seed={fold}").data)
        kept = set(_rows(part.train.images))
        assert kept <= everything and len(kept) == len(part.train)
        held_out.append(everything - kept)
        assert torch.equal(part.test.images, full.test.images)  # every fold is tested on the whole test split
        held = torch.tensor([label for row, label in zip(_rows(full.train.images), full.train.labels.tolist())
                             if row in held_out[-1]])
        counts = torch.bincount(held, minlength=10)
        whole = torch.bincount(full.train.labels, minlength=10)
        assert ((counts - whole // 10) >= 0).all() and ((counts - whole // 10) <= 1).all()  # a tenth of each class
        assert len(held) == len(held_out[-1]) and len(part.train) == len(full.train) - len(held)
    assert all(a.isdisjoint(b) for i, a in enumerate(held_out) for b in held_out[i + 1:])
    assert set().union(*held_out) == everything
    again = load_data(make_config("data=digits", "data.fold=3", "seed=7").data)  # the same fold in another run
    assert torch.equal(again.train.images, load_data(make_config("data=digits", "data.fold=3").data).train.images)


@pytest.mark.slow
def test_folds_cut_the_sample_and_their_number_is_a_setting():
    sample = load_data(make_config("data=digits", "data.sample={train: 50, test: 20}").data)
    parts = [load_data(make_config("data=digits", "data.sample={train: 50, test: 20}", "data.folds=5",
                                   f"data.fold={fold}").data) for fold in range(5)]
    assert [len(p.train) for p in parts] == [40] * 5 and all(len(p.test) == 20 for p in parts)
    rows = set(_rows(sample.train.images))
    held = [rows - set(_rows(p.train.images)) for p in parts]
    assert all(len(h) == 10 for h in held) and set().union(*held) == rows


def test_an_epoch_from_a_start_batch_is_the_tail_of_the_whole_epoch():
    stream = _stream(make_synthetic_data(72, 8, 4, 3, 8, seed=0), crop_padding=2, flip=True)  # batches 16 x 4 + 8
    whole = list(stream.epoch(2))
    tail = list(stream.epoch(2, start=3))
    assert len(whole) == 5 and len(tail) == 2
    for (x, y), (x_tail, y_tail) in zip(whole[3:], tail):
        assert torch.equal(x, x_tail) and torch.equal(y, y_tail)


def test_periods_lay_the_passes_end_to_end_and_cut_them_into_epochs():
    stream = _stream(make_synthetic_data(72, 8, 4, 3, 8, seed=0), crop_padding=2, flip=True)  # 5 batches a pass
    passes = [batch for p in range(4) for batch in stream.epoch(p)]
    sizes = [16, 16, 16, 16, 8] * 4
    periods = Periods(stream, 4)
    assert len(periods) == 4 and periods.samples == round(4 * 72 / 5)
    for epoch in (2, 0, 3, 1):  # any epoch alone, in any order: batches 4 * epoch .. 4 * epoch + 3 of the passes
        batches = list(periods.epoch(epoch))
        assert len(batches) == 4
        for i, (x, y) in enumerate(batches):
            expected_x, expected_y = passes[4 * epoch + i]
            assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
            assert periods.global_size(i) == sizes[4 * epoch + i] == len(y)


@pytest.mark.slow
def test_a_sample_of_one_split_leaves_the_other_whole():
    full = load_data(make_config("data=digits").data)
    train_only = load_data(make_config("data=digits", "data.sample={train: 50}").data)
    assert len(train_only.train) == 50 and torch.equal(train_only.test.images, full.test.images)
