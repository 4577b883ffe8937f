"""A finished classification run's accuracy in evaluation mode on its own training images, beside its test accuracy.

    python scripts/eval_checkpoint.py RUN_DIR [RUN_DIR ...] [--data-root DATA]

metrics.csv's ``train_acc`` is counted in training mode while the weights still move over the epoch, so it cannot
tell a run that fits its training set less well from one that fits it as well but generalizes or evaluates worse.
This script loads each run's last checkpoint (``checkpoint.pt``) into the model and method its config builds and
counts, in evaluation mode as the run's test accuracy is counted, its training images (in order, without
augmentation: how well it fits them) and its test images (the run's last test accuracy, recomputed: a check that
the checkpoint is the run's). Their difference is the run's generalization gap. Prints one markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from qtrain.data.batches import BatchStream
from qtrain.run import at_checkpoint
from qtrain.task import Task


@torch.no_grad()
def accuracy(model: nn.Module, batches: BatchStream, task: Task) -> float:
    """Share of ``batches``' samples ``model`` classifies right, in its current mode."""
    return sum(task.hits(model(x), y).item() for x, y in batches.epoch(0)) / batches.samples


def evaluate(run_dir: Path, data_root: str | None = None) -> dict[str, object]:
    """``run_dir``'s row: its method, model and epochs, and its accuracy on its training and test images."""
    cfg, data, _, model, _ = at_checkpoint(run_dir, data_root)
    model.eval()
    size = cfg.train.eval_batch_size
    train = BatchStream(data, data.train, size, cfg.seed, False)
    test = BatchStream(data, data.test, size, cfg.seed, False)
    return {"run": run_dir.name, "method": cfg.method.name, "model": cfg.model.name, "epochs": cfg.train.epochs,
            "train (eval mode)": accuracy(model, train, data.task), "test": accuracy(model, test, data.task)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run directories (summary.json, checkpoint.pt)")
    parser.add_argument("--data-root", help="where the data is now, if not at the run's data.root")
    args = parser.parse_args()
    table = pd.DataFrame([evaluate(run, args.data_root) for run in args.runs])
    table[["train (eval mode)", "test"]] *= 100
    print(table.to_markdown(index=False, floatfmt=".2f"))


if __name__ == "__main__":
    main()
