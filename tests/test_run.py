"""Runs end to end in-process: results files, reproducibility, resume after a kill, divergence, bad config,
run identity, the run directory's lock and checkpoints that load as plain tensors."""

import errno
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import qtrain.results
from qtrain.config import digest, first_difference, identity
from qtrain.errors import ConfigError, DivergedError, RunDirError
from qtrain.results import CHECKPOINT_KEYS
from qtrain.run import run
from qtrain.train import Trainer

from .conftest import TINY, TINY_TEXT, make_config, run_cli

TIMING = ["epoch_seconds", "wall_seconds"]


def _metrics(run_dir):
    return pd.read_csv(run_dir / "metrics.csv").drop(columns=TIMING)


@pytest.mark.slow
def test_sbm_run_writes_every_result_file(tmp_path):
    umask = os.umask(0o027)
    try:
        summary = run(make_config(*TINY), tmp_path)
    finally:
        os.umask(umask)
    for name in ("metrics.csv", "precision.csv", "cost.csv", "summary.json", "checkpoint.pt",
                 ".hydra/config.yaml", ".hydra/overrides.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640, name  # the umask's mode, not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hydra", "checkpoint.pt", "cost.csv", "metrics.csv", "precision.csv", "summary.json"]  # no lock, no temp file
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


@pytest.mark.slow
def test_float32_costs_100_percent_and_learns(tmp_path):
    summary = run(make_config(*TINY, "method=float32", "train.epochs=3"), tmp_path)
    assert summary["cost"]["percent_of_float32"] == pytest.approx(100.0)
    assert summary["final"]["test_acc"] > 0.9  # four well-separated synthetic classes


@pytest.mark.slow
def test_same_config_and_seed_give_the_same_metrics(tmp_path):
    run(make_config(*TINY), tmp_path / "a")
    run(make_config(*TINY), tmp_path / "b")
    pd.testing.assert_frame_equal(_metrics(tmp_path / "a"), _metrics(tmp_path / "b"))
    run(make_config(*TINY, "seed=1"), tmp_path / "c")
    assert not _metrics(tmp_path / "a").equals(_metrics(tmp_path / "c"))


@pytest.mark.slow
def test_evaluating_every_other_epoch_trains_the_same_and_reports_the_evaluated_epochs(tmp_path):
    every = run(make_config(*TINY, "train.epochs=3"), tmp_path / "every")
    sparse = run(make_config(*TINY, "train.epochs=3", "train.eval_every=2"), tmp_path / "sparse")
    a, b = _metrics(tmp_path / "every"), _metrics(tmp_path / "sparse")
    test = [column for column in a if column.startswith("test_")]
    pd.testing.assert_frame_equal(a.drop(columns=test), b.drop(columns=test))
    assert b.loc[0, test].isna().all()  # epoch 1; epoch 2 is the 2nd, epoch 3 the last
    pd.testing.assert_frame_equal(a.loc[1:, test], b.loc[1:, test])
    assert sparse["best_test_acc"] == a.test_acc[1:].max() and sparse["final"] == every["final"]
    assert digest(identity(make_config(*TINY, "train.eval_every=1"))) == digest(identity(make_config(*TINY)))
    assert first_difference(identity(make_config(*TINY)), identity(make_config(*TINY, "train.eval_every=2"))) == \
        "train.eval_every (absent) → 2"


