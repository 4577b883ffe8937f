"""Sweeps under Hydra's launchers: local parallel jobs (joblib), SLURM (submitit) and submitit's local launcher.

Each keeps the sweep's guarantees: a failed job is recorded in its directory, the closing table lists every
job, the exit code says whether any failed, and a rerun redoes the failed jobs only.
"""

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from joblib import cpu_count
from omegaconf import OmegaConf

from qtrain.config import check_command_line, digest, identity, run_dir_name, sweep_size
from qtrain.errors import ConfigError
from qtrain.launch import job_tag, job_threads
from qtrain.resources import conf_dir

from .conftest import TINY, make_config, once, run_cli


def test_each_parallel_job_gets_its_share_of_the_cores():
    joblib = {"n_jobs": 4}
    assert job_threads(joblib, 24, cores=16) == 4  # 16 cores, 4 jobs at a time
    assert job_threads(joblib, 2, cores=16) == 8  # only 2 jobs in the sweep: 2 at a time
    assert job_threads(joblib, None, cores=16) == 4  # a sweep whose size Hydra decides
    assert job_threads({"n_jobs": -1}, 24, cores=16) == 1  # one job per core
    assert job_threads({"n_jobs": -1}, 3, cores=16) == 5  # 3 jobs on 16 cores: 5 each, one core spare
    assert job_threads({"n_jobs": -4}, 24, cores=16) == 1  # 13 at a time
    assert job_threads({"n_jobs": -4}, 24, cores=32) == 1  # 29 at a time: 32 // 29
    assert job_threads({"n_jobs": -20}, 24, cores=16) == 16  # all but 19 of 16 cores: one at a time
    assert job_threads({"n_jobs": 32}, 24, cores=16) == 1  # more jobs than cores: one thread each
    assert job_threads({"cpus_per_task": 6, "timeout_min": 60}, 24, cores=2) == 6  # SLURM: what the job asked for
    assert job_threads({"cpus_per_task": None}, 24, cores=16) is None  # submitit with no CPU count: torch's own
    assert job_threads({}, 24, cores=16) is None  # the basic launcher: one job at a time, torch's own
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ConfigError, match=rf"^hydra\.launcher\.n_jobs={bad!r} is not allowed: it must be a number"):
            job_threads({"n_jobs": bad}, 2, cores=16)
    with pytest.raises(ConfigError, match=r"^hydra\.launcher\.cpus_per_task=0 is not allowed: it must be an integer >= 1$"):
        job_threads({"cpus_per_task": 0}, 2, cores=16)


