"""A SLURM stand-in for tests, on this machine: ``sbatch``, ``srun``, ``sacct``, ``scontrol requeue``, ``scancel``.

Enough of SLURM for submitit's SLURM executor: ``sbatch`` starts each task of the job array at once, in a
supervisor process that runs the batch script, sends the job its time-limit signal (``--signal``) when the
test asks, and starts the task again when the job requeued itself (``scontrol requeue``), as SLURM does.
``sacct`` reports each task RUNNING until its supervisor is done.

:func:`install` writes the commands into a folder to put first on ``PATH``. The state lives in
``$FAKE_SLURM_DIR``. ``FAKE_SLURM_SIGNALS=TASK:N,...`` has task ``TASK`` signalled in each of its first
``N`` runs, as soon as that run has written a ``checkpoint.pt`` under ``FAKE_SLURM_RUNS`` (a glob with
``{task}`` in it): a time-out or a preemption in the middle of training.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ("sbatch", "srun", "sacct", "scontrol", "scancel")


def install(bin_dir: Path) -> None:
    """Write SLURM's commands into ``bin_dir``, each running this file with this Python."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
        path.chmod(0o755)


def _state() -> Path:
    return Path(os.environ["FAKE_SLURM_DIR"])


def sbatch(script: str) -> None:
    text = Path(script).read_text()
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    tasks = int(flags["array"].split("-")[1].split("%")[0]) + 1 if "array" in flags else 1
    counter = _state() / "next_job_id"
    job_id = int(counter.read_text()) if counter.exists() else 100
    counter.write_text(str(job_id + 1))
    for task in range(tasks):
        subprocess.Popen([sys.executable, __file__, "_supervise", str(job_id), str(task), script, flags["signal"]],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job_id}")


def _signals_for(task: int) -> int:
    pairs = (item.split(":") for item in os.environ.get("FAKE_SLURM_SIGNALS", "").split(",") if item)
    return next((int(n) for t, n in pairs if int(t) == task), 0)


def _supervise(job_id: str, task: str, script: str, signal_spec: str) -> None:
    key = f"{job_id}_{task}"
    env = {**os.environ, "SLURM_JOB_ID": str(1000 + int(job_id) * 100 + int(task)), "SLURM_ARRAY_JOB_ID": job_id,
           "SLURM_ARRAY_TASK_ID": task, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    sig = getattr(signal, "SIG" + signal_spec.split("@")[0])
    runs = os.environ.get("FAKE_SLURM_RUNS", "").replace("{task}", task)
    for run in range(1000):
        start = time.time()
        batch = subprocess.Popen(["bash", script], env=env)
        if run < _signals_for(int(task)):
            while batch.poll() is None and not any(os.path.getmtime(p) > start for p in glob.glob(f"{runs}/checkpoint.pt")):
                time.sleep(0.05)
            if batch.poll() is None:
                os.kill(int((_state() / f"{key}.pid").read_text()), sig)
        batch.wait()
        requeue = _state() / f"{key}.requeue"
        if not requeue.exists():
            break
        requeue.unlink()
        (_state() / f"{key}.runs").write_text(str(run + 2))
    (_state() / f"{key}.done").touch()


def srun(args: list[str]) -> None:
    """Run the job step in this process, its output to the files ``--output`` and ``--error`` name."""
    key = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    files = {}
    while args[0].startswith("--"):
        option = args.pop(0)
        if option in ("--output", "--error"):
            name = args.pop(0).replace("%A", os.environ["SLURM_ARRAY_JOB_ID"]).replace("%a", os.environ["SLURM_ARRAY_TASK_ID"])
            files[option] = name.replace("%j", os.environ["SLURM_JOB_ID"]).replace("%t", "0")
    for option, fd in (("--output", 1), ("--error", 2)):
        if option in files:
            Path(files[option]).parent.mkdir(parents=True, exist_ok=True)
            os.dup2(os.open(files[option], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    (_state() / f"{key}.pid").write_text(str(os.getpid()))
    os.execvp(args[0], args)


def sacct(args: list[str]) -> None:
    print("JobID|State|NodeList")
    for pid_file in sorted(_state().glob("*.pid")):
        key = pid_file.stem
        print(f"{key}|{'COMPLETED' if (_state() / f'{key}.done').exists() else 'RUNNING'}|localhost")


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "sbatch":
        sbatch(args[-1])
    elif command == "_supervise":
        _supervise(*args)
    elif command == "srun":
        srun(args)
    elif command == "sacct":
        sacct(args)
    elif command == "scontrol" and args[0] == "requeue":
        (_state() / f"{args[1]}.requeue").touch()


if __name__ == "__main__":
    main()
