"""qtrain-report: run directories read back, tables over seeds, the papers' tables beside ours, plots, errors.

Most run directories here are written by hand with known figures, so every expected number is computed
from those figures, not by the code under test; one test reports real runs of the CLI.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from qtrain.report.cli import latex, main, markdown, report
from qtrain.report.figure_style import by_config, config_label, config_style, groups, method_colour
from qtrain.report.paper import command, compare, load_table, missing, paper_tables, views
from qtrain.report.run_plots import _average_bits, write_plots
from qtrain.report.runs import ReportError, find_runs, one_per_identity
from qtrain.report.tables import display_frame, other_keys, run_frame, summary_frame
from qtrain.resources import conf_dir
from qtrain.results import loss_explosion

from .conftest import TINY, make_config, run_cli


def _group(group: str, name: str, **changes) -> dict:
    """Config group ``group``'s option ``name`` as its yaml holds it (interpolations unresolved), with ``changes``."""
    option = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{name}.yaml"))
    option.update(changes)
    return option


def fake_run(root: Path, name: str, method: str, accs: list[float], macs: list[float], *, seed: int = 0,
             model: str = "resnet18", data: str = "cifar100", status: str | None = "completed", epochs: int = 2,
             method_keys: dict | None = None, data_keys: dict | None = None, summary_extra: dict | None = None,
             precision: list[dict] | None = None, metrics_extra: dict | None = None, train_keys: dict | None = None,
             optim_keys: dict | None = None, scale: str | None = None, float32_share: float = 0.0,
             model_keys: dict | None = None) -> Path:
    """A run directory as a run leaves it: metrics.csv per epoch, and a summary unless ``status`` is None;
    ``scale`` on its recorded command line (``.hydra/overrides.yaml``); ``float32_share`` of its cost in float32
    layers."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    if scale is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(["method=" + method, f"scale={scale}"]))
    config = {"method": _group("method", method, **(method_keys or {})), "model": _group("model", model, **(model_keys or {})),
              "data": {"name": data, **(data_keys or {})}, "seed": seed,
              "train": {"epochs": epochs, "batch_size": 128, **(train_keys or {})}, "optim": optim_keys or {}}
    metrics = pd.DataFrame({"epoch": range(1, len(accs) + 1), "test_acc": accs, "train_loss": [2.0 - a for a in accs],
                            "effective_macs": macs, **(metrics_extra or {})})
    metrics.to_csv(run_dir / "metrics.csv", index=False)
    if precision is not None:
        pd.DataFrame(precision).to_csv(run_dir / "precision.csv", index=False)
    else:  # a float32 run's: no layer ever changed precision
        (run_dir / "precision.csv").write_text("epoch\n")
    if status is not None:
        summary = {"status": status, "method": method, "model": model, "data": data, "seed": seed,
                   "epochs_completed": len(accs), "final": {"test_acc": accs[-1]}, "best_test_acc": max(accs),
                   "cost": {"effective_macs": macs[-1], "percent_of_float32": 100.0 * macs[-1] / 1e12},
                   "float32_layers": {"share_of_cost": float32_share},
                   "config": OmegaConf.to_container(OmegaConf.create(config), resolve=True), **(summary_extra or {})}
        (run_dir / "summary.json").write_text(json.dumps(summary))
    else:
        (run_dir / ".hydra").mkdir(exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    return run_dir


def _key_paths(value: object, prefix: str = "") -> set[str]:
    """Every key path of nested dicts (``cost.effective_macs``)."""
    if not isinstance(value, dict):
        return {prefix[:-1]}
    return set().union(*(_key_paths(v, f"{prefix}{k}.") for k, v in value.items())) if value else {prefix[:-1]}


@pytest.mark.slow
def test_the_fake_runs_files_hold_only_what_a_real_run_writes(tmp_path):
    # fake_run writes summary.json and metrics.csv by hand: a key summary.py renamed would leave these tests reading a
    # file no run writes
    from qtrain.run import run  # torch: the other tests here read files only

    real = tmp_path / "real"
    run(make_config(*TINY, "train.epochs=1", "method=dynasty"), real)
    fake = fake_run(tmp_path, "fake", "dynasty", [0.5], [1e9], summary_extra={"dynasty": {"average_bits": 4.0}})
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (fake, real)]
    for summary in summaries:
        summary["config"] = {}  # the fake's config is its own (a model and data of the test's choosing)
    assert _key_paths(summaries[0]) <= _key_paths(summaries[1])
    assert set(pd.read_csv(fake / "metrics.csv").columns) <= set(pd.read_csv(real / "metrics.csv").columns)


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


def test_a_row_is_compared_with_its_baseline_seed_by_seed(tmp_path):
    # float32 spreads 20 points over its seeds; SBM is a point above it on two seeds and a point below on the third
    for seed, (ours, theirs) in enumerate([(0.51, 0.50), (0.61, 0.60), (0.69, 0.70)]):
        fake_run(tmp_path, f"f{seed}", "float32", [theirs], [1e12], seed=seed)
        fake_run(tmp_path, f"s{seed}", "sbm", [ours], [6.25e10], seed=seed)
    fake_run(tmp_path, "s3", "sbm", [0.99], [6.25e10], seed=3)  # no float32 run of seed 3 to pair it with
    fake_run(tmp_path / "again", "f0", "float32", [0.50], [1e12], seed=0)  # seed 0 in a second folder: one pair still
    # a language model is compared by perplexity, where lower is better
    for seed, (ours, theirs) in enumerate([(90.0, 100.0), (110.0, 120.0), (140.0, 120.0)]):
        for name, method, ppl in ((f"lf{seed}", "float32", theirs), (f"ls{seed}", "sbm", ours)):
            fake_run(tmp_path, name, method, [0.1], [1e12], seed=seed, model="transformer", data="wikitext2",
                     metrics_extra={"test_ppl": [ppl]})
    table = summary_frame(run_frame(find_runs([tmp_path])), {"method": "float32"}).set_index(["method", "model"])
    sbm = table.loc[("sbm", "resnet18")]
    assert sbm.paired_mean == pytest.approx(statistics.mean([1.0, 1.0, -1.0]))
    assert sbm.paired_std == pytest.approx(statistics.stdev([1.0, 1.0, -1.0])) and sbm.better == "2/3"
    assert sbm.test_acc_std > 10 * sbm.paired_std  # the seeds' spread hides what the pairs show
    language = table.loc[("sbm", "transformer")]
    assert language.paired_mean == pytest.approx(0.0) and language.better == "2/3"  # 10 lower twice, 20 higher once
    assert math.isnan(table.loc[("float32", "resnet18")].paired_mean) and table.loc[("float32", "resnet18")].better == ""
    shown = display_frame(table.reset_index()).set_index(["method", "model"])
    assert shown.loc[("sbm", "resnet18"), "Δ vs baseline, same seed"] == f"0.33 ± {statistics.stdev([1.0, 1.0, -1.0]):.2f}"
    assert shown.loc[("sbm", "resnet18"), "better on"] == "2/3"
    assert "paired_mean" not in summary_frame(run_frame(find_runs([tmp_path])), {"method": "float32"}, "best")


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
    assert table.runs.iloc[0] == 3 and table.test_acc_mean.iloc[0] == pytest.approx(10.0)  # the finished run's alone


def test_a_row_of_runs_in_progress_shows_their_last_epoch(tmp_path):
    fake_run(tmp_path, "done", "sbm", [0.5], [1e9])
    fake_run(tmp_path, "stopped", "sbm", [0.3], [1e9], status=None, seed=1)
    fake_run(tmp_path, "pfq", "pfq", [0.2, 0.4], [1e9, 1e9], status=None)
    table = summary_frame(run_frame(find_runs([tmp_path]))).set_index("method")
    assert table.loc["sbm", "test_acc_mean"] == pytest.approx(50.0) and math.isnan(table.loc["sbm", "test_acc_std"])
    assert table.loc["pfq", "test_acc_mean"] == pytest.approx(40.0) and table.loc["pfq", "status"] == "stopped"


def test_seeds_stopped_at_different_epochs_are_not_averaged_together(tmp_path):
    fake_run(tmp_path, "seed0", "dfq", [0.2, 0.4], [1e9, 1e9], status=None)
    fake_run(tmp_path, "seed1", "dfq", [0.2, 0.4, 0.6, 0.7], [1e9] * 4, status=None, seed=1)
    fake_run(tmp_path, "seed2", "dfq", [0.2, 0.4, 0.6, 0.8], [1e9] * 4, status=None, seed=2)
    row = summary_frame(run_frame(find_runs([tmp_path]))).iloc[0]
    assert (row.runs, row.epochs, row.status) == (3, 4, "stopped")
    assert row.test_acc_mean == pytest.approx(75.0) and row.test_acc_std == pytest.approx(math.sqrt(50))
    assert row.notes == "figures: the 2 runs at epoch 4"
    fake_run(tmp_path, "done", "dfq", [0.5], [1e9], seed=3)
    row = summary_frame(run_frame(find_runs([tmp_path]))).iloc[0]
    assert row.test_acc_mean == pytest.approx(50.0) and row.notes == "figures: the 1 finished run"


def test_a_run_in_progress_reads_its_config_resolved_as_a_finished_one(tmp_path):
    # summary.py resolves the config into summary.json; .hydra/config.yaml keeps sbm.yaml's ${.grad_bits}
    fake_run(tmp_path, "done", "sbm", [0.5], [1e9])
    fake_run(tmp_path, "stopped", "sbm", [0.6], [1e9], status=None, seed=1)
    frame = run_frame(find_runs([tmp_path]))
    assert set(frame.config) == {""}  # no key sets the two apart
    assert len(summary_frame(frame)) == 1


def test_other_config_differences_split_rows(tmp_path):
    fake_run(tmp_path, "a", "sbm", [0.5], [1e9], epochs=2)
    fake_run(tmp_path, "b", "sbm", [0.6], [2e9], epochs=4)
    frame = run_frame(find_runs([tmp_path]))
    assert sorted(frame.config) == ["train.epochs=2", "train.epochs=4"]
    assert len(summary_frame(frame)) == 2


def test_a_run_on_several_processes_is_another_configuration_than_one_on_one(tmp_path):
    # both in progress (.hydra/config.yaml only), the same config and seed: the record's world_size sets them apart
    one = fake_run(tmp_path, "one", "sbm", [0.5], [1e9], status=None)
    four = fake_run(tmp_path, "four", "sbm", [0.6], [1e9], status=None)
    config = OmegaConf.load(four / ".hydra" / "config.yaml")
    config.world_size = 4
    (four / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    runs = find_runs([tmp_path])
    kept, twins = one_per_identity(runs)
    assert len(kept) == 2 and twins == []
    frame = run_frame(runs).set_index("dir")
    assert frame.loc[str(one), "config"] == "" and frame.loc[str(four), "config"] == "world_size=4"
    assert len(summary_frame(frame.reset_index())) == 2


def test_a_run_alone_names_the_keys_a_run_made_before_them_lacks(tmp_path):
    # nothing to differ from, yet the runs table and the labels still say the classifier's draw and the process count
    four = fake_run(tmp_path / "four", "four", "sbm", [0.6], [1e9], status=None, model="resnet38",
                    model_keys={"classifier_init": "normal_in_out"}, train_keys={"eval_every": 2})
    config = OmegaConf.load(four / ".hydra" / "config.yaml")
    config.world_size = 4
    (four / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    fake_run(tmp_path / "plain", "plain", "sbm", [0.6], [1e9], model="resnet38", model_keys={"classifier_init": "torch"})
    for folder, expected in (("four", "model.classifier_init=normal_in_out train.eval_every=2 world_size=4"),
                             ("plain", "")):
        runs = find_runs([tmp_path / folder])
        assert run_frame(runs).config.tolist() == [expected]
        assert other_keys(runs[0], runs) == expected
        assert config_label(runs[0], runs) == " ".join(filter(None, ("sbm", expected)))


def test_a_run_made_before_eval_every_and_one_at_its_default_are_one_configuration(tmp_path):
    fake_run(tmp_path, "before", "sbm", [0.5], [1e9])  # its config has no train.eval_every
    fake_run(tmp_path, "default", "sbm", [0.6], [1e9], seed=1, train_keys={"eval_every": 1})
    frame = run_frame(find_runs([tmp_path]))
    assert frame.config.tolist() == ["", ""] and len(summary_frame(frame)) == 1
    fake_run(tmp_path, "sparse", "sbm", [0.7], [1e9], train_keys={"eval_every": 5})
    frame = run_frame(find_runs([tmp_path])).set_index("dir")
    assert frame.loc[str(tmp_path / "sparse"), "config"] == "train.eval_every=5"
    assert len(summary_frame(frame.reset_index())) == 2


def test_an_mx_run_made_before_scale_rule_and_one_at_floor_are_one_configuration(tmp_path):
    old = fake_run(tmp_path, "old", "mx", [0.5], [1e9])
    summary = json.loads((old / "summary.json").read_text())
    del summary["config"]["method"]["scale_rule"]  # as a run made before the key was
    (old / "summary.json").write_text(json.dumps(summary))
    floor = fake_run(tmp_path, "floor", "mx", [0.6], [1e9], seed=1)
    ceil = fake_run(tmp_path, "ceil", "mx", [0.7], [1e9], method_keys={"scale_rule": "ceil"})
    frame = run_frame(find_runs([tmp_path])).set_index("dir")
    assert frame.loc[str(old), "setting"] == frame.loc[str(floor), "setting"] == ""
    assert frame.loc[str(ceil), "setting"] == "scale_rule=ceil"
    assert len(summary_frame(frame.reset_index())) == 2


def test_a_run_between_evaluations_reports_its_last_evaluated_accuracy(tmp_path):
    # train.eval_every: a run in progress whose last epoch was not evaluated, and one with no evaluation yet
    fake_run(tmp_path, "a", "sbm", [0.4, math.nan], [1e9, 2e9], status=None)
    fake_run(tmp_path, "b", "sbm", [math.nan], [1e9], seed=1, status=None)
    frame = run_frame(find_runs([tmp_path])).set_index("seed")
    assert frame.loc[0, "test_acc"] == pytest.approx(40.0) and frame.loc[0, "best_test_acc"] == pytest.approx(40.0)
    assert frame.loc[1, "test_acc"] is None or math.isnan(frame.loc[1, "test_acc"])
    from qtrain.report.paper import _at_best

    assert [_at_best(run) for run in sorted(find_runs([tmp_path]), key=lambda run: run.seed)] == [1e9, None]


@pytest.mark.slow
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
    assert len(unmatched) == len(paper) - len(comparison)


def test_a_sweep_names_its_default_value_in_the_table_and_the_legends(tmp_path):
    fake_run(tmp_path, "d4", "dynasty", [0.7], [1e10], method_keys={"target_bits": 4})  # 4 is the file's default
    fake_run(tmp_path, "d2", "dynasty", [0.6], [5e9], method_keys={"target_bits": 2})
    fake_run(tmp_path, "d4-other", "dynasty", [0.7], [1e10], model="resnet20", method_keys={"target_bits": 4})
    runs = find_runs([tmp_path])
    frame = run_frame(runs).set_index("dir")
    assert frame.loc[str(tmp_path / "d4"), "setting"] == "target_bits=4"
    assert frame.loc[str(tmp_path / "d2"), "setting"] == "target_bits=2"
    assert frame.loc[str(tmp_path / "d4-other"), "setting"] == ""  # alone on its model: nothing to tell apart
    assert sorted(config_label(run, runs) for run in runs) == ["dynasty", "dynasty target_bits=2", "dynasty target_bits=4"]


def test_a_methods_configurations_in_one_figure_are_shades_and_styles_of_its_colour(tmp_path):
    for bits in (2, 3, 4):
        fake_run(tmp_path, f"d{bits}", "dynasty", [0.7], [1e10], method_keys={"target_bits": bits})
    fake_run(tmp_path, "s", "sbm", [0.7], [1e10])
    configs = by_config(find_runs([tmp_path]))
    styles = {name: config_style(members[0].method, name, configs) for name, members in configs.items()}
    assert styles["sbm"] == (method_colour("sbm"), "-")  # alone in its method: its colour, a solid line
    dynasty = [styles[f"dynasty target_bits={bits}"] for bits in (2, 3, 4)]
    assert len({colour for colour, _ in dynasty}) == 3 and len({style for _, style in dynasty}) == 3
    purple = method_colour("dynasty")
    assert dynasty[1][0] == pytest.approx(purple)  # the middle of three is the method's own colour
    assert all(a < b for a, b in zip(dynasty[0][0], purple)) and all(a > b for a, b in zip(dynasty[2][0], purple))


@pytest.mark.slow
def test_a_cell_matches_only_runs_with_its_setting(tmp_path):
    fake_run(tmp_path, "d2", "dynasty", [0.7], [1e10], method_keys={"target_bits": 2})
    assert run_frame(find_runs([tmp_path])).setting.tolist() == ["target_bits=2"]
    comparison, _ = compare(find_runs([tmp_path]), "dynasty_table1")
    assert set(comparison.row) == {"CIFAR-100 / DYNASTY / 2"}
    assert set(comparison.metric) == {"test_acc", "average_bits", "acc_drop"}
    assert comparison.set_index("metric").loc["acc_drop"].isna().ours  # no float32 run to measure against


@pytest.mark.slow
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


@pytest.mark.slow
def test_best_of_picks_the_best_fold(tmp_path):
    # AdaPT's protocol: every fold tested on the whole test split, the best fold's accuracy reported
    adapt512 = {"batch_size": 512, "epochs": 100}
    for fold, (acc, f32) in enumerate([(0.88, 0.89), (0.91, 0.87), (0.90, 0.90)]):
        fake_run(tmp_path, f"a{fold}", "adapt", [0.5, acc], [1e9, 2e9], model="resnet20", data="cifar10",
                 data_keys={"fold": fold}, train_keys=adapt512, epochs=100)
        fake_run(tmp_path, f"f{fold}", "float32", [0.5, f32], [1e9, 2e9], model="resnet20", data="cifar10",
                 data_keys={"fold": fold}, train_keys=adapt512, epochs=100)
    frame = run_frame(find_runs([tmp_path]))
    assert sorted(frame.fold) == [0, 0, 1, 1, 2, 2] and set(frame.config) == {""}  # folds share a row
    best = summary_frame(frame, aggregate="best").set_index("method")
    assert best.loc["adapt", "test_acc_mean"] == pytest.approx(91.0) and best.loc["adapt", "runs"] == 3
    assert best.loc["float32", "test_acc_mean"] == pytest.approx(90.0) and math.isnan(best.loc["adapt", "test_acc_std"])
    assert summary_frame(frame).set_index("method").loc["adapt", "test_acc_mean"] == pytest.approx(89.667, abs=1e-3)
    cells = compare(find_runs([tmp_path]), "adapt_table2", aggregate="best")[0].set_index(["row", "column"])
    assert cells.loc[("ResNet_AdaPT", "CIFAR10 / Quantized"), "ours"] == pytest.approx(91.0)
    assert cells.loc[("ResNet_AdaPT", "CIFAR10 / Float32"), "ours"] == pytest.approx(90.0)
    assert cells.loc[("ResNet_AdaPT", "CIFAR10 / ∆"), "ours"] == pytest.approx(91.0 - 90.0)  # best against best
    mean = compare(find_runs([tmp_path]), "adapt_table2")[0].set_index(["row", "column"])
    assert mean.loc[("ResNet_AdaPT", "CIFAR10 / Quantized"), "ours"] == pytest.approx(89.667, abs=1e-3)
    with pytest.raises(ReportError, match="--aggregate median is not allowed"):
        compare(find_runs([tmp_path]), "adapt_table2", aggregate="median")


@pytest.mark.slow
def test_adapts_drop_pairs_with_its_float32_run_of_another_weight_decay(tmp_path):
    # adapt_cifar keeps L2 in AdaPT's loss (weight decay 0), adapt_float32 in the optimizer (1e-4): one setup
    setup = {"model": "resnet20", "data": "cifar10", "train_keys": {"batch_size": 512}, "epochs": 100}
    fake_run(tmp_path, "adapt", "adapt", [0.5, 0.905], [1, 2], optim_keys={"weight_decay": 0.0}, **setup)
    fake_run(tmp_path, "float32", "float32", [0.5, 0.89], [1, 2], optim_keys={"weight_decay": 1e-4}, **setup)
    fake_run(tmp_path, "float32-e50", "float32", [0.5, 0.5], [1, 2], optim_keys={"weight_decay": 1e-4},
             **{**setup, "epochs": 50})  # another setup: not a baseline
    cells = compare(find_runs([tmp_path]), "adapt_table2")[0].set_index(["row", "column"])
    assert cells.loc[("ResNet_AdaPT", "CIFAR10 / ∆"), "ours"] == pytest.approx(90.5 - 89.0)


def _performance_model(su: float, printed: float, **sparsity: float) -> dict:
    return {"adapt": {"performance_model": {"baselines": {"same": {"SU": su, "SU_printed": printed}},
                                            "sparsity": sparsity}}}


@pytest.mark.slow
def test_su2_from_the_adapt_run_and_its_float32_baseline(tmp_path):
    # AdaPT reaches float32's 89.5 % in its 3rd of 4 epochs: SU2 = SU1 / (3 / 4), each reading
    train = {"batch_size": 512, "accum_steps": 4}
    fake_run(tmp_path, "adapt", "adapt", [0.5, 0.8, 0.9, 0.91], [1, 2, 3, 4], model="resnet20", data="cifar10",
             train_keys=train, epochs=4, summary_extra=_performance_model(1.2, 0.9, final=0.3, final_weighted=0.2))
    fake_run(tmp_path, "float32", "float32", [0.6, 0.895], [1, 2], model="resnet20", data="cifar10",
             train_keys=train, epochs=4)
    # MuPPET's float32 baseline (batch 128) is not AdaPT's: its 95 % would never be reached
    fake_run(tmp_path, "float32-128", "float32", [0.9, 0.95], [1, 2], model="resnet20", data="cifar10",
             train_keys={"accum_steps": 1}, epochs=4)
    cells = compare(find_runs([tmp_path]), "adapt_table3")[0].set_index(["row", "column"])
    su2 = cells.loc[("ResNet_AdaPT", "CIFAR10 / SU2")]
    assert su2.ours == pytest.approx(1.2 / 0.75) and su2.beside == pytest.approx(0.9 / 0.75)
    assert su2.beside_is == "Sec. 4.1.2's formula"
    assert cells.loc[("ResNet_AdaPT", "CIFAR10 / SU1")].ours == pytest.approx(1.2)
    sparsity = compare(find_runs([tmp_path]), "adapt_table5")[0].set_index(["row", "column"])
    final = sparsity.loc[("ResNet_CIFAR10", "Sparsity / Final Model")]
    assert (final.ours, final.beside, final.beside_is) == (pytest.approx(0.3), pytest.approx(0.2), "weighted by weight count")
    shown = report([str(tmp_path), "--paper", "adapt_table3"])
    assert "1.2 (Sec. 4.1.2's formula)" in shown  # 0.9 / 0.75 beside 1.6
    shutil.rmtree(tmp_path / "float32")
    alone = compare(find_runs([tmp_path]), "adapt_table3")[0].set_index(["row", "column"])
    assert math.isnan(alone.loc[("ResNet_AdaPT", "CIFAR10 / SU2")].ours)  # no float32 run of AdaPT's setting


def test_su2_is_su1_where_the_float32_accuracy_is_never_reached(tmp_path):
    fake_run(tmp_path, "adapt", "adapt", [0.5, 0.8], [1, 2], model="alexnet", data="cifar100",
             summary_extra=_performance_model(1.3, 1.1))
    fake_run(tmp_path, "float32", "float32", [0.6, 0.85], [1, 2], model="alexnet", data="cifar100")
    cells = compare(find_runs([tmp_path]), "adapt_table4")[0].set_index(["row", "column"])
    assert cells.loc[("AlexNet_AdaPT", "CIFAR100 / SU2")].ours == pytest.approx(1.3)


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


def test_a_precision_plot_draws_only_operands_whose_width_changes(tmp_path, monkeypatch):
    # DYNASTY-like: weight bits per block change; activations and gradients stay at 8 bits, whose share-weighted sum
    # over 0.2, 0.7 and 0.1 of the work is 7.999999999999999; a drawn flat line would say nothing
    assert 8 * 0.2 + 8 * 0.7 + 8 * 0.1 != 8
    rows = [{"epoch": e, "step": 10 * e, "layer": f"l{k}", "format": "range-linear", "share": share,
             "weight_bits": w, "act_bits": 8, "grad_bits": 8, "grad_weight_bits": 8}
            for e in (1, 2) for k in range(12) for share, w in ((0.2, 4), (0.7, 2 + e), (0.1, 2))]
    fake_run(tmp_path, "dyn", "dynasty", [0.4, 0.6], [1e9, 2e9], model="resnet20", precision=rows)
    drawn = {}

    def keep(fig, path):
        drawn[path.name] = fig
        return path

    monkeypatch.setattr("qtrain.report.run_plots.save", keep)
    write_plots(find_runs([tmp_path]), tmp_path / "plots")
    (fig,) = [fig for name, fig in drawn.items() if name.startswith("precision-")]
    panels = [axes for axes in fig.axes if axes.get_label() != "<colorbar>"]
    assert [axes.get_ylabel() for axes in panels] == ["weight bits"]
    assert fig.get_suptitle().endswith("bits in every layer and epoch: activation 8, gradient 8, weight-gradient 8")
    (bar,) = [axes for axes in fig.axes if axes.get_label() == "<colorbar>"]
    ticks = [tick for tick in bar.get_yticks() if 0 <= tick <= 11]
    assert ticks and all(tick == int(tick) for tick in ticks)  # layers 0-11, counted


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.mark.slow
def test_plots_for_each_kind_of_run(tmp_path):
    root = tmp_path / "runs"
    dfq_rows = [{"epoch": e, "step": 10 * e, "layer": layer, "format": "range-linear", "share": share,
                 "weight_bits": 4, "act_bits": a, "grad_bits": g, "grad_weight_bits": g, "density": 1.0}
                for e in (1, 2) for layer in ("l1", "l2") for share, a, g in ((0.6, 4, 12), (0.3, 6, 8))]
    fake_run(root, "dfq", "dfq", [0.4, 0.6], [1e9, 2e9], model="resnet20", precision=dfq_rows)
    fake_run(root, "pfq", "pfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], model="resnet20",
             metrics_extra={"stage": [0, 0, 1]},
             precision=[{"epoch": e, "step": 10 * e, "layer": "l1", "format": "range-linear", "share": 1.0,
                         "weight_bits": b, "act_bits": b, "grad_bits": 6, "grad_weight_bits": 6, "density": 0.5}
                        for e, b in ((1, 3), (2, 4))])
    # one width for every layer and epoch: a flat line says nothing, so no precision plot
    fake_run(root, "sbm", "sbm", [0.4, 0.6], [1e9, 2e9], model="resnet20",
             precision=[{"epoch": e, "step": 10 * e, "layer": layer, "format": "range-linear", "share": 1.0,
                         "weight_bits": 8, "act_bits": 8, "grad_bits": 8, "grad_weight_bits": 8, "density": 1.0}
                        for e in (1, 2) for layer in ("l1", "l2")])
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
    assert [name for name in names if name.startswith("precision")] == ["precision-pfq-resnet20-cifar100"]
    for path in out.glob("*.png"):
        width, height = _png_size(path)
        assert width > 300 and height > 200


@pytest.mark.slow
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
    assert "| sbm " in done.stdout and "FracTrain Table 1: the paper's cells (no run here matches one yet)" in done.stdout
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


def _table3_mini(root: Path, scale: str = "mini") -> None:
    """FracTrain Table 3's ResNet-38 CIFAR-10 rows at a reduced scale: SBM once, FracTrain over two seeds, with
    the window and L_scale epochs its scale file sets (conf/scale/method/<scale>_fractrain.yaml)."""
    scale_keys = OmegaConf.to_container(OmegaConf.load(conf_dir() / "scale" / "method" / f"{scale}_fractrain.yaml"))
    common = {"model": "resnet38", "data": "cifar10", "epochs": 8, "scale": scale}
    fake_run(root, "sbm", "sbm", [0.2, 0.281], [1e11, 2e11], method_keys={"act_range": "tensor", "last_layer": "float32"},
             summary_extra={"hardware": {"models": {"bitfusion": {"joules": 60.0, "seconds": 540.0}}}},
             float32_share=0.01, **common)
    for seed, (acc, macs, joules) in enumerate([(0.262, 7.2e10, 40.0), (0.270, 7.0e10, 42.0)]):
        fake_run(root, f"ft{seed}", "fractrain", [0.2, acc], [4e10, macs], seed=seed, method_keys=scale_keys,
                 summary_extra={"hardware": {"models": {"bitfusion": {"joules": joules, "seconds": 400.0}}}},
                 float32_share=0.2, **common)


@pytest.mark.slow
def test_a_reduced_scale_table_compares_against_its_baseline_row(tmp_path):
    _table3_mini(tmp_path)
    comparison, _ = compare(find_runs([tmp_path]), "fractrain_table3")
    assert set(comparison.scale) == {"mini"}
    parts = dict(views(comparison))
    assert list(parts) == ["comparable", "scale-bound"]  # nothing at paper scale: today's view has no row
    row = "ResNet-38 CIFAR-10 / FracTrain / cp=1.5/2/2.5/3"
    comparable = parts["comparable"].set_index(["row", "column"])
    acc = comparable.loc[(row, "Acc (%)")]
    assert acc.figure == "difference to SBM" and acc.paper == pytest.approx(92.54 - 92.66)  # the paper's own cells
    assert acc.ours == pytest.approx(statistics.fmean([26.2 - 28.1, 27.0 - 28.1]))
    assert acc.ours_std == pytest.approx(statistics.stdev([26.2 - 28.1, 27.0 - 28.1]))
    assert acc.difference == pytest.approx(acc.ours - acc.paper)
    macs = comparable.loc[(row, "MACs")]
    assert macs.figure == "% saved against SBM" and macs.paper == pytest.approx(100 * (1 - 3.97e13 / 1.18e14))
    # the paper's MACs leave out the layers each run keeps in float32: 20 % of FracTrain's cost, 1 % of SBM's
    quantized = [m * 0.8 / (2e11 * 0.99) for m in (7.2e10, 7e10)]
    assert macs.ours == pytest.approx(statistics.fmean([100 * (1 - q) for q in quantized]))
    energy = comparable.loc[(row, "Energy (kJ)")]
    assert energy.paper == pytest.approx(100 * (1 - 22.93 / 33.55)) and energy.ours == pytest.approx(100 * (1 - 41 / 60))
    assert comparable.loc[(row, "Latency (min)")].ours == pytest.approx(100 * (1 - 400 / 540))
    improvement = comparable.loc[("ResNet-38 CIFAR-10 / FracTrain Improv.", "Acc (%)")]  # relative as printed
    assert improvement.paper == pytest.approx(-0.12) and improvement.ours == pytest.approx(acc.ours)
    assert not comparable.index.get_level_values("row").str.contains("SBM").any()  # the baseline against itself: no row
    bound = parts["scale-bound"].set_index(["row", "column"])
    assert "difference" not in bound  # absolute figures are context, not compared
    assert bound.loc[("ResNet-38 CIFAR-10 / SBM / FW-8 / BW-8", "Acc (%)")].ours == pytest.approx(28.1)
    assert len(bound) == 8  # SBM and FracTrain: accuracy, MACs, energy, latency; and nothing else absolute
    shown = report([str(tmp_path), "--paper", "fractrain_table3"])
    assert "## FracTrain Table 3 at mini scale: against the table's SBM row" in shown
    assert "## FracTrain Table 3 at mini scale: scale-bound absolute figures" in shown
    assert "FracTrain Table 3: paper and ours" not in shown and "-1.18e+14" not in shown


def test_paper_plots_keep_to_one_unit_an_axis():
    from qtrain.report.paper_plots import paper_accuracy_cost_figure, paper_figure

    def cell(row, column, metric, paper, ours, **keys):
        return {"row": row, "column": column, "metric": metric, "scale": "paper", "config": "", "paper": paper,
                "ours": ours, "ours_std": math.nan} | keys

    # at paper scale a table's absolute rows stand beside its relative "Improv." row: only the first kind is drawn
    frame = pd.DataFrame([cell("SBM", "Acc", "best_test_acc", 92.7, 92.0), cell("SBM", "MACs", "quantized_macs", 1.2e14, 1.1e14),
                          cell("DFQ", "Acc", "best_test_acc", 92.5, 91.0), cell("DFQ", "MACs", "quantized_macs", 5e13, 6e13),
                          cell("Improv.", "Acc", "acc_delta_vs_sbm", -0.1, -1.0),
                          cell("Improv.", "MACs", "savings_vs_sbm_percent", 58.0, 45.0),
                          cell("Bad", "Acc", "best_test_acc", math.inf, 90.0)])
    (axes,) = paper_accuracy_cost_figure(frame, "t").axes
    assert [line.get_label() for line in axes.get_lines()][1::2] == ["SBM", "DFQ"]
    assert axes.get_xlabel() == "MACs: quantized_macs"
    panels = {a.get_xlabel() for a in paper_figure(frame, "t").axes}  # an infinite cell is left out, not an error
    assert panels == {f"paper: {m}" for m in ("best_test_acc", "quantized_macs", "acc_delta_vs_sbm", "savings_vs_sbm_percent")}
    # at a reduced scale a difference in perplexity gets a panel apart from one in accuracy
    mini = pd.DataFrame([cell("PFQ", "Acc", "best_test_acc", -0.1, -2.0, figure="difference to SBM"),
                         cell("PFQ LM", "Perplexity", "perplexity", -0.06, 3.0, figure="difference to SBM")])
    assert {a.get_xlabel() for a in paper_figure(mini, "t").axes} == {
        "paper: difference to SBM", "paper: difference to SBM (perplexity)"}
    # a row run at two reduced scales: a point for each, named by its scale
    scales = pd.DataFrame([cell("DFQ", "Acc", "best_test_acc", -0.1, ours, scale=scale, figure="difference to SBM")
                           for scale, ours in (("mini", -2.0), ("smoke", -5.0))]
                          + [cell("DFQ", "MACs", "quantized_macs", 58.0, ours, scale=scale, figure="% saved against SBM")
                             for scale, ours in (("mini", 49.0), ("smoke", 30.0))])
    (axes,) = paper_accuracy_cost_figure(scales, "t").axes
    assert [line.get_label() for line in axes.get_lines()][1::2] == ["DFQ mini", "DFQ smoke"]


def test_runs_of_methods_that_do_not_read_the_gate_options_are_not_told_apart_by_them(tmp_path):
    # model.dfq_options is read by the gated methods only (DFQ, FracTrain): two float32 pre-trainings that differ in
    # it alone are one configuration, and its value, the same for every gated run, names no run's config
    common = {"model": "resnet38", "data": "cifar10", "scale": "mini"}
    for name, options in (("f-a", [[0, 0], [2, 6]]), ("f-b", [[0, 0], [4, 6]])):
        fake_run(tmp_path, name, "float32", [0.6], [1e12], model_keys={"dfq_options": options}, **common)
    for name, method in (("d", "dfq"), ("t", "fractrain")):
        fake_run(tmp_path, name, method, [0.5], [5e11], model_keys={"dfq_options": [[0, 0], [6, 8]]}, **common)
    runs = find_runs([tmp_path])
    table = summary_frame(run_frame(runs))
    assert list(table.config) == ["", "", ""] and table.set_index("method").runs.to_dict() == {
        "float32": 2, "dfq": 1, "fractrain": 1}
    assert {group.title for group in groups(runs)} == {"resnet38 on cifar10 at mini scale"}  # one figure, no key in it


def _two_settings() -> pd.DataFrame:
    """FracTrain Table 5's comparable view at a reduced scale: adaptation and fine-tuning, each its own runs, and the
    "Improv." row that restates FracTrain's figures against SBM."""

    def cell(row, column, metric, paper, ours, config):
        figure = "difference to SBM" if "acc" in metric else "% saved against SBM"
        return {"row": row, "column": column, "metric": metric, "figure": figure, "scale": "mini", "config": config,
                "paper": paper, "ours": ours, "ours_std": math.nan}

    cells = []
    for setting, config, (acc, saved) in (("Adaptation", "data.subset.by=classes", (-5.8, 39.0)),
                                          ("Fine-tuning", "data.subset.by=samples", (-1.85, 23.1))):
        cells += [cell("FracTrain", f"{setting} / Acc (%)", "best_test_acc", 0.08, acc, config),
                  cell("FracTrain", f"{setting} / MACs", "effective_macs_at_best", 68.67, saved, config),
                  cell("FracTrain Improv.", f"{setting} / Acc (%)", "acc_delta_vs_sbm", 0.08, acc, config),
                  cell("FracTrain Improv.", f"{setting} / MACs", "savings_vs_sbm_percent", 68.7, saved, config)]
    return pd.DataFrame(cells)


