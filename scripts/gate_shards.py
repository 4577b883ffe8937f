"""How a data-parallel split of the batch moves a gated run's gates: the task's pull on them, stage by stage, with
each training batch whole and cut into shards.

    python scripts/gate_shards.py RUN_DIR [--shards 1 4] [--batches 4] [--pair skip FW4/BW6] [--pair FW4/BW6 FW6/BW8]
        [--data-root DATA] [--seed S]

FracTrain's logged runs wrap the model in ``DataParallel``: each of N replicas takes its batch norms' statistics and
its quantization ranges over its 128/N samples (docs/methods/dfq.md, departures), where a qtrain run on one process
takes them over the whole batch. This loads the checkpoint of RUN_DIR (a DFQ or FracTrain run, in progress or done),
and for each of the first ``--batches`` training batches of the epoch after it, runs the task loss's forward and
backward (no cost term, no update) in training mode, once for each ``--shards`` count: the batch cut into that many
equal shards, each from the weights and buffers the checkpoint holds (as each replica starts from the model's),
its loss weighted by its share of the batch. Per shard count and stage it prints each option's share of the block
runs the gates chose and, for each ``--pair A B``, how the task's gradient moves B's logit against A's (descent,
per sample and block, mean over the batches; positive: toward B), as scripts/gate_start.py measures a first step.
A pair with the skip counts only the blocks that may skip (under ``skip_downsample=never`` those that change the shape
do not; a stage with none prints nan). A stage runs from a block that changes the shape to the next such block.
Each pass starts the stochastic rounding draws from the same seed, but shards of other sizes draw them in another
order: the spread that alone gives, ``--shards 1`` under another ``--seed``, is the floor a shards' effect must pass.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from gate_start import logit_drift, option_names
from omegaconf import DictConfig

from qtrain.data.base import Periods
from qtrain.errors import ConfigError
from qtrain.methods.dfq import DFQ
from qtrain.run import at_checkpoint

DEFAULT_PAIRS = (("skip", "FW4/BW6"), ("FW4/BW6", "FW6/BW8"))


def _restore(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Every buffer of ``model`` (batch norms' and ranges' running values) back to its value in ``buffers``."""
    with torch.no_grad():
        for name, value in model.named_buffers():
            value.copy_(buffers[name])


