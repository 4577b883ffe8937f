"""scripts/run_table.py: a table's sweeps (conf/sweeps/) become single runs in the directories the sweeps give them."""

import importlib.util
import time
from pathlib import Path

import pytest

from qtrain.errors import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_table.py"
spec = importlib.util.spec_from_file_location("run_table", SCRIPT)
run_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_table)


def test_a_sweep_expands_into_the_cartesian_product_of_its_values():
    runs = run_table.expanded(["qtrain", "-m", "method=dfq,sbm", "model.dfq_options=[[3,6],[4,6]]", "seed=0,1",
                               "name='a,b'"])
    assert runs == [
        ["qtrain", "-m", f"method={m}", "model.dfq_options=[[3,6],[4,6]]", f"seed={s}", "name='a,b'"]
        for m in ("dfq", "sbm") for s in ("0", "1")
    ]


def test_only_keeps_the_runs_that_set_the_value_and_those_that_do_not_sweep_the_key():
    runs = [["qtrain", "model=resnet38", "data=cifar10"], ["qtrain", "model=resnet74", "data=cifar10"],
            ["qtrain", "data=cifar100"]]
    assert run_table.selected(runs, ["model=resnet38"]) == [runs[0], runs[2]]
    assert run_table.selected(runs, ["model=resnet38", "data=cifar10"]) == [runs[0]]


def test_table3s_resnet38_cifar10_cells_are_three_runs_with_the_sweeps_settings(tmp_path):
    commands = [run_table.filled(words, tmp_path, tmp_path, "mini") for words in run_table.table_commands("fractrain_table3")]
    runs = run_table.selected([r for c in commands if c[0] == "qtrain" for r in run_table.expanded(c)],
                              ["model=resnet38", "data=cifar10"])
    methods = [next(w for w in r if w.startswith("method=")) for r in runs]
    assert methods == ["method=dfq", "method=fractrain", "method=sbm"]
    assert all("scale=mini" in r and f"hydra.sweep.dir={tmp_path}/fractrain_table3" in r for r in runs)
    assert "method.act_range=tensor" in runs[2]


def test_an_only_that_matches_no_run_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        run_table.main(["fractrain_table3", "--data", str(tmp_path), "--out", str(tmp_path), "--only", "model=vgg"])
    assert stop.value.code == 2
    assert "--only model=vgg matches none" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_table5s_cifar10_halves_are_ten_runs_under_out_and_start_from_the_table_s_own_pretrainings(tmp_path):
    commands = [run_table.filled(words, tmp_path, tmp_path, "mini") for words in run_table.table_commands("fractrain_table5")]
    runs = run_table.selected([r for c in commands if c[0] == "qtrain" for r in run_table.expanded(c)], ["data=cifar10"])
    assert len(runs) == 10
    assert not any("cifar100" in w for r in runs for w in r)
    pretrainings = [run_table.option(r, "hydra.run.dir") for r in runs[:2]]
    assert pretrainings == [f"{tmp_path}/fractrain_table5/pretrain_adapt_cifar10",
                            f"{tmp_path}/fractrain_table5/pretrain_finetune_cifar10"]
    assert {run_table.option(r, "train.init_from") for r in runs[2:]} == set(pretrainings)
    assert all(run_table.option(r, "hydra.sweep.dir") == f"{tmp_path}/fractrain_table5" for r in runs[2:])


def test_a_run_waits_for_the_run_it_starts_from_and_is_not_started_when_that_one_fails():
    finished: list[str] = []
    started_after: dict[str, list[str]] = {}

    def launch(words: list[str]) -> int:
        name = words[1]
        started_after[name] = list(finished)
        if name == "slow":
            time.sleep(0.3)
        finished.append(name)
        return 1 if name == "broken" else 0

    runs = [["qtrain", "slow", "hydra.run.dir=/o/a"], ["qtrain", "broken", "hydra.run.dir=/o/b"],
            ["qtrain", "from_a", "train.init_from=/o/a"], ["qtrain", "from_b", "train.init_from=/o/b"],
            ["qtrain", "free"]]
    codes = run_table.run_all(runs, 2, launch)
    assert codes == [0, 1, 0, None, 0]
    assert "slow" in started_after["from_a"]
    assert "from_b" not in started_after