def test_paper_accuracy_cost_axes_name_what_every_setting_shares():
    from qtrain.report.paper_plots import paper_accuracy_cost_figure

    (axes,) = paper_accuracy_cost_figure(_two_settings(), "t").axes
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("MACs: % saved against SBM", "Acc (%): difference to SBM")
    assert [line.get_label() for line in axes.get_lines()][1::2][:2] == [  # the legend names each point's setting
        "FracTrain / Adaptation data.subset.by=classes", "FracTrain / Fine-tuning data.subset.by=samples"]


def test_paper_accuracy_cost_draws_a_restated_row_once():
    from qtrain.report.paper_plots import paper_accuracy_cost_figure

    (axes,) = paper_accuracy_cost_figure(_two_settings(), "t").axes
    ours = [line for line in axes.get_lines()][1::2]  # "Improv.": FracTrain's point again, not drawn over it
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in ours] == [(39.0, -5.8), (23.1, -1.85)]
    assert all(line.get_label().startswith("FracTrain /") for line in ours)


@pytest.mark.slow
def test_fractrain_table1_measures_each_row_against_the_sbm_run_it_implies(tmp_path):
    # the table prints no SBM cell: each row's implied one (Acc - dAcc, MACs / (1 - saving)) names SBM at its last BW
    common = {"model": "mobilenetv2", "data": "cifar10", "epochs": 4, "scale": "mini"}
    fake_run(tmp_path, "pfq", "pfq", [0.30, 0.41], [1e10, 2e10], method_keys={"fw": [4, 4, 6, 8], "bw": [6, 8, 12, 16]},
             float32_share=0.1, **common)
    for bits, acc in ((16, 0.45), (8, 0.60)):  # only the BW-16 one is the row's baseline
        fake_run(tmp_path, f"sbm{bits}", "sbm", [0.30, acc], [4e10, 8e10], float32_share=0.0,
                 method_keys={"grad_bits": bits, "act_range": "tensor", "last_layer": "float32"}, **common)
    comparable = dict(views(compare(find_runs([tmp_path]), "fractrain_table1")[0]))["comparable"]
    cells = comparable.set_index(["row", "column"])
    row = "FW(4,4,6,8)/BW(6,8,12,16) / CIFAR-10"
    delta = cells.loc[(row, "Acc (ΔAcc) (parenthesized)")]
    assert (delta.paper, delta.ours) == pytest.approx((-0.10, 41.0 - 45.0))
    derived = cells.loc[(row, "Acc (ΔAcc)")]  # 93.90 against the implied 94.00
    assert (derived.figure, derived.paper, derived.ours) == ("difference to SBM", pytest.approx(-0.10), pytest.approx(-4.0))
    saving = cells.loc[(row, "Comp. Saving")]
    assert (saving.paper, saving.ours) == pytest.approx((21.96, 100 * (1 - 2e10 * 0.9 / 8e10)))
    assert cells.loc[(row, "MACs")].paper == pytest.approx(100 * (1 - 1.87e14 / 2.396e14))
    assert not comparable.row.str.contains("BW\\(6,6,8,8\\)").any()  # no PFQ run of that row here


