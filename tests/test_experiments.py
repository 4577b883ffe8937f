"""Every experiment composes at every scale and passes the checks a run makes before any work; paper scale is
the papers' settings; mini shortens the schedule in proportion; every experiment runs at smoke scale."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from qtrain.config import digest, group_options, identity, validate
from qtrain.data.registry import REGISTRY
from qtrain.methods import build_method
from qtrain.report.cli import report
from qtrain.report.paper import compare, paper_tables
from qtrain.report.runs import find_runs
from qtrain.resources import conf_dir

from .conftest import make_config

EXPERIMENTS = group_options(conf_dir(), "experiment")
SCALES = group_options(conf_dir(), "scale")


def test_the_scales_are_paper_mini_and_smoke():
    assert SCALES == ["mini", "paper", "smoke"]
    assert make_config().train.epochs == make_config("scale=paper").train.epochs == 12


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.slow
def test_every_experiment_composes_and_passes_the_checks(experiment, scale, tmp_path):
    cfg = make_config(f"experiment={experiment}", f"scale={scale}")
    if REGISTRY[cfg.data.name].needs_root and OmegaConf.is_missing(cfg.data, "root"):
        cfg.data.root = str(tmp_path)  # a folder: the files are read only once a run starts
    validate(cfg)
    build_method(cfg.method)
    if scale == "smoke":  # no data files, eager kernels, no progress bars, 2 epochs
        assert not REGISTRY[cfg.data.name].needs_root
        assert (cfg.train.epochs, cfg.fused, cfg.progress) == (2, False, False)


@pytest.mark.parametrize("experiment,model,data,accum,buffer_bits,l2,lookback", [
    ("adapt_alexnet_cifar10", "alexnet", "cifar10", 4, 4, 1e-8, {"low": 25, "high": 100, "momentum": 0.33}),
    ("adapt_alexnet_cifar100", "alexnet", "cifar100", 4, 8, 1e-4, {"low": 25, "high": 150, "momentum": 0.9}),
    ("adapt_resnet20_cifar10", "resnet20", "cifar10", 4, 8, 1e-4, {"low": 25, "high": 100, "momentum": 1.0}),
    ("adapt_resnet20_cifar100", "resnet20", "cifar100", 2, 8, 1e-4, {"low": 25, "high": 100, "momentum": 0.9}),
])
def test_adapt_table_runs_follow_the_paper_and_reference_configs(experiment, model, data, accum, buffer_bits, l2,
                                                                 lookback):
    cfg = make_config(f"experiment={experiment}")
    assert (cfg.model.name, cfg.data.name, cfg.method.name) == (model, data, "adapt")
    assert (cfg.train.batch_size, cfg.train.accum_steps, cfg.train.epochs) == (512, accum, 100)
    # the reference's L2 is its optimizer's weight decay on the normalized gradient, not a loss term
    assert (cfg.method.buffer_bits, cfg.method.l2, cfg.optim.weight_decay) == (buffer_bits, 0.0, l2)
    assert cfg.sched.name == "plateau" and (cfg.method.initial.wl, cfg.method.initial.fl) == (8, 4)
    assert (cfg.sched.patience, dict(cfg.method.lookback)) == (10, lookback)
    assert (cfg.method.grad, cfg.method.pushup, cfg.method.pushdown_search) == ("quantized", "reference", "reference")
    assert cfg.data.sample is None


@pytest.mark.parametrize("model,data,l1,l2", [("alexnet", "cifar100", 1e-8, 1e-4), ("resnet20", "cifar10", 1e-8, 1e-4)])
@pytest.mark.slow
def test_adapt_float32_baselines_follow_the_reference_float32_configs(model, data, l1, l2):
    cfg = make_config("experiment=adapt_float32", f"model={model}", f"data={data}")
    assert cfg.method.name == "float32" and (cfg.method.init, cfg.method.init_scale) == ("tnvs", 0.5)
    assert (cfg.method.l1, cfg.optim.weight_decay) == (l1, l2)
    assert (cfg.train.batch_size, cfg.train.accum_steps, cfg.optim.lr) == (512, 4, 0.1)


@pytest.mark.parametrize("method", ["dynasty", "float32", "sbm"])
def test_dynasty_table1_follows_the_paper_schedule(method):
    cfg = make_config("experiment=dynasty_cifar100", f"method={method}")
    assert (cfg.model.name, cfg.data.name, cfg.method.name) == ("resnet18", "cifar100", method)
    assert (cfg.train.batch_size, cfg.train.epochs, cfg.optim.name, cfg.optim.lr) == (128, 200, "sgd", 0.1)
    assert (list(cfg.sched.milestones), cfg.sched.gamma, cfg.sched.warmup_epochs) == ([60, 120, 160], 0.2, 1)
    assert cfg.hardware.target_acc == 0.74 and cfg.data.sample is None


@pytest.mark.parametrize("experiment", ["fractrain_table1", "fractrain_table3", "fractrain_table5", "fractrain_fig3",
                                        "fractrain_manual_pfq", "fractrain_table6"])
def test_fractrain_experiments_follow_the_paper_schedule(experiment):
    cfg = make_config(f"experiment={experiment}")
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.optim.lr, cfg.optim.weight_decay) == (160, 128, 0.1, 1e-4)
    assert (list(cfg.sched.milestones), cfg.sched.gamma, cfg.data.sample) == ([80, 120], 0.1, None)
    assert (cfg.method.window, cfg.method.scale_epochs) == (5, 10)
    assert list(cfg.method.manual_epochs) == ([40, 80, 120] if experiment == "fractrain_manual_pfq" else [])


def test_fractrain_table6_trains_fractrain_on_resnet110_with_the_released_scripts_options():
    cfg = make_config("experiment=fractrain_table6")
    assert (cfg.method.name, cfg.model.name, cfg.data.name) == ("fractrain", "resnet110", "cifar10")
    assert list(cfg.method.cp_schedule) == [1.5, 2.0, 2.5, 3.0] and cfg.method.weight_bits == 4
    # train_frac.py's hard-coded set: the paper names none for these depths (Table 3's are for ResNet-38/74)
    assert [list(o) for o in cfg.method.options] == [[3, 6], [4, 6], [4, 8], [6, 8], [6, 12]]
    assert make_config("experiment=fractrain_table6", "model=resnet164").method.options == cfg.method.options


@pytest.mark.parametrize("model", ["resnet18", "resnet34"])
def test_fractrain_table4_follows_the_reference_imagenet_command(model):
    cfg = make_config("experiment=fractrain_table4", f"model={model}")
    assert (cfg.method.name, cfg.model.name, cfg.data.name) == ("fractrain", model, "imagenet")
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.optim.lr, cfg.optim.weight_decay) == (90, 256, 0.1, 1e-4)
    assert (list(cfg.sched.milestones), cfg.sched.gamma) == ([30, 60], 0.1)
    assert list(cfg.method.cp_schedule) == [3.0, 3.5, 4.0, 4.5]  # the table's cp=3/3.5/4/4.5
    assert (cfg.method.epsilon, cfg.method.alpha, cfg.method.act_momentum) == (0.05, 0.3, 0.9)
    assert [list(o) for o in cfg.method.options] == [[3, 6], [4, 8], [6, 12], [8, 16]] and cfg.method.weight_bits == 6
    assert dict(cfg.method.gate) == {"width": None, "embed": 40, "hidden": 20}
    assert cfg.method.projection == "float32"  # fractrain_imagenet/models.py: plain nn.Conv2d shortcuts
    sbm = make_config("experiment=fractrain_imagenet", "method=sbm", f"model={model}")  # the table's SBM sweep
    assert (sbm.method.name, sbm.train.epochs, sbm.model.name) == ("sbm", 90, model)


def test_muppet_experiments_follow_the_reference_configs():
    muppet, baseline = make_config("experiment=muppet_cifar"), make_config("experiment=muppet_float32")
    assert (muppet.train.epochs, muppet.method.resolution, muppet.method.patience) == (150, 3, 2)
    assert muppet.method.float32_lr.every == 15 and muppet.data.sample is None
    assert (baseline.train.epochs, list(baseline.sched.milestones)) == (150, [50, 100])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.slow
def test_mini_shortens_the_schedule_in_proportion(experiment):
    paper, mini = make_config(f"experiment={experiment}"), make_config(f"experiment={experiment}", "scale=mini")
    if paper.train.epochs == 12:  # the default length: nothing to shorten (sbm_bw16_*)
        assert mini.train.epochs == 12
        return
    assert mini.train.epochs < paper.train.epochs
    if paper.sched.name == "multistep":  # each lr step at the same fraction of training, to within an epoch
        assert len(mini.sched.milestones) == len(paper.sched.milestones)
        for short, full in zip(mini.sched.milestones, paper.sched.milestones):
            assert abs(short / mini.train.epochs - full / paper.train.epochs) <= 1 / mini.train.epochs
    if paper.sched.name == "plateau":
        assert mini.sched.patience == round(paper.sched.patience * mini.train.epochs / paper.train.epochs)
    if paper.sched.name == "inverse_sqrt":  # the warm-up the same share of the optimizer steps, to within a tenth
        steps = {c: c.train.epochs * (c.train.batches_per_epoch or 195) for c in (paper, mini)}  # mini: 195 a pass
        assert mini.sched.warmup_steps / steps[mini] == pytest.approx(paper.sched.warmup_steps / steps[paper], rel=0.1)
    assert mini.data.sample is not None  # a fixed sample of the real data
    # a language model's batch is rows of seq_len tokens: the same tokens a batch (the small model's shorter rows)
    tokens = {c: c.train.batch_size * (c.model.seq_len if c.model.name == "transformer" else 1) for c in (paper, mini)}
    assert (tokens[mini], mini.train.accum_steps, mini.optim.lr) == (tokens[paper], paper.train.accum_steps, paper.optim.lr)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """One folder per run identity: an experiment that is another's run (a table's file) finds it finished.

    One torch thread: on runs this small a second thread's synchronization costs more than it saves, and on a
    loaded 2-core machine several times more (measured: 4-7x the time with two).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path_factory.mktemp("smoke")
    torch.set_num_threads(threads)


