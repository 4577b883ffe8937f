"""qtrain-report: run directories read back, tables over seeds, the papers' tables beside ours, plots, errors.

Most run directories here are written by hand with known figures, so every expected number is computed
from those figures, not by the code under test; one test reports real runs of the CLI.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from qtrain.cli import conf_dir
from qtrain.report.cli import main, report
from qtrain.report.paper import compare, load_table, paper_tables
from qtrain.report.plots import _average_bits, write_plots
from qtrain.report.runs import ReportError, find_runs
from qtrain.report.tables import display_frame, run_frame, summary_frame

from .conftest import TINY, run_cli


def _method(name: str, **changes) -> dict:
    method = OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / f"{name}.yaml"))
    method.update(changes)
    return method


def fake_run(root: Path, name: str, method: str, accs: list[float], macs: list[float], *, seed: int = 0,
             model: str = "resnet18", data: str = "cifar100", status: str | None = "completed", epochs: int = 2,
             method_keys: dict | None = None, data_keys: dict | None = None, summary_extra: dict | None = None,
             precision: list[dict] | None = None, metrics_extra: dict | None = None) -> Path:
    """A run directory as run.py leaves it: metrics.csv per epoch, and a summary unless ``status`` is None."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"method": _method(method, **(method_keys or {})), "model": {"name": model},
              "data": {"name": data, **(data_keys or {})}, "seed": seed, "train": {"epochs": epochs, "batch_size": 128}}
    metrics = pd.DataFrame({"epoch": range(1, len(accs) + 1), "test_acc": accs, "train_loss": [2.0 - a for a in accs],
                            "effective_macs": macs, **(metrics_extra or {})})
    metrics.to_csv(run_dir / "metrics.csv", index=False)
    if precision is not None:
        pd.DataFrame(precision).to_csv(run_dir / "precision.csv", index=False)
    if status is not None:
        summary = {"status": status, "method": method, "model": model, "data": data, "seed": seed,
                   "epochs_completed": len(accs), "final": {"test_acc": accs[-1]}, "best_test_acc": max(accs),
                   "cost": {"effective_macs": macs[-1], "percent_of_float32": 100.0 * macs[-1] / 1e12},
                   "config": config, **(summary_extra or {})}
        (run_dir / "summary.json").write_text(json.dumps(summary))
    else:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    return run_dir


@pytest.fixture
def dynasty_sweep(tmp_path):
    """DYNASTY Table 1's CIFAR-100 rows in miniature: float32 and DYNASTY at 4 bits over two seeds, SBM once."""
    root = tmp_path / "sweep"
    fake_run(root, "f0", "float32", [0.70, 0.76], [5e11, 1e12], seed=0)
    fake_run(root, "f1", "float32", [0.71, 0.78], [5e11, 1e12], seed=1)
    fake_run(root, "d0", "dynasty", [0.70, 0.75], [8e9, 1.6e10], seed=0, method_keys={"target_bits": 4},
             summary_extra={"dynasty": {"average_bits": 4.02}})
    fake_run(root, "d1", "dynasty", [0.72, 0.77], [8e9, 1.5e10], seed=1, method_keys={"target_bits": 4},
             summary_extra={"dynasty": {"average_bits": 3.98}})
    fake_run(root, "s0", "sbm", [0.70, 0.74], [3e10, 6.25e10])
    return root


def test_seeds_share_a_row_with_mean_and_std(dynasty_sweep):
    table = summary_frame(run_frame(find_runs([dynasty_sweep])), {"method": "sbm"})
    dynasty = table[table.method == "dynasty"].iloc[0]
    assert dynasty.runs == 2 and dynasty.setting == "" and dynasty.status == "completed"  # 4 bits is the default
    assert dynasty.test_acc_mean == pytest.approx(76.0)
    assert dynasty.test_acc_std == pytest.approx(statistics.stdev([75.0, 77.0]))
    assert dynasty.effective_macs_mean == pytest.approx(1.55e10)
    assert dynasty.savings_mean == pytest.approx(100 * (1 - 1.55e10 / 6.25e10))
    float32 = table[table.method == "float32"].iloc[0]
    assert float32.setting == "" and float32.test_acc_mean == pytest.approx(77.0)
    assert math.isnan(table[table.method == "sbm"].iloc[0].test_acc_std)  # one seed: no spread
    shown = display_frame(table)
    assert shown.loc[shown.method == "dynasty", "test acc %"].iloc[0] == f"76.00 ± {statistics.stdev([75.0, 77.0]):.2f}"
    assert "setting" not in shown and "config" not in shown  # nothing but the method differs between these runs


