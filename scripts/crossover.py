"""Cross qtrain's DFQ with the FracTrain authors' DFQ script: train each code on from the other's state.

At full scale on CIFAR-10 (``results/reference_runs/``), qtrain's DFQ ResNet-38 and the authors' ``train_dp_lr.py``
train alike, but from epoch 7 their gates part: the authors' run stage 3 more and more, qtrain's keep skipping most of
it. Whether that is in the state each code has reached (its weights, gates, batch norms) or in how each code goes on
learning from a state is what crossing them tells: give each code the other's epoch-10 state and train it on.

    python scripts/crossover.py to-authors RUN_DIR --code CODE --out FILE
    python scripts/authors_code.py GIT_DIR --data DATA --out OUT --dfq --iters 4680 --seed S --start-from FILE
    python scripts/crossover.py to-qtrain CHECKPOINT --out RUN_DIR [--epochs 2] data.root=DATA seed=S
    python scripts/crossover.py shares [--authors CSV...] [--qtrain RUN_DIR...]

``to-authors`` writes a checkpoint of the authors' gated ResNet-38 (``cifar10_rnn_gate_38``) holding the state of the
qtrain DFQ run in RUN_DIR (cp 3 %, 4-bit weights: the DFQ log's run) at its last checkpoint, which their script starts
from with its own ``--resume FILE --proceed True`` (``scripts/authors_code.py --start-from``): fresh optimizers and
log averages, the iteration count where qtrain's run stopped. CODE is the authors' code as ``scripts/authors_code.py``
extracted it (``OUT/code``); entries their model has and qtrain's has not (the batch norm their blocks without a
downsampling path build and never use, the unused backward quantizers' ranges) keep their freshly built values.

``to-qtrain`` reads the authors' checkpoint (``checkpoint_NNNNN_*.pth.tar`` of their run, read with pickle: only a
file of one's own run) and trains a new qtrain DFQ run from its state in RUN_DIR for ``--epochs`` epochs (the lr stays
0.1: FracTrain's first step is at epoch 80), with fresh momentum; its ``train.init_from`` names the checkpoint.
Further arguments are qtrain overrides (the data's folder, the seed).

``shares`` prints, per epoch of each run given, each stage's share of block runs skipped on the test split (the
gates' choices there, as the authors' logs count them) and the train and test top-1: the authors' runs from their
tabulated gates (``OUT/<name>_gates.csv`` and the epoch table beside it), qtrain's from their run directories.

The state maps as ``scripts/authors_code.py --check-gates`` maps a qtrain model into theirs (its
``_their_gated_names``), and each quantizer's running activation range between qtrain's (low, high) and their zero
point and width.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_code import CODE, GATE_CHECK, _their_gated_names  # noqa: E402

RANGE = ".quant.act.running_range"  # qtrain's (low, high) of a quantized convolution's input
TRACKED = ".quant.act.tracked"
THEIR_RANGE = ".quantize_input_fw.running_range"  # theirs: the width, and the low end as the zero point
THEIR_ZERO = ".quantize_input_fw.running_zero_point"
ITERS_PER_EPOCH = 390  # their script's evaluation interval, an epoch in its log


def _their_conv(names: dict[str, str], key: str) -> str:
    """The authors' name of the convolution whose input range qtrain keeps under ``key``."""
    return names[key][: -len(RANGE)]


