"""The one training loop (:class:`Trainer`): batches in, method hooks, cost meter, evaluation. docs/design.md (the run
lifecycle, the method interface) and docs/running.md ("One run on several processes") describe it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from qtrain import distributed
from qtrain.cost import CostMeter
from qtrain.data import Stream
from qtrain.errors import DivergedError
from qtrain.methods import Method, StepInfo
from qtrain.precision import EpochPrecision
from qtrain.task import Task


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    elapsed: float = 0.0  # seconds of training and evaluation, summed over resumes
    history: list[dict] = field(default_factory=list)  # one metrics row per completed epoch


class Diverged(DivergedError):
    def __init__(self, loss: float, epoch: int, step: int) -> None:
        super().__init__(f"the loss became {loss} at epoch {epoch + 1}, step {step}: training diverged")
        self.loss, self.epoch, self.step = loss, epoch, step


@dataclass
class Trainer:
    model: nn.Module
    method: Method
    optimizer: torch.optim.Optimizer
    scheduler: object
    meter: CostMeter
    train_batches: Stream
    test_batches: Stream
    task: Task
    epochs: int
    accum_steps: int = 1
    show_progress: bool = True
    step_schedule: torch.optim.lr_scheduler.LRScheduler | None = None  # stepped after every optimizer step
    eval_every: int = 1  # evaluate after every eval_every-th epoch, the last, and one the method stops training at
    progress: Progress = field(default_factory=Progress)
    epoch_precision: EpochPrecision = field(default_factory=EpochPrecision)  # of the last epoch trained

    def _bar(self, **kwargs) -> tqdm:
        """A progress bar on a terminal (none when ``show_progress`` is off or stderr is not a terminal)."""
        return tqdm(**kwargs, disable=None if self.show_progress else True, dynamic_ncols=True)

    def fit(self, on_epoch_end: Callable[[Progress], None]) -> Progress:
        """Train from ``progress.epoch`` to ``epochs``, or until the method stops it, calling ``on_epoch_end`` after each epoch.

        Log lines go through tqdm while the bars are up, so a line is never written into a bar.
        """
        with logging_redirect_tqdm(), self._bar(total=self.epochs, initial=self.progress.epoch, desc="training",
                                                unit="epoch") as bar:
            while self.progress.epoch < self.epochs and self.method.stopped() is None:
                self._fit_epoch(on_epoch_end)
                bar.update()
        return self.progress

    def _fit_epoch(self, on_epoch_end: Callable[[Progress], None]) -> None:
        """One epoch: train, evaluate, step the schedule, the method's epoch decision, the metrics row, the callback."""
        start = time.perf_counter()
        epoch = self.progress.epoch
        lr = self.optimizer.param_groups[0]["lr"]
        train = self.train_epoch(epoch)
        distributed.average_buffers(self.model)
        evaluated = (epoch + 1) % self.eval_every == 0 or epoch + 1 == self.epochs
        test = self.evaluate() if evaluated else self.task.metrics("test", math.nan, math.nan)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(test["test_loss"])
        else:
            self.scheduler.step()
        metrics = {"epoch": epoch + 1, "step": self.progress.step, **train, **test, "lr": lr}
        self.method.end_epoch(epoch, metrics)
        if not evaluated and self.method.stopped() is not None:  # the run's last epoch after all
            metrics.update(self.evaluate())
        if distributed.active():
            self.meter.merge_ranks(distributed.sum_floats)
        seconds = time.perf_counter() - start
        self.progress.elapsed += seconds
        self.progress.epoch += 1
        self.progress.history.append({
            **metrics, "effective_macs": self.meter.total(),
            "percent_of_float32": self.meter.percent_of_float32(),
            "epoch_seconds": seconds, "wall_seconds": self.progress.elapsed,
            **(self.meter.hardware.columns() if self.meter.hardware is not None else {}),
        })
        on_epoch_end(self.progress)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        batches = self.train_batches
        n = len(batches)
        loss_sum, positions, correct = 0.0, 0, 0
        bar = self._bar(iterable=batches.epoch(epoch), total=n, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                        position=1)
        self.optimizer.zero_grad(set_to_none=True)
        self.epoch_precision = EpochPrecision()
        for i, (x, y) in enumerate(bar):
            samples = batches.global_size(i)
            info = StepInfo(epoch, self.progress.step, samples)
            step_ends = (i + 1) % self.accum_steps == 0 or i + 1 == n
            with distributed.gradient_sync(self.model, step_ends):
                logits = self.model(x)
                loss = self.task.loss(logits, y)
                total = self.method.loss(loss, info)
                value = total.item()
                task = value if total is loss else loss.item()
                if distributed.active():  # any rank's NaN makes the sum NaN: every rank stops together
                    value, task = (v / samples for v in distributed.sum_floats([value * len(y), task * len(y)]))
                    # DDP averages the ranks' gradients: weighted so, they are the gradient of the whole batch's mean
                    total = total * (len(y) * distributed.world_size() / samples)
                if not math.isfinite(value):
                    raise Diverged(value, epoch, self.progress.step)
                (total / self.accum_steps).backward()
            record = self.method.precision()
            self.meter.add(record, len(y))
            self.epoch_precision.add(record, len(y))
            if step_ends:
                self.method.after_backward(info)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.progress.step += 1
                if self.step_schedule is not None:
                    self.step_schedule.step()
                self.method.after_step(info)
            counted = samples * y[0].numel()  # positions over all ranks: every sample of a batch has as many
            loss_sum += task * counted
            correct = correct + self.task.hits(logits, y)  # stays on the device until the epoch ends
            positions += counted
            bar.set_postfix(loss=f"{value:.3f}", refresh=False)
        self.epoch_precision = EpochPrecision.merged(distributed.all_gather(self.epoch_precision))
        return self.task.metrics("train", loss_sum / positions, distributed.sum_(correct).item() / positions)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        model = distributed.unwrap(self.model)
        model.eval()
        loss_sum, correct, positions = 0.0, 0, 0
        batches = self.test_batches
        for x, y in self._bar(iterable=batches.epoch(0), total=len(batches), desc="evaluating", leave=False, position=1):
            if not len(y):  # a rank's slice of a short last batch
                continue
            logits = model(x)
            loss_sum += self.task.loss(logits, y, reduction="sum").item()
            correct += self.task.hits(logits, y).item()
            positions += y.numel()
        loss_sum, correct, positions = distributed.sum_floats([loss_sum, correct, positions])
        return self.task.metrics("test", loss_sum / positions, correct / positions)
