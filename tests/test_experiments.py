"""Every experiment config composes, and its values pass the checks a run makes before any work."""

import pytest
from omegaconf import OmegaConf

from qtrain.cli import conf_dir
from qtrain.config import group_options, validate
from qtrain.methods import build_method

from .conftest import make_config


@pytest.mark.parametrize("experiment", group_options(conf_dir(), "experiment"))
def test_every_experiment_composes_and_passes_the_checks(experiment, tmp_path):
    cfg = make_config(f"experiment={experiment}")
    if "root" in cfg.data.keys() and OmegaConf.is_missing(cfg.data, "root"):
        cfg.data.root = str(tmp_path)  # a folder: the files are read only once a run starts
    validate(cfg)
    build_method(cfg.method)


@pytest.mark.parametrize("experiment,model,data,accum,buffer_bits,l2", [
    ("adapt_alexnet_cifar10", "alexnet", "cifar10", 4, 4, 1e-8),
    ("adapt_alexnet_cifar100", "alexnet", "cifar100", 4, 8, 1e-4),
    ("adapt_resnet20_cifar10", "resnet20", "cifar10", 4, 8, 1e-4),
    ("adapt_resnet20_cifar100", "resnet20", "cifar100", 2, 8, 1e-4),
])
def test_adapt_table_runs_follow_the_paper_and_reference_configs(experiment, model, data, accum, buffer_bits, l2):
    cfg = make_config(f"experiment={experiment}")
    assert (cfg.model.name, cfg.data.name, cfg.method.name) == (model, data, "adapt")
    assert (cfg.train.batch_size, cfg.train.accum_steps, cfg.train.epochs) == (512, accum, 100)
    assert (cfg.method.buffer_bits, cfg.method.l2, cfg.optim.weight_decay) == (buffer_bits, l2, 0.0)
    assert cfg.sched.name == "plateau" and (cfg.method.initial.wl, cfg.method.initial.fl) == (8, 4)


@pytest.mark.parametrize("method", ["dynasty", "float32", "sbm"])
def test_dynasty_table1_follows_the_paper_schedule(method):
    cfg = make_config("experiment=dynasty_cifar100", f"method={method}")
    assert (cfg.model.name, cfg.data.name, cfg.method.name) == ("resnet18", "cifar100", method)
    assert (cfg.train.batch_size, cfg.train.epochs, cfg.optim.name, cfg.optim.lr) == (128, 200, "sgd", 0.1)
    assert (list(cfg.sched.milestones), cfg.sched.gamma, cfg.sched.warmup_epochs) == ([60, 120, 160], 0.2, 1)
    assert cfg.hardware.target_acc == 0.74