def test_status_of_runs_without_a_summary(tmp_path):
    fake_run(tmp_path, "stopped", "sbm", [0.5], [1e9], status=None)
    running = fake_run(tmp_path, "running", "sbm", [0.6, 0.7], [1e9, 2e9], status=None, seed=1)
    fake_run(tmp_path, "diverged", "sbm", [0.1], [1e9], status="diverged", seed=2)
    fd = os.open(running / ".qtrain.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live run holds it
    try:
        frame = run_frame(find_runs([tmp_path])).set_index("seed")
    finally:
        os.close(fd)
    assert frame.loc[0, "status"] == "stopped" and frame.loc[1, "status"] == "running"
    assert frame.loc[2, "status"] == "diverged"
    assert frame.loc[1, "test_acc"] == pytest.approx(70.0) and frame.loc[1, "epochs"] == 2  # from metrics.csv
    table = summary_frame(frame.reset_index())
    assert set(table.status.iloc[0].split(", ")) == {"1 stopped", "1 running", "1 diverged"}


def test_other_config_differences_split_rows(tmp_path):
    fake_run(tmp_path, "a", "sbm", [0.5], [1e9], epochs=2)
    fake_run(tmp_path, "b", "sbm", [0.6], [2e9], epochs=4)
    frame = run_frame(find_runs([tmp_path]))
    assert sorted(frame.config) == ["train.epochs=2", "train.epochs=4"]
    assert len(summary_frame(frame)) == 2


def test_dynasty_table_beside_ours(dynasty_sweep):
    comparison, unmatched = compare(find_runs([dynasty_sweep]), "dynasty_table1")
    paper = load_table("dynasty_table1")
    cells = comparison.set_index(["row", "column"])
    acc = cells.loc[("CIFAR-100 / DYNASTY / 4", "Top 1 Validation Accuracy (%)")]
    printed = paper[(paper.row == "CIFAR-100 / DYNASTY / 4") & (paper.column == "Top 1 Validation Accuracy (%)")].value
    assert acc.ours == pytest.approx(76.0) and acc.runs == 2 and acc.paper == pytest.approx(printed.iloc[0])
    assert acc.difference == pytest.approx(76.0 - printed.iloc[0])
    drop = cells.loc[("CIFAR-100 / DYNASTY / 4", "Top 1 Validation Accuracy (%) (parenthesized)")]
    assert drop.metric == "acc_drop" and drop.ours == pytest.approx(76.0 - 77.0)  # seed by seed against float32's mean
    assert drop.ours_std == pytest.approx(statistics.stdev([75.0 - 77.0, 77.0 - 77.0]))
    assert cells.loc[("CIFAR-100 / DYNASTY / 4", "Average Bit-Width*")].ours == pytest.approx(4.0)
    assert cells.loc[("CIFAR-100 / Banner et al. / 8", "Top 1 Validation Accuracy (%) (parenthesized)")].ours \
        == pytest.approx(74.0 - 77.0)
    assert ("CIFAR-100 / DYNASTY / 2", "Top 1 Validation Accuracy (%)") not in cells.index  # not run
    assert unmatched == len(paper) - len(comparison)


def test_a_cell_matches_only_runs_with_its_setting(tmp_path):
    fake_run(tmp_path, "d2", "dynasty", [0.7], [1e10], method_keys={"target_bits": 2})
    assert run_frame(find_runs([tmp_path])).setting.tolist() == ["target_bits=2"]
    comparison, _ = compare(find_runs([tmp_path]), "dynasty_table1")
    assert set(comparison.row) == {"CIFAR-100 / DYNASTY / 2"}
    assert set(comparison.metric) == {"test_acc", "average_bits", "acc_drop"}
    assert comparison.set_index("metric").loc["acc_drop"].isna().ours  # no float32 run to measure against


def test_a_relative_figure_takes_the_baseline_of_its_own_data_half(tmp_path):
    # FracTrain Table 5: savings over SBM on the adaptation half (classes) against SBM on that half, not the other
    adaptation, finetuning = {"subset": {"by": "classes", "part": 1}}, {"subset": {"by": "samples", "part": 1}}
    sbm = {"act_range": "tensor", "last_layer": "float32"}
    fake_run(tmp_path, "sbm-a", "sbm", [0.5, 0.7], [4e12, 8e12], model="resnet38", data_keys=adaptation, method_keys=sbm)
    fake_run(tmp_path, "sbm-f", "sbm", [0.5, 0.6], [5e12, 9e12], model="resnet38", data_keys=finetuning, method_keys=sbm)
    fake_run(tmp_path, "ft-a", "fractrain", [0.72, 0.71], [1e12, 2e12], model="resnet38", data_keys=adaptation,
             method_keys={"cp_schedule": [1.5, 2, 2.5, 3]})
    cells = compare(find_runs([tmp_path]), "fractrain_table5")[0].set_index(["row", "column"])
    improvement = "ResNet-38 CIFAR-100 / FracTrain Improv."
    assert cells.loc[(improvement, "Adaptation / MACs")].ours == pytest.approx(100 * (1 - 1e12 / 8e12))  # at best epochs
    assert cells.loc[(improvement, "Adaptation / Acc (%)")].ours == pytest.approx(72.0 - 70.0)
    assert (improvement, "Fine-tuning / MACs") not in cells.index  # no FracTrain run on the fine-tuning half


def test_every_paper_table_reads_and_names_known_runs():
    methods = {p.stem for p in (conf_dir() / "method").glob("*.yaml")}
    assert len(paper_tables()) == 13
    for name in paper_tables():
        table = load_table(name)
        assert table.value.notna().all() and not table.duplicated(["table", "row", "column"]).any()
        assert set(table.method) - {""} <= methods


def test_average_bits_count_skipped_work_as_zero_bits():
    # a DFQ layer: 30 % of samples at FW4/BW12, 50 % at FW6/BW8, 20 % skipped; and a float32 layer
    precision = pd.DataFrame([
        {"epoch": 1, "step": 10, "layer": "a", "format": "range-linear", "share": 0.3, "act_bits": 4, "grad_bits": 12},
        {"epoch": 1, "step": 10, "layer": "a", "format": "range-linear", "share": 0.5, "act_bits": 6, "grad_bits": 8},
        {"epoch": 1, "step": 10, "layer": "b", "format": "float32", "share": 1.0, "act_bits": 32, "grad_bits": 32},
    ])
    bits = _average_bits(precision, "act_bits").set_index("layer").bits
    assert bits["a"] == pytest.approx(0.3 * 4 + 0.5 * 6) and bits["b"] == 32


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plots_for_each_kind_of_run(tmp_path):
    root = tmp_path / "runs"
    dfq_rows = [{"epoch": e, "step": 10 * e, "layer": layer, "format": "range-linear", "share": share,
                 "weight_bits": 4, "act_bits": a, "grad_bits": g, "grad_weight_bits": g, "density": 1.0}
                for e in (1, 2) for layer in ("l1", "l2") for share, a, g in ((0.6, 4, 12), (0.3, 6, 8))]
    fake_run(root, "dfq", "dfq", [0.4, 0.6], [1e9, 2e9], model="resnet20", precision=dfq_rows)
    fake_run(root, "pfq", "pfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], model="resnet20",
             metrics_extra={"stage": [0, 0, 1]},
             precision=[{"epoch": 1, "step": 10, "layer": "l1", "format": "range-linear", "share": 1.0, "weight_bits": 3,
                         "act_bits": 3, "grad_bits": 6, "grad_weight_bits": 6, "density": 0.5}])
    fake_run(root, "dyn", "dynasty", [0.4, 0.6], [1e9, 2e9], model="resnet20",
             metrics_extra={"dynasty_average_bits": [4.0, 2.0], "bit_serial_seconds": [1.0, 2.0]},
             precision=[{"epoch": 2, "step": 20, "layer": "l1", "event": "bitmap", "operand": "weight", "share_0bit": 0.1,
                         "share_2bit": 0.6, "share_4bit": 0.3}])
    out = tmp_path / "plots"
    names = sorted(path.name.rsplit("-", 1)[0] for path in write_plots(find_runs([root]), out))
    kinds = [name.split("-")[0] for name in names]
    for kind in ("accuracy", "average", "loss", "precision", "sparsity", "allocation"):
        assert kind in kinds, names
    assert kinds.count("allocation") == 2  # DFQ's options and DYNASTY's map; PFQ allocates nothing per sample
    for path in out.glob("*.png"):
        width, height = _png_size(path)
        assert width > 300 and height > 200


def test_report_command_end_to_end(tmp_path):
    sweep = run_cli("-m", "method=float32,sbm", "seed=0,1", *TINY, "train.epochs=1", "data.n_train=64", "data.n_test=32",
                    "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    exe = Path(sys.executable).with_name("qtrain-report")
    done = subprocess.run([str(exe), "sweep", "--baseline", "method=float32", "--csv", "t.csv", "--latex", "t.tex",
                           "--plots", "plots", "--paper", "fractrain_table1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / "t.csv").set_index("method")
    runs = {json.loads(p.read_text())["method"] + str(json.loads(p.read_text())["seed"]): json.loads(p.read_text())
            for p in (tmp_path / "sweep").rglob("summary.json")}
    assert table.loc["sbm", "runs"] == 2
    assert table.loc["sbm", "test_acc_mean"] == pytest.approx(
        50 * (runs["sbm0"]["final"]["test_acc"] + runs["sbm1"]["final"]["test_acc"]))
    assert table.loc["sbm", "savings_mean"] == pytest.approx(100 - 6.25, abs=0.01)  # SBM's 8x8 bits / float32's 32x32
    assert "| sbm " in done.stdout and "FracTrain Table 1: paper and ours" in done.stdout
    assert "\\begin{tabular}" in (tmp_path / "t.tex").read_text()
    page = (tmp_path / "plots" / "report.html").read_text()
    assert "<table" in page and "accuracy-cost" in page


@pytest.mark.parametrize("args,message", [
    (["missing"], "missing does not exist"),
    (["."], "holds no qtrain run"),
    (["RUNS", "--baseline", "methd=sbm"], "--baseline methd=sbm is not allowed"),
    (["RUNS", "--paper", "adapt_table9"], "unknown paper table 'adapt_table9'"),
])
def test_bad_input_is_one_line(tmp_path, args, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path, "RUNS", "sbm", [0.5], [1e9])
    (tmp_path / "empty").mkdir()
    args = ["empty" if a == "." else a for a in args]
    with pytest.raises(ReportError, match=message.replace("(", r"\(")):
        report(args)


def _damage(tmp_path, how):
    run = fake_run(tmp_path, "damaged", "sbm", [0.5], [1e9], seed=1)
    if how == "summary a list":
        (run / "summary.json").write_text("[]")
    elif how == "summary without status":
        (run / "summary.json").write_text(json.dumps({"method": "sbm"}))
    elif how == "metrics not UTF-8":
        (run / "metrics.csv").write_bytes(b"epoch,test_acc\n1,\xff\xfe\n")
    else:
        (run / "metrics.csv").write_text("epoch,test_acc\n1,0.5\n2,0.6,7\n")
    return run


@pytest.mark.parametrize("how,why", [
    ("summary a list", "summary.json: it holds a JSON list, not an object"),
    ("summary without status", "summary.json: its status is '(absent)', not one of completed, diverged, failed"),
    ("metrics not UTF-8", "metrics.csv: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    ("metrics with extra fields", "metrics.csv: ParserError: Error tokenizing data. C error: Expected 2 fields in "
                                  "line 3, saw 3"),
])
def test_a_damaged_run_is_a_row_and_the_report_goes_on(tmp_path, capsys, how, why):
    fake_run(tmp_path, "good", "sbm", [0.5, 0.7], [1e9, 2e9])
    _damage(tmp_path, how)
    main([str(tmp_path), "--plots", str(tmp_path / "plots")])
    frame = run_frame(find_runs([tmp_path])).set_index("dir")
    assert frame.loc[str(tmp_path / "good"), "status"] == "completed"
    assert frame.loc[str(tmp_path / "good"), "test_acc"] == pytest.approx(70.0)
    status = frame.loc[str(tmp_path / "damaged"), "status"]
    assert status.startswith(f"damaged: {why}") and "\n" not in status
    assert "Runs (2)" in capsys.readouterr().out


@pytest.fixture
def immutable_dir(tmp_path):
    folder = tmp_path / "immutable"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("option,where,message", [
    ("--csv", "a_file/t.csv", "cannot create the --csv folder {tmp}/a_file: {tmp}/a_file is not a directory"),
    ("--latex", "a_file/deeper/t.tex", "cannot create the --latex folder {tmp}/a_file/deeper: {tmp}/a_file is not a "
                                       "directory"),
    ("--csv", "a_dir", "--csv {tmp}/a_dir is not allowed: it is a directory (give a file name)"),
    ("--plots", "a_file", "--plots {tmp}/a_file is not allowed: it is a file (give a folder)"),
    ("--plots", "a_file/plots", "cannot create the --plots folder {tmp}/a_file/plots: {tmp}/a_file is not a directory"),
    ("--csv", "immutable/t.csv", "cannot write to the --csv folder {tmp}/immutable: Operation not permitted in "
                                 "{tmp}/immutable"),
    ("--plots", "immutable/plots", "cannot write to the --plots folder {tmp}/immutable/plots: Operation not permitted "
                                   "in {tmp}/immutable"),
])
def test_an_unwritable_output_is_one_line_before_anything_is_written(tmp_path, capsys, request, option, where, message):
    if where.startswith("immutable"):
        request.getfixturevalue("immutable_dir")
    fake_run(tmp_path, "runs/a", "sbm", [0.5], [1e9])
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "runs"), "--csv", str(tmp_path / "ok.csv"), option, str(tmp_path / where)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"qtrain-report: error: {message.replace('{tmp}', str(tmp_path))}"]
    assert sorted(tmp_path.rglob("*")) == before


def test_outputs_go_into_folders_made_for_them(tmp_path):
    fake_run(tmp_path, "runs/a", "sbm", [0.5], [1e9])
    report([str(tmp_path / "runs"), "--csv", str(tmp_path / "new" / "t.csv"), "--latex", str(tmp_path / "x" / "t.tex")])
    assert pd.read_csv(tmp_path / "new" / "t.csv").runs.tolist() == [1]
    assert "\\begin{tabular}" in (tmp_path / "x" / "t.tex").read_text()


def test_a_baseline_that_matches_no_run_is_refused(tmp_path):
    fake_run(tmp_path, "a", "sbm", [0.5], [1e9])
    fake_run(tmp_path, "b", "float32", [0.5], [1e9])
    with pytest.raises(ReportError, match=r"--baseline method=nonexistent matches no run \(its runs have method: "
                                          r"float32, sbm\)"):
        report([str(tmp_path), "--baseline", "method=nonexistent"])


def test_one_identity_in_two_directories_is_counted_once(tmp_path):
    # a sweep without seed= and one with seed=0 name the same run twice; the report must not average it with itself
    fake_run(tmp_path, "method=sbm,id=d01d7eb4", "sbm", [0.5], [1e9], summary_extra={"run_id": "d01d7eb4"})
    fake_run(tmp_path, "method=sbm,seed=0,id=d01d7eb4", "sbm", [0.5], [1e9], summary_extra={"run_id": "d01d7eb4"})
    fake_run(tmp_path, "method=sbm,seed=1,id=0badcafe", "sbm", [0.7], [1e9], seed=1,
             summary_extra={"run_id": "0badcafe"})
    text = report([str(tmp_path), "--csv", str(tmp_path / "t.csv")])
    row = pd.read_csv(tmp_path / "t.csv").iloc[0]
    assert row.runs == 2 and row.test_acc_mean == pytest.approx(60.0)
    assert row.test_acc_std == pytest.approx(statistics.stdev([50.0, 70.0]))
    assert "1 more directory holds a run counted once above" in text


def test_report_help_does_not_load_torch():
    code = "import sys, qtrain.report.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
