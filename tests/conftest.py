"""Shared fixtures: composing qtrain configs in-process and running qtrain in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from qtrain.quant.rounding import set_fused
from qtrain.resources import conf_dir

# Real datasets for the tests marked realdata: a folder holding cifar-10-batches-py and MNIST in the layouts
# torchvision downloads (unset: those tests are skipped; nothing is downloaded).
REAL_DATA = Path(os.environ["QTRAIN_DATA"]) if os.environ.get("QTRAIN_DATA") else None
# A run small enough for a test: 256 synthetic 8x8 images, two epochs, eager quantizers.
TINY = ["data=synthetic", "train.epochs=2", "train.batch_size=64", "progress=false", "fused=false"]


# A run of the Transformer's tiny preset on a sample of the embedded text corpus (data=text).
TINY_TEXT = ["model=transformer", "model.preset=tiny", "data=text", "data.sample={train: 3000, test: 600}",
             "train.epochs=2", "train.batch_size=8", "train.eval_batch_size=4", "progress=false", "fused=false"]


# The devices a `device` test runs on: the CPU always, CUDA when there is one (marked `cuda`: `pytest -m cuda` runs
# only those, as `make gpu-check` does; skipped without a CUDA device).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="no CUDA device")])]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True, scope="session")
def text_cache(tmp_path_factory):
    """The embedded text corpus is built into a folder of the test session's (the user's cache stays untouched)."""
    os.environ["QTRAIN_CACHE"] = str(tmp_path_factory.mktemp("qtrain-cache"))


@pytest.fixture(autouse=True)
def eager_quantizers():
    """Tests run the eager kernel unless they ask for the fused one (no compile; the same bits, test_run checks)."""
    set_fused(False)
    yield
    set_fused(False)


@pytest.fixture(autouse=True)
def checkpoints_load_safely(tmp_path):
    """Every checkpoint a test writes under its tmp_path, in-process or by the CLI, loads with weights_only=True."""
    yield
    for path in tmp_path.rglob("checkpoint.pt"):
        torch.load(path, map_location="cpu", weights_only=True)


def make_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def prepared(method: str, *overrides: str, model: str = "resnet20", size: int = 8):
    """The method ``method`` (with ``overrides``) and the model it prepared, for ``size`` x ``size`` RGB inputs."""
    from qtrain.methods import build_method
    from qtrain.models import build_model

    built = build_method(make_config(f"method={method}", *overrides).method)
    return built, built.prepare(build_model(model, in_channels=3, num_classes=10, input_size=(size, size)))


def once(*args: str) -> list[str]:
    """A command line with each key once: a later ``key=value`` replaces an earlier one in its place (``*TINY,
    "train.epochs=1"``: qtrain refuses a key given twice)."""
    where: dict[str, int] = {}
    line: list[str] = []
    for arg in args:
        key, equals, _ = arg.partition("=")
        if not equals or arg.startswith("-"):
            line.append(arg)
        elif key in where:
            line[where[key]] = arg
        else:
            where[key] = len(line)
            line.append(arg)
    return line


def run_cli(*args: str, cwd: Path, timeout: int = 300, raw: bool = False) -> subprocess.CompletedProcess:
    """Run the installed ``qtrain`` entry point as a user would, on ``once(*args)`` (``raw``: ``args`` as given)."""
    exe = Path(sys.executable).with_name("qtrain")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    line = args if raw else once(*args)
    return subprocess.run([str(exe), *line], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