@pytest.mark.slow
def test_a_paper_scale_table_keeps_its_view_and_mixed_scales_split(tmp_path):
    fake_run(tmp_path, "sbm", "sbm", [0.5, 0.9], [1e13, 1.2e14], model="resnet38", data="cifar10", epochs=160,
             method_keys={"act_range": "tensor", "last_layer": "float32"})
    paper_scale, _ = compare(find_runs([tmp_path]), "fractrain_table3")
    assert [kind for kind, _ in views(paper_scale)] == ["paper scale"]
    cells = paper_scale.set_index(["row", "column"])
    assert cells.loc[("ResNet-38 CIFAR-10 / SBM / FW-8 / BW-8", "MACs")].difference == pytest.approx(1.2e14 - 1.18e14)
    shown = report([str(tmp_path), "--paper", "fractrain_table3"])
    assert "FracTrain Table 3: paper and ours" in shown and "| scale" not in shown  # no scale column at paper scale
    _table3_mini(tmp_path / "mini")
    mixed, _ = compare(find_runs([tmp_path]), "fractrain_table3")
    assert [kind for kind, _ in views(mixed)] == ["paper scale", "comparable", "scale-bound"]
    sbm = mixed[(mixed.row == "ResNet-38 CIFAR-10 / SBM / FW-8 / BW-8") & (mixed.column == "Acc (%)")].set_index("scale")
    assert sbm.loc["paper", "ours"] == pytest.approx(90.0) and sbm.loc["mini", "ours"] == pytest.approx(28.1)
    acc = dict(views(mixed))["comparable"].set_index(["row", "column"]).loc[
        ("ResNet-38 CIFAR-10 / FracTrain / cp=1.5/2/2.5/3", "Acc (%)")]
    assert acc.ours == pytest.approx(26.6 - 28.1)  # against the SBM run of its own scale, not the paper-scale one


