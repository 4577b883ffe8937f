"""FracTrain's comparison in miniature on real CIFAR-10: SBM vs PFQ vs DFQ vs FracTrain, with float32 for reference.

    python scripts/fractrain_mini.py --root DIR [--out results/fractrain_mini_cifar10]

DIR holds ``cifar-10-batches-py`` (CIFAR-10's python version, as torchvision downloads it). Sized for a
2-core CPU machine: ResNet-20, the 25,000-image half of the training set (``data.subset={by: samples,
part: 0}``, every class halved), the whole test set, 8 epochs of SGD (momentum 0.9, wd 5e-4, batch 128)
at lr 0.1, divided by 10 after epoch 6: FracTrain's step schedule (0.1, /10 at 80 of 160 epochs) compressed.
The settings of FracTrain Table 3, scaled down:
- SBM FW-8/BW-8, with the quantizers of the reference's baseline (global activation range, classifier
  in float32, as PFQ's);
- PFQ FW(3,4,6,8)/BW(6,6,8,8), whose last stage is SBM's precision;
- DFQ with ResNet's seven options and target cp 3 % (of the gated blocks' float32 cost, as the reference);
- FracTrain with targets 1.5/2/2.5/3 %.
PFQ's and FracTrain's loss indicator compares 2-epoch windows with L_scale from the first 2 epochs, at
the reference code's epsilon 0.15 and alpha 0.4 (the paper's 5- and 10-epoch windows and epsilon 0.05 leave
no room for two turning points in 8 epochs). ``--jobs 2`` trains two runs at a time, one torch thread
each. Each run lives in outputs/fractrain_mini/<method> (rerunning the script resumes unfinished runs
and reports finished ones); the table goes to <out>.csv and <out>.md.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from mini_runs import add_savings_vs_sbm, machine, parser, train_all, turning_points, write_results

RUNS_DIR = Path("outputs/fractrain_mini")
EPOCHS, MILESTONES = 8, [6]
WINDOW = 2
INDICATOR = [f"method.window={WINDOW}", f"method.scale_epochs={WINDOW}", "method.epsilon=0.15", "method.alpha=0.4"]
RUNS = {
    "float32": ("float32", []),
    "sbm": ("FW-8/BW-8", ["method.act_range=tensor", "method.last_layer=float32"]),
    "pfq": ("FW(3,4,6,8)/BW(6,6,8,8)", ["method.fw=[3,4,6,8]", "method.bw=[6,6,8,8]", *INDICATOR]),
    "dfq": ("cp=3", []),
    "fractrain": ("cp=1.5/2/2.5/3", INDICATOR),
}


def row(method: str, setting: str, run_dir: Path) -> dict:
    """One table row from a run's metrics.csv (a run cut short shows the epochs it completed)."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    last = metrics.iloc[-1]
    cp = metrics["cp"].round(2).astype(str).str.cat(sep="/") if "cp" in metrics else ""
    return {
        "method": method, "precision": setting, "epochs": f"{int(last.epoch)}/{EPOCHS}",
        "test_acc": round(100 * last.test_acc, 2), "best_test_acc": round(100 * metrics.test_acc.max(), 2),
        "effective_macs": f"{last.effective_macs:.3e}", "bit_macs": f"{1024 * last.effective_macs:.3e}",
        "percent_of_float32": round(last.percent_of_float32, 3),
        "turning_points_after_epoch": turning_points(metrics), "cp_per_epoch": cp,
        "median_epoch_s": round(metrics.epoch_seconds.median(), 1),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0], "results/fractrain_mini_cifar10").parse_args()
    if not args.report_only:
        common = ["model=resnet20", "data=cifar10", f"data.root={args.root}", "data.subset={by: samples, part: 0}",
                  f"train.epochs={EPOCHS}", "sched=multistep", f"sched.milestones=[{','.join(map(str, MILESTONES))}]"]
        train_all({m: [f"method={m}", *common, *extra] for m, (_, extra) in RUNS.items()}, RUNS_DIR, args.jobs)
    table = pd.DataFrame([row(method, setting, RUNS_DIR / method) for method, (setting, _) in RUNS.items()])
    add_savings_vs_sbm(table)
    described, threads_text = machine(RUNS_DIR / "sbm", args.jobs)
    command = f"python scripts/fractrain_mini.py --root DIR --jobs {args.jobs}"
    write_results(args.out, table, EPOCHS, "FracTrain in miniature: ResNet-20 on real CIFAR-10", (
        f"Made by `{command}` (DIR: an offline CIFAR-10 copy in torchvision's python layout, "
        f"images JPEG-re-encoded at quality 75) on {described}.\n\n"
        f"Data: the 25,000-image half of the training set (every class halved), the whole 10,000-image test set. "
        f"{EPOCHS} epochs, SGD lr 0.1 divided by 10 after epoch{'s' * (len(MILESTONES) > 1)} "
        f"{' and '.join(map(str, MILESTONES))}, momentum 0.9, "
        f"wd 5e-4, batch 128, seed 0, one run each. PFQ and FracTrain: loss indicator with {WINDOW}-epoch windows, "
        f"L_scale from the first {WINDOW} epochs, epsilon 0.15 and alpha 0.4 (the reference code's defaults; the "
        f"paper's 5- and 10-epoch windows and epsilon 0.05 leave no room for two turning points in {EPOCHS} epochs). "
        f"Cost: effective MACs of the three training GEMMs (FracTrain's CC) of every layer, gates included, "
        f"bit-MACs = 1024 x effective MACs; `percent_of_float32` is the whole model's, `cp_per_epoch` the controller's "
        f"cp over the gated blocks (DFQ's stem and classifier run in float32, as in the reference code). "
        f"`median_epoch_s` is the median epoch's wall time (training and evaluation) with {threads_text}; "
        f"`epoch_time_x_float32` divides it by float32's."))


if __name__ == "__main__":
    main()
