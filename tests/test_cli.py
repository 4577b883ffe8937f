"""The ``qtrain`` command as a user runs it: help, one-line errors, the default job, run directories, sweeps."""

import json

import pytest

from .conftest import TINY, make_config, once, run_cli
from .test_data import _write_mnist


@pytest.mark.slow
def test_help_lists_the_config_groups(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    groups = ("method: adapt, cpt, dfq, dynasty, float32, fp8, fractrain, muppet, mx, pfq, sbm",
              "model: alexnet, mobilenetv2, resnet110, resnet164, resnet18, resnet20, resnet34",
              "data: cifar10", "experiment: adapt_alexnet_cifar10, adapt_alexnet_cifar100, adapt_cifar")
    for group in groups:
        assert group in result.stdout
    assert "scale: mini, paper, smoke" in result.stdout and "scale/" not in result.stdout  # the scales' own files
    assert "qtrain-report DIR" in result.stdout


def test_unknown_choice_is_one_line_and_nonzero(tmp_path):
    result = run_cli("method=nope", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("qtrain: error: unknown method 'nope' "
                                     "(choose from: adapt, cpt, dfq, dynasty, float32, fp8, fractrain, muppet, mx, pfq, sbm)")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_bad_bits_are_one_line_and_nonzero(tmp_path):
    result = run_cli(*TINY, "method.act_bits=40", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "qtrain: error: method.act_bits=40 is not allowed: bit-widths are integers from 1 to 32")


@pytest.mark.slow
def test_default_job_on_digits_prints_the_result_table(tmp_path):
    # the no-argument job (SBM, ResNet-20, digits, fused quantizers), shortened to one epoch
    result = run_cli("train.epochs=1", "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "test acc %" in result.stdout and "% of float32" in result.stdout and "6.25" in result.stdout
    assert result.stderr == ""  # nothing the user must act on: no CUDA notice on a CPU-only machine
    [run_dir] = (tmp_path / "outputs" / "sbm-resnet20-digits").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["fused"] is True
    assert run_dir.name == f"train.epochs=1,id={summary['run_id']}"
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- train.epochs=1\n- progress=false\n"


@pytest.mark.slow
def test_rerun_with_another_config_in_the_same_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, "train.epochs=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = run_cli(*TINY, "train.epochs=1", "seed=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr.splitlines() == [f"qtrain: error: {run_dir} holds another run (seed 0 → 1): pass force=true to "
                                          "replace it, or choose another directory with hydra.run.dir=DIR"]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # .hydra/config.yaml included


@pytest.mark.slow
def test_multirun_sweep_skips_finished_jobs(tmp_path):
    args = ["-m", "method=float32,sbm", *TINY, "train.epochs=1"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    summaries = sorted((tmp_path / "multirun").rglob("summary.json"))
    assert len(summaries) == 2
    stamps = [p.stat().st_mtime_ns for p in summaries]
    second = run_cli(*args, cwd=tmp_path)
    assert second.returncode == 0 and "already holds a finished run" in second.stdout + second.stderr
    assert [p.stat().st_mtime_ns for p in summaries] == stamps


@pytest.mark.slow
def test_a_sweep_over_data_roots_keeps_each_dataset_in_its_own_directory(tmp_path):
    for name in ("a", "b"):
        _write_mnist(tmp_path / name, n=8)
    result = run_cli("-m", *TINY, "data=mnist", f"data.root={tmp_path / 'a'},{tmp_path / 'b'}", "train.epochs=1",
                     "method=float32", "train.eval_batch_size=8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    roots = sorted(json.loads(p.read_text())["config"]["data"]["root"] for p in (tmp_path / "multirun").rglob("summary.json"))
    assert roots == [str(tmp_path / "a"), str(tmp_path / "b")]


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    pre = tmp_path / "pre"  # the pre-training that the second job starts from does not exist yet
    args = ["-m", f"train.init_from=null,'{pre}'", *TINY, "train.epochs=1", "method=float32"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 1
    lines = first.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.split()[:2] == ["job", "status"]))
    assert lines[start].split() == ["job", "status", "directory"]
    assert [line.split()[:2] for line in lines[start + 1:start + 3]] == [["0", "completed"], ["1", "failed"]]
    header, *rows = lines[start + 3:]  # then the finished runs' table, as qtrain-report gives it
    assert header.split()[:8] == ["method", "model", "data", "runs", "status", "epochs", "test", "acc"]
    assert [row.split()[:5] for row in rows] == [["float32", "resnet20", "synthetic", "1", "completed"]]
    error = f"train.init_from={pre} is not allowed: it holds no finished run (run the pre-training first)"
    assert first.stderr.splitlines()[-1] == f"qtrain: error: job 1 failed: {error}"
    summaries = {json.loads(p.read_text())["status"]: p for p in (tmp_path / "multirun").rglob("summary.json")}
    assert set(summaries) == {"completed", "failed"}
    failed = json.loads(summaries["failed"].read_text())
    assert failed["error"] == error and failed["config"]["train"]["init_from"] == str(pre)
    stamp = summaries["completed"].stat().st_mtime_ns

    from qtrain.run import run
    run(make_config(*TINY, "train.epochs=1", "method=float32"), pre)
    second = run_cli(*args, cwd=tmp_path)  # redoes the failed job only
    assert second.returncode == 0, second.stderr
    assert summaries["completed"].stat().st_mtime_ns == stamp
    assert json.loads(summaries["failed"].read_text())["status"] == "completed"


def _on_a_terminal(*args: str, cwd) -> str:
    """Run qtrain with stdout and stderr on a pseudo-terminal, as a user at a shell sees it; return what it showed."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios
    from pathlib import Path

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column window
    exe = Path(sys.executable).with_name("qtrain")
    process = subprocess.Popen([str(exe), *once(*args)], cwd=cwd, stdout=follower, stderr=follower, close_fds=True,
                               env=os.environ)
    os.close(follower)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    process.wait(timeout=300)
    os.close(leader)
    return shown.decode(errors="replace")


@pytest.mark.slow
def test_progress_bars_on_a_terminal_and_never_in_a_log_line(tmp_path):
    shown = _on_a_terminal(*[a for a in TINY if a != "progress=false"], "train.epochs=2", cwd=tmp_path)
    assert "%|" in shown and "epoch 2/2:" in shown  # the bars were drawn
    assert "training:" in shown  # the epochs' bar
    lines = [_visible(line) for line in shown.replace("\r\n", "\n").split("\n")]
    log_lines = [line for line in lines if "train loss" in line]
    assert len(log_lines) == 2
    for line in log_lines:  # each log line is a line of its own, with no bar drawn into it
        assert line.startswith("epoch ") and "%|" not in line, repr(line)


def _visible(line: str) -> str:
    """What a terminal shows of ``line``: each carriage return writes over the line from its start."""
    shown: list[str] = []
    for part in line.split("\r"):
        shown[:len(part)] = part
    return "".join(shown).rstrip()


@pytest.mark.slow
def test_no_progress_bars_when_not_on_a_terminal(tmp_path):
    result = run_cli(*[a for a in TINY if a != "progress=false"], "train.epochs=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr + result.stdout and "it/s" not in result.stderr


@pytest.mark.slow
def test_an_identity_finished_under_another_name_is_not_trained_again(tmp_path):
    args = ["-m", "method=float32", *TINY, "train.epochs=1"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    [summary] = (tmp_path / "multirun").rglob("summary.json")
    stamp = summary.stat().st_mtime_ns
    again = run_cli(*args, "seed=0", cwd=tmp_path)  # the default seed spelt out: the same identity, another name
    assert again.returncode == 0, again.stderr
    assert "already holds this run, finished" in again.stdout and "epoch 1/1" not in again.stdout
    assert [p.name for p in summary.parents[1].iterdir()] == [summary.parent.name]  # no second directory left
    assert summary.stat().st_mtime_ns == stamp
    beside = summary.parent.with_name(f"single,{summary.parent.name.rpartition(',')[2]}")
    single = run_cli(*TINY, "method=float32", "train.epochs=1", f"hydra.run.dir='{beside}'", cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    assert f"results: {summary.parent}" in single.stdout and not beside.exists()


def test_a_run_directory_name_keeps_whole_overrides():
    from omegaconf import OmegaConf

    from qtrain.config import NAME_LENGTH, run_dir_name

    items = [f"method.key{i}={'x' * 20}" for i in range(8)]
    name = run_dir_name(",".join(items), _root_=OmegaConf.create({"seed": 0}))
    kept, _, run_id = name.rpartition(",")
    assert run_id.startswith("id=") and kept.split(",") == items[:len(kept.split(","))]
    assert len(kept) <= NAME_LENGTH < len(kept) + 1 + len(items[0])  # as many whole items as fit
    assert run_dir_name("x" * 200, _root_=OmegaConf.create({"seed": 0})).startswith("id=")