@pytest.mark.parametrize("method", [
    ["method=sbm"],
    # a stage switch after epoch 1 and gates whose state lives in the model
    ["method=fractrain", "method.switch=manual", "method.manual_epochs=[1,2,3]"],
    # the gates' own rate, a third of the network's from step 5 (epoch 2's second), through the schedule's drops
    ["method=dfq", "method.gate_lr={from_step: 5, divide_by: 3}"],
    # lookback windows of 3 steps in epochs of 4: the kill falls in the middle of a window
    ["method=adapt", "method.lookback={low: 3, high: 3, momentum: 0.33}"],
    # a diversity window of 2 epochs, open when the kill comes
    ["method=muppet", "method.resolution=2"],
    # bit-width maps and lambda carried over, and the lr warm-up killed halfway
    ["method=dynasty", "method.target_bits=2", "sched.warmup_epochs=2"],
    # epochs of 3 batches over passes of 4: the kill falls where an epoch starts inside a pass
    ["method=sbm", "train.batches_per_epoch=3"],
    # FP8's delayed scaling: every operand's amax history carried over
    ["method=fp8", "method.amax_history_len=3", "method.first_layer=quantized"],
    # NVFP4 with stochastic gradients, 2-D weight blocks and the Hadamard transform
    ["method=mx", "method.weight=nvfp4", "method.act=nvfp4", "method.grad=nvfp4", "method.grad_rounding=stochastic",
     "method.weight_blocks=2d", "method.hadamard_wgrad=true"],
    # a language model: token batches, quantized attention, perplexity, a stage switch after epoch 1
    [*TINY_TEXT, "method=pfq", "method.switch=manual", "method.manual_epochs=[1,2,3]"],
    # CPT's cycles of 6 of the 12 steps: the kill falls two thirds into the first cycle
    ["method=cpt", "method.cycles=2"],
])
@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path, monkeypatch, method, device):
    overrides = [*TINY, *method, "train.epochs=3", "sched=multistep", "sched.milestones=[1,2]", f"device={device}"]
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
    # what a kill -9 in the middle of writes leaves: temporary files, and the lock file of a dead process
    for stale in (".metrics.csv.k1ll3d.tmp", ".checkpoint.pt.k1ll3d.tmp", ".hydra/.config.yaml.k1ll3d.tmp", ".qtrain.lock"):
        (tmp_path / "resumed" / stale).write_text("half")
    monkeypatch.setattr(Trainer, "train_epoch", original)
    run(make_config(*overrides), tmp_path / "resumed")
    assert not [p for p in (tmp_path / "resumed").rglob(".*") if p.name != ".hydra"]
    pd.testing.assert_frame_equal(_metrics(tmp_path / "whole"), _metrics(tmp_path / "resumed"))
    for name in ("precision.csv", "cost.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "whole" / name), pd.read_csv(tmp_path / "resumed" / name))
    whole, resumed = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "resumed"))
    for report in (whole, resumed):
        report.get("adapt", {}).pop("switch_seconds", None)  # wall time
    assert whole.get(whole["method"]) == resumed.get(resumed["method"])


def _not_json(constant):
    raise ValueError(f"{constant} is not JSON (a strict parser refuses it)")


