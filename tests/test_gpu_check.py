"""scripts/gpu_check.py's machinery, run here on the CPU: the dry run compares a real run against itself, the
comparison fails what it should, and without CUDA the check refuses in one line."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.slow
def test_the_dry_run_trains_on_both_sides_and_finds_every_metric_equal(tmp_path, capsys):
    out = tmp_path / "table.md"
    assert gpu_check.main(["--device", "cpu", "--parts", "runs", "--methods", "sbm", "--out", str(out)]) == 0
    table = out.read_text()
    assert table in capsys.readouterr().out
    row, = [line for line in table.splitlines() if line.startswith("| run |")]
    assert row.startswith("| run | sbm | pass |") and "every metric equal" in row


def _result(losses, cost=6.25, acc=0.9, bits=8):
    return {"metrics": pd.DataFrame({"epoch": range(len(losses)), "train_loss": losses}),
            "precision": pd.DataFrame({"epoch": range(len(losses)), "bits": [bits] * len(losses)}),
            "summary": {"cost": {"percent_of_float32": cost}, "final": {"test_acc": acc}}}


def test_the_comparison_holds_each_side_to_its_rule():
    base = _result([1.0, 0.5])
    assert gpu_check.compare("sbm", base, _result([1.0, 0.5]), same_device=True)[0]
    assert not gpu_check.compare("sbm", base, _result([1.0, 0.5 + 2**-20]), same_device=True)[0]  # equal means equal
    # a difference counts against the first epoch's loss (the run's scale), not the last one's
    assert gpu_check.compare("sbm", _result([1.0, 0.509]), base, same_device=False)[0]  # 0.9 % < 1 %
    assert not gpu_check.compare("sbm", _result([1.0, 0.511]), base, same_device=False)[0]  # 1.1 %
    assert not gpu_check.compare("sbm", _result([1.011, 0.5]), base, same_device=False)[0]  # at any epoch
    assert gpu_check.compare("float32", _result([1.0, 0.50009]), base, same_device=False)[0]
    assert not gpu_check.compare("float32", _result([1.0, 0.5002]), base, same_device=False)[0]  # > 1e-4
    assert gpu_check.compare("pfq", _result([1.0, 0.59], acc=0.5), base, same_device=False)[0]  # 9 %; acc reported
    assert not gpu_check.compare("pfq", _result([1.0, 0.61]), base, same_device=False)[0]  # 11 %
    # float32's accuracy within one of the 64 images
    assert gpu_check.compare("float32", _result([1.0, 0.5], acc=0.9 - 1 / 64), base, same_device=False)[0]
    assert not gpu_check.compare("float32", _result([1.0, 0.5], acc=0.9 - 2 / 64), base, same_device=False)[0]
    # a fixed precision must cost the same on any device; a data-driven one is reported, not failed
    assert not gpu_check.compare("sbm", _result([1.0, 0.5], cost=6.3), base, same_device=False)[0]
    ok, detail = gpu_check.compare("pfq", _result([1.0, 0.5], bits=4), base, same_device=False)
    assert ok and "differs (reported only)" in detail


def test_a_gated_runs_record_apart_only_in_the_gates_probabilities_says_so():
    def gated(shares, chosen=0.75):
        return pd.DataFrame({"epoch": [1, 1, 1], "layer": ["b.conv1"] * 3, "share": [chosen, *shares],
                             "event": ["epoch", "gates_probability", "gates_probability"]})

    base = {**_result([1.0, 0.5]), "precision": gated([0.6, 0.4])}
    apart = {**_result([1.0, 0.5]), "precision": gated([0.6 + 3e-7, 0.4 - 3e-7])}
    ok, detail = gpu_check.compare("dfq", apart, base, same_device=False)
    assert ok and "record equal but the gates' mean probabilities (apart by up to 3e-07)" in detail
    for other in (gated([0.6, 0.4], chosen=0.5), gated([0.6, 0.4]).assign(layer="c.conv1")):  # a choice, a layer
        ok, detail = gpu_check.compare("dfq", {**_result([1.0, 0.5]), "precision": other}, base, same_device=False)
        assert ok and "record differs (reported only)" in detail
    assert "record equal;" in gpu_check.compare("dfq", base, base, same_device=False)[1] + ";"


def test_without_cuda_it_says_so_in_one_line_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "t.md")]) == 2
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    assert not (tmp_path / "t.md").exists()


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--parts", "all"], ["--methods", "sgd"]])
def test_unknown_choices_are_refused(argv):
    with pytest.raises(SystemExit):
        gpu_check.main(argv)


@pytest.mark.slow
def test_the_cuda_tests_all_lie_in_the_files_the_check_collects():
    """The check collects the cuda-marked tests from the device test files only (the others may import qtorch):
    every test marked cuda anywhere in tests/ must lie in one of them."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           str(SCRIPT.parents[1] / "tests")], capture_output=True, text=True, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    files = {path.name for path in gpu_check.device_test_files()}
    assert ids and {node.split("::")[0].split("/")[-1] for node in ids} <= files
    assert "test_fixed_format.py" not in files  # imports qtorch at the top


@pytest.mark.slow
def test_a_timed_out_child_is_killed_with_its_children_and_its_output_kept():
    # the child prints, then waits on a grandchild that holds the output pipe for a minute
    code = ("import subprocess, sys; print('started', flush=True); "
            "subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        gpu_check.run_child([sys.executable, "-c", code], timeout=2, env=gpu_check.child_env())
    assert time.monotonic() - started < 20
    assert gpu_check.last_line(caught.value.stdout) == "started"
    done = gpu_check.run_child([sys.executable, "-c", "print('ok')"], timeout=30, env=gpu_check.child_env())
    assert (done.returncode, done.stdout) == (0, "ok\n")


def test_the_device_test_files_import_without_qtorch_or_torchao():
    # the GPU machine has neither: a device test file that imports one (itself or through a file it borrows from)
    # fails gpu-check's collection there, every CUDA test with it
    files = [str(path) for path in gpu_check.device_test_files()]
    code = ("import sys; sys.modules.update(qtorch=None, torchao=None); import pytest; "
            f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *{files!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:]