def test_the_scale_files_settings_are_not_a_runs_setting(tmp_path):
    _table3_mini(tmp_path / "mini")
    _table3_mini(tmp_path / "smoke", "smoke")
    fake_run(tmp_path, "ft-w4", "fractrain", [0.2, 0.3], [1, 2], model="resnet38", data="cifar10", epochs=8,
             scale="mini", method_keys={"window": 4, "scale_epochs": 2})  # a window the run chose itself
    frame = run_frame(find_runs([tmp_path]))
    fractrain = frame[frame.method == "fractrain"]
    # the mini runs at the scale's window are named by it only because a mini run of the report chose another
    assert sorted(fractrain.setting) == ["", "", "window=2", "window=2", "window=4"]
    assert set(fractrain.scale) == {"mini", "smoke"} and set(frame.config) == {""}  # the scale is its own column
    shown = display_frame(summary_frame(frame))
    assert "scale_epochs" not in " ".join(shown.setting) and set(shown.scale) == {"mini", "smoke"}
    assert len(shown[shown.method == "fractrain"]) == 3  # mini, smoke, and mini with its own window


def test_a_runs_scale_is_read_from_its_command_line(tmp_path):
    recorded = fake_run(tmp_path, "mini", "sbm", [0.5], [1], scale="mini")
    unrecorded = fake_run(tmp_path, "plain", "sbm", [0.5], [1], seed=1)
    stand_in = fake_run(tmp_path, "smoke", "sbm", [0.5], [1], seed=2, data_keys={"stand_in_for": "cifar100"})
    damaged = fake_run(tmp_path, "damaged", "sbm", [0.5], [1], seed=3, scale="mini")
    (damaged / ".hydra" / "overrides.yaml").write_bytes(b"- scale=[mini\n\xff: {")  # not YAML: the fallback
    scales = {run.dir: run.scale for run in find_runs([tmp_path])}
    assert (scales[recorded], scales[unrecorded], scales[stand_in], scales[damaged]) == ("mini", "paper", "smoke", "paper")


