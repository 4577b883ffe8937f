"""Exact resumption of the FracTrain authors' gated training script (``train_dp_lr.py``) after a kill, for
``scripts/authors_code.py --dfq --resume``.

Their script saves the model and the iteration at each evaluation but not the optimizers' momentum, the running
meters its log prints (averaged since iteration 0, never reset), nor where the data and the random draws had got to,
so a run restarted from their checkpoint is another run. :func:`make_resumable` edits their script (at extraction,
like ``restore_skip``) so that each checkpoint also holds :func:`run_state` and a run started with
``AUTHORS_RESUME=<checkpoint>`` continues through :func:`restore_run` as if it had never stopped: the same batches,
the same stochastic-rounding draws, the same printed averages. Nothing here changes what the run computes.

The training loader is wrapped in :class:`ResumableLoader`. A pass over the data takes its shuffle and its workers'
seeds from torch's global generator when it starts, and an evaluation (every 390 iterations) falls inside a pass
(391 batches): the position is the generator's state at the pass's start, the batches given since, and the
generator's state now. Restarting replays the pass's start, draws the given batches again (their loading and
augmentation, not the training on them) and puts the generator back where it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

METERS = ("[losses, top1, skip_ratios, cp_record, cp_record_fw, cp_record_eb, cp_record_gc, "
          "*sum(layerwise_decision_statistics, [])]")  # every meter whose averages the log prints or the step reads
OPTIMIZERS = "[optimizer1, optimizer2]"
RESUME_EDITS = [
    ("'best_prec1':  best_prec1,",
     "'best_prec1':  best_prec1,\n"
     f"                    'resume': authors_resume.run_state({OPTIMIZERS}, best_full_prec, {METERS}, train_loader),"),
    ("    i = args.start_iter\n",
     "    if os.environ.get('AUTHORS_RESUME'):  # qtrain's launcher: continue a stopped run exactly\n"
     "        best_prec1, best_full_prec, args.start_iter = authors_resume.restore_run(\n"
     f"            os.environ['AUTHORS_RESUME'], model, {OPTIMIZERS}, {METERS}, train_loader)\n"
     "    i = args.start_iter\n"),
]
LAUNCH = ("AUTHORS_SEED", "AUTHORS_THREADS", "AUTHORS_OPTIONS", "AUTHORS_FC_INIT")  # what must match to resume


def _launch() -> dict[str, str]:
    return {name: os.environ.get(name, "") for name in LAUNCH}


def make_resumable(script_text: str) -> str:
    """``train_dp_lr.py`` with its checkpoints holding the whole run's state and a restart from one (see above).
    Each edit is made once; a text without one of its lines is refused."""
    for old, new in RESUME_EDITS:
        if old not in script_text:
            raise ValueError(f"train_dp_lr.py has no line {old.strip()!r} to make its runs resumable at")
        script_text = script_text.replace(old, new, 1)
    return script_text


class ResumableLoader:
    """A training loader that can restart where a run stopped, to the bit (see the module's docstring)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.pass_start: torch.Tensor | None = None
        self.given = 0
        self.pending: dict | None = None

    def __iter__(self) -> Iterator[Any]:
        pending, self.pending = self.pending, None
        if pending is None:
            self.pass_start, self.given = torch.get_rng_state(), 0
            batches = iter(self.loader)
        else:
            self.pass_start, self.given = pending["pass_start"], pending["given"]
            torch.set_rng_state(self.pass_start)
            batches = iter(self.loader)
            for _ in range(self.given):
                next(batches)
            torch.set_rng_state(pending["rng"])
        for batch in batches:
            self.given += 1
            yield batch

    def state(self) -> dict:
        return {"pass_start": self.pass_start, "given": self.given, "rng": torch.get_rng_state()}

    def restart_from(self, state: dict) -> None:
        """The next pass continues the one ``state`` was taken in."""
        self.pending = state


def run_state(optimizers: Sequence[Any], best_full_prec: float, meters: Sequence[Any],
              loader: ResumableLoader) -> dict:
    """What a checkpoint needs beyond the model and the iteration for the run to go on exactly."""
    return {"optimizers": [o.state_dict() for o in optimizers], "best_full_prec": best_full_prec,
            "meters": [dict(vars(m)) for m in meters], "loader": loader.state(),
            "launch": _launch()}


def restore_run(path: str, model: Any, optimizers: Sequence[Any], meters: Sequence[Any],
                loader: ResumableLoader) -> tuple[float, float, int]:
    """Put the run back as it was when ``path`` was saved; returns the best top-1s and the iteration."""
    checkpoint = torch.load(path)
    state = checkpoint.get("resume")
    if state is None:
        raise SystemExit(f"{path}: this checkpoint holds no run state (written before runs were made resumable)")
    launch = _launch()
    if state["launch"] != launch:
        raise SystemExit(f"{path}: saved by a run launched with {state['launch']}, not {launch}")
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for meter, saved in zip(meters, state["meters"], strict=True):
        meter.__dict__.update(saved)
    loader.restart_from(state["loader"])
    print(f"qtrain's launcher: resumed from {path} at iteration {checkpoint['iter']}")
    return checkpoint["best_prec1"], state["best_full_prec"], checkpoint["iter"]