def to_theirs(ours: dict[str, torch.Tensor], template: dict[str, torch.Tensor],
              aliases: list[list[str]]) -> dict[str, torch.Tensor]:
    """qtrain's DFQ ResNet-38 state as the authors' gated ResNet-38's (names without DataParallel's ``module.``):
    ``template`` (their freshly built model's state) with every entry qtrain has replaced, under each of its names in
    ``aliases`` (their model registers a downsampling block's skip convolution and batch norm twice, as
    ``group{g}_ds0``/``group{g}_bn0`` and within ``group{g}_layer0``: loading gives the one tensor whichever value
    comes last)."""
    names, theirs = _their_gated_names(ours), {k: v.clone() for k, v in template.items()}
    given = set()
    for key, value in ours.items():
        if key.endswith(TRACKED):
            continue
        if key.endswith(RANGE):
            conv = _their_conv(names, key)
            theirs[conv + THEIR_ZERO] = value[0].reshape(theirs[conv + THEIR_ZERO].shape).clone()
            theirs[conv + THEIR_RANGE] = (value[1] - value[0]).reshape(theirs[conv + THEIR_RANGE].shape).clone()
            given |= {conv + THEIR_ZERO, conv + THEIR_RANGE}
        elif names[key] in theirs and theirs[names[key]].shape == value.shape:
            theirs[names[key]] = value.clone()
            given.add(names[key])
        else:
            raise ValueError(f"qtrain's {key} {tuple(value.shape)} has no entry {names[key]} of that shape in the "
                             "authors' model")
    for group in aliases:
        source = [key for key in group if key in given]
        for key in group:
            if source:
                theirs[key] = theirs[source[0]].clone()
    return theirs