def test_each_run_logs_to_a_file_named_by_what_sets_it_apart(tmp_path):
    commands = [run_table.filled(words, tmp_path, tmp_path, "mini") for words in run_table.table_commands("fractrain_table5")]
    runs = run_table.selected([r for c in commands if c[0] == "qtrain" for r in run_table.expanded(c)], ["data=cifar10"])
    names = run_table.log_names("fractrain_table5", runs)
    assert len(set(names)) == 10  # the two pre-trainings once wrote into one file
    assert names[:2] == ["fractrain_table5-fractrain_adapt_pretrain-pretrain_adapt_cifar10.log",
                         "fractrain_table5-fractrain_finetune_pretrain-pretrain_finetune_cifar10.log"]
    assert "fractrain_table5-fractrain_finetune-dfq-pretrain_finetune_cifar10.log" in names
    assert not any(str(tmp_path.name) in name for name in names)  # locations are not part of a name
    same = [["qtrain", "method=sbm", "seed=0"], ["qtrain", "method=sbm", "seed=0"], ["qtrain", "method=dfq", "seed=0"]]
    assert run_table.log_names("t", same) == ["t-sbm.log", "t-sbm-2.log", "t-dfq.log"]


def test_a_sweeps_file_is_read_as_its_command_lines(tmp_path, monkeypatch):
    from qtrain import sweeps

    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "own_table.yaml").write_text(
        "# A table's runs (FracTrain's recipe: an apostrophe in a comment), then its report:\n"
        "- qtrain -m experiment=own_table method=sbm,dfq 'method.fw=[4,6]' seed=0,1 data.root=DATA hydra.sweep.dir=OUT/own\n"
        "# the report\n"
        "- qtrain-report OUT/own --paper own\n")
    (tmp_path / "sweeps" / "not_a_list.yaml").write_text("qtrain: method=sbm\n")
    (tmp_path / "sweeps" / "other_program.yaml").write_text("- qtrain method=sbm\n- python scripts/run_table.py own\n")
    (tmp_path / "sweeps" / "unclosed.yaml").write_text("- qtrain 'method.fw=[4,6]\n")
    (tmp_path / "sweeps" / "interpolated.yaml").write_text("- qtrain -m hydra.sweep.dir=OUT/${now:%H-%M} seed=0,1\n")
    monkeypatch.setattr(sweeps.resources, "conf_dir", lambda: tmp_path)
    sweeps.commands.cache_clear()
    try:
        assert sweeps.commands("own_table") == (
            ("qtrain", "-m", "experiment=own_table", "method=sbm,dfq", "method.fw=[4,6]", "seed=0,1", "data.root=DATA",
             "hydra.sweep.dir=OUT/own"),
            ("qtrain-report", "OUT/own", "--paper", "own"))
        assert sweeps.commands("no_such_table") is None
        assert sweeps.commands("interpolated") == (("qtrain", "-m", "hydra.sweep.dir=OUT/${now:%H-%M}", "seed=0,1"),)
        with pytest.raises(ConfigError, match=r"not_a_list.yaml is not a list of command lines"):
            sweeps.commands("not_a_list")
        with pytest.raises(ConfigError, match=r"other_program.yaml: 'python scripts/run_table.py own' is not a command "
                                              r"line of qtrain or qtrain-report"):
            sweeps.commands("other_program")
        assert sweeps.experiments() == ["interpolated", "not_a_list", "other_program", "own_table", "unclosed"]
        with pytest.raises(SystemExit, match=r"'nope' has no sweeps file conf/sweeps/nope.yaml \(one of: interpolated, "):
            run_table.table_commands("nope")
        with pytest.raises(SystemExit, match=r"^run_table: error: .*unclosed.yaml: \"qtrain 'method.fw=\[4,6\]\" does "
                                             r"not split into words: No closing quotation$"):
            run_table.table_commands("unclosed")
    finally:
        sweeps.commands.cache_clear()


def test_every_sweeps_file_belongs_to_an_experiment_that_names_it():
    import re

    from qtrain import sweeps
    from qtrain.config.command_line import group_options
    from qtrain.resources import conf_dir

    assert set(sweeps.experiments()) <= set(group_options(conf_dir(), "experiment"))
    for experiment in sweeps.experiments():
        assert sweeps.commands(experiment), experiment  # a file with no command is an error, not a table
        assert f"conf/sweeps/{experiment}.yaml" in (conf_dir() / "experiment" / f"{experiment}.yaml").read_text()
    named = {m for path in (conf_dir() / "experiment").glob("*.yaml")
             for m in re.findall(r"conf/sweeps/(\w+)\.yaml", path.read_text())}
    assert named <= set(sweeps.experiments())