@pytest.mark.slow
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
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=_not_json)
    assert summary["status"] == "diverged" and summary["diverged"]["epoch"] == 2 and summary["diverged"]["step"] == 4
    assert summary["diverged"]["loss"] == "nan"  # a string: NaN is not JSON
    assert len(pd.read_csv(tmp_path / "metrics.csv")) == 1
    # rerunning reports the divergence again instead of passing for a finished run; force=true starts over
    monkeypatch.setattr(Trainer, "train_epoch", original)
    with pytest.raises(DivergedError, match=r"holds a run that diverged \(the loss became nan at epoch 2, step 4\)"):
        run(make_config(*TINY), tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert run(make_config(*TINY, "force=true"), tmp_path)["status"] == "completed"


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_finished_run_is_reused_only_for_the_same_identity(tmp_path):
    first = run(make_config(*TINY), tmp_path)
    assert first["run_id"] == digest(identity(make_config(*TINY)))
    # force and progress cannot change results: the same run
    assert run(make_config(*TINY, "progress=true"), tmp_path) == first
    before = _snapshot(tmp_path)
    for override, difference in [
        ("seed=1", "seed 0 → 1"),
        ("method=float32", "method.name 'sbm' → 'float32'"),
        ("train.epochs=3", "train.epochs 2 → 3"),
        ("fused=true", "fused False → True"),  # other kernels: another run, though the bits agree
        ("data.n_train=128", "data.n_train 256 → 128"),
    ]:
        with pytest.raises(RunDirError) as err:
            run(make_config(*TINY, override), tmp_path)
        assert str(err.value) == (f"{tmp_path} holds another run ({difference}): pass force=true to replace it, "
                                  "or choose another directory with hydra.run.dir=DIR")
        assert _snapshot(tmp_path) == before  # the directory is left as it was
    # a partial run (checkpoint, no summary) is guarded the same way
    (tmp_path / "summary.json").unlink()
    with pytest.raises(RunDirError, match=r"holds another run \(optim.lr 0.1 → 0.05\)"):
        run(make_config(*TINY, "optim.lr=0.05"), tmp_path)
    forced = run(make_config(*TINY, "optim.lr=0.05", "force=true"), tmp_path)
    assert forced["config"]["optim"]["lr"] == 0.05


@pytest.mark.slow
def test_identity_leaves_out_only_force_and_progress(tmp_path):
    base = identity(make_config(*TINY))
    assert "force" not in base and "progress" not in base
    assert identity(make_config(*TINY, "force=true", "progress=true")) == base
    variants = ["device=cpu", "fused=true", "seed=1", "data.seed=1", f"train.init_from={tmp_path}", "optim.lr=0.05"]
    assert len({digest(base), *(digest(identity(make_config(*TINY, v))) for v in variants)}) == len(variants) + 1
    # two data roots are two runs, and a relative root is the absolute folder it names
    a = identity(make_config("data=cifar10", "data.root=/data/a"))
    assert a["data"]["root"] == "/data/a" and digest(a) != digest(identity(make_config("data=cifar10", "data.root=/data/b")))
    assert identity(make_config("data=cifar10", "data.root=rel"))["data"]["root"] == os.path.abspath("rel")


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from qtrain.results import RunLock
lock = RunLock(Path(sys.argv[1]))
lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_second_process_cannot_train_into_a_locked_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError) as err:
            run(make_config(*TINY), tmp_path)
        assert f"{tmp_path} is in use by another qtrain run (pid {holder.pid} on " in str(err.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".qtrain.lock"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released the killed holder's lock: the run goes ahead, and removes the lock file when done
    assert run(make_config(*TINY, "train.epochs=1"), tmp_path)["status"] == "completed"
    assert not (tmp_path / ".qtrain.lock").exists()


@pytest.mark.parametrize("method", ["float32", "sbm", "pfq", "dfq", "fractrain", "muppet", "adapt", "dynasty"])
@pytest.mark.slow
def test_checkpoints_hold_plain_tensors_and_values_only(tmp_path, method):
    run(make_config(*TINY, f"method={method}", "train.epochs=1"), tmp_path)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)  # no pickled objects: nothing can run on load
    assert state["identity"]["method"]["name"] == method and state["device_type"] == "cpu"
    assert tuple(state) == CHECKPOINT_KEYS  # the format's keys, in the order they were always written
    assert set(state["rng"]) >= {"torch", "python", "numpy"}


@pytest.mark.parametrize("override,message", [
    ("method.weight_bits=0", "method.weight_bits=0 is not allowed"),
    ("method.grad_bits=33", "method.grad_bits=33 is not allowed"),
    ("train.epochs=-1", "train.epochs=-1 is not allowed"),
    ("method.name=nope", "unknown method 'nope'"),
    ("model.name=vgg", "unknown model 'vgg'"),
    ("method.act_range=median", "method.act_range='median' is not allowed"),
    ("optim.lr=0", "optim.lr=0 is not allowed"),
    ("optim.lr=nan", "optim.lr=nan is not allowed: it must be a finite number > 0"),
    ("optim.weight_decay=inf", "optim.weight_decay=inf is not allowed: it must be a finite number >= 0"),
    ("train.epochs=0", "train.epochs=0 is not allowed: it must be an integer >= 1"),
    ("data.n_train=0", "data.n_train=0 is not allowed: it must be an integer >= 1"),
    ("sched.min_lr=-1", "sched.min_lr=-1 is not allowed: it must be a finite number >= 0"),
])
@pytest.mark.slow
def test_bad_values_are_one_line_config_errors(tmp_path, monkeypatch, override, message):
    def no_data(cfg):
        raise AssertionError("data loaded before the config was checked")

    monkeypatch.setattr("qtrain.run.load_data", no_data)
    with pytest.raises(ConfigError) as err:
        run(make_config(*TINY, override), tmp_path / "run")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_too_small_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"input 3x8x8 is too small for model alexnet: it needs at least 29x29"):
        run(make_config(*TINY, "model=alexnet"), tmp_path)