@pytest.mark.slow
def test_cells_without_a_run_are_listed_by_why_and_by_command(tmp_path):
    _table3_mini(tmp_path)
    _, missing = compare(find_runs([tmp_path]), "fractrain_table3")
    table = load_table("fractrain_table3")
    assert len(missing) == len(table) - 8 - 1  # the runs give 2 rows of 4 cells and the improvement's accuracy
    cells = missing.set_index(["row", "column"])
    unnamed = table[table.method == ""]  # the cells whose run results/paper/README.md says qtrain does not have
    assert set(cells.index[cells.group == "not produced by qtrain"]) == set(zip(unnamed.row, unnamed.column))
    assert cells.why[("ResNet-74 CIFAR-100 / WAGEUBN / FW-8 / BW-8", "Acc (%)")] == "WAGEUBN is not a qtrain method"
    assert cells.why[("ResNet-38 CIFAR-10 / DoReFa / FW-8 / BW-8", "MACs")] == "DoReFa is not a qtrain method"
    assert cells.why[("ResNet-38 CIFAR-10 / FracTrain Improv.", "MACs (range low)")].startswith(
        "the range's end that is a saving over WAGEUBN or DoReFa")
    assert cells.why[("ResNet-74 CIFAR-100 / DFQ / cp=3", "Acc (%)")] == (
        "qtrain -m experiment=fractrain_table3 method=dfq model=resnet74 data=cifar100 scale=mini data.root=DATA "
        "hydra.sweep.dir=OUT/fractrain_table3")  # the table's sweep cut to that run, at the report's scale
    assert cells.why[("ResNet-38 CIFAR-100 / SBM / FW-8 / BW-8", "MACs")] == (
        "qtrain -m experiment=fractrain_table3 method=sbm method.act_range=tensor method.last_layer=float32 "
        "model=resnet38 data=cifar100 scale=mini data.root=DATA hydra.sweep.dir=OUT/fractrain_table3")
    shown = report([str(tmp_path), "--paper", "fractrain_table3"])
    assert f"{len(missing)} of the table's cells have no run here:" in shown
    assert f"- not produced by qtrain (why): {len(unnamed)}" in shown
    assert f"- not run yet (the command that makes it): {len(missing) - len(unnamed)}" in shown
    assert "  - WAGEUBN is not a qtrain method: ResNet-38 CIFAR-10 / WAGEUBN / FW-8 / BW-8 (4 cells);" in shown


@pytest.mark.slow
def test_why_and_commands_for_cells_of_other_tables():
    dynasty = load_table("dynasty_table1").set_index(["row", "column"], drop=False)
    cell = dynasty.loc[("CIFAR-100 / DYNASTY / 2", "Top 1 Validation Accuracy (%)")]
    assert command("dynasty_table1", cell, "smoke") == ("qtrain -m experiment=dynasty_table1 method.target_bits=2 "
                                                        "scale=smoke data.root=DATA hydra.sweep.dir=OUT/dynasty")
    banner = missing("dynasty_table1", dynasty.loc[[("CIFAR-100 / Banner et al. / 8", "Average Bit-Width*")]])
    assert banner.group.tolist() == ["not produced by qtrain"] and "not a figure qtrain reports for sbm" in banner.why[0]
    table4 = missing("fractrain_table4", load_table("fractrain_table4")).set_index(["row", "column"])
    for model in ("ResNet-18", "ResNet-34"):  # the table's SBM sweep (through fractrain_imagenet) makes both
        sbm = table4.loc[(f"{model} / SBM / FW-8 / BW-16", "MACs")]
        assert sbm.group == "not run yet" and sbm.why.startswith("qtrain -m experiment=fractrain_imagenet method=sbm ")
        assert f"model={model.lower().replace('-', '')} " in sbm.why
    gated = pd.Series({"method": "dfq", "model": "alexnet", "metric": "test_acc", "row": "AlexNet / DFQ", "column": "Acc"})
    assert "dfq_options: null" in missing("fractrain_table4", pd.DataFrame([gated])).why[0]  # no options to gate with


def test_latex_escapes_what_latex_reads_as_commands():
    frame = pd.DataFrame({"set_ting": ["a_b & c", "50% #1 $x$ {y}"], "test acc %": ["76.00 ± 1.41", "∆ −2"]})
    text = latex(frame)
    assert r"set\_ting" in text and r"test acc \%" in text
    assert r"a\_b \& c" in text and r"50\% \#1 \$x\$ \{y\}" in text
    assert r"76.00 $\pm$ 1.41" in text and r"$\Delta$ -2" in text
    assert all(ord(character) < 128 for character in text)  # nothing the default input encoding lacks


