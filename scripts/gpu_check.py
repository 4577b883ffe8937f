"""One command on a GPU (``make gpu-check``): the CUDA tests, every method on CUDA against the same run on the CPU,
and the speed benchmark on the GPU, summed up in one markdown table.

    python scripts/gpu_check.py [--device cuda|cpu] [--parts tests runs bench] [--out gpu_check.md] [--fused]

Without a CUDA device it says so in one line and exits 2. ``--device cpu`` is a dry run of the same logic: the
"CUDA" side of every comparison runs on the CPU too, so every metric must come out equal (tests/test_gpu_check.py).

The tests: those marked ``cuda``, collected from the test files that hold device tests only (the others are not
imported: several import qtorch, which on a CUDA machine compiles a CUDA extension at its first import; the files
that are imported must not import qtorch or torchao, tests/test_gpu_check.py checks it). Where a test fails, pytest's
output (short tracebacks and the summary of failures) goes into the table's file. The runs:
2 epochs of ResNet-20 on 256 synthetic 8x8 images, batch 64, eager quantizers (``--fused``: the compiled ones), two
methods at a time on both devices. Each part has a time budget (under 10 minutes together), and each row is printed
as soon as it is known, so a check stopped from outside still shows what it found. The stochastic rounding draws
(keyed from the CPU generator, a hash of the element index) are the same on both devices, and runs on CUDA use
deterministic float32 kernels (no TF32), but cuDNN/cuBLAS sum products in other orders than the CPU kernels, so on
different devices the losses are compared within a tolerance (LOSS_TOL, measured as said there), and a rounding
boundary crossed on one side only may move a data-driven precision decision. Where no decision reads a value
(float32, SBM) the cost and the precision record must be equal. The benchmark times the methods the check runs
(``--methods``), one round. Exit status: 0 when every check passed, 1 when one failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("float32", "sbm", "muppet", "adapt", "dynasty", "pfq", "dfq", "fractrain")
PARTS = ("tests", "runs", "bench")
RUN = ["data=synthetic", "train.epochs=2", "train.batch_size=64", "progress=false"]
FIXED_PRECISION = {"float32", "sbm"}  # no precision decision reads a value: cost and precision record equal anywhere
# How far the device's training loss may lie from the CPU's, at any epoch, as a share of the CPU's first-epoch loss
# (the run's loss scale: by epoch 2 the loss is 20-40x smaller, and a relative difference of it magnifies one
# rounding step). Measured on the CPU alone (docs/benchmarks.md, "GPU"): float32 runs at 1 and 4 threads differ by
# 5e-9, SBM's by 3e-5; runs whose precision decisions read values differ by up to 0.006 between thread counts of one
# CPU and by 0.078 (AdaPT) between two CPUs, where oneDNN sums in other orders: a rounding boundary crossed on one
# side only moves a decision, and 8 steps later the runs are apart. So those runs are held to the CPUs' own spread.
LOSS_TOL = {"float32": 1e-4, "sbm": 0.01}  # others: DATA_DRIVEN_LOSS_TOL
DATA_DRIVEN_LOSS_TOL = 0.10
# float32's accuracy on the 64 test images within one image; a quantized run's is reported, not held: two CPUs put
# AdaPT's 16 images apart, SBM's 2
FLOAT32_ACC_ATOL = 1 / 64
TIMEOUT_S = {"tests": 240, "runs": 120, "bench": 180}  # the parts' budgets: 9 minutes together, under a 10-minute call
RUN_PAIRS = 2  # methods run at a time, each on both devices
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # as qtrain.launch sets them


def child_env(threads: int | None = None) -> dict[str, str]:
    """A child process's environment: the checkout importable (its qtrain, whether or not one is installed),
    unbuffered output (what a child printed before a timeout comes back), and ``threads`` torch threads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env.update(dict.fromkeys(THREAD_VARS, str(threads)))
    return env


def decoded(text: str | bytes | None) -> str:
    """A child's output as text (a timed-out child's comes as bytes, or None)."""
    return text.decode(errors="replace") if isinstance(text, bytes) else (text or "")


def last_line(*texts: str | bytes | None) -> str:
    """The last line of the first of ``texts`` that has one."""
    for text in map(decoded, texts):
        if text.strip():
            return text.strip().splitlines()[-1]
    return "no output"


