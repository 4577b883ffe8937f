"""Where a gated run's gates start: each precision option's share of the block runs at the run's first training step.

    python scripts/gate_start.py OVERRIDES... [--seeds 0 1 2 3]

DFQ's and FracTrain's gates (FracTrain Sec. 3.2) pick an option per sample and residual block from a softmax, and the
straight-through gradient reaches an option through its probability: a gate that starts near zero for an option
moves toward it slowly, and two options with the same forward (FW6/BW8 and FW6/BW12: the gradient bits do not touch
the forward) get the same task gradient, which favours whichever is already more probable. So where the gates start
can decide where they settle, and it changes with the seed. For each seed this builds, seeds and profiles the model
and method as a run of ``OVERRIDES seed=S`` does, and counts the gates' choices on that run's first training batch,
in training mode, before any update. Prints one markdown table: a row per seed, a column per option (the skip first
where the options have one), in percent of the block runs (blocks x samples).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from qtrain.config import validate
from qtrain.config.command_line import compose_config
from qtrain.data import load_data
from qtrain.errors import ConfigError
from qtrain.methods import build_method
from qtrain.methods.dfq import DFQ
from qtrain.models import build_model
from qtrain.resources import conf_dir
from qtrain.run import seed_everything


def option_names(method: DFQ) -> list[str]:
    """``skip`` and ``FWa/BWg`` for each option, in the gates' order."""
    return ["skip"] * method.has_skip + [f"FW{fw}/BW{bw}" for fw, bw in method.run_options]


@torch.no_grad()
def first_step_shares(overrides: list[str], seed: int) -> dict[str, float]:
    """Each option's share of the block runs that the gates of run ``overrides seed=seed`` choose at its first step."""
    cfg = compose_config(conf_dir(), [*overrides, f"seed={seed}"])
    validate(cfg)
    if cfg.train.init_from is not None:
        raise ConfigError(f"train.init_from={cfg.train.init_from} is not allowed here: the gates' start is that of "
                          "freshly initialized weights (leave it null)")
    method = build_method(cfg.method)
    if not isinstance(method, DFQ):
        raise ConfigError(f"method={cfg.method.name} is not allowed here: it has no gates (choose dfq or fractrain)")
    seed_everything(cfg.seed)  # in the run's order: the data, the model, the method's preparation, the profile
    data = load_data(cfg.data)
    model = method.prepare(build_model(cfg.model.name, cfg.model, **data.model_inputs()))
    train_batches, _ = data.streams(cfg, torch.device("cpu"), 0, 1)
    sample = train_batches.example(2)
    method.profile(model, sample)
    method.operand_sizes(model, sample)
    images, _ = next(iter(train_batches.epoch(0)))
    model.train()(images)
    shares = torch.cat([block.gates for block in method.blocks]).mean(0)
    return dict(zip(option_names(method), shares.tolist()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="+", help="the run's config overrides, without seed (method=dfq or fractrain)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="the seeds to start (default 0-3)")
    args = parser.parse_args(argv)
    if any(o.startswith("seed=") for o in args.overrides):
        parser.error("give the seeds with --seeds, not as an override")
    try:
        rows = [{"seed": seed, **first_step_shares(args.overrides, seed)} for seed in args.seeds]
    except ConfigError as err:
        parser.exit(2, f"gate_start.py: error: {err}\n")
    table = pd.DataFrame(rows).set_index("seed") * 100
    print(table.to_markdown(floatfmt=".1f"))


if __name__ == "__main__":
    main()
