"""Every bad input, driven through the ``qtrain`` command: one line ``qtrain: error: ...``, exit code 2,
no traceback, nothing trained, and no file or folder created or changed."""

import collections
import json
import pickle
import shutil
import subprocess

import pytest
import torch

from .conftest import TINY, run_cli
from .test_data import _write_mnist


def _tree(folder):
    """Every path under ``folder``, and each file's size and modification time."""
    return {str(p.relative_to(folder)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _no_epochs(tmp_path):
    run = tmp_path / "empty_run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "completed", "epochs_completed": 0}))


def _run_files(folder, summary=None, checkpoint=None):
    folder.mkdir()
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    if checkpoint is not None:
        torch.save(checkpoint, folder / "checkpoint.pt")


# every key a checkpoint holds but the identity
_NO_IDENTITY = {key: {} for key in ("device_type", "model", "optimizer", "scheduler", "method", "step_schedule", "meter",
                                    "progress", "precision_log", "rng")}


def _a_file(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")


def _corrupt_mnist(tmp_path):
    raw = _write_mnist(tmp_path / "mnist")
    (raw / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x07" + bytes(16))  # 7 dimensions: not an idx file


CASES = {
    # the command line, checked before Hydra composes anything
    "misspelt key": (["train.epoch=3"], None, "unknown key train.epoch (did you mean train.epochs?)"),
    "added key": (["+train.epoch=3"], None, "+train.epoch=3 is not allowed: nothing reads train.epoch "
                                            "(did you mean train.epochs?)"),
    "added existing key": (["+seed=3"], None, "+seed=3 is not allowed: seed is set already (drop the +)"),
    # once tracebacks, or a run under another group's name
    "seed past numpy's range": (["seed=99999999999999999999999"], None,
                                "seed=99999999999999999999999 is not allowed: it must be an integer in [0, 2147483647]"),
    "a group renamed": (["data.name=cifar10"], None, "data.name=cifar10 is not allowed: choose the data with data=NAME"),
    "an unset environment variable": (["train.epochs=${oc.env:QTRAIN_UNSET_VARIABLE}"], None,
                                      "train.epochs cannot be resolved: Environment variable 'QTRAIN_UNSET_VARIABLE' "
                                      "not found"),
    "milestones out of order": (["sched=multistep", "sched.milestones=[5,2]"], None,
                                "sched.milestones=[5, 2] is not allowed: its epochs must increase"),
    "a value that refers to itself": (["optim.lr=${optim.lr}"], None,
                                      "optim.lr cannot be resolved: Recursive interpolation detected"),
    "a model renamed": (["model.name=resnet38"], None,
                        "model.name=resnet38 is not allowed: choose the model with model=NAME"),
    "FP8 margin past float32": (["method=fp8", "method.margin=100000"], None,
                                "method.margin=100000 is not allowed: it must be an integer in [0, 127]"),
    "deleted key": (["~train.init_from"], None, "~train.init_from is not allowed: qtrain reads every key of its "
                                                "config (set train.init_from instead)"),
    "nested misspelt key": (["method.grad_bit=4"], None, "unknown key method.grad_bit (did you mean method.grad_bits?)"),
    "number as text": (["optim.lr=abc"], None, "optim.lr='abc' is not allowed: it must be a number"),
    "float for an integer": (["train.epochs=2.5"], None, "train.epochs=2.5 is not allowed: it must be an integer"),
    "sweep without -m": (["seed=0,1"], None, "seed=0,1 is a sweep: add -m (--multirun) to run one job per value"),
    "unknown choice": (["optim=lbfgs"], None, "unknown optim 'lbfgs' (choose from: adam, sgd)"),
    "a key given twice": (["seed=3", "seed=4"], None, "seed is given twice (seed=3, seed=4): give it once"),
    "a key of TINY given twice": (["train.epochs=3", "train.epochs=4"], None,
                                  "train.epochs is given twice (train.epochs=3, train.epochs=4): give it once"),
    "a group given twice": (["optim=adam", "optim=sgd"], None, "optim is given twice (optim=adam, optim=sgd): give it once"),
    "a path with a space, unquoted": (["data=mnist", "data.root={tmp}/my", "data"], None,
                                      "cannot read the override 'data': missing EQUAL at '<EOF>' (a value with spaces "
                                      "must be quoted: data.root=\"... data\")"),
    "another config name": (["-cn", "mine"], None, "-cn/--config-name mine is not allowed: qtrain composes its own "
                                                   "config tree (set keys on the command line, or choose experiment=NAME)"),
    "another config dir": (["-cd", "{tmp}"], None, "-cd/--config-dir {tmp} is not allowed: qtrain composes its own "
                                                   "config tree (set keys on the command line, or choose experiment=NAME)"),
    # the composed config, checked before the run directory is made and before any data is loaded
    "nan learning rate": (["optim.lr=nan"], None, "optim.lr=nan is not allowed: it must be a finite number > 0"),
    "infinite learning rate": (["optim.lr=inf"], None, "optim.lr=inf is not allowed: it must be a finite number > 0"),
    "no epochs": (["train.epochs=0"], None, "train.epochs=0 is not allowed: it must be an integer >= 1"),
    "epochs of no batches": (["train.batches_per_epoch=0"], None,
                             "train.batches_per_epoch=0 is not allowed: it must be an integer >= 1 or null"),
    "a transformer preset that does not exist": (["model=transformer", "model.preset=huge"], None,
                                                 "model.preset='huge' is not allowed (choose from: base, small, tiny)"),
    "no training data": (["data.n_train=0"], None, "data.n_train=0 is not allowed: it must be an integer >= 1"),
    "no data root": (["data=cifar10"], None, "data.root is not set: pass data.root=DIR, the folder that holds the "
                                             "cifar10 files"),
    "unknown text level": (["data=text", "data.level=byte"], None,
                           "data.level='byte' is not allowed (choose from: word, char)"),
    "fold past the last": (["data.fold=10"], None,
                           "data.fold=10 is not allowed: an integer from 0 to data.folds - 1 = 9, or null (the whole "
                           "training split)"),
    "one fold": (["data.folds=1"], None, "data.folds=1 is not allowed: it must be an integer >= 2"),
    # synthetic data: 256 training and 64 test images of 4 classes; a sample of 40 takes 10 of each
    "sample larger than its split": (["data.sample={train: 300}"], None,
                                     "data.sample.train=300 is not allowed: a class-balanced sample of the train split "
                                     "takes from 4 (one of each class) to 256 (the whole split) images"),
    "sample smaller than the classes": (["data.sample={test: 3}"], None,
                                        "data.sample.test=3 is not allowed: a class-balanced sample of the test split "
                                        "takes from 4 (one of each class) to 64 (the whole split) images"),
    "more folds than a class holds": (["data.sample={train: 40}", "data.fold=0", "data.folds=11"], None,
                                      "data.folds=11 is not allowed: at most 10, the images of the training split's "
                                      "smallest class (each fold holds part of every class)"),
    "manual epochs under the automatic switch": (["method=pfq", "method.manual_epochs=[1]"], None,
                                                 "method.manual_epochs=[1] is not allowed with method.switch=auto, which "
                                                 "moves on at the loss indicator's turning points: set "
                                                 "method.switch=manual, or leave manual_epochs empty"),
    "empty run directory": (["hydra.run.dir="], None, "hydra.run.dir= is not allowed: hydra.run.dir names the run's "
                            "folder (give a path, or leave it out for qtrain's own)"),
    "sweep over no values": (["-m", "seed=range(0,0)"], None, "seed=range(0,0) sweeps over no values: give it one at least"),
    # every job of a sweep is checked before the first starts: job 0 (one epoch) would otherwise train first
    "a sweep's later value": (["-m", "train.epochs=1,0"], None,
                              "train.epochs=0 is not allowed: it must be an integer >= 1"),
    "sample of a split that is not there": (["data.sample={train: 10, valid: 5}"], None,
                                            "data.sample={'train': 10, 'valid': 5} is not allowed: {train: N, test: M} "
                                            "with integers >= 1 (a split left out is taken whole), or null"),
    # CPT's cycles against the run's optimizer steps, known before the data loads (the CIFAR folder is empty):
    # 2 epochs of 782 batches of 64 of CIFAR's 50,000 images; 2 epochs of 3 batches
    "more CPT cycles than steps": (["method=cpt", "data=cifar10", "data.root={tmp}", "method.cycles=1565"], None,
                                   "method.cycles=1565 is not allowed: the run trains at most 1564 optimizer steps, "
                                   "and a cycle needs one at least (at most 1564 cycles)"),
    "more CPT cycles than short epochs' steps": (["method=cpt", "train.batches_per_epoch=3", "method.cycles=7"], None,
                                                 "method.cycles=7 is not allowed: the run trains at most 6 optimizer "
                                                 "steps, and a cycle needs one at least (at most 6 cycles)"),
    "evaluation too rare for the plateau schedule": (["sched=plateau", "train.eval_every=2"], None,
                                                      "train.eval_every=2 is not allowed with sched=plateau: it steps "
                                                      "on every epoch's test loss (use train.eval_every=1, or another "
                                                      "schedule)"),
    "evaluation every 0 epochs": (["train.eval_every=0"], None,
                                  "train.eval_every=0 is not allowed: it must be an integer >= 1"),
    "MX's ceil scale rule with only NVFP4 operands": (
        ["method=mx", "method.weight=nvfp4", "method.act=nvfp4", "method.grad=nvfp4", "method.scale_rule=ceil"], None,
        "method.scale_rule='ceil' is not allowed: it is the MX formats' shared exponent, and every operand is nvfp4 "
        "(which has its own): leave it floor"),
    "cp over 100 %": (["method=dfq", "method.target_cp=150"], None,
                      "method.target_cp=150 is not allowed: it must be a finite number in (0, 100]"),
    "dfq without blocks": (["method=dfq", "model=alexnet"], None,
                           "method dfq needs a model with residual blocks to gate; this model config has no dfq_options "
                           "(choose a ResNet or mobilenetv2)"),
    "dynasty target above its widest block": (["method=dynasty", "method.target_bits=9"], None,
                                              "method.target_bits=9 is not allowed: it must be a number in (0, 8] (the "
                                              "average bit-width, at most method.max_bits)"),
    "resnet18 stem": (["model=resnet18", "model.stem=vgg"], None,
                      "model.stem='vgg' is not allowed (choose from: auto, cifar, imagenet)"),
    "hardware target over 1": (["hardware.target_acc=74"], None,
                               "hardware.target_acc=74 is not allowed: it must be a finite number in (0, 1] or null"),
    "init from a run of no epochs": (["train.init_from={tmp}/empty_run"], _no_epochs,
                                     "train.init_from={tmp}/empty_run is not allowed: its run has no checkpoint to "
                                     "start from"),
    "init from a checkpoint that is a tensor": (
        ["train.init_from={tmp}/pre"], lambda t: _run_files(t / "pre", {"status": "completed"}, torch.zeros(3)),
        "train.init_from={tmp}/pre is not allowed: {tmp}/pre/checkpoint.pt is not a qtrain checkpoint (it holds a "
        "Tensor, not a dict); it was written by an older qtrain or by something else"),
    "init from a checkpoint without weights": (
        ["train.init_from={tmp}/pre"],
        lambda t: _run_files(t / "pre", {"status": "completed"}, {k: v for k, v in _NO_IDENTITY.items() if k != "model"}),
        "train.init_from={tmp}/pre is not allowed: {tmp}/pre/checkpoint.pt is not a qtrain checkpoint (it lacks "
        "identity, model); it was written by an older qtrain or by something else"),
    "init from a run whose summary is a list": (
        ["train.init_from={tmp}/pre"], lambda t: _run_files(t / "pre", ["completed"]),
        "train.init_from={tmp}/pre is not allowed: {tmp}/pre/summary.json is not a qtrain summary (it holds a JSON "
        "list, not an object)"),
    "resume a run whose summary is a list": (
        ["hydra.run.dir={tmp}/run"], lambda t: _run_files(t / "run", []),
        "{tmp}/run/summary.json is not a qtrain summary (it holds a JSON list, not an object): pass force=true to "
        "replace it, or choose another directory with hydra.run.dir=DIR"),
    "resume a run whose summary has no status": (
        ["hydra.run.dir={tmp}/run"], lambda t: _run_files(t / "run", {"method": "float32"}),
        "{tmp}/run/summary.json is not a qtrain summary (its status is '(absent)', not one of completed, diverged, "
        "failed): pass force=true to replace it, or choose another directory with hydra.run.dir=DIR"),
    "resume a run whose summary names no config": (
        ["hydra.run.dir={tmp}/run"], lambda t: _run_files(t / "run", {"status": "completed"}),
        "{tmp}/run/summary.json is not a qtrain summary (it names no config): pass force=true to replace it, or "
        "choose another directory with hydra.run.dir=DIR"),
    "resume a checkpoint without identity": (
        ["hydra.run.dir={tmp}/run"], lambda t: _run_files(t / "run", checkpoint=_NO_IDENTITY),
        "{tmp}/run/checkpoint.pt is not a qtrain checkpoint (it lacks identity); it was written by an older qtrain or "
        "by something else: pass force=true to replace it, or choose another directory with hydra.run.dir=DIR"),
    "run directory under a file": (["hydra.run.dir={tmp}/a_file/run"], _a_file,
                                   "cannot create the run directory {tmp}/a_file/run: {tmp}/a_file is not a directory"),
    # found while loading the data: the run directory made for it is removed again
    "corrupt MNIST": (["data=mnist", "data.root={tmp}/mnist"], _corrupt_mnist,
                      "corrupt MNIST file {tmp}/mnist/MNIST/raw/train-images-idx3-ubyte: its idx header or size is "
                      "not that of an MNIST file"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_bad_input_is_one_line_before_any_work(tmp_path, case):
    args, setup, message = CASES[case]
    if setup is not None:
        setup(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    before = _tree(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    given = {a.partition("=")[0] for a in args}  # the case's keys replace TINY's; the case's own stay as written
    flags = [a for a in args if a in ("-m", "--multirun")]  # comes before the overrides
    result = run_cli(*flags, *(a for a in TINY if a.partition("=")[0] not in given),
                     *(a for a in args if a not in flags), cwd=work, raw=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"qtrain: error: {message.replace('{tmp}', str(tmp_path))}"]
    assert "epoch 1" not in result.stdout
    assert _tree(tmp_path) == before


@pytest.fixture
def immutable(tmp_path):
    folder = tmp_path / "immutable"
    folder.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("where", ["immutable", "immutable/run"])
@pytest.mark.slow
def test_unwritable_run_directory_is_one_line(tmp_path, immutable, where):
    before = _tree(tmp_path)
    result = run_cli(*TINY, f"hydra.run.dir={tmp_path / where}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"qtrain: error: cannot write to the run directory {tmp_path / where}: Operation not permitted in {immutable}"]
    assert _tree(tmp_path) == before


@pytest.mark.slow
def test_raw_pickle_checkpoint_is_refused_without_torch_warning(tmp_path):
    _run_files(tmp_path / "pre", {"status": "completed"})
    checkpoint = tmp_path / "pre" / "checkpoint.pt"
    checkpoint.write_bytes(pickle.dumps({"model": collections.Counter()}, protocol=4))  # a global weights_only refuses
    work = tmp_path / "work"
    work.mkdir()
    try:
        result = run_cli(*TINY, f"train.init_from={tmp_path / 'pre'}", cwd=work)
    finally:
        checkpoint.unlink()  # the fixture that loads every checkpoint with weights_only=True would refuse it too
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"qtrain: error: train.init_from={tmp_path / 'pre'} is not allowed: {checkpoint} cannot be read as a qtrain "
        "checkpoint of plain tensors (UnpicklingError); it was written by an older qtrain or by something else"]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
@pytest.mark.slow
def test_world_size_without_torchrun_rendezvous_is_one_line(tmp_path, monkeypatch, missing):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv(missing)
    result = run_cli(*TINY, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"qtrain: error: WORLD_SIZE=2 is set but {missing} is not: start several "
                                          "processes with torchrun --nproc-per-node=N -m qtrain.cli ..."]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["immutable", "immutable/sweep"])
@pytest.mark.slow
def test_unwritable_sweep_directory_is_one_line(tmp_path, immutable, where):
    before = _tree(tmp_path)
    result = run_cli("-m", *TINY, "seed=0,1", f"hydra.sweep.dir={tmp_path / where}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"qtrain: error: cannot write to the sweep directory {tmp_path / where}: Operation not permitted in {immutable}"]
    assert _tree(tmp_path) == before


@pytest.mark.slow
def test_sweep_directory_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = run_cli("-m", *TINY, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'a_file' / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"qtrain: error: cannot create the sweep directory {tmp_path / 'a_file' / 'sweep'}: "
                                          f"{tmp_path / 'a_file'} is not a directory"]


# Each line once made qtrain (through Hydra) call a function or read a file the command line chose; MARKER is a file
# that such a call creates, and must never appear.
UNSAFE = {
    "callback touches a file": ["+hydra.callbacks.e._target_=pathlib.Path.touch", "+hydra.callbacks.e._args_=[MARKER]"],
    "callback opens a file": ["+hydra.callbacks.e._target_=builtins.open", "+hydra.callbacks.e._args_=[MARKER,w]"],
    "qtrain's callback replaced": ["hydra.callbacks.qtrain._target_=pathlib.Path.touch"],
    "config search path": ["hydra.searchpath=[file://MARKER]"],
    "logging handler": ["hydra.job_logging.handlers.console.class=logging.FileHandler"],
    "hydra's own logging": ["+hydra.hydra_logging.handlers.f.filename=MARKER"],
    "launcher class": ["hydra.launcher._target_=pathlib.Path.touch"],
    "sweeper class": ["hydra.sweeper._target_=pathlib.Path.touch"],
    "environment": ["hydra.job.env_set.LD_PRELOAD=MARKER"],
    "a whole subtree": ["hydra.job={env_set:{X:MARKER}}"],
    "sweeper's params": ["hydra.sweeper.params={optim._target_:pathlib.Path.touch}"],
    "sweeper chosen": ["hydra/sweeper=basic"],
    "a node made from a string": ["hydra.launcher.n_jobs='${oc.create:{a:1}}'"],
    "a group placed under the callbacks": ["+hydra/sweeper@hydra.callbacks.x=basic"],
    "optimizer class": ["optim._target_=pathlib.Path.touch"],
    "nested instantiation": ["optim.lr={_target_:pathlib.Path.touch,_args_:[MARKER]}"],
}


@pytest.mark.parametrize("case", list(UNSAFE))
def test_the_command_line_makes_qtrain_call_no_function_of_its_choosing(tmp_path, case):
    marker = tmp_path / "marker"
    args = [a.replace("MARKER", str(marker)) for a in UNSAFE[case]]
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli(*TINY, *args, cwd=work, raw=True)
    assert result.returncode == 2, result.stderr
    line, = result.stderr.splitlines()
    assert line.startswith("qtrain: error: ") and "is not allowed" in line
    assert not marker.exists() and list(work.iterdir()) == []


def test_experimental_rerun_unpickles_nothing(tmp_path):
    # a pickle that would create the marker when loaded
    marker = tmp_path / "marker"
    payload = tmp_path / "config.pickle"
    payload.write_bytes(pickle.dumps(_Touch(str(marker))))
    result = run_cli("--experimental-rerun", str(payload), cwd=tmp_path, raw=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"qtrain: error: --experimental-rerun {payload} is not allowed: it unpickles "
                                          "the file it is given (rerun a run with the command line in its "
                                          ".hydra/overrides.yaml)"]
    assert not marker.exists()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import pathlib

        return pathlib.Path(self.path).touch, ()