def run_child(command: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in the checkout, in a process group of its own:
    past ``timeout`` the whole group is killed (a pytest's or a run's own children too, which would otherwise hold
    the output pipes open and the check with them) and TimeoutExpired carries what it printed."""
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def device_test_files() -> list[Path]:
    """The test files with a test that takes the ``device`` fixture or is marked ``cuda`` (the CUDA tests live there)."""
    files = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        tests = [node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
        if "mark.cuda" in source or any(arg.arg == "device" for test in tests for arg in test.args.args):
            files.append(path)
    return files


def _left(deadline: float) -> float:
    """Seconds to ``deadline``; a part past its budget raises TimeoutExpired for the next step."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise subprocess.TimeoutExpired("gpu_check", 0)
    return left


def _run_dir_metrics(run_dir: Path) -> dict:
    """A finished run's per-epoch metrics (wall times dropped), precision record and summary."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return {"metrics": metrics.drop(columns=[c for c in metrics.columns if c.endswith("seconds")]),
            "precision": pd.read_csv(run_dir / "precision.csv"),
            "summary": json.loads((run_dir / "summary.json").read_text())}


def train(method: str, device: str, out: Path, fused: bool, deadline: float) -> dict:
    """One short run of ``method`` on ``device`` through the qtrain entry point, in ``out/<method>-<device>``."""
    run_dir = out / f"{method}-{device}"
    command = [sys.executable, "-m", "qtrain.cli", *RUN, f"method={method}", f"device={device}",
               f"fused={str(fused).lower()}", "force=true", f"hydra.run.dir={run_dir}"]
    threads = max(1, min(4, (os.cpu_count() or 1) // (2 * RUN_PAIRS)))
    proc = run_child(command, _left(deadline), child_env(threads))
    if proc.returncode:
        raise RuntimeError(f"{device} run, exit {proc.returncode}: {last_line(proc.stderr, proc.stdout)}")
    return _run_dir_metrics(run_dir)


def compare(method: str, a: dict, b: dict, same_device: bool) -> tuple[bool, str]:
    """Whether run ``a`` (the device under test) agrees with run ``b`` (the CPU), and how they were compared."""
    loss_a, loss_b = a["metrics"]["train_loss"], b["metrics"]["train_loss"]
    cost_a, cost_b = (r["summary"]["cost"]["percent_of_float32"] for r in (a, b))
    acc_a, acc_b = (r["summary"]["final"]["test_acc"] for r in (a, b))
    facts = (f"loss {' '.join(f'{v:.5f}' for v in loss_a)} / {' '.join(f'{v:.5f}' for v in loss_b)}, "
             f"acc {acc_a:.3f} / {acc_b:.3f}, cost % {cost_a:.3f} / {cost_b:.3f}")
    if same_device:
        equal = a["metrics"].equals(b["metrics"]) and a["precision"].equals(b["precision"]) and cost_a == cost_b
        return equal, f"{facts}; same arithmetic: every metric equal"
    tol = LOSS_TOL.get(method, DATA_DRIVEN_LOSS_TOL)
    worst = float((loss_a - loss_b).abs().max() / abs(loss_b.iloc[0]))
    ok = worst <= tol
    how = f"other reduction order: loss within {tol:g} of the first epoch's (worst {worst:.2g})"
    if method == "float32":
        ok = ok and abs(acc_a - acc_b) <= FLOAT32_ACC_ATOL
        how += ", acc within one image"
    # density (the share of nonzero weights) moves with a weight that rounds to zero on one device only
    precision_a, precision_b = (r["precision"].drop(columns="density", errors="ignore") for r in (a, b))
    precision_equal = precision_a.equals(precision_b) and cost_a == cost_b
    if method in FIXED_PRECISION:
        ok = ok and precision_equal
        how += "; cost and precision record equal" + ("" if precision_equal else " (they differ)")
    else:
        record = "equal" if precision_equal else probabilities_apart(precision_a, precision_b) if cost_a == cost_b else None
        how += f"; precision decisions read values: record {record or 'differs (reported only)'}"
    return ok, f"{facts}; {how}"


def probabilities_apart(a: pd.DataFrame, b: pd.DataFrame) -> str | None:
    """Where two precision records differ only in the gates' mean probabilities (``gates_probability`` rows' shares,
    float sums that the devices round apart), how far apart those lie; else None."""
    if "event" not in a or "event" not in b or a.event.tolist() != b.event.tolist():
        return None
    probable = a.event.eq("gates_probability").to_numpy()
    if not probable.any():
        return None
    a, b = a.reset_index(drop=True), b.reset_index(drop=True)
    if not a.drop(columns="share").equals(b.drop(columns="share")) or not a.share[~probable].equals(b.share[~probable]):
        return None
    return f"equal but the gates' mean probabilities (apart by up to {(a.share - b.share).abs().max():.2g})"


def run_tests(device: str) -> tuple[bool, str, str]:
    """The tests marked ``cuda`` (on the CPU every one of them skips): on CUDA they pass, and at least one ran.
    Also pytest's whole output (each failure's short traceback and the summary of failures)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-m", "cuda", "-p", "no:cacheprovider",
               *map(str, device_test_files())]
    try:
        proc = run_child(command, TIMEOUT_S["tests"], child_env())
    except subprocess.TimeoutExpired as err:
        return False, f"ran past {TIMEOUT_S['tests']} s; its last line: {last_line(err.stdout)}", decoded(err.stdout)
    last = last_line(proc.stdout)
    if device == "cpu":
        return proc.returncode in (0, 5), last, proc.stdout
    return proc.returncode == 0 and " passed" in last, last, proc.stdout + proc.stderr