@pytest.mark.slow
def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    # AlexNet has no batch norm, so two accumulated half-batches give the gradient of the whole batch
    common = ["data=synthetic", "data.size=32", "data.n_train=128", "model=alexnet", "method=float32",
              "train.epochs=2", "progress=false", "fused=false", "optim.lr=0.01"]
    whole = run(make_config(*common, "train.batch_size=64"), tmp_path / "whole")
    accumulated = run(make_config(*common, "train.batch_size=32", "train.accum_steps=2"), tmp_path / "accumulated")
    assert whole["steps"] == accumulated["steps"] == 4
    for key in ("train_loss", "test_loss"):
        assert accumulated["final"][key] == pytest.approx(whole["final"][key], rel=1e-4)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_init_from_needs_a_finished_run_with_a_safe_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "summary.json").write_text(json.dumps({"status": "completed"}))
    with pytest.raises(ConfigError, match="its run has no checkpoint"):  # e.g. a run of zero epochs
        run(make_config(*TINY, f"train.init_from={foreign}"), tmp_path / "x")
    torch.save({"model": _RunsCode()}, foreign / "checkpoint.pt")
    with pytest.raises(ConfigError, match="cannot be read as a qtrain checkpoint of plain tensors"):
        run(make_config(*TINY, f"train.init_from={foreign}"), tmp_path / "x")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "x").exists()
    (foreign / "checkpoint.pt").unlink()  # not a qtrain checkpoint: keep the suite's check of all checkpoints green


@pytest.mark.slow
def test_a_run_can_start_from_a_finished_float32_run(tmp_path):
    run(make_config(*TINY, "method=float32"), tmp_path / "pre")
    with pytest.raises(ConfigError, match="holds no finished run"):
        run(make_config(*TINY, f"train.init_from={tmp_path / 'none'}"), tmp_path / "x")
    with pytest.raises(ConfigError, match="weights do not fit this model"):
        run(make_config(*TINY, "model=resnet38", f"train.init_from={tmp_path / 'pre'}"), tmp_path / "y")
    start = run(make_config(*TINY, "train.epochs=1", f"train.init_from={tmp_path / 'pre'}"), tmp_path / "z")
    scratch = run(make_config(*TINY, "train.epochs=1"), tmp_path / "s")
    assert start["final"]["train_loss"] < scratch["final"]["train_loss"]


def test_every_json_file_parses_strictly(tmp_path):
    from qtrain.results import strict_json

    strict = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": {"d": math.nan}, "e": (1, math.nan)}
    assert json.loads(strict_json(strict), parse_constant=_not_json) == {"a": None, "b": [None, None, 1.5],
                                                                         "c": {"d": None}, "e": [1, None]}
    for path in Path(__file__).resolve().parents[1].joinpath("results").rglob("*.json"):  # committed results too
        json.loads(path.read_text(), parse_constant=_not_json)


@pytest.mark.slow
def test_the_python_release_is_part_of_a_text_run_identity(monkeypatch):
    import platform

    ident = identity(make_config(*TINY_TEXT))
    assert ident["data"]["python"] == platform.python_version()  # its corpus is this release's pydoc topics
    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    assert first_difference(ident, identity(make_config(*TINY_TEXT))) == f"data.python {ident['data']['python']!r} → '3.99.0'"
    assert "python" not in identity(make_config(*TINY))["data"]  # an image run's identity is as it was


@pytest.mark.slow
def test_summary_and_log_name_the_data_sizes(tmp_path, caplog):
    from qtrain.data import load_data

    caplog.set_level("INFO", logger="qtrain")
    cfg = make_config(*TINY_TEXT, "train.epochs=1")
    sizes = run(cfg, tmp_path / "text")["data_sizes"]
    vocab = len(load_data(cfg.data).vocab)
    assert sizes == {"train_tokens": 3000, "test_tokens": 600, "vocab_size": vocab}  # data.sample's counts
    assert f"data text: train_tokens 3000, test_tokens 600, vocab_size {vocab}" in caplog.text
    run(make_config(*TINY, "train.epochs=1"), tmp_path / "image")
    image = json.loads((tmp_path / "image" / "summary.json").read_text())["data_sizes"]
    assert image == {"train_samples": 256, "test_samples": 64, "in_channels": 3, "num_classes": 4,
                     "input_size": [8, 8]}


