"""scripts/bench_speed.py: its timing child on the methods whose workload the benchmark sets up itself (DFQ's and
FracTrain's gates drawing from its trained shares): pairs of tiny steps against float32's in two turns, a cost and a
ratio; methods taking turns until their pairs run out; the median's 95 % interval against the binomial
distribution's exact coverage."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "scripts" / "bench_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dfq", "fractrain"])
def test_a_gated_method_is_timed_and_costed(method):
    # the gates' drawn options must give way to the method's forced one while it profiles every block
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--serve", method, "--batch", "8",
                           "--model", "resnet20", "--device", "cpu"], input="pairs 1\npairs 2\nfacts\n",
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ready, first, second, facts = proc.stdout.strip().splitlines()[-4:]
    assert ready == "ready"
    times = [json.loads(first), json.loads(second)]
    assert [len(t["steps"]) for t in times] == [1, 2] and [len(t["float32"]) for t in times] == [1, 2]
    result = _bench().pair_ratio(times[0]["steps"] + times[1]["steps"], times[0]["float32"] + times[1]["float32"],
                                 json.loads(facts))
    assert result["step_s"] > 0 and result["float32_step_s"] > 0 and 0 < result["cost_percent"] < 100
    assert result["pairs"] == 3 and result["low"] <= result["ratio"] <= result["high"]


@pytest.mark.slow
def test_methods_take_turns_until_their_pairs_run_out():
    # 2 pairs a turn, at most 3: the second turn times the one pair left; 3 pairs cannot settle (20 at least)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--methods", "sbm", "pfq",
                           "--batch", "8", "--turn", "2", "--max-pairs", "3", "--no-qtorch"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if "(float32 step" in line}
    assert sorted(rows) == ["pfq", "sbm"]
    for _, step_s, ratio, interval, pairs, *_ in rows.values():
        low, high = (float(v) for v in interval.rstrip("*").split("-"))
        assert pairs == "3" and interval.endswith("*") and low <= float(ratio) <= high and float(step_s) > 0


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
    bench = _bench()
    # n = 100: the 40th and 61st smallest (the tables' ranks for the median's 95 % interval)
    assert bench.median_interval([float(v) for v in range(100, 0, -1)]) == (50.5, 40.0, 61.0)
    for n in range(10, 400):
        _, low, high = bench.median_interval([float(v) for v in range(1, n + 1)])
        # [x_(j), x_(k)) holds the true median unless fewer than j or at least k values fall below it: binomial(n, 1/2)
        covered = sum(math.comb(n, i) for i in range(int(low), int(high))) / 2**n
        assert covered >= 0.95, n
