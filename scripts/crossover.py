"""Cross qtrain's DFQ with the FracTrain authors' DFQ script: train each code on from the other's state.

At full scale on CIFAR-10 (``results/reference_runs/``), qtrain's DFQ ResNet-38 and the authors' ``train_dp_lr.py``
train alike, but from epoch 7 their gates part: the authors' run stage 3 more and more, qtrain's keep skipping most of
it. Whether that is in the state each code has reached (its weights, gates, batch norms) or in how each code goes on
learning from a state is what crossing them tells: give each code the other's epoch-10 state and train it on.

    python scripts/crossover.py to-authors RUN_DIR --code CODE --out FILE
    python scripts/authors_code.py GIT_DIR --data DATA --out OUT --dfq --iters 4680 --seed S --start-from FILE
    python scripts/crossover.py to-qtrain CHECKPOINT --out RUN_DIR [--epochs 2] data.root=DATA seed=S
    python scripts/crossover.py shares [--authors CSV...] [--qtrain RUN_DIR...]
    python scripts/crossover.py check RUN_DIR CHECKPOINT --code CODE [--images 10000]
    python scripts/crossover.py step RUN_DIR --code CODE [--samples 128] [--seed 0]

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

``check`` tells whether the mapping holds at full scale: it evaluates qtrain's run (RUN_DIR's last state) and the
authors' checkpoint each in both models, qtrain's and theirs (with the state mapped), on the first ``--images``
test images, each state with its own code's input normalization (theirs divides by the std 0.2023/0.1994/0.2010,
qtrain by CIFAR-10's 0.247/0.244/0.262; a model in evaluation reads its inputs through batch-norm statistics
gathered at its code's scale), and prints each model's top-1, how often the two models' predictions and gate
choices agree, and each model's share of stage 3's block runs skipped.

``step`` compares one training step of the two codes from RUN_DIR's last state: both models in training mode on
the same batch of ``--samples`` training images drawn with ``--seed`` (no augmentation), each code's loss (the task's
and the cost term, signed by the batch's cp as each code signs it), both sides' gradient rounding at nearest; it
prints, per group of parameters (the gates' LSTM and projection, their embeddings, each stage's blocks, the batch
norms, the first convolution and the classifier), the cosine and the norm ratio of qtrain's gradient to theirs, and
the same for qtrain against itself on the batch scaled by 1 + 2**-20 (the floor that near-ties set: a value that
lies that near a rounding boundary moves a level, and with it a batch's range and statistics downstream).

The state maps as ``scripts/authors_code.py --check-gates`` maps a qtrain model into theirs (its
``_their_gated_names``), and each quantizer's running activation range between qtrain's (low, high) and their zero
point and width. Their model registers a downsampling block's skip convolution and batch norm twice (as
``group{g}_ds0``/``group{g}_bn0`` and within ``group{g}_layer0``), so each is written under both names.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_code import CODE, GATE_CHECK, _their_cost_term, _their_gated_names, dfq_resnet38  # noqa: E402

RANGE = ".quant.act.running_range"  # qtrain's (low, high) of a quantized convolution's input
TRACKED = ".quant.act.tracked"
THEIR_RANGE = ".quantize_input_fw.running_range"  # theirs: the width, and the low end as the zero point
THEIR_ZERO = ".quantize_input_fw.running_zero_point"
THEIR_NORMALIZATION = ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))  # their data.py's CIFAR mean and std
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
        source = next((key for key in group if key in given), None)
        if source is not None:
            for key in group:
                theirs[key] = theirs[source].clone()
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
    from qtrain.resources import conf_dir

    cfg = compose_config(conf_dir(), [*GATE_CHECK, *overrides])
    return cfg, dfq_resnet38(cfg)[1].state_dict()


def aliases(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names under which a model's state holds one tensor twice or more."""
    by_memory: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, value in state.items():
        by_memory.setdefault((value.data_ptr(), tuple(value.shape)), []).append(key)
    return [keys for keys in by_memory.values() if len(keys) > 1]