def test_sweep_size_counts_the_combinations():
    assert sweep_size(["method=float32,sbm", "seed=0,1,2", "train.epochs=1"]) == 6
    assert sweep_size(["seed=range(0,4)", "model=resnet20"]) == 4
    assert sweep_size(["train.epochs=1"]) == 1
    assert sweep_size(["method=glob(*)"]) is None  # Hydra lists the choices
    assert sweep_size(["optim.lr=interval(0.01,0.1)"]) is None  # a sampling sweeper's to draw


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.slow
def test_slurm_config_requeues_and_names_job_directories_as_a_local_sweep(monkeypatch):
    OmegaConf.register_new_resolver("qtrain.run_dir_name", run_dir_name, replace=True)  # the CLI registers it
    job = ["method=float32", "seed=1"]
    cfg = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=1", *job)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.cpus_per_task, launcher.mem_gb) == ("gpu", 1, 8, 32)
    assert (launcher.nodes, launcher.tasks_per_node) == (1, 1)  # a qtrain job is one process
    # requeued after up to 10 time-outs of 12 hours (preemptions do not count), warned 2 minutes ahead
    assert (launcher.timeout_min, launcher.max_num_timeout, launcher.signal_delay_s) == (720, 10, 120)
    assert job_threads(launcher, 24, cores=2) == 8  # the job's torch threads: its CPUs, not the login node's

    from submitit.slurm.slurm import _make_sbatch_string

    sbatch = _make_sbatch_string("python -m submitit.core._submit", "/tmp/logs/%j", partition=launcher.partition,
                                 time=launcher.timeout_min, cpus_per_task=launcher.cpus_per_task,
                                 gpus_per_node=launcher.gpus_per_node, signal_delay_s=launcher.signal_delay_s)
    assert {"#SBATCH --signal=USR2@120", "#SBATCH --time=720", "#SBATCH --cpus-per-task=8",
            "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1"} <= set(sbatch.splitlines())

    # A requeued job composes the same config, so it finds the same directory: the config's digest names it,
    # whatever the launcher, so a sweep started on a workstation can be finished on a cluster and back.
    local = _compose(*job)
    assert cfg.hydra.sweep.dir == local.hydra.sweep.dir == "multirun"
    task = OmegaConf.masked_copy(local, [k for k in local.keys() if k != "hydra"])
    expected = f"float32-resnet20-digits/method=float32,seed=1,id={digest(identity(task))}"
    assert cfg.hydra.sweep.subdir == local.hydra.sweep.subdir == expected
    assert cfg.hydra.launcher.submitit_folder == "multirun/.submitit/%j"

    # the command-line check lets Hydra's own overrides through, sweeps included
    check_command_line(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "method=float32,sbm"], conf_dir(), True)
    check_command_line(["hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "seed=0,1"], conf_dir(), True)


@pytest.mark.slow
def test_launchers_pass_the_command_line_check_and_help(tmp_path):
    for launcher in ("parallel", "slurm"):
        result = run_cli("-m", f"hydra/launcher={launcher}", "method=float32", "--help", cwd=tmp_path)
        assert result.returncode == 0 and "method: adapt, cpt, dfq" in result.stdout, result.stderr
    result = run_cli("-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=0", "seed=0,1", *TINY, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["qtrain: error: hydra.launcher.n_jobs=0 is not allowed: it must be a number of "
                                          "jobs at a time (>= 1) or -k for all cores but k-1 (-1: one job per core)"]
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["hydra/launcher=nope"],
     "unknown launcher 'nope' (choose from: basic, joblib, parallel, slurm, submitit_local, submitit_slurm)"),
    (["hydra/launcher=slurm", "hydra.launcher.partiton=gpu"],
     "unknown key hydra.launcher.partiton of hydra/launcher=slurm (did you mean hydra.launcher.partition?)"),
    (["hydra/launcher=slurm", "hydra.launcher.timeout_min=1.5"],
     "hydra.launcher.timeout_min=1.5 is not allowed: it must be an integer"),
    (["hydra/launcher=parallel", "hydra.launcher.n_jobs=two", "seed=0,1"],
     "hydra.launcher.n_jobs='two' is not allowed: it must be an integer"),
    (["hydra.launcher.n_jobs=2", "seed=0,1"],  # the basic launcher runs one job at a time
     "unknown key hydra.launcher.n_jobs of hydra/launcher=basic (hydra.launcher has: _target_)"),
])
def test_a_bad_launcher_or_launcher_key_is_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        check_command_line(args, conf_dir(), True)
    assert str(err.value) == message


def test_launcher_keys_hydra_checks_itself_pass():
    # a key of a mapping that takes any key (sbatch flags submitit has no name for), added with +
    check_command_line(["hydra/launcher=slurm", "+hydra.launcher.additional_parameters.mail-user=me"], conf_dir(), True)


def _table(stdout):
    lines = stdout.splitlines()
    start = lines.index(next(line for line in lines if line.split()[:2] == ["job", "status"]))
    jobs = [line.split()[:2] for line in lines[start + 1:]]
    return jobs[:next((i for i, job in enumerate(jobs) if not job[0].isdigit()), len(jobs))]