def _run_at_smoke(experiment: str, runs: Path, *overrides: str) -> Path:
    from qtrain.run import run

    cfg = make_config(f"experiment={experiment}", "scale=smoke", *overrides)
    if cfg.train.init_from is not None:  # the pre-training experiment's run, by the name its default path gives
        pretrain = _run_at_smoke(Path(cfg.train.init_from).name, runs)
        cfg = make_config(f"experiment={experiment}", "scale=smoke", *overrides, f"train.init_from={pretrain}")
    run_dir = runs / digest(identity(cfg))
    assert run(cfg, run_dir)["status"] == "completed"
    return run_dir


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.slow
def test_every_experiment_runs_at_smoke_scale(experiment, smoke_runs):
    run_dir = _run_at_smoke(experiment, smoke_runs)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = OmegaConf.create(summary["config"])
    metrics = pd.read_csv(run_dir / "metrics.csv")
    # the experiment's own config trained to its end (or to the epoch its method stopped at), every epoch on record
    assert summary["run_id"] == run_dir.name and summary["method"] == config.method.name
    stopped = summary["stopped_early"]
    assert summary["epochs_completed"] == (stopped["epoch"] if stopped else config.train.epochs)
    assert metrics.epoch.tolist() == list(range(1, summary["epochs_completed"] + 1))
    assert metrics.effective_macs.is_monotonic_increasing and metrics.train_loss.notna().all()
    cost = summary["cost"]
    assert cost["effective_macs"] == pytest.approx(metrics.effective_macs.iloc[-1])
    if config.method.name == "float32":
        assert cost["percent_of_float32"] == pytest.approx(100.0)
    else:  # every quantized method costs less than float32's MACs, and more than nothing
        assert 0 < cost["percent_of_float32"] < 100