def test_a_missing_figure_reads_as_a_dash_in_markdown_as_in_latex():
    frame = pd.DataFrame({"epoch": [1, 2], "range": [2.5, float("nan")], "note": ["a", None]})
    rows = markdown(frame).splitlines()
    assert [cell.strip() for cell in rows[2].strip("|").split("|")] == ["1", "2.5", "a"]
    assert [cell.strip() for cell in rows[3].strip("|").split("|")] == ["2", "-", "-"]
    assert "nan" not in latex(frame) and " - " in latex(frame)


@pytest.mark.slow
def test_paper_tables_export_beside_the_runs_table(tmp_path):
    _table3_mini(tmp_path / "runs")
    report([str(tmp_path / "runs"), "--paper", "fractrain_table3", "dynasty_table1", "--csv", str(tmp_path / "t.csv"),
            "--latex", str(tmp_path / "t.tex")])
    assert set(pd.read_csv(tmp_path / "t.csv").method) == {"sbm", "fractrain"}  # the runs table, as before
    exported = pd.read_csv(tmp_path / "t-fractrain_table3.csv")
    counts = exported.view.value_counts()
    assert (counts["comparable"], counts["scale-bound"]) == (5, 8)  # FracTrain's 4 relative figures and the printed Acc
    saved = exported[(exported.view == "comparable") & (exported.column == "MACs")]
    assert saved.ours.iloc[0] == pytest.approx(statistics.fmean([100 * (1 - m * 0.8 / (2e11 * 0.99)) for m in (7.2e10, 7e10)]))
    assert counts["not produced by qtrain"] == (load_table("fractrain_table3").method == "").sum()
    assert exported[exported.view == "not run yet"].why.str.startswith("qtrain ").all()
    dynasty = pd.read_csv(tmp_path / "t-dynasty_table1.csv")
    # no run of it here: the published cells (ours empty), then the cells to make
    assert set(dynasty.view) == {"paper scale", "not produced by qtrain", "not run yet"}
    assert dynasty[dynasty.view == "paper scale"].ours.isna().all()
    tex = (tmp_path / "t-fractrain_table3.tex").read_text()
    assert tex.count(r"\begin{tabular}") == 2 and "% FracTrain Table 3 at mini scale: scale-bound" in tex
    assert r"\% saved against SBM" in tex


@pytest.mark.slow
def test_paper_plots_put_each_cell_at_the_papers_value_and_ours(tmp_path):
    from matplotlib.container import ErrorbarContainer

    from qtrain.report.paper_plots import paper_accuracy_cost_figure, paper_figure

    _table3_mini(tmp_path / "runs")
    report([str(tmp_path / "runs"), "--paper", "fractrain_table3", "--plots", str(tmp_path / "plots")])
    written = sorted(path.name for path in (tmp_path / "plots").glob("paper-*.png"))
    # absolute figures at mini are not compared
    assert written == ["paper-fractrain_table3-comparable-accuracy-cost.png", "paper-fractrain_table3-comparable.png"]
    assert "paper-fractrain_table3-comparable.png" in (tmp_path / "plots" / "report.html").read_text()
    comparable = dict(views(compare(find_runs([tmp_path / "runs"]), "fractrain_table3")[0]))["comparable"]
    fig = paper_figure(comparable, "title")
    panels = {axes.get_xlabel(): axes for axes in fig.axes}
    assert set(panels) == {"paper: difference to SBM", "paper: % saved against SBM"}  # one panel a unit
    saved = panels["paper: % saved against SBM"]
    points = next(c for c in saved.containers if isinstance(c, ErrorbarContainer)).lines[0]
    # FracTrain's MACs, energy and latency saved against SBM (the _table3_mini runs), the paper's from Table 3
    macs = statistics.fmean([100 * (1 - m * 0.8 / (2e11 * 0.99)) for m in (7.2e10, 7e10)])
    pairs = list(zip(points.get_xdata(), points.get_ydata()))
    assert len(pairs) == 3
    assert pairs[0] == pytest.approx((100 * (1 - 3.97e13 / 1.18e14), macs))
    assert pairs[1] == pytest.approx((100 * (1 - 22.93 / 33.55), 100 * (1 - 41 / 60)))
    assert pairs[2][1] == pytest.approx(100 * (1 - 400 / 540))
    key = [text.get_text() for text in saved.texts if text.get_text().startswith("1: ")][0]
    assert key.splitlines()[0] == "1: ResNet-38 CIFAR-10 / FracTrain / cp=1.5/2/2.5/3 | MACs"
    acc = panels["paper: difference to SBM"]
    labels = sorted(text.get_text() for text in acc.texts if ":" not in text.get_text())
    assert labels == ["1,2"]  # FracTrain's Acc and the improvement row: paper's -0.12 twice, ours alike: one label
    assert paper_figure(comparable.assign(ours=float("nan")), "title") is None  # no cell with both values

    fig = paper_accuracy_cost_figure(comparable, "title")
    (axes,) = fig.axes
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("MACs: % saved against SBM", "Acc (%): difference to SBM")
    lines = axes.get_lines()  # per row with both figures (DFQ has no run here): the paper's point, then ours
    assert len(lines) == 2 and lines[0].get_markerfacecolor() == "none"
    assert (lines[0].get_xdata()[0], lines[0].get_ydata()[0]) == pytest.approx((100 * (1 - 3.97e13 / 1.18e14),
                                                                                 92.54 - 92.66))
    assert (lines[1].get_xdata()[0], lines[1].get_ydata()[0]) == pytest.approx(
        (macs, statistics.fmean([26.2 - 28.1, 27.0 - 28.1])))
    assert lines[1].get_label() == "ResNet-38 CIFAR-10 / FracTrain / cp=1.5/2/2.5/3"
    assert paper_accuracy_cost_figure(comparable[comparable.column != "MACs"], "title") is None  # no cost cell


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed")
def test_the_latex_exports_compile(tmp_path):
    _table3_mini(tmp_path / "runs")
    fake_run(tmp_path / "runs", "odd", "sbm", [0.5], [1e9], model="resnet38", data="cifar10", epochs=8, scale="mini",
             method_keys={"act_range": "tensor", "last_layer": "float32", "grad_bits": 16})  # a setting with _
    report([str(tmp_path / "runs"), "--paper", "fractrain_table3", "--latex", str(tmp_path / "t.tex")])
    (tmp_path / "doc.tex").write_text("\\documentclass{article}\\usepackage[utf8]{inputenc}\\usepackage{booktabs}"
                                      "\\usepackage{graphicx}\\begin{document}\\input{t.tex}\\input{t-fractrain_table3.tex}\\end{document}\n")
    done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert (tmp_path / "doc.pdf").stat().st_size > 1000


def test_seeds_plot_as_their_mean_with_a_min_max_band_and_a_marker_each(tmp_path):
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    from qtrain.report.figure_style import config_lines, seed_marker

    accs = [[0.40, 0.60, 0.70], [0.50, 0.62, 0.64], [0.45, 0.58, 0.76]]
    for seed, acc in enumerate(accs):
        fake_run(tmp_path, f"p{seed}", "pfq", acc, [1e9, 2e9, 3e9], seed=seed, model="resnet20",
                 metrics_extra={"stage": [0, 1, 1] if seed else [0, 0, 1]})
    fake_run(tmp_path, "sbm", "sbm", [0.5, 0.6, 0.7], [4e9, 8e9, 1.2e10], model="resnet20")
    axes = Figure().add_subplot()
    assert config_lines(find_runs([tmp_path]), axes, "effective_macs", "test_acc", 100.0)
    lines = {line.get_label(): line for line in axes.lines}
    mean = lines["pfq (mean of 3 seeds)"]
    assert list(mean.get_ydata()) == pytest.approx([100 * statistics.fmean(a[i] for a in accs) for i in range(3)])
    assert "sbm seed 0" in lines  # one seed: its own line
    band = [c for c in axes.collections if isinstance(c, PolyCollection)]
    assert len(band) == 1
    ys = band[0].get_paths()[0].vertices[:, 1]
    assert (ys.min(), ys.max()) == (pytest.approx(40.0), pytest.approx(76.0))  # min-max over the seeds
    pfq_markers = [line.get_marker() for line in axes.lines if line.get_linestyle() == "None"
                   and line.get_label().startswith("_") and line.get_color() == mean.get_color()]
    assert sorted(pfq_markers) == sorted(seed_marker(i) for i in range(3)) and len(set(pfq_markers)) == 3
    assert "seed #3 of a configuration" in lines
    names = [path.name for path in write_plots(find_runs([tmp_path]), tmp_path / "plots")]
    assert any(name.startswith("loss-turning-points") for name in names)


def test_an_option_has_one_colour_in_every_allocation_plot():
    from qtrain.report.figure_style import share_colour

    # DFQ on ResNet-20 and FracTrain on MobileNetV2 allocate among different options; FW6/BW8 is in both
    assert share_colour("FW6/BW8") == share_colour("FW6/BW8.0")
    resnet = ["FW2/BW6", "FW3/BW6", "FW4/BW6", "FW4/BW12", "FW6/BW8", "FW6/BW12"]
    mobilenet = ["FW4/BW8", "FW6/BW8", "FW6/BW10", "FW8/BW8"]
    colours = [share_colour(option) for option in sorted(set(resnet + mobilenet))]
    assert len(set(colours)) == len(colours)  # no two configured options alike
    assert share_colour("skipped") == (0.85, 0.85, 0.85, 1.0) and share_colour("4 bits") != share_colour("2 bits")


