"""scripts/log_beta.py: the cost term's weight read back from a gated log's printed losses. A log is written by hand
here as the authors' script would print it, the loss built from a known beta: the regression returns that beta, and a
target that the schedule changes is read from the first line printed after it."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location("log_beta", Path(__file__).resolve().parents[1] / "scripts" / "log_beta.py")
log_beta = importlib.util.module_from_spec(spec)
spec.loader.exec_module(log_beta)
Log, Run = log_beta.Log, log_beta.Run  # reference_curves' log and run, as log_beta reads them

BLOCKS = 18


def _log(beta: float, targets: dict[int, float], seed: int = 0) -> Log:
    """Lines every 10 iterations to 32,000: cp drawn around the target in force, the loss a falling task loss plus
    noise plus sign * beta * cost, with cost = cp / 100 * 3 * 128 * blocks."""
    rng = np.random.default_rng(seed)
    log = Log(target=dict(targets), decisions={390: {b: [1.0] for b in range(BLOCKS)}})
    for i in range(10, 32_000, 10):
        goal = targets[max(k for k in targets if k <= i)]
        cp = goal + rng.normal(0, 0.3)
        sign = 1.0 if cp >= goal else -1.0
        task = 1.5 * np.exp(-i / 20_000) + rng.normal(0, 0.15)
        log.train[i] = {"loss_val": task + sign * beta * cp / 100 * 3 * 128 * BLOCKS, "cp_val": cp}
    return log


@pytest.mark.parametrize("beta", [1e-3, 3e-4])
def test_a_fixed_targets_beta_comes_back(beta):
    fits = log_beta.beta_fits(_log(beta, {0: 3.0}), Run("p", "dfq", "dfq", "", target_cp=3.0))
    assert [f["iterations"] for f in fits] == ["2000-9990", "10000-17990", "18000-25990", "26000-31990"]
    for fit in fits:
        assert fit["target cp"] == 3.0
        assert abs(fit["beta"] - beta) < 4 * fit["standard error"]
        assert fit["standard error"] < beta / 5


def test_a_schedules_target_is_fitted_span_by_span_without_the_interval_before_each_printed_change():
    # the true switch at 8,000; the log prints it at the evaluation after it, 8,190: lines from 7,800 on are left out
    truth = {0: 1.0, 8_000: 1.5}
    log = _log(1e-3, truth)
    log.target = {0: 1.0, 8_190: 1.5}
    fits = log_beta.beta_fits(log, Run("p", "fractrain", "fractrain", ""))
    assert [(f["iterations"], f["target cp"]) for f in fits][:3] == [("2000-7790", 1.0), ("8190-16180", 1.5),
                                                                    ("16190-24180", 1.5)]
    assert all(abs(f["beta"] - 1e-3) < 4 * f["standard error"] for f in fits)