@pytest.mark.parametrize("table", [e for e in EXPERIMENTS if e in paper_tables()])
@pytest.mark.slow
def test_every_paper_table_is_reported_from_its_smoke_run(table, smoke_runs):
    # the table's own run (reported, not rerun, when the test above made it); Table 1's sweep sets FW(4,4,6,8)
    _run_at_smoke(table, smoke_runs, *(["method.fw=[4,4,6,8]"] if table == "fractrain_table1" else []))
    comparison, _ = compare(find_runs([smoke_runs]), table)
    assert len(comparison) and comparison.ours.notna().any()  # the paper's cells beside figures of ours
    assert set(comparison.scale) == {"smoke"}  # the stand-in data tells the scale of a run with no command line
    assert f"Table {table.rpartition('table')[2]} at smoke scale: " in report([str(smoke_runs), "--paper", table])


def _documented_commands() -> list[tuple[str, str]]:
    """(experiment, command line after ``qtrain``) for every ``qtrain`` command of the sweeps files."""
    import shlex

    from qtrain import sweeps

    return [(experiment, shlex.join(words[1:])) for experiment in sweeps.experiments()
            for words in sweeps.commands(experiment) if words[0] == "qtrain"]


@pytest.mark.parametrize("experiment,command", _documented_commands())
@pytest.mark.slow
def test_documented_commands_compose(experiment, command, tmp_path):
    """The command line passes qtrain's checks, and composes without its sweeps (Hydra's first step in a sweep)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from qtrain.config import check_command_line

    words = shlex.split(command.replace("DATA", str(tmp_path)).replace("OUT", str(tmp_path)))
    # a dataset's folder named by a placeholder of its own (IMAGENET, WIKITEXT103): a folder here, as on a user's disk;
    # every job's data.root must exist (a sweep checks each job's values before the first starts)
    words = [re.sub(r"^data\.root=([A-Z][A-Z0-9_]*)$", lambda m: f"data.root={tmp_path / m[1]}", w) for w in words]
    for word in words:
        if word.startswith("data.root="):
            for folder in word.partition("=")[2].split(","):
                Path(folder).mkdir(parents=True, exist_ok=True)
    multirun = words[0] == "-m"
    overrides = words[1:] if multirun else words
    check_command_line(overrides, conf_dir(), multirun)
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()]
    make_config(*fixed)


@pytest.mark.parametrize("experiment", sorted({e for e, _ in _documented_commands() if e.startswith(("fractrain_", "dynasty_"))}))
def test_cifar10_cells_come_first_and_cifar100_apart(experiment):
    # a sweeps file's first command must run without CIFAR-100 on disk: each command names one CIFAR dataset
    import shlex

    datasets = []
    for found, command in _documented_commands():
        words = dict(word.partition("=")[::2] for word in shlex.split(command) if word.startswith("data="))
        if found == experiment and words:
            assert "," not in words["data"], command
            datasets.append(words["data"])
    cifar = [name for name in datasets if name in ("cifar10", "cifar100")]
    if "cifar10" in cifar:
        assert cifar[0] == "cifar10", datasets