def test_allocation_and_layer_order_come_from_the_training_epochs_rows():
    """A gated run's file holds its gates' evaluation choices and mean probabilities before the epoch rows: the
    allocation plot's shares and the layer plots' order are the epoch rows' alone."""
    from qtrain.report.run_plots import _layer_order, _option_shares

    def row(layer, event, share, act, grad, fmt="range-linear"):
        return {"epoch": 1, "layer": layer, "event": event, "format": fmt, "share": share, "act_bits": act,
                "grad_bits": grad}

    precision = pd.DataFrame([
        row("b.conv1", "gates_probability", 0.5, 6, 8), row("b.conv1", "gates_probability", 0.3, 6, 12),
        row("b.conv1", "gates_eval", 0.9, 6, 8),
        row("conv1", "epoch", 1.0, 32, 32, "float32"),
        row("b.conv1", "epoch", 0.25, 6, 8), row("b.conv1", "epoch", 0.5, 6, 12),
        row("b.conv2", "epoch", 0.25, 6, 8), row("b.conv2", "epoch", 0.5, 6, 12),
        row("fc", "epoch", 1.0, 32, 32, "float32"),
    ])
    assert _layer_order(precision) == ["conv1", "b.conv1", "b.conv2", "fc"]
    shares, of = _option_shares(precision)
    assert of == "share of samples (%)" and list(shares.index) == ["b.conv1", "b.conv2"]
    assert shares.loc["b.conv1"].tolist() == pytest.approx([0.25, 0.5, 0.25])  # FW6/BW8, FW6/BW12, skipped
    assert list(shares.columns)[-1] == "skipped"


def _damage(tmp_path, how):
    run = fake_run(tmp_path, "damaged", "sbm", [0.5], [1e9], seed=1)
    if how == "summary a list":
        (run / "summary.json").write_text("[]")
    elif how == "summary without status":
        (run / "summary.json").write_text(json.dumps({"method": "sbm"}))
    elif how in ("final a string", "test_acc a string", "NaN", "past float range"):
        summary = json.loads((run / "summary.json").read_text())
        summary["final"] = "done" if how == "final a string" else {"test_acc": "high" if how == "test_acc a string" else 0.5}
        text = json.dumps(summary)
        if how in ("NaN", "past float range"):
            text = text.replace('"best_test_acc": 0.5', '"best_test_acc": ' + ("NaN" if how == "NaN" else "1e999"))
        (run / "summary.json").write_text(text)
    elif how == "metrics not UTF-8":
        (run / "metrics.csv").write_bytes(b"epoch,test_acc\n1,\xff\xfe\n")
    elif how == "precision with extra fields":
        (run / "precision.csv").write_text("epoch,layer\n1,conv1\n2,conv1,8\n")
    else:
        (run / "metrics.csv").write_text("epoch,test_acc\n1,0.5\n2,0.6,7\n")
    return run


