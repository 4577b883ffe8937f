"""scripts/bench_speed.py's one-method child, on the methods whose workload the benchmark sets up itself (DFQ's and
FracTrain's gates drawing from its trained shares): one tiny step, a cost and a time."""

import json
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
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--one", method, "--steps", "1",
                           "--batch", "8", "--model", "resnet20", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step_s"] > 0 and 0 < result["cost_percent"] < 100