@pytest.mark.slow
def test_a_parallel_sweep_records_its_failure_and_a_rerun_redoes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # what each job would run with if qtrain left the threads alone
    pre = tmp_path / "pre"  # the second job starts from a pre-training that does not exist yet: only its run finds out
    args = ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", f"train.init_from=null,'{pre}'", *TINY,
            "train.epochs=1", "method=float32"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 1, first.stderr
    assert _table(first.stdout) == [["0", "completed"], ["1", "failed"]]
    error = f"train.init_from={pre} is not allowed: it holds no finished run (run the pre-training first)"
    assert first.stderr.splitlines()[-1] == f"qtrain: error: job 1 failed: {error}"
    summaries = {json.loads(p.read_text())["status"]: p for p in (tmp_path / "multirun").rglob("summary.json")}
    assert set(summaries) == {"completed", "failed"}
    assert json.loads(summaries["failed"].read_text())["error"] == error
    assert json.loads(summaries["completed"].read_text())["threads"] == max(1, cpu_count() // 2)  # 2 jobs at a time
    assert not list((tmp_path / "multirun").glob(".qtrain-sweep-*"))  # the sweep's record is gone with its table
    stamp = summaries["completed"].stat().st_mtime_ns

    from qtrain.run import run

    run(make_config(*TINY, "train.epochs=1", "method=float32"), pre)
    second = run_cli(*args, cwd=tmp_path)  # reports the finished job, redoes the failed one
    assert second.returncode == 0, second.stderr
    assert _table(second.stdout) == [["0", "completed"], ["1", "completed"]]
    assert summaries["completed"].stat().st_mtime_ns == stamp
    redone = json.loads(summaries["failed"].read_text())
    assert redone["status"] == "completed" and redone["threads"] == max(1, cpu_count() // 2)


@pytest.mark.slow
def test_slurm_jobs_resume_after_a_time_out_and_the_last_time_out_is_recorded(tmp_path, monkeypatch):
    """Through submitit's SLURM executor, on a SLURM stand-in (tests/fake_slurm.py) that signals the jobs."""
    from .fake_slurm import install

    install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_SLURM_RUNS", str(tmp_path / "multirun" / "*" / "*seed={task},*"))
    # Job 0 gets its time-limit signal once, job 1 in each of its two runs: with one requeue allowed, job 1 runs out.
    monkeypatch.setenv("FAKE_SLURM_SIGNALS", "0:1,1:2")
    # timeout_min=1: every signal comes after 80 % of the time limit, so submitit counts it as a time-out
    args = ["-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=1", "hydra.launcher.max_num_timeout=1",
            "hydra.launcher.cpus_per_task=1", "seed=0,1", *TINY, "train.epochs=4", "method=float32"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 1, first.stderr
    assert _table(first.stdout) == [["0", "completed"], ["1", "failed"]]
    error = "UncompletedJobError: Job not requeued because: timed-out too many times."
    assert first.stderr.splitlines()[-1] == f"qtrain: error: job 1 failed: {error}"
    assert (tmp_path / "100_0.runs").read_text() == (tmp_path / "100_1.runs").read_text() == "2"  # each requeued once
    logs = tmp_path / "multirun" / ".submitit"
    [log0] = logs.glob("100_0/*_log.out")
    assert re.search(r"resuming \S+seed=0,\S+ after epoch \d", log0.read_text())
    [summary0] = (tmp_path / "multirun").glob("*/*seed=0,*/summary.json")
    assert json.loads(summary0.read_text())["status"] == "completed"
    assert json.loads(summary0.read_text())["threads"] == 1  # its cpus_per_task
    stamp = summary0.stat().st_mtime_ns
    [run1] = (tmp_path / "multirun").glob("*/*seed=1,*")
    failed = json.loads((run1 / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["error"] == error
    # epochs finished before the last time-out: the checkpoint's (it is written before the tables, which a kill
    # right after it leaves one epoch behind until the run resumes and rewrites them)
    from qtrain.results import load_state

    done = load_state(run1 / "checkpoint.pt")["progress"]["epoch"]
    assert 2 <= done < 4
    assert len(pd.read_csv(run1 / "metrics.csv")) in (done - 1, done)

    monkeypatch.setenv("FAKE_SLURM_SIGNALS", "")
    second = run_cli(*args, cwd=tmp_path)  # the rerun redoes job 1 from its checkpoint
    assert second.returncode == 0, second.stderr
    assert _table(second.stdout) == [["0", "completed"], ["1", "completed"]]
    assert summary0.stat().st_mtime_ns == stamp
    [log1] = logs.glob("101_1/*_log.out")
    assert f"after epoch {done}" in log1.read_text()
    assert pd.read_csv(run1 / "metrics.csv")["epoch"].tolist() == [1, 2, 3, 4]


@pytest.mark.slow
def test_parallel_jobs_tag_their_log_lines_and_a_single_run_does_not(tmp_path):
    sweep = run_cli("-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "method=float32,sbm", *TINY,
                    "train.epochs=1", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    epochs = [line for line in sweep.stdout.splitlines() if " epoch 1/1 " in line]
    assert sorted(line.split(" epoch ")[0] for line in epochs) == ["[0 method=float32]", "[1 method=sbm]"]
    single = run_cli("method=sbm", *TINY, "train.epochs=1", "seed=5", cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    assert [line for line in single.stdout.splitlines() if "epoch 1/1" in line][0].startswith("epoch 1/1 ")


def test_a_job_tag_names_the_swept_values():
    assert job_tag(3, ["experiment=fractrain_table3", "method=dfq", "model=resnet74", "seed=1"], {"method", "seed"}) \
        == "[3 method=dfq seed=1]"
    assert job_tag(0, ["+x=1"], set()) == "[0]"


_FAULTS_PROBE = """
import resource, torch
from qtrain.launch import keep_freed_memory

def faults():  # minor page faults taken by allocating, writing and freeing tensors of 1-64 MiB, as a step does
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        for mib in (1, 4, 16, 64):
            torch.ones(mib * 2**18)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

before = faults()
kept = keep_freed_memory()
faults()  # the heap grows to the largest block once
print(before, int(kept), faults())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only: elsewhere keep_freed_memory changes nothing")
def test_keep_freed_memory_stops_the_page_faults_of_freed_tensors():
    # The process starts as glibc's default does before its threshold adapts: every block over 128 KiB is mapped
    # fresh and unmapped when freed, so each of its 4 KiB pages faults on first write.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", _FAULTS_PROBE], capture_output=True, text=True, check=True, env=env)
    before, kept, after = map(int, proc.stdout.split())
    assert kept == 1
    # every 4 KiB page of every tensor faults each time (fewer where the kernel maps huge pages), none once kept
    assert before > 1000 and after < before // 100


def test_a_job_whose_record_cannot_be_written_is_counted_and_fails_the_sweep(tmp_path, capsys):
    from hydra.core.utils import JobReturn, JobStatus

    from qtrain.cli import RunCallback

    callback = RunCallback()
    (tmp_path / "full").write_text("")  # the manifest's folder cannot be made under a file: every record fails
    callback.manifest = tmp_path / "full" / "manifest"
    sweep = OmegaConf.create({"hydra": {"overrides": {"task": ["seed=0,1"]}}})
    for num in (0, 1):
        job = OmegaConf.create({"hydra": {"job": {"num": num}, "runtime": {"output_dir": str(tmp_path / str(num))}}})
        done = JobReturn()
        done.status, done.return_value = JobStatus.COMPLETED, {"status": "completed"}
        callback.on_job_end(job, done)
    with pytest.raises(SystemExit) as ended:
        callback.on_multirun_end(sweep)
    assert ended.value.code == 1
    errors = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2].strip() for line in errors[:2]] == ["job 0", "job 1"]
    assert errors[-1] == ("qtrain: error: 2 of the sweep's 2 jobs left no record (a full disk, or a job killed from "
                          "outside): rerun the sweep to resume them")


@pytest.mark.slow
def test_sigterm_stops_a_parallel_sweep_and_its_jobs_which_keep_their_checkpoints(tmp_path):
    """A cluster's preemption sends SIGTERM to the sweep's process: its jobs stop with it, not train on orphaned."""
    exe = Path(sys.executable).with_name("qtrain")
    line = once("-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", "seed=0,1", *TINY, "train.epochs=500",
                f"hydra.sweep.dir={tmp_path / 'sweep'}")
    sweep = subprocess.Popen([str(exe), *line], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "sweep").rglob("checkpoint.pt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sweep.poll() is None, sweep.communicate()[1]
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=60)
    assert sweep.returncode == 143
    assert stderr.splitlines()[-1] == ("qtrain: terminated: each run keeps its last complete epoch (rerun the same "
                                       "command to resume)")
    metrics = sorted((tmp_path / "sweep").rglob("metrics.csv"))
    rows = [len(path.read_text().splitlines()) for path in metrics]
    time.sleep(5)  # a job still training would write an epoch's row in about a second
    assert [len(path.read_text().splitlines()) for path in metrics] == rows
    assert len(metrics) == 2 and all(n >= 2 for n in rows)