def to_ours(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The authors' gated ResNet-38 state as qtrain's DFQ ResNet-38's, whose own state ``ours`` gives the names and
    shapes; every entry of qtrain's comes from theirs."""
    names, state = _their_gated_names(ours), {}
    for key, value in ours.items():
        if key.endswith(TRACKED):
            state[key] = torch.ones_like(value)
        elif key.endswith(RANGE):
            conv = _their_conv(names, key)
            low = theirs[conv + THEIR_ZERO].reshape(())
            state[key] = torch.stack([low, low + theirs[conv + THEIR_RANGE].reshape(())]).to(value.dtype)
        elif names[key] in theirs and theirs[names[key]].shape == value.shape:
            state[key] = theirs[names[key]].clone()
        else:
            raise ValueError(f"the authors' checkpoint has no {names[key]} of shape {tuple(value.shape)} (qtrain's "
                             f"{key})")
    return state


def _qtrain_dfq(overrides: list[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The DFQ log's run's config with ``overrides``, and a freshly prepared qtrain model's state for it."""
    from qtrain.config.command_line import compose_config
    from qtrain.methods import build_method
    from qtrain.models import build_model
    from qtrain.resources import conf_dir

    cfg = compose_config(conf_dir(), [*GATE_CHECK, *overrides])
    model = build_method(cfg.method).prepare(build_model("resnet38", cfg.model, in_channels=3, num_classes=10,
                                                         input_size=(32, 32)))
    return cfg, model.state_dict()


def aliases(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names under which a model's state holds one tensor twice or more."""
    by_memory: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, value in state.items():
        by_memory.setdefault((value.data_ptr(), tuple(value.shape)), []).append(key)
    return [keys for keys in by_memory.values() if len(keys) > 1]


def _their_template(code: Path, weight_bits: int, options: int) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """A freshly built authors' gated ResNet-38's state, and its names that alias one tensor."""
    sys.path.insert(0, str(code / CODE))
    import models

    models.WEIGHT_BITS = weight_bits  # read when their layers are built
    state = models.cifar10_rnn_gate_38(False, proj_dim=options).state_dict()
    return state, aliases(state)


def write_theirs(run_dir: Path, code: Path, out: Path) -> None:
    from qtrain.run import at_checkpoint

    cfg, _, _, model, state = at_checkpoint(run_dir)
    theirs = to_theirs(model.state_dict(), *_their_template(code, cfg.method.weight_bits, len(cfg.method.options)))
    epoch = state["progress"]["epoch"]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"iter": epoch * ITERS_PER_EPOCH, "arch": "cifar10_rnn_gate_38", "best_prec1": 0.0,
                "state_dict": {f"module.{k}": v for k, v in theirs.items()}}, out)
    print(f"{out}: qtrain's {run_dir} after epoch {epoch} as the authors' model (iteration {epoch * ITERS_PER_EPOCH})")


def train_ours(checkpoint: Path, out: Path, epochs: int, overrides: list[str]) -> None:
    from qtrain.run import run

    theirs = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    theirs = {k.removeprefix("module."): v for k, v in theirs.items()}
    run_overrides = [*overrides, f"train.epochs={epochs}", f"train.init_from={checkpoint.resolve()}", "progress=false"]
    cfg, ours = _qtrain_dfq(run_overrides)
    summary = run(cfg, out, [*GATE_CHECK, *run_overrides], initial=to_ours(theirs, ours))
    print(f"{out}: {summary['status']}")


def _authors_rows(gates_csv: Path) -> list[dict]:
    import pandas as pd

    gates = pd.read_csv(gates_csv)
    epochs = pd.read_csv(gates_csv.with_name(gates_csv.name.replace("_gates.csv", ".csv"))).set_index("epoch")
    skipped = gates.pivot_table(index="epoch", columns="stage", values="opt0_skip")
    return [{"run": gates_csv.name.replace("_gates.csv", ""), "code": "authors'", "epoch": int(epoch),
             **{f"stage {stage}": 100 * skipped.loc[epoch, stage] for stage in skipped.columns},
             "train top-1": epochs.loc[epoch, "train_acc"], "test top-1": epochs.loc[epoch, "test_acc"]}
            for epoch in skipped.index]


def _qtrain_rows(run_dir: Path) -> list[dict]:
    from qtrain.report.reference import _block_shares
    from qtrain.report.runs import find_runs

    rows = []
    for run in find_runs([run_dir]):
        metrics = run.metrics.set_index("epoch")
        for epoch in metrics.index:
            found = _block_shares(run, int(epoch))
            if found is None or found[1] != "evaluation":
                continue
            shares, _, stages = found
            skipped = shares.skipped.groupby(stages.str.replace("layer", "").astype(int).values).mean()
            rows.append({"run": str(run.dir), "code": "qtrain", "epoch": int(epoch),
                         **{f"stage {stage}": 100 * value for stage, value in skipped.items()},
                         "train top-1": 100 * metrics.loc[epoch, "train_acc"],
                         "test top-1": 100 * metrics.loc[epoch, "test_acc"]})
    return rows


def print_shares(authors: list[Path], qtrain: list[Path]) -> None:
    import pandas as pd

    rows = [row for path in authors for row in _authors_rows(path)] + [row for path in qtrain for row in _qtrain_rows(path)]
    print(pd.DataFrame(rows).round(2).to_string(index=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-authors", help="a qtrain DFQ run's last state as the authors' checkpoint")
    a.add_argument("run_dir", type=Path)
    a.add_argument("--code", type=Path, required=True, help="the authors' code, as scripts/authors_code.py extracts it")
    a.add_argument("--out", type=Path, required=True)
    q = sub.add_parser("to-qtrain", help="train a qtrain DFQ run from the authors' checkpoint")
    q.add_argument("checkpoint", type=Path)
    q.add_argument("--out", type=Path, required=True, help="the new run's directory")
    q.add_argument("--epochs", type=int, default=2)
    t = sub.add_parser("shares", help="each stage's share of block runs skipped on the test split, per epoch")
    t.add_argument("--authors", type=Path, nargs="*", default=[], help="the authors' runs' OUT/<name>_gates.csv")
    t.add_argument("--qtrain", type=Path, nargs="*", default=[], help="qtrain DFQ run directories")
    args, overrides = ap.parse_known_args(argv)  # to-qtrain's further arguments: qtrain overrides
    if args.command != "to-qtrain" and overrides:
        ap.error(f"{overrides[0]} is not allowed here: only to-qtrain takes qtrain overrides")
    if args.command == "shares":
        print_shares(args.authors, args.qtrain)
        return 0
    if args.command == "to-authors":
        if not (args.code / CODE / "models.py").is_file():
            ap.error(f"--code {args.code} is not allowed: it holds no {CODE}/models.py (give OUT/code of "
                     "scripts/authors_code.py)")
        write_theirs(args.run_dir, args.code, args.out)
    else:
        if not args.checkpoint.is_file():
            ap.error(f"{args.checkpoint} is not allowed: no such file (give a checkpoint of the authors' DFQ run)")
        if args.epochs < 1:
            ap.error(f"--epochs {args.epochs} is not allowed: train at least 1")
        bad = [o for o in overrides if not re.match(r"^[\w.]+=", o)]
        if bad:
            ap.error(f"{bad[0]} is not allowed: give qtrain overrides as key=value (data.root=DIR seed=S)")
        train_ours(args.checkpoint, args.out, args.epochs, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
