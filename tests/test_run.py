"""Runs end to end in-process: results files, reproducibility, resume after a kill, divergence, bad config."""

import json

import pandas as pd
import pytest
import torch

from qtrain.errors import ConfigError, DivergedError
from qtrain.run import run
from qtrain.train import Trainer

from .conftest import TINY, make_config

TIMING = ["epoch_seconds", "wall_seconds"]


def _metrics(run_dir):
    return pd.read_csv(run_dir / "metrics.csv").drop(columns=TIMING)


def test_sbm_run_writes_every_result_file(tmp_path):
    summary = run(make_config(*TINY), tmp_path)
    for name in ("metrics.csv", "precision.csv", "cost.csv", "summary.json", "checkpoint.pt"):
        assert (tmp_path / name).is_file()
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    assert summary["cost"]["percent_of_float32"] == pytest.approx(6.25)
    assert summary["cost"]["bit_macs"] == pytest.approx(1024 * summary["cost"]["effective_macs"])
    assert summary["config"]["method"]["name"] == "sbm" and torch.__version__.startswith(summary["versions"]["torch"])
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["epoch"].tolist() == [1, 2] and metrics["effective_macs"].is_monotonic_increasing
    precision = pd.read_csv(tmp_path / "precision.csv")
    assert set(precision["weight_bits"]) == {8} and set(precision["format"]) == {"range-linear"}
    assert precision["density"].between(0, 1).all()
    cost = pd.read_csv(tmp_path / "cost.csv")
    assert cost["effective_macs"].sum() == pytest.approx(summary["cost"]["effective_macs"])
    # 2 epochs x 256 samples, 3 GEMMs, each at 8x8/32x32 of the float32 cost
    assert cost["effective_macs"].sum() == pytest.approx(2 * 256 * 3 * cost["macs_per_sample"].sum() / 16)


def test_float32_costs_100_percent_and_learns(tmp_path):
    summary = run(make_config(*TINY, "method=float32", "train.epochs=3"), tmp_path)
    assert summary["cost"]["percent_of_float32"] == pytest.approx(100.0)
    assert summary["final"]["test_acc"] > 0.9  # four well-separated synthetic classes


def test_same_config_and_seed_give_the_same_metrics(tmp_path):
    run(make_config(*TINY), tmp_path / "a")
    run(make_config(*TINY), tmp_path / "b")
    pd.testing.assert_frame_equal(_metrics(tmp_path / "a"), _metrics(tmp_path / "b"))
    run(make_config(*TINY, "seed=1"), tmp_path / "c")
    assert not _metrics(tmp_path / "a").equals(_metrics(tmp_path / "c"))


@pytest.mark.parametrize("method", [
    ["method=sbm"],
    # a stage switch after epoch 1 and gates whose state lives in the model
    ["method=fractrain", "method.switch=manual", "method.manual_epochs=[1,2,3]"],
])
def test_killed_run_resumes_to_the_same_metrics(tmp_path, monkeypatch, method):
    overrides = [*TINY, *method, "train.epochs=3", "sched=multistep", "sched.milestones=[1,2]"]
    run(make_config(*overrides), tmp_path / "whole")

    original = Trainer.train_epoch

    def killed_in_epoch_2(self, epoch):
        if epoch == 1:
            raise KeyboardInterrupt
        return original(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", killed_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run(make_config(*overrides), tmp_path / "resumed")
    assert len(pd.read_csv(tmp_path / "resumed" / "metrics.csv")) == 1
    assert not (tmp_path / "resumed" / "summary.json").exists()
    monkeypatch.setattr(Trainer, "train_epoch", original)
    run(make_config(*overrides), tmp_path / "resumed")
    pd.testing.assert_frame_equal(_metrics(tmp_path / "whole"), _metrics(tmp_path / "resumed"))
    for name in ("precision.csv", "cost.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "whole" / name), pd.read_csv(tmp_path / "resumed" / name))


def test_nan_loss_stops_with_a_clear_error_and_keeps_earlier_results(tmp_path, monkeypatch):
    original = Trainer.train_epoch

    def poisoned(self, epoch):
        if epoch == 1:
            forward = self.model.forward
            self.model.forward = lambda x: forward(x) * float("nan")
        return original(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", poisoned)
    with pytest.raises(DivergedError, match=r"loss became nan at epoch 2, step 4"):
        run(make_config(*TINY), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged"]["epoch"] == 2 and summary["diverged"]["step"] == 4
    assert len(pd.read_csv(tmp_path / "metrics.csv")) == 1


def test_finished_run_is_reported_not_rerun_unless_forced(tmp_path):
    first = run(make_config(*TINY), tmp_path)
    assert run(make_config(*TINY), tmp_path) == first
    with pytest.raises(ConfigError, match="another config"):
        (tmp_path / "summary.json").unlink()
        run(make_config(*TINY, "optim.lr=0.05"), tmp_path)
    forced = run(make_config(*TINY, "optim.lr=0.05", "force=true"), tmp_path)
    assert forced["config"]["optim"]["lr"] == 0.05


@pytest.mark.parametrize("override,message", [
    ("method.weight_bits=0", "method.weight_bits=0 is not allowed"),
    ("method.grad_bits=33", "method.grad_bits=33 is not allowed"),
    ("train.epochs=-1", "train.epochs=-1 is not allowed"),
    ("method.name=nope", "unknown method 'nope'"),
    ("model.name=vgg", "unknown model 'vgg'"),
    ("method.act_range=median", "method.act_range='median' is not allowed"),
    ("optim.lr=0", "optim.lr=0 is not allowed"),
])
def test_bad_values_are_one_line_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        run(make_config(*TINY, override), tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "metrics.csv").exists()


def test_too_small_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"input 3x8x8 is too small for model alexnet: it needs at least 29x29"):
        run(make_config(*TINY, "model=alexnet"), tmp_path)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    # AlexNet has no batch norm, so two accumulated half-batches give the gradient of the whole batch
    common = ["data=synthetic", "data.size=32", "data.n_train=128", "model=alexnet", "method=float32",
              "train.epochs=2", "progress=false", "fused=false", "optim.lr=0.01"]
    whole = run(make_config(*common, "train.batch_size=64"), tmp_path / "whole")
    accumulated = run(make_config(*common, "train.batch_size=32", "train.accum_steps=2"), tmp_path / "accumulated")
    assert whole["steps"] == accumulated["steps"] == 4
    for key in ("train_loss", "test_loss"):
        assert accumulated["final"][key] == pytest.approx(whole["final"][key], rel=1e-4)


def test_a_run_can_start_from_a_finished_float32_run(tmp_path):
    run(make_config(*TINY, "method=float32"), tmp_path / "pre")
    with pytest.raises(ConfigError, match="holds no finished run"):
        run(make_config(*TINY, f"train.init_from={tmp_path / 'none'}"), tmp_path / "x")
    with pytest.raises(ConfigError, match="weights do not fit this model"):
        run(make_config(*TINY, "model=resnet38", f"train.init_from={tmp_path / 'pre'}"), tmp_path / "y")
    start = run(make_config(*TINY, "train.epochs=1", f"train.init_from={tmp_path / 'pre'}"), tmp_path / "z")
    scratch = run(make_config(*TINY, "train.epochs=1"), tmp_path / "s")
    assert start["final"]["train_loss"] < scratch["final"]["train_loss"]
