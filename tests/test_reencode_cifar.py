"""scripts/reencode_cifar.py: a CIFAR-10 copy through JPEG keeps its layout, labels and colours; bad input is refused."""

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from qtrain.data.vision import load_cifar

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reencode_cifar.py"
spec = importlib.util.spec_from_file_location("reencode_cifar", SCRIPT)
reencode_cifar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reencode_cifar)

# per batch file: a flat colour (red, green, blue planes), a smooth ramp and noise
FLAT = (200, 30, 90)


def _images(rng: np.random.Generator) -> np.ndarray:
    flat = np.broadcast_to(np.array(FLAT, dtype=np.uint8).reshape(3, 1, 1), (3, 32, 32))
    ramp = np.broadcast_to((np.arange(32, dtype=np.uint8) * 8).reshape(1, 1, 32), (3, 32, 32))
    noise = rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)
    return np.stack([flat, ramp, noise]).reshape(3, 3072)


def _write_copy(root: Path) -> Path:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i, name in enumerate(reencode_cifar.BATCHES):
        batch = {b"batch_label": name.encode(), b"labels": [i % 10, 3, 7], b"data": _images(rng),
                 b"filenames": [f"{name}_{j}.png".encode() for j in range(3)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(c) for c in range(10)]}))
    return folder


def test_the_copy_keeps_layout_labels_and_colours(tmp_path, capsys):
    source = _write_copy(tmp_path / "src")
    reencode_cifar.main([str(tmp_path / "src"), str(tmp_path / "q50"), "--quality", "50"])
    reencode_cifar.main([str(tmp_path / "src"), str(tmp_path / "q95"), "--quality", "95"])
    printed = capsys.readouterr().out.splitlines()
    psnr50, psnr95 = (float(line.split("PSNR against")[1].split(":")[1].split()[0]) for line in printed)
    assert 10 < psnr50 < psnr95 < 60  # the finer quality keeps more (of a third of the pixels uniform noise)
    original, coarse = load_cifar(tmp_path / "src", 10), load_cifar(tmp_path / "q50", 10)
    assert torch.equal(original.train.labels, coarse.train.labels) and torch.equal(original.test.labels, coarse.test.labels)
    # the flat colour comes back flat and in its planes' order (a transposed layout would mix the planes)
    flat = coarse.train.images[0].to(torch.int16)
    assert (flat - torch.tensor(FLAT, dtype=torch.int16).view(3, 1, 1)).abs().max() <= 3
    assert not torch.equal(original.train.images, coarse.train.images)  # the noise image is not JPEG's to keep
    written = pickle.loads((tmp_path / "q50" / "cifar-10-batches-py" / "data_batch_2").read_bytes())
    kept = pickle.loads((source / "data_batch_2").read_bytes())
    assert written.keys() == kept.keys() and written[b"filenames"] == kept[b"filenames"]
    assert (tmp_path / "q50" / "cifar-10-batches-py" / "batches.meta").read_bytes() == (source / "batches.meta").read_bytes()


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys):
    _write_copy(tmp_path / "src")
    for argv, message in (([str(tmp_path / "src"), str(tmp_path / "out"), "--quality", "0"], "--quality 0 is not allowed"),
                          ([str(tmp_path / "none"), str(tmp_path / "out"), "--quality", "50"], "lacks data_batch_1"),
                          ([str(tmp_path / "src"), str(tmp_path / "src"), "--quality", "50"], "exists")):
        with pytest.raises(SystemExit) as stop:
            reencode_cifar.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_psnr_by_hand():
    a = np.zeros((2, 3072), dtype=np.uint8)
    assert reencode_cifar.psnr(a, a) == float("inf")
    # every value one level apart: MSE 1, so 10 log10(255^2) = 48.13 dB; half of them 4 apart: MSE 8, 39.10 dB
    assert reencode_cifar.psnr(a, a + 1) == pytest.approx(48.1308, abs=1e-4)
    b = a.copy()
    b[0] = 4
    assert reencode_cifar.psnr(a, b) == pytest.approx(39.0999, abs=1e-4)