def _pass(model: torch.nn.Module, method: DFQ, images: torch.Tensor, labels: torch.Tensor, loss_fn, shards: int,
          buffers: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each block's hard gates, probabilities and the task loss's gradient at the gates over the whole batch (three
    lists of one tensor a block), its shards run one after another from the same ``buffers``, each shard's loss
    weighted by its share."""
    found: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    for x, y in zip(images.chunk(shards), labels.chunk(shards)):
        _restore(model, buffers)
        loss = loss_fn(model(x), y) * (len(y) / len(labels))
        gates = [block.gates for block in method.blocks]
        for g in gates:
            g.retain_grad()
        loss.backward()
        found.append([(g.detach(), block.probs.detach(), g.grad) for g, block in zip(gates, method.blocks)])
        model.zero_grad(set_to_none=True)
    _restore(model, buffers)
    return [[torch.cat([shard[b][k] for shard in found]) for b in range(len(method.blocks))] for k in range(3)]


def stages(model: torch.nn.Module, method: DFQ) -> list[str]:
    """Each gated block's stage: a stage starts at the first block and at each block that changes the shape (its
    resolution or width). Named by the path its blocks share (``layer2``), or where another stage shares that path
    too (MobileNetV2's ``blocks``), by it and its blocks' first and last index (``blocks.3-5``)."""
    names = [name for name, module in model.named_modules() if module in method.blocks]
    groups: list[list[list[str]]] = []
    for name, block in zip(names, method.blocks):
        if not groups or not block.block.identity:
            groups.append([])
        groups[-1].append(name.split("."))
    shared = [os.path.commonprefix(group) for group in groups]  # element-wise: the path segments they share
    labels = []
    for group, common in zip(groups, shared):
        if shared.count(common) == 1:  # a stage of one block shares its whole path with none
            labels.append(".".join(common))
        else:
            first, last = (".".join(path[len(common):]) for path in (group[0], group[-1]))
            labels.append(f"{'.'.join(common)}.{first}-{last}")
    return [label for group, label in zip(groups, labels) for _ in group]


def load_run(run_dir: Path, data_root: str | None = None) -> tuple[DictConfig, Any, DFQ, torch.nn.Module, dict]:
    """:func:`qtrain.run.at_checkpoint` of a gated run (DFQ or FracTrain); any other is refused."""
    loaded = at_checkpoint(run_dir, data_root)
    cfg, _, method, _, _ = loaded
    if not isinstance(method, DFQ):
        raise ConfigError(f"{run_dir} is not allowed: its method {cfg.method.name} has no gates (dfq or fractrain)")
    return loaded


def shard_pull(run_dir: Path, shard_counts: list[int], pairs: list[tuple[str, str]] | None, batches: int,
               data_root: str | None = None, seed: int | None = None) -> pd.DataFrame:
    """One row per shard count and stage: the options' shares of the block runs and each pair's drift (``pairs``
    None: those of :data:`DEFAULT_PAIRS` the run has); ``seed`` (default: the run's) keys the rounding draws."""
    cfg, data, method, model, state = load_run(run_dir, data_root)
    names = option_names(method)
    if pairs is None:
        pairs = [pair for pair in DEFAULT_PAIRS if set(pair) <= set(names)]
        if not pairs:
            raise ConfigError(f"{run_dir} has none of the default pairs' options: give --pair A B from {', '.join(names)}")
    for pair in pairs:
        if not set(pair) <= set(names):
            raise ConfigError(f"--pair {' '.join(pair)} is not allowed: both must be options of the run ({', '.join(names)})")
    shard_counts = list(dict.fromkeys(shard_counts))
    bad = [n for n in shard_counts if n < 1 or cfg.train.batch_size % n]
    if bad:
        raise ConfigError(f"--shards {bad[0]} is not allowed: give divisors of the batch size {cfg.train.batch_size}")
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    train_batches, _ = data.streams(cfg, torch.device("cpu"), 0, 1)
    if cfg.train.batches_per_epoch is not None:  # the run's epochs, as qtrain.run cuts them
        train_batches = Periods(train_batches, cfg.train.batches_per_epoch)
    stage_of = stages(model, method)
    can_skip = [not block.mask_skip for block in method.blocks]  # a block skipped only by masking never skips
    totals: dict[tuple[int, str], dict[str, float]] = {}
    model.train()
    read = 0
    for i, (images, labels) in enumerate(train_batches.epoch(state["progress"]["epoch"])):
        if i == batches:
            break
        read += 1
        for shards in shard_counts:
            torch.manual_seed((cfg.seed if seed is None else seed) + i)  # the rounding draws start alike each pass
            gates, probs, grads = _pass(model, method, images, labels, data.task.loss, shards, buffers)
            for stage in dict.fromkeys(stage_of):
                mine = [b for b, s in enumerate(stage_of) if s == stage]
                row = totals.setdefault((shards, stage), {})
                chosen = torch.cat([gates[b] for b in mine]).mean(0).tolist()
                for name, share in zip(names, chosen):
                    row[f"choice {name}"] = row.get(f"choice {name}", 0.0) + share
                for first, second in pairs:
                    counted = [b for b in mine if can_skip[b] or "skip" not in (first, second)]
                    drift = logit_drift([grads[k] for k in counted], [probs[k] for k in counted], names.index(first),
                                        names.index(second)) / (len(labels) * len(counted)) if counted else float("nan")
                    key = f"{second} against {first}"
                    row[key] = row.get(key, 0.0) + drift
    return pd.DataFrame([{"shards": n, "stage": s, **{k: v / read for k, v in row.items()}}
                         for (n, s), row in totals.items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a DFQ or FracTrain run directory with its checkpoint")
    parser.add_argument("--shards", nargs="+", type=int, default=[1, 4], help="shard counts (default 1 4)")
    parser.add_argument("--batches", type=int, default=4, help="training batches to average over (default 4)")
    parser.add_argument("--pair", nargs=2, action="append", metavar=("A", "B"),
                        help="options as printed (skip, FW4/BW6): how the task moves B's logit against A's "
                             "(repeatable; default: skip FW4/BW6 and FW4/BW6 FW6/BW8, those the run has)")
    parser.add_argument("--data-root", help="where the data is now, if not at the run's data.root")
    parser.add_argument("--seed", type=int, help="the stochastic rounding draws' seed (default: the run's; another "
                        "seed with --shards 1 gives the draws' own spread)")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches {args.batches} is not allowed: give a whole number from 1")
    try:
        table = shard_pull(args.run, args.shards, [tuple(p) for p in args.pair] if args.pair else None, args.batches,
                           args.data_root, args.seed)
    except ConfigError as err:
        parser.exit(2, f"gate_shards.py: error: {err}\n")
    shares = [c for c in table if c.startswith("choice ")]
    table[shares] *= 100
    print(table.to_markdown(index=False, floatfmt=".3g"))


if __name__ == "__main__":
    main()