def _their_model(code: Path, weight_bits: int, options: int) -> Any:
    """A freshly built authors' gated ResNet-38 from their code in ``code``."""
    torch.Tensor.cuda = lambda self, *a, **k: self  # their code calls it unconditionally; no GPU here
    sys.path.insert(0, str(code / CODE))
    import models

    models.WEIGHT_BITS = weight_bits  # read when their layers are built
    return models.cifar10_rnn_gate_38(False, proj_dim=options)


def _loaded(theirs: Any, ours: dict[str, torch.Tensor]) -> Any:
    """``theirs`` holding qtrain's state ``ours``."""
    template = theirs.state_dict()
    theirs.load_state_dict(to_theirs(ours, template, aliases(template)))
    return theirs


def write_theirs(run_dir: Path, code: Path, out: Path) -> None:
    from qtrain.run import at_checkpoint

    cfg, _, _, model, state = at_checkpoint(run_dir)
    theirs = _loaded(_their_model(code, cfg.method.weight_bits, len(cfg.method.options)), model.state_dict())
    epoch = state["progress"]["epoch"]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"iter": epoch * ITERS_PER_EPOCH, "arch": "cifar10_rnn_gate_38", "best_prec1": 0.0,
                "state_dict": {f"module.{k}": v for k, v in theirs.state_dict().items()}}, out)
    print(f"{out}: qtrain's {run_dir} after epoch {epoch} as the authors' model (iteration {epoch * ITERS_PER_EPOCH})")


def train_ours(checkpoint: Path, out: Path, epochs: int, overrides: list[str]) -> None:
    from qtrain.run import run

    theirs = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    theirs = {k.removeprefix("module."): v for k, v in theirs.items()}
    run_overrides = [*overrides, f"train.epochs={epochs}", f"train.init_from={checkpoint.resolve()}", "progress=false"]
    cfg, ours = _qtrain_dfq(run_overrides)
    summary = run(cfg, out, [*GATE_CHECK, *run_overrides], initial=to_ours(theirs, ours))
    print(f"{out}: {summary['status']}")


CHUNK = 1000  # test images evaluated at once


def _normalized(images: torch.Tensor, pixel_max: float, stats: tuple) -> torch.Tensor:
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in stats)
    return (images.float() / pixel_max - mean) / std