def run_bench(device: str, methods: list[str]) -> tuple[bool, str, str]:
    """The speed benchmark of ``methods`` on ``device``: whether it ran, its targets met and missed, and its
    printout."""
    # one turn of 20 pairs a method: each row prints as soon as its method is timed, inside the check's time limit
    command = [sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--device", device, "--max-pairs", "20",
               "--turn", "20", "--no-qtorch", "--methods", *methods]
    proc = run_child(command, TIMEOUT_S["bench"], child_env())
    text = proc.stdout + (proc.stderr if proc.returncode else "")
    verdicts = [line.split()[5] for line in proc.stdout.splitlines() if "(float32 step" in line]
    return proc.returncode == 0, f"targets met {verdicts.count('met')}, missed {verdicts.count('missed')}", text


def _line(part: str, what: str, ok: bool, detail: str) -> str:
    return f"| {part} | {what} | {'pass' if ok else 'FAIL'} | {detail} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device under test (cpu: a dry run, every comparison CPU against CPU)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check.md", help="the markdown table's file")
    parser.add_argument("--fused", action="store_true", help="the runs with compiled quantizer kernels (fused=true)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is available here (torch.cuda.is_available() is False); nothing was checked")
        return 2
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run: CPU against CPU)"
    rows: list[tuple[str, str, bool, str]] = []
    header = [f"gpu-check on {where}, torch {torch.__version__}", "", "| part | what | result | detail |", "|---|---|---|---|"]
    print("\n".join(header), flush=True)

    def row(part: str, what: str, ok: bool, detail: str) -> None:
        rows.append((part, what, ok, detail))
        print(_line(part, what, ok, detail), flush=True)

    bench_text = tests_text = ""
    if "tests" in args.parts:
        ok, last, output = run_tests(args.device)
        row("tests", "pytest -m cuda", ok, last)
        tests_text = "" if ok else output
    if "runs" in args.parts:
        deadline = time.monotonic() + TIMEOUT_S["runs"]
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2 * RUN_PAIRS) as pool:
            out = Path(tmp)
            # the device under test and the CPU side by side (in a dry run the second CPU run goes to its own folder)
            other = "cpu-ref" if args.device == "cpu" else "cpu"
            pairs = {method: (pool.submit(train, method, args.device, out, args.fused, deadline),
                              pool.submit(train, method, "cpu", out / other, args.fused, deadline))
                     for method in args.methods}
            try:
                for method, (tested, reference) in pairs.items():
                    try:
                        ok, detail = compare(method, tested.result(), reference.result(), args.device == "cpu")
                    except subprocess.TimeoutExpired:
                        ok, detail = False, f"did not finish within the runs' {TIMEOUT_S['runs']} s"
                    except Exception as err:  # noqa: BLE001 - one method's failure is its row's, not the check's
                        ok, detail = False, f"did not finish: {type(err).__name__}: {err}"
                    row("run", method, ok, detail)
            finally:
                pool.shutdown(cancel_futures=True)
    if "bench" in args.parts:
        try:
            ok, detail, bench_text = run_bench(args.device, args.methods)
        except subprocess.TimeoutExpired as err:
            ok, detail = False, f"ran past {TIMEOUT_S['bench']} s"
            bench_text = decoded(err.stdout)
        row("bench", "scripts/bench_speed.py", ok, detail)
    table = "\n".join([*header, *[_line(*r) for r in rows]])
    if tests_text:
        printout = f"\n\nThe tests' output:\n\n```\n{tests_text.strip()}\n```"
        print(printout)
        table += printout
    if bench_text:
        printout = f"\n\nThe benchmark's printout:\n\n```\n{bench_text.strip()}\n```"
        print(printout)
        table += printout
    args.out.write_text(table + "\n")
    print(f"\nwritten to {args.out}")
    return 0 if all(ok for _, _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
