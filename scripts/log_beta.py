"""The cost term's weight beta, read back from the FracTrain authors' published gated training logs.

DFQ's and FracTrain's loss (FracTrain Sec. 3.2) is the task loss plus ``sign * beta * cost``: ``cost`` the batch's
summed gate choices priced per 32x32 GEMM, ``sign`` +1 where the batch's cp is at or above the target and -1 below.
Every 10 iterations the logs (``scripts/reference_curves.py`` reads them) print one batch's loss with that term and
its cp, from which its cost is ``cp / 100 * 3 * batch * blocks``. Regressing the printed loss on ``sign * cost`` (with
a quadratic in the iteration for the task loss's own trend), span by span at learning rate 0.1, gives beta as the
logged run had it, and with it a check of the cost's units and of the sign rule (a dead band around the target,
where the sign shrinks, would pull the fit below the run's beta), to hold against qtrain's ``method.beta`` (1e-3)
and cost term (docs/methods/dfq.md).

    python scripts/log_beta.py GIT_DIR [--commit SHA]

GIT_DIR is a git directory of the Tubbz-alt/FracTrain snapshot, as for ``reference_curves.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_curves import (  # noqa: E402
    BATCH_SIZE,
    DEFAULT_COMMIT,
    EVAL_EVERY,
    Log,
    Run,
    at_or_before,
    git,
    parse_log,
    published_runs,
)

LR_DROP = 32_000  # the first iteration at learning rate 0.01
SKIP = 2_000  # the first iterations, where the task loss falls too fast for a quadratic
SPAN = 8_000  # the longest span fitted at once


def beta_fits(log: Log, run: Run) -> list[dict[str, object]]:
    """One least-squares fit of the printed loss on (1, t, t^2, sign * cost) per span of one target, at most ``SPAN``
    iterations long. A schedule's target is printed at evaluations, up to one evaluation interval after it changed:
    the lines of such an interval are left out."""
    blocks = len(next(iter(log.decisions.values())))

    def target(i: int) -> float:
        return run.target_cp if run.target_cp is not None else at_or_before(log.target, i)

    rows = sorted((i, r) for i, r in log.train.items()
                  if SKIP <= i < LR_DROP and "cp_val" in r and target(i) == target(i + EVAL_EVERY))
    spans: list[list[tuple[int, dict]]] = []
    for i, r in rows:  # a new span where the target changes or the span would pass SPAN iterations
        if not spans or target(i) != target(spans[-1][0][0]) or i >= spans[-1][0][0] + SPAN:
            spans.append([])
        spans[-1].append((i, r))
    fits = []
    for span in spans:
        first, goal = span[0][0], target(span[0][0])
        t = np.array([(i - first) / 1000 for i, _ in span])
        cp = np.array([r["cp_val"] for _, r in span])
        sign = np.where(cp >= goal, 1.0, -1.0)
        design = np.column_stack([np.ones_like(t), t, t * t, sign * cp / 100 * 3 * BATCH_SIZE * blocks])
        loss = np.array([r["loss_val"] for _, r in span])
        coef, *_ = np.linalg.lstsq(design, loss, rcond=None)
        resid = loss - design @ coef
        se = np.sqrt(resid.var(ddof=4) * np.linalg.inv(design.T @ design)[3, 3])
        fits.append({"run": run.name, "iterations": f"{first}-{span[-1][0]}", "target cp": goal, "lines": len(span),
                     "beta": coef[3], "standard error": se, "share at or above target": (sign > 0).mean()})
    return fits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("git_dir", type=Path, help="git directory of the Tubbz-alt/FracTrain snapshot")
    ap.add_argument("--commit", default=DEFAULT_COMMIT)
    args = ap.parse_args(argv)
    fits = []
    for run in published_runs():
        if run.options and run.name.startswith("resnet38_cifar10_"):
            fits += beta_fits(parse_log(git(args.git_dir, "show", f"{args.commit}:{run.path}")), run)
    print(pd.DataFrame(fits).to_markdown(index=False, floatfmt=".3g"))


if __name__ == "__main__":
    main()