def _evaluate(method: Any, ours: Any, theirs: Any, data: Any, stats: tuple, images: int) -> dict[str, float]:
    """Both models in evaluation on the first ``images`` test images normalized by ``stats``: each one's top-1, the
    share of samples they predict alike and of block decisions they take alike, and each model's share of stage 3's
    block runs skipped."""
    from authors_code import DFQ_OPTIONS

    ours.eval()
    theirs.eval()
    counts = torch.zeros(6)
    for first in range(0, images, CHUNK):
        x = _normalized(data.test.images[first:min(images, first + CHUNK)], data.pixel_max, stats)
        y = data.test.labels[first:first + len(x)].long()
        with torch.no_grad():
            mine = ours(x)
            my_choices = torch.stack([block.gates.argmax(-1) for block in method.blocks])  # (blocks, samples)
            yours, masks = theirs(x, [a for a, _ in DFQ_OPTIONS], [g for _, g in DFQ_OPTIONS])
        your_choices = torch.stack([torch.stack([m.reshape(-1) for m in block]).argmax(0) for block in masks])
        stage3 = slice(2 * len(masks) // 3, len(masks))
        per_sample = [(mine.argmax(1) == y).float(), (yours.argmax(1) == y).float(),
                      (mine.argmax(1) == yours.argmax(1)).float(), (my_choices == your_choices).float().mean(0),
                      (my_choices[stage3] == 0).float().mean(0), (your_choices[stage3] == 0).float().mean(0)]
        counts += torch.stack([values.sum() for values in per_sample])
    shares = (100 * counts / images).tolist()
    return dict(zip(("top-1 qtrain", "top-1 theirs", "predictions alike", "gate choices alike",
                     "stage 3 skipped qtrain", "stage 3 skipped theirs"), shares))


def check(run_dir: Path, checkpoint: Path, code: Path, images: int) -> None:
    import pandas as pd

    from qtrain.run import at_checkpoint

    cfg, data, method, ours, _ = at_checkpoint(run_dir)
    qtrain_state = ours.state_dict()
    theirs = _loaded(_their_model(code, cfg.method.weight_bits, len(cfg.method.options)), qtrain_state)
    rows = [{"state": f"qtrain's {run_dir}",
             **_evaluate(method, ours, theirs, data, (data.mean, data.std), images)}]
    their_state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    their_state = {k.removeprefix("module."): v for k, v in their_state.items()}
    theirs.load_state_dict(their_state)
    ours.load_state_dict(to_ours(their_state, qtrain_state))
    rows.append({"state": f"the authors' {checkpoint.name}",
                 **_evaluate(method, ours, theirs, data, THEIR_NORMALIZATION, images)})
    print(f"the first {images} test images, in evaluation (%)")
    print(pd.DataFrame(rows).round(2).to_string(index=False))


def _their_loss(output: torch.Tensor, masks: list, y: torch.Tensor, options: list, weight_bits: int, target: float,
                beta: float) -> tuple[torch.Tensor, float]:
    """train_dp_lr.py's training loss of a forward, whose ``masks`` are per block a list of each option's (samples,)
    mask: the task's cross-entropy plus the cost term of ``scripts/authors_code.py`` (the skip free, signed by the
    batch's cp against the target); and that cp."""
    import torch.nn.functional as F

    term, cp = _their_cost_term(torch.stack([torch.stack(block, 1) for block in masks]), options, weight_bits, target,
                                beta)
    return F.cross_entropy(output, y) + term, cp


GROUPS = [("gates' LSTM and projection", r"gate_controller\."), ("gates' embeddings", r"\.embed\."),
          ("batch norms", r"(bn\d|shortcut\.1)\."), ("stage 1 blocks", r"layer1\."), ("stage 2 blocks", r"layer2\."),
          ("stage 3 blocks", r"layer3\."), ("first convolution", r"conv1\."), ("classifier", r"fc\.")]


def _group(name: str) -> str:
    return next(group for group, pattern in GROUPS if re.search(pattern, name))


def _agreement(mine: dict[str, torch.Tensor], yours: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per group of parameters: the cosine of the two gradients and the norm ratio, mine over yours."""
    found = {}
    for group, _ in GROUPS:
        keys = [k for k in mine if _group(k) == group]
        a = torch.cat([mine[k].flatten() for k in keys]).double()
        b = torch.cat([yours[k].flatten() for k in keys]).double()
        cosine = (a @ b / (a.norm() * b.norm())).item()
        found[group] = f"{cosine:.4f} / {(a.norm() / b.norm()).item():.3f}"
    return found


def step(run_dir: Path, code: Path, samples: int, seed: int) -> None:
    import pandas as pd
    import torch.nn.functional as F
    from authors_code import DFQ_OPTIONS, _nearest_gradients

    from qtrain.methods import StepInfo
    from qtrain.run import at_checkpoint

    cfg, data, method, ours, _ = at_checkpoint(run_dir)
    theirs = _loaded(_their_model(code, cfg.method.weight_bits, len(cfg.method.options)), ours.state_dict())
    import modules.quantize as their_quantize

    _nearest_gradients(ours, their_quantize)
    chosen = torch.randperm(len(data.train.labels), generator=torch.Generator().manual_seed(seed))[:samples]
    x = _normalized(data.train.images[chosen], data.pixel_max, (data.mean, data.std))
    options = [tuple(o) for o in cfg.method.options]
    y = data.train.labels[chosen].long()
    ours.eval()
    method.profile(ours, x[:2])  # each block's cost per option, for the cost term; in evaluation: no statistics move

    def our_gradients(inputs: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
        ours.train()
        ours.zero_grad()
        task = F.cross_entropy(ours(inputs), y)
        loss = method.loss(task, StepInfo(0, 0, len(inputs)))
        loss.backward()
        choices = torch.stack([block.gates.detach() for block in method.blocks])  # priced as theirs: the same cp
        cp = _their_cost_term(choices, options, cfg.method.weight_bits, cfg.method.target_cp, cfg.method.beta)[1]
        return {k: p.grad.clone() for k, p in ours.named_parameters() if p.grad is not None}, cp

    mine, my_cp = our_gradients(x)
    nudged, nudged_cp = our_gradients(x * (1 + 2.0 ** -20))
    theirs.train()
    theirs.zero_grad()
    output, masks = theirs(x, [a for a, _ in DFQ_OPTIONS], [g for _, g in DFQ_OPTIONS])
    loss, your_cp = _their_loss(output, masks, y, options, cfg.method.weight_bits, cfg.method.target_cp,
                                cfg.method.beta)
    loss.backward()
    names, their_params = _their_gated_names(ours.state_dict()), dict(theirs.named_parameters(remove_duplicate=False))
    yours = {k: their_params[names[k]].grad for k in mine}
    print(f"one training step from {run_dir}'s last state on {samples} training images (seed {seed}): the batch's cp "
          f"{my_cp:.3f} % (qtrain; {nudged_cp:.3f} % nudged) / {your_cp:.3f} % (theirs); per group, the gradients' cosine / "
          "norm ratio")
    print(pd.DataFrame([{"gradients": "qtrain against theirs", **_agreement(mine, yours)},
                        {"gradients": "qtrain against itself, the batch x (1 + 2**-20)", **_agreement(nudged, mine)}]
                       ).set_index("gradients").T.to_string())


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
    c = sub.add_parser("check", help="both states evaluated in both models")
    c.add_argument("run_dir", type=Path)
    c.add_argument("checkpoint", type=Path)
    c.add_argument("--code", type=Path, required=True, help="the authors' code, as scripts/authors_code.py extracts it")
    c.add_argument("--images", type=int, default=10000)
    g = sub.add_parser("step", help="one training step's gradients of both codes from a qtrain run's state")
    g.add_argument("run_dir", type=Path)
    g.add_argument("--code", type=Path, required=True, help="the authors' code, as scripts/authors_code.py extracts it")
    g.add_argument("--samples", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    args, overrides = ap.parse_known_args(argv)  # to-qtrain's further arguments: qtrain overrides
    if args.command != "to-qtrain" and overrides:
        ap.error(f"{overrides[0]} is not allowed here: only to-qtrain takes qtrain overrides")
    if args.command == "shares":
        print_shares(args.authors, args.qtrain)
        return 0
    if args.command in ("to-authors", "check", "step") and not (args.code / CODE / "models.py").is_file():
        ap.error(f"--code {args.code} is not allowed: it holds no {CODE}/models.py (give OUT/code of "
                 "scripts/authors_code.py)")
    if args.command in ("to-qtrain", "check") and not args.checkpoint.is_file():
        ap.error(f"{args.checkpoint} is not allowed: no such file (give a checkpoint of the authors' DFQ run)")
    if args.command == "step":
        if not 2 <= args.samples <= 50000:
            ap.error(f"--samples {args.samples} is not allowed: give 2 to 50000 (the training split)")
        step(args.run_dir, args.code, args.samples, args.seed)
    elif args.command == "check":
        if not 1 <= args.images <= 10000:
            ap.error(f"--images {args.images} is not allowed: give 1 to 10000 (the test split)")
        check(args.run_dir, args.checkpoint, args.code, args.images)
    elif args.command == "to-authors":
        write_theirs(args.run_dir, args.code, args.out)
    else:
        if args.epochs < 1:
            ap.error(f"--epochs {args.epochs} is not allowed: train at least 1")
        bad = [o for o in overrides if not re.match(r"^[\w.]+=", o)]
        if bad:
            ap.error(f"{bad[0]} is not allowed: give qtrain overrides as key=value (data.root=DIR seed=S)")
        train_ours(args.checkpoint, args.out, args.epochs, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