@pytest.mark.parametrize("refused", ["checkpoint.pt", "metrics.csv"])
@pytest.mark.slow
def test_a_full_disk_loses_no_epoch_and_says_so_in_one_line(tmp_path, monkeypatch, refused):
    overrides = [*TINY, "train.epochs=3"]
    run(make_config(*overrides), tmp_path / "whole")
    original, writes = qtrain.results.atomic_write, []

    def full_at_epoch_2(path, write):
        writes.append(path.name)
        if path.name == refused and writes.count(refused) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(path, write)

    monkeypatch.setattr(qtrain.results, "atomic_write", full_at_epoch_2)
    run_dir = tmp_path / "resumed"
    with pytest.raises(RunDirError) as caught:
        run(make_config(*overrides), run_dir)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot write {run_dir / refused}: No space left on device")
    # the files agree: no row describes an epoch the checkpoint lacks
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)["progress"]["epoch"]
    assert saved == (2 if refused == "metrics.csv" else 1)
    assert len(pd.read_csv(run_dir / "metrics.csv")) == 1
    monkeypatch.setattr(qtrain.results, "atomic_write", original)
    run(make_config(*overrides), run_dir)
    pd.testing.assert_frame_equal(_metrics(tmp_path / "whole"), _metrics(run_dir))
    for name in ("precision.csv", "cost.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "whole" / name), pd.read_csv(run_dir / name))


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_the_run_resumes(tmp_path):
    exe = Path(sys.executable).with_name("qtrain")
    tiny = [a for a in TINY if not a.startswith("train.epochs=")]
    command = [str(exe), *tiny, "train.epochs=8", "hydra.run.dir=run"]
    # SIGINT at its default even where the suite runs in the background (a shell starts those ignoring it)
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.csv").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == ("qtrain: interrupted: each run keeps its last complete epoch (rerun the "
                                               "same command to resume)")
    assert "Traceback" not in stderr
    assert len(pd.read_csv(tmp_path / "run" / "metrics.csv")) < 8
    resumed = run_cli(*command[1:], cwd=tmp_path, raw=True)
    assert resumed.returncode == 0, resumed.stderr
    assert len(pd.read_csv(tmp_path / "run" / "metrics.csv")) == 8


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_checkpoint_on_a_full_disk_is_the_no_space_error():
    # /dev/full refuses every write with ENOSPC; torch's own writer would report it as "unexpected pos"
    with pytest.raises(OSError) as caught:
        qtrain.results.save_state({"weights": torch.randn(300_000)}, Path("/dev/full"))
    assert caught.value.errno == errno.ENOSPC


def test_a_run_starts_from_a_state_of_its_own_methods_model():
    """``train.init_from`` (or ``run(initial=...)``) with a DFQ run's state: its gates and quantizers' ranges load
    after the method has prepared the model, where a float32 run's weights load before."""
    from qtrain.data import load_data
    from qtrain.methods import build_method
    from qtrain.models import build_model
    from qtrain.run import Preflight, _model

    cfg = make_config(*TINY, "method=dfq", "train.init_from=/elsewhere")
    inputs = load_data(cfg.data).model_inputs()
    torch.manual_seed(1)
    donor = build_method(cfg.method).prepare(build_model(cfg.model.name, cfg.model, **inputs)).state_dict()
    torch.manual_seed(2)
    fresh = build_method(cfg.method).prepare(build_model(cfg.model.name, cfg.model, **inputs)).state_dict()
    gate = next(k for k in donor if k.startswith("gate_controller."))
    assert not torch.equal(donor[gate], fresh[gate])  # the seeds draw different gates
    model = _model(cfg, Preflight(torch.device("cpu"), build_method(cfg.method), donor), inputs)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in donor.items())
    misfit = {k: v for k, v in donor.items() if k != gate}
    with pytest.raises(ConfigError, match="train.init_from=/elsewhere is not allowed: its weights do not fit this "
                                          r"model \(resnet20, .* or a dfq run of it\)"):
        _model(cfg, Preflight(torch.device("cpu"), build_method(cfg.method), misfit), inputs)
