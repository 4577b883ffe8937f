"""Where a gated run's gates start: each precision option's share of the block runs at the run's first training step.

    python scripts/gate_start.py OVERRIDES... [--seeds 0 1 2 3] [--pair FW6/BW8 FW6/BW12]

DFQ's and FracTrain's gates (FracTrain Sec. 3.2) pick an option per sample and residual block from a softmax, and the
straight-through gradient reaches an option's logit scaled by its probability: a gate that starts near zero for an
option moves toward it slowly, and two options with the same forward (FW6/BW8 and FW6/BW12: the gradient bits do not
touch the forward) get the same task signal, scaled by their probabilities. So where the gates start can decide
where they settle, and it changes with the seed. For each seed this builds, seeds and profiles the model and method
as a single-process CPU run of ``OVERRIDES seed=S`` does, and runs that run's first training step's forward and loss
on its first batch, in training mode, before any update. It prints, in percent, each option's share of the block
runs (blocks x samples) that the gates choose and the gates' mean probability of each option; with ``--pair A B``
also how that step's gradient moves the logit of B against A's (descent, summed over samples and blocks; positive:
toward B), from the task loss and from the cost term apart (docs/methods/dfq.md, the gates' task gradient).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from qtrain.config import validate
from qtrain.config.command_line import compose_config
from qtrain.data import load_data
from qtrain.errors import ConfigError
from qtrain.methods import StepInfo, build_method
from qtrain.methods.dfq import DFQ
from qtrain.models import build_model
from qtrain.quant.rounding import set_fused
from qtrain.resources import conf_dir
from qtrain.run import seed_everything


def option_names(method: DFQ) -> list[str]:
    """``skip`` and ``FWa/BWg`` for each option, in the gates' order."""
    return ["skip"] * method.has_skip + [f"FW{fw}/BW{bw}" for fw, bw in method.run_options]


def logit_drift(grads: list[torch.Tensor], probs: list[torch.Tensor], a: int, b: int) -> float:
    """Descent's move of logit ``b`` against logit ``a``, summed over blocks and samples, from the gradients ``grads``
    at the straight-through gates: with ``G = dL/dg = dL/dp``, ``dL/dz_j = p_j (G_j - sum_k p_k G_k)``."""
    drift = 0.0
    for g, p in zip(grads, probs):
        dz = p * (g - (p * g).sum(1, keepdim=True))
        drift += (dz[:, a] - dz[:, b]).sum().item()
    return drift


def first_step(overrides: list[str], seed: int, pair: tuple[str, str] | None = None) -> dict[str, float]:
    """The gates' start in run ``overrides seed=seed``: each option's share of the block runs they choose
    (``choice OPTION``) and its mean probability (``p OPTION``) at the first step; with ``pair``, the first step's
    drift of the pair's second logit against its first, from the task (``task drift``) and the cost term (``cost
    drift``)."""
    cfg = compose_config(conf_dir(), [*overrides, f"seed={seed}"])
    validate(cfg)
    if cfg.train.init_from is not None:
        raise ConfigError(f"train.init_from={cfg.train.init_from} is not allowed here: the gates' start is that of "
                          "freshly initialized weights (leave it null)")
    method = build_method(cfg.method)
    if not isinstance(method, DFQ):
        raise ConfigError(f"method={cfg.method.name} is not allowed here: it has no gates (choose dfq or fractrain)")
    names = option_names(method)
    if pair is not None and not set(pair) <= set(names):
        raise ConfigError(f"--pair {' '.join(pair)} is not allowed: both must be options of this config ({', '.join(names)})")
    seed_everything(cfg.seed)  # in the run's order: the data, the model, the method's preparation, the profile
    set_fused(cfg.fused)
    data = load_data(cfg.data)
    model = method.prepare(build_model(cfg.model.name, cfg.model, **data.model_inputs()))
    train_batches, _ = data.streams(cfg, torch.device("cpu"), 0, 1)
    sample = train_batches.example(2)
    method.profile(model, sample)
    method.operand_sizes(model, sample)
    images, labels = next(iter(train_batches.epoch(0)))
    task_loss = data.task.loss(model.train()(images), labels)
    cost_term = method.loss(task_loss, StepInfo(0, 0, len(labels))) - task_loss
    gates = [block.gates for block in method.blocks]
    probs = [block.probs for block in method.blocks]
    row = {f"choice {name}": share for name, share in zip(names, torch.cat(gates).detach().mean(0).tolist())}
    row |= {f"p {name}": share for name, share in zip(names, torch.cat(probs).mean(0).tolist())}
    if pair is not None:
        a, b = (names.index(name) for name in pair)
        for g in gates:
            g.retain_grad()
        task_loss.backward(retain_graph=True)
        row["task drift"] = logit_drift([g.grad for g in gates], probs, a, b)
        for g in gates:
            g.grad = None
        cost_term.backward()
        row["cost drift"] = logit_drift([g.grad for g in gates], probs, a, b)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="+", help="the run's config overrides, without seed (method=dfq or fractrain)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="the seeds to start (default 0-3)")
    parser.add_argument("--pair", nargs=2, metavar=("A", "B"), help="two options (as printed, e.g. FW6/BW8 FW6/BW12): "
                        "how the first step moves B's logit against A's")
    args = parser.parse_args(argv)
    if any(o.startswith("seed=") for o in args.overrides):
        parser.error("give the seeds with --seeds, not as an override")
    try:
        rows = [{"seed": seed, **first_step(args.overrides, seed, args.pair)} for seed in args.seeds]
    except ConfigError as err:
        parser.exit(2, f"gate_start.py: error: {err}\n")
    table = pd.DataFrame(rows).set_index("seed")
    shares = [c for c in table if c.startswith(("choice ", "p "))]
    table[shares] *= 100
    print(table.to_markdown(floatfmt=".3g"))


if __name__ == "__main__":
    main()
