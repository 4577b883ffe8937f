"""The ``qtrain`` command as a user runs it: help, one-line errors, the default job, sweeps."""

import json

from .conftest import TINY, run_cli


def test_help_lists_the_config_groups(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    groups = ("method: dfq, float32, fractrain, pfq, sbm", "model: alexnet, mobilenetv2, resnet20", "data: cifar10",
              "experiment: fractrain_adapt, fractrain_adapt_pretrain, fractrain_cifar")
    for group in groups:
        assert group in result.stdout


def test_unknown_choice_is_one_line_and_nonzero(tmp_path):
    result = run_cli("method=nope", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "qtrain: error: unknown method 'nope' (choose from: dfq, float32, fractrain, pfq, sbm)"
    assert not (tmp_path / "outputs").exists()


def test_bad_bits_are_one_line_and_nonzero(tmp_path):
    result = run_cli(*TINY, "method.act_bits=40", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "qtrain: error: method.act_bits=40 is not allowed: bit-widths are integers from 1 to 32")


def test_default_job_on_digits_prints_the_result_table(tmp_path):
    # the no-argument job (SBM, ResNet-20, digits, fused quantizers), shortened to one epoch
    result = run_cli("train.epochs=1", "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "test acc %" in result.stdout and "% of float32" in result.stdout and "6.25" in result.stdout
    summary = json.loads((tmp_path / "outputs" / "sbm-resnet20-digits" / "train.epochs=1" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["fused"] is True


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
