"""scripts/bench_speed.py: its one-method child on the methods whose workload the benchmark sets up itself (DFQ's and
FracTrain's gates drawing from its trained shares): two pairs of tiny steps against float32's, a cost and a ratio;
the median's 95 % interval against the binomial distribution's exact coverage."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dfq", "fractrain"])
def test_a_gated_method_is_timed_and_costed(method):
    # the gates' drawn options must give way to the method's forced one while it profiles every block
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--one", method, "--max-pairs", "2",
                           "--batch", "8", "--model", "resnet20", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step_s"] > 0 and result["float32_step_s"] > 0 and 0 < result["cost_percent"] < 100
    assert result["pairs"] == 2 and result["low"] <= result["ratio"] <= result["high"]


@pytest.mark.slow
def test_memory_only_gives_each_methods_peak_beside_float32s():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--memory-only", "--methods", "sbm",
                           "dfq", "--batch", "16"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    float32 = float(lines[-1].split()[-2])  # "float32 peak memory X MB"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert sorted(rows) == ["dfq", "sbm"] and float32 > 0
    for peak, ratio, *verdict in rows.values():
        assert float(ratio) == pytest.approx(float(peak) / float32, abs=0.01) and verdict[0] in ("met", "missed")


def test_the_median_interval_covers_the_median_with_95_percent_at_least():
    spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "scripts" / "bench_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # n = 100: the 40th and 61st smallest (the tables' ranks for the median's 95 % interval)
    assert bench.median_interval([float(v) for v in range(100, 0, -1)]) == (50.5, 40.0, 61.0)
    for n in range(10, 400):
        _, low, high = bench.median_interval([float(v) for v in range(1, n + 1)])
        # [x_(j), x_(k)) holds the true median unless fewer than j or at least k values fall below it: binomial(n, 1/2)
        covered = sum(math.comb(n, i) for i in range(int(low), int(high))) / 2**n
        assert covered >= 0.95, n
