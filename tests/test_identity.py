"""A run's identity stays what it was for every config: committed results name their runs by its digest."""

import copy

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from qtrain.config import NOT_IN_DIR_NAME, OMITTED_AT, digest, identity, with_keys_added_since
from qtrain.resources import conf_dir

from .conftest import make_config

# Digests computed on the branch before the optimizer and schedule configs gained Hydra's _target_ and _partial_
# (commit 20b3c7f, qtrain.config.identity over conf/ as it was then): those keys are left out of the identity, so
# every existing config keeps its run directory.
BEFORE_TARGETS = {
    (): "a211650e",
    ("sched=constant",): "447d5f85",
    ("sched=multistep",): "f062ffd3",
    ("sched=plateau",): "2ff66f02",
    ("optim=adam",): "d4d72f11",
    ("model=transformer",): "c9c01220",
    ("experiment=muppet_cifar", "data=synthetic"): "b75a8102",
    ("experiment=fractrain_table3", "scale=smoke"): "e767027a",
    ("experiment=dynasty_cifar100", "scale=smoke"): "bd869ee5",
}


@pytest.mark.parametrize("overrides", list(BEFORE_TARGETS))
def test_the_identity_of_a_config_is_what_it_was(overrides):
    assert digest(identity(make_config(*overrides))) == BEFORE_TARGETS[overrides]


# keys added after runs were committed: at the value those runs had, left out of the identity
@pytest.mark.parametrize("key,before,other,overrides", [("train.eval_every", 1, 3, ()),
                                                        ("method.scale_rule", "floor", "ceil", ("method=mx",)),
                                                        ("method.cp_gemms", "all", "weight_gradient", ("method=dfq",)),
                                                        ("model.classifier_init", "torch", "normal_in_out",
                                                         ("model=resnet38",))])
def test_a_key_added_later_keeps_the_identity_at_the_value_runs_had_before_it(key, before, other, overrides):
    assert OMITTED_AT[key] == before
    config = make_config(*overrides, f"{key}={before}")
    made_before = OmegaConf.to_container(config, resolve=True)  # the same config as a run made before the key has it
    section, name = key.split(".")
    del made_before[section][name]
    assert digest(identity(config)) == digest(identity(made_before))
    assert digest(identity(make_config(*overrides, f"{key}={other}"))) != digest(identity(made_before))
    if not overrides:
        assert digest(identity(config)) == BEFORE_TARGETS[()]


def test_hydras_instantiation_keys_are_not_in_the_identity():
    cfg = make_config("optim=adam", "sched=multistep")
    assert (cfg.optim._target_, cfg.sched._partial_) == ("torch.optim.Adam", True)
    ident = identity(cfg)
    assert not {"_target_", "_partial_"} & (set(ident["optim"]) | set(ident["sched"]))


def test_the_run_directory_name_leaves_out_the_keys_run_keys_says():
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["force=true", "seed=3"], return_hydra_config=True)
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == list(NOT_IN_DIR_NAME)
    assert {"data.root", "train.init_from", "force", "progress", "hydra.run.dir"} <= set(NOT_IN_DIR_NAME)
    assert cfg.hydra.job.override_dirname == "seed=3"


def test_a_config_recorded_before_keys_were_added_gets_them_at_the_values_runs_had():
    current = {m: OmegaConf.to_container(make_config(f"method={m}"), resolve=True) for m in ("sbm", "mx", "dfq")}
    recorded = copy.deepcopy(current)
    for config in recorded.values():
        del config["train"]["eval_every"]
    for key in ("scale_rule", "matmuls"):
        del recorded["mx"]["method"][key]
    del recorded["dfq"]["method"]["cp_gemms"]
    assert {m: with_keys_added_since(config) for m, config in recorded.items()} == current
    assert "scale_rule" not in with_keys_added_since(recorded["sbm"])["method"]  # no key of a method lacking it
    transformer = OmegaConf.to_container(make_config("model=transformer", "data=text"), resolve=True)
    assert "classifier_init" not in with_keys_added_since(transformer)["model"]  # nor of a model lacking it