@pytest.mark.parametrize("how,why", [
    ("summary a list", "summary.json: it holds a JSON list, not an object"),
    ("summary without status", "summary.json: its status is '(absent)', not one of completed, diverged, failed"),
    ("final a string", "summary.json: its final is a JSON str, not an object"),
    ("test_acc a string", "summary.json: its final.test_acc is 'high', not a number"),
    ("NaN", "summary.json: it holds NaN, which JSON lacks"),
    ("past float range", "summary.json: it holds 1e999, beyond float range"),
    ("metrics not UTF-8", "metrics.csv: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    ("metrics with extra fields", "metrics.csv: ParserError: Error tokenizing data. C error: Expected 2 fields in "
                                  "line 3, saw 3"),
    ("precision with extra fields", "precision.csv: ParserError: Error tokenizing data. C error: Expected 2 fields in "
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


@pytest.mark.slow
def test_report_loads_neither_torch_nor_the_qtrain_command():
    code = ("import sys; from qtrain import sweeps; "
            "from qtrain.report import cli, figure_style, paper, paper_plots, pareto, run_plots, tables; "
            # each one's config-tree lookups too
            "tables._method_defaults('sbm', 'mini'), sweeps.commands('fractrain_table3'); "
            "figure_style._configured_options(); "
            "loaded = {'torch', 'qtrain.cli'} & set(sys.modules); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _table5_adaptation_on_cifar10(root: Path) -> None:
    """SBM and FracTrain retrained on CIFAR-10's second five classes, at mini scale: Table 5's adaptation, stand-in."""
    common = {"model": "resnet38", "data": "cifar10", "scale": "mini", "data_keys": {"subset": {"by": "classes", "part": 1}}}
    # best epochs: SBM's second (80 %, 8e11 MACs by then), FracTrain's second (78 %, 2e11), each before a worse last
    fake_run(root, "sbm", "sbm", [0.70, 0.80, 0.79], [4e11, 8e11, 1.2e12],
             method_keys={"act_range": "tensor", "last_layer": "float32"}, **common)
    fake_run(root, "ft", "fractrain", [0.75, 0.78, 0.77], [1e11, 2e11, 3e11], **common)


@pytest.mark.slow
def test_runs_on_a_stand_in_dataset_match_a_papers_cells_only_when_named(tmp_path):
    _table5_adaptation_on_cifar10(tmp_path)
    comparison, _ = compare(find_runs([tmp_path]), "fractrain_table5")
    assert comparison.empty  # CIFAR-10 runs are not CIFAR-100 cells
    runs = find_runs([tmp_path])
    for run in runs:
        run.stands_in_for = "cifar100"
    comparison, missed = compare(runs, "fractrain_table5")
    assert set(comparison.stand_in) == {"cifar10"}
    parts = dict(views(comparison))
    assert list(parts) == ["comparable", "scale-bound"]  # a stand-in is never compared as at paper scale
    cells = parts["comparable"].set_index(["row", "column"])
    improv = "ResNet-38 CIFAR-100 / FracTrain Improv."
    assert cells.ours[(improv, "Adaptation / MACs")] == pytest.approx(100 * (1 - 2e11 / 8e11))  # at each best epoch
    assert cells.paper[(improv, "Adaptation / MACs")] == pytest.approx(68.7)
    assert cells.ours[(improv, "Adaptation / Acc (%)")] == pytest.approx(78.0 - 80.0)
    finetune = missed.set_index(["row", "column"]).why[("ResNet-38 CIFAR-100 / SBM / FW-8 / BW-8", "Fine-tuning / MACs")]
    assert finetune.startswith("qtrain -m experiment=fractrain_finetune method=sbm ")  # the stand-in's sweep command
    assert " data=cifar10 " in finetune and "pretrain_finetune_cifar10" in finetune
    shown = report([str(tmp_path), "--paper", "fractrain_table5", "--stand-in", "cifar10=cifar100"])
    assert "| stand_in" in shown and "| cifar10 " in shown


@pytest.mark.parametrize("args,error", [
    (["--stand-in", "cifar10=cifar100"], "--stand-in cifar10=cifar100 is not allowed without --paper"),
    (["--paper", "fractrain_table5", "--stand-in", "cifar10"], "--stand-in cifar10 is not allowed: give DATA=PAPER_DATA"),
    (["--paper", "fractrain_table5", "--stand-in", "cifar10=cifar10"], "two different dataset names"),
    (["--paper", "fractrain_table5", "--stand-in", "mnist=cifar100"],
     "--stand-in mnist=cifar100 matches no run (the runs' data: cifar10)"),
])
def test_a_bad_stand_in_is_one_line_before_any_output(tmp_path, args, error):
    _table5_adaptation_on_cifar10(tmp_path / "runs")
    with pytest.raises(ReportError, match=error.replace("(", r"\(").replace(")", r"\)")):
        report([str(tmp_path / "runs"), *args, "--csv", str(tmp_path / "out" / "t.csv")])
    assert not (tmp_path / "out").exists()


def test_the_pareto_frontier_keeps_the_points_nothing_beats_on_cost_and_score():
    from qtrain.report.pareto import pareto_front

    costs = [100.0, 6.25, 3.8, 6.25, 1.9, 12.0]
    scores = [92.0, 91.0, 88.5, 90.0, 80.0, 91.0]  # the 12 % point ties a cheaper one; 6.25 twice: the better
    assert pareto_front(costs, scores) == [4, 2, 1, 0]
    assert pareto_front([5.0], [1.0]) == [0]


def test_the_report_draws_a_pareto_plot_per_model_and_data(tmp_path):
    from matplotlib.figure import Figure

    from qtrain.report import pareto

    for seed in (0, 1):
        fake_run(tmp_path, f"f{seed}", "float32", [0.5, 0.70 + seed / 100], [5e11, 1e12], seed=seed, model="resnet20")
        fake_run(tmp_path, f"s{seed}", "sbm", [0.5, 0.69 + seed / 100], [3e10, 6.25e10], seed=seed, model="resnet20")
        fake_run(tmp_path, f"m{seed}", "mx", [0.5, 0.60], [2e10, 4e10], seed=seed, model="resnet20")
    drawn = []
    original = Figure.savefig
    Figure.savefig = lambda fig, *a, **k: (drawn.append(fig), original(fig, *a, **k))[1]
    try:
        paths = pareto.pareto_plot(summary_frame(run_frame(find_runs([tmp_path]))), tmp_path / "plots")
    finally:
        Figure.savefig = original
    assert [p.name for p in paths] == ["pareto-resnet20-cifar100.png"]  # plain runs: no scale in the name
    axes = drawn[0].axes[0]
    frontier = [line for line in axes.lines if line.get_label() == "Pareto frontier"][0]
    # mx (4 %, 60 %) is cheapest, SBM (6.25 %, 69.5 %) better, float32 (100 %, 70.5 %) best: all three on the frontier
    assert list(frontier.get_xdata()) == pytest.approx([4.0, 6.25, 100.0])
    assert list(frontier.get_ydata()) == pytest.approx([60.0, 69.5, 70.5])
    width, height = _png_size(paths[0])
    assert width > 300 and height > 200


def test_a_missing_table_and_an_exploded_loss_are_noted_in_the_row(tmp_path):
    # optim=adam optim.lr=1e3 in miniature: the loss climbs from 2.3 to 4e12 while the run completes
    fake_run(tmp_path, "exploded", "sbm", [0.3, 0.1, 0.1], [1e9] * 3, metrics_extra={"train_loss": [2.3, 5e3, 4e12]})
    fake_run(tmp_path, "steady", "sbm", [0.3, 0.5, 0.6], [1e9] * 3, seed=1, metrics_extra={"train_loss": [2.3, 1.5, 1.2]})
    (fake_run(tmp_path, "no_precision", "float32", [0.5], [1e12]) / "precision.csv").unlink()
    frame = run_frame(find_runs([tmp_path])).set_index("dir")
    # 5e3 is over 100x epoch 1's 2.3 (and over 100): the first epoch past both bounds is named
    assert frame.loc[str(tmp_path / "exploded"), "notes"] == "loss exploded: 5e+03 at epoch 2 (epoch 1: 2.3)"
    assert frame.loc[str(tmp_path / "exploded"), "status"] == "completed"  # the rule stands; the row says why to doubt it
    assert frame.loc[str(tmp_path / "steady"), "notes"] == ""
    assert frame.loc[str(tmp_path / "no_precision"), "notes"] == "no precision.csv"
    shown = display_frame(summary_frame(frame.reset_index())).set_index("method")
    assert shown.loc["sbm", "notes"] == "loss exploded: 5e+03 at epoch 2 (epoch 1: 2.3)"


def test_loss_explosion_needs_both_bounds():
    assert loss_explosion([2.3, 1.0, 4e12]) == {"epoch": 3, "train_loss": 4e12, "first_epoch_train_loss": 2.3}
    assert loss_explosion([0.5, 60.0]) is None  # 120x epoch 1's, but a loss a model at chance can have
    assert loss_explosion([2.0, 150.0]) is None  # over 100, but only 75x epoch 1's
    assert loss_explosion([1.0, 101.0])["epoch"] == 2
    assert loss_explosion([float("nan"), 1.0, float("inf"), 200.0])["epoch"] == 4  # non-finite epochs: the diverged rule's
    assert loss_explosion([]) is None and loss_explosion([None, 3.0]) is None


def test_a_copy_of_a_finished_run_holding_only_its_checkpoint_is_counted_once(tmp_path):
    import torch

    from qtrain.config import digest, identity

    done = fake_run(tmp_path, "done", "sbm", [0.5, 0.6], [1e9, 2e9])
    summary = json.loads((done / "summary.json").read_text())
    summary["run_id"] = digest(identity(summary["config"]))
    (done / "summary.json").write_text(json.dumps(summary))
    copy = tmp_path / "copy"  # the run's folder copied before it finished, under a name without its id
    copy.mkdir()
    torch.save({"epoch": 1}, copy / "checkpoint.pt")  # the report reads no checkpoint: its presence marks a run
    (copy / ".hydra").mkdir()
    (copy / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(summary["config"]))
    shutil.copy(done / "metrics.csv", copy / "metrics.csv")
    kept, twins = one_per_identity(find_runs([tmp_path]))
    assert [run.dir for run in kept] == [done] and [run.dir for run in twins] == [copy]


def test_a_paper_table_without_a_matching_run_shows_the_published_cells(tmp_path):
    fake_run(tmp_path, "other", "float32", [0.5], [1e12])  # ResNet-18 on CIFAR-100: no cell of FracTrain's Table 3
    text = report([str(tmp_path), "--paper", "fractrain_table3"])
    section = text.split("## FracTrain Table 3: the paper's cells (no run here matches one yet)")[1]
    # the table as results/paper/fractrain_table3.csv transcribes the paper, the target before any run
    row = next(line for line in section.splitlines() if "ResNet-38 CIFAR-10 / WAGEUBN / FW-8 / BW-8" in line
               and "Acc (%)" in line)
    assert [cell.strip() for cell in row.strip("|").split("|")][-2:] == ["91.81", "-"]


def test_figures_read_to_three_significant_figures_with_si_prefixes():
    from qtrain.report.tables import si

    assert [si(v) for v in (0.0, 8.19e9, 1.31e11, 2.1844e10, 999.6e6, 12.0, -3.2e6)] == [
        "0", "8.19 G", "131 G", "21.8 G", "1 G", "12", "-3.2 M"]


def test_the_latex_runs_table_keeps_the_columns_a_paper_prints_and_fits_the_width(tmp_path):
    fake_run(tmp_path, "s0", "sbm", [0.5, 0.6], [1e9, 2.184e10])
    fake_run(tmp_path, "s1", "sbm", [0.5, 0.62], [1e9, 2.184e10], seed=1)
    report([str(tmp_path), "--latex", str(tmp_path / "t.tex")])
    text = (tmp_path / "t.tex").read_text()
    assert text.startswith("\\resizebox{\\linewidth}{!}{%\n\\begin{tabular}")
    header = text.split("\\toprule\n")[1].split("\\\\")[0]
    assert [cell.strip() for cell in header.split("&")] == ["method", "model", "data", "runs", "test acc \\%",
                                                           "eff. MACs", "\\% of float32"]
    assert "21.8 G $\\pm$ 0" in text  # two seeds of one cost: no e+10, no 0.000e+00


def test_labels_of_points_close_together_are_moved_apart_and_others_stay():
    from qtrain.report.pareto import _label_offsets

    # MuPPET and SBM at nearly one cost and accuracy (as in the league), float32 far from both: closeness is a
    # twelfth of the log-cost range (2 decades here) and a thirtieth of the accuracy range (here 6 points: 0.2)
    assert _label_offsets([6.25, 6.4, 100.0], [69.0, 69.1, 75.0], False) == [3, -6, 3]
    assert _label_offsets([6.25, 6.3, 6.35, 100.0], [69.0, 69.05, 69.1, 75.0], False) == [3, -6, -15, 3]
    assert _label_offsets([6.25, 6.4, 100.0], [69.0, 69.5, 75.0], False) == [3, 3, 3]  # half a point apart: room
    assert _label_offsets([1.0, 100.0], [50.0, 90.0], False) == [3, 3]


def test_every_figure_of_the_html_report_has_its_caption(tmp_path):
    fake_run(tmp_path / "runs", "s0", "sbm", [0.5, 0.6], [1e9, 2e9], model="resnet20")
    main([str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")])
    page = (tmp_path / "plots" / "report.html").read_text()
    figures = re.findall(r"<figure><img src='([^']+)' alt='([^']*)'><figcaption>([^<]*)</figcaption></figure>", page)
    assert figures and len(figures) == page.count("<figure>")
    assert all(alt == text and text and not text.endswith(".png") for _, alt, text in figures)
    assert any(name.startswith("learning-curves-") and text.startswith("learning curves: resnet20 on cifar100")
               for name, _, text in figures)


def test_the_accuracy_cost_figure_leaves_out_the_hardware_panels_no_run_has_figures_for(tmp_path):
    from qtrain.report.run_plots import accuracy_cost_plot

    nan = float("nan")
    unpriced = {"bit_serial_seconds": [nan, nan], "bitfusion_seconds": [nan, nan]}  # a float format's (docs/cost.md)
    for seed in (0, 1):
        fake_run(tmp_path, f"fp8-{seed}", "fp8", [0.5, 0.6], [1e10, 2e10], seed=seed, metrics_extra=unpriced)
    (group,) = groups(find_runs([tmp_path]))
    path = accuracy_cost_plot(group, tmp_path)
    assert path is not None
    priced = {"bit_serial_seconds": [1.0, 2.0], "bitfusion_seconds": [nan, nan]}
    fake_run(tmp_path, "sbm-0", "sbm", [0.5, 0.55], [1e10, 2e10], metrics_extra=priced)
    from matplotlib.figure import Figure

    drawn = []
    original = Figure.savefig
    Figure.savefig = lambda fig, *a, **k: (drawn.append(fig), original(fig, *a, **k))[1]
    try:
        (group,) = groups(find_runs([tmp_path]))
        accuracy_cost_plot(group, tmp_path)
    finally:
        Figure.savefig = original
    assert [axes.get_xlabel() for axes in drawn[0].axes] == ["cumulative effective MACs (float32-equivalent)",
                                                             "cumulative bit-serial time (s)"]


@pytest.mark.slow
def test_one_panel_line_plots_fit_a_configuration_label_wider_than_the_panel(tmp_path, recwarn):
    """The training-loss and average-bits plots put their legend below the panel, as the learning curves do: a
    legend inside a 6.5-inch panel with a longer label collapsed the panel (matplotlib warned and drew the legend
    over the axes)."""
    pfq = {"fw": [2, 3, 4, 5, 6, 7, 8], "bw": [6, 7, 8, 10, 12, 14, 16], "switch": "manual",
           "manual_epochs": [10, 20, 30, 40, 50, 60], "epsilon": 0.15, "alpha": 0.4, "window": 3,
           "scale_epochs": 5, "act_range": "sample_mean", "first_layer": "float32", "last_layer": "quantized"}
    dynasty = {"levels": [0, 1, 2, 3, 4, 5, 6, 7, 8], "max_bits": 8, "initial_bits": 6, "smoothing": 0.25,
               "iterations": 5, "weight_rounding": "stochastic", "act_rounding": "stochastic",
               "grad_rounding": "nearest", "first_layer": "float32", "last_layer": "float32", "average": "blocks",
               "act_map": "forward"}
    for seed in (0, 1):
        fake_run(tmp_path / "runs", f"pfq{seed}", "pfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], seed=seed,
                 model="resnet20", method_keys=pfq, metrics_extra={"stage": [0, 0, 1]})
        fake_run(tmp_path / "runs", f"dyn{seed}", "dynasty", [0.4, 0.6], [1e9, 2e9], seed=seed, model="resnet20",
                 method_keys=dynasty, metrics_extra={"dynasty_average_bits": [4.0, 2.0]})
    runs = find_runs([tmp_path / "runs"])
    assert all(len(config_label(run, runs)) > 200 for run in runs)
    names = [path.name.split("-")[0] for path in write_plots(runs, tmp_path / "plots")]
    assert {"loss", "average"} <= set(names)
    assert not [str(w.message) for w in recwarn if "constrained_layout not applied" in str(w.message)]
