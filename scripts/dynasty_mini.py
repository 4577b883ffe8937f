"""DYNASTY's comparison in miniature on real CIFAR-10: float32, SBM 8-bit, DYNASTY at average 4 and 2 bits.

    python scripts/dynasty_mini.py --root DIR [--jobs 2] [--out results/dynasty_mini_cifar10]

DIR holds ``cifar-10-batches-py`` (CIFAR-10's python version, as torchvision downloads it). Sized for a
2-core CPU machine: ResNet-20 (ResNet-18, the paper's model, takes about 14 times the MACs per image),
the whole training and test sets, EPOCHS epochs, batch 128, SGD lr 0.1 with momentum 0.9 and weight
decay 5e-4, DYNASTY's linear warm-up over the first epoch, then cosine decay; the same for every method.
The table gives accuracy, the average bit-width of DYNASTY's maps in each epoch, FracTrain's cost
(effective MACs, % of float32), and the hardware models, read from metrics.csv's cumulative figures:
each model's time and energy per epoch against SBM 8-bit's (Banner et al.'s baseline), BitFusion's
per epoch, and each model's time to TARGET test accuracy against SBM's. A run cut short (rerunning the
command resumes it) is compared over the epochs it completed. Runs live
in outputs/dynasty_mini/<name>; the table goes to <out>.csv and <out>.md.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from mini_runs import machine, parser, train_all, write_results

from qtrain.cost import to_target

RUNS_DIR = Path("outputs/dynasty_mini")
EPOCHS = 4
TARGET = 0.6
MODELS = ("bit_serial", "bitfusion")
RUNS = {  # name: (method, setting, overrides), shortest first
    "float32": ("float32", "float32", ["method=float32"]),
    "sbm": ("sbm", "FW-8/BW-8", ["method=sbm"]),
    "dynasty4": ("dynasty", "average 4 bits", ["method=dynasty", "method.target_bits=4"]),
    "dynasty2": ("dynasty", "average 2 bits", ["method=dynasty", "method.target_bits=2"]),
}


def _metrics(name: str) -> pd.DataFrame:
    return pd.read_csv(RUNS_DIR / name / "metrics.csv")


def per_epoch(metrics: pd.DataFrame, key: str) -> float:
    """A cumulative figure's mean per epoch over the epochs the run completed."""
    return float(metrics[key].iloc[-1] / metrics.epoch.iloc[-1])


def row(name: str, method: str, setting: str, sbm: pd.DataFrame) -> dict:
    """One table row from a run's metrics.csv, against SBM's per epoch (a run cut short shows the epochs it
    completed; the hardware figures are cumulative per epoch there, so nothing needs its summary.json)."""
    metrics = _metrics(name)
    last = metrics.iloc[-1]
    reached = to_target(metrics.to_dict("records"), TARGET, list(MODELS))
    reached_sbm = to_target(sbm.to_dict("records"), TARGET, list(MODELS))
    bits = metrics.get("dynasty_average_bits")

    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return round(ours / theirs, 3) if ours is not None and theirs else None

    def over_sbm(key: str) -> float | None:
        return ratio(per_epoch(metrics, key), per_epoch(sbm, key))

    return {
        "method": method, "setting": setting, "epochs": f"{int(last.epoch)}/{EPOCHS}",
        "test_acc": round(100 * last.test_acc, 2), "best_test_acc": round(100 * metrics.test_acc.max(), 2),
        "average_bits_per_epoch": "/".join(f"{b:.2f}" for b in bits) if bits is not None else "",
        "percent_of_float32": round(last.percent_of_float32, 3),
        "bit_serial_time_x_sbm": over_sbm("bit_serial_seconds"),
        "bit_serial_energy_x_sbm": over_sbm("bit_serial_joules"),
        "bitfusion_time_x_sbm": over_sbm("bitfusion_seconds"),
        "bitfusion_energy_x_sbm": over_sbm("bitfusion_joules"),
        "bitfusion_s_per_epoch": round(per_epoch(metrics, "bitfusion_seconds"), 1),
        "bitfusion_J_per_epoch": round(per_epoch(metrics, "bitfusion_joules"), 2),
        f"epoch_to_{round(100 * TARGET)}pct": reached["epoch"] if reached else None,
        "bit_serial_time_to_target_x_sbm": ratio(reached and reached["bit_serial_seconds"],
                                                 reached_sbm and reached_sbm["bit_serial_seconds"]),
        "bitfusion_time_to_target_x_sbm": ratio(reached and reached["bitfusion_seconds"],
                                                reached_sbm and reached_sbm["bitfusion_seconds"]),
        "median_epoch_s": round(metrics.epoch_seconds.median(), 1),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0], "results/dynasty_mini_cifar10").parse_args()
    if not args.report_only:
        common = ["model=resnet20", "data=cifar10", f"data.root={args.root}", f"train.epochs={EPOCHS}", "sched=cosine",
                  "sched.warmup_epochs=1", f"hardware.target_acc={TARGET}"]
        train_all({name: [*extra, *common] for name, (_, _, extra) in RUNS.items()}, RUNS_DIR, args.jobs)
    sbm = _metrics("sbm")
    table = pd.DataFrame([row(name, method, setting, sbm) for name, (method, setting, _) in RUNS.items()])
    described, sharing = machine(RUNS_DIR / "float32", args.jobs)
    write_results(args.out, table, EPOCHS, "DYNASTY in miniature: ResNet-20 on real CIFAR-10", (
        f"Made by `python scripts/dynasty_mini.py --root DIR --jobs {args.jobs}` (DIR: an offline CIFAR-10 copy in "
        f"torchvision's python layout, images JPEG-re-encoded at quality 75) "
        f"on {described}.\n\n"
        f"Data: the whole 50,000-image training set and 10,000-image test set, crop 32 pad 4 and flips. ResNet-20, "
        f"{EPOCHS} epochs, batch 128, SGD lr 0.1, momentum 0.9, weight decay 5e-4, linear warm-up over the first "
        f"epoch (DYNASTY Sec. 5.1) then cosine decay, seed 0, one run each. DYNASTY as configured by default: "
        f"4x4 blocks, maps of 0/2/4/6/8 bits, smoothing 0.5, Algorithm 1 with 3 steps, every block at 4 bits in "
        f"the first epoch.\n\n"
        f"`average_bits_per_epoch`: the computation-weighted average width of DYNASTY's maps in each epoch. "
        f"`percent_of_float32`: FracTrain's cost (effective MACs of the three training GEMMs) over float32's. "
        f"Hardware models (qtrain/cost), from metrics.csv's cumulative figures: `*_time_x_sbm` and "
        f"`*_energy_x_sbm` are the run's time and energy per epoch over SBM 8-bit's (every operand at 8 bits: "
        f"Banner et al.'s baseline), on the UNPU-style bit-serial accelerator with DYNASTY's module power and on "
        f"BitFusion (float32 priced as 32-bit integers on both, which neither runs); BitFusion's seconds and "
        f"joules per epoch; "
        f"`epoch_to_{round(100 * TARGET)}pct` the first epoch at {round(100 * TARGET)} % test accuracy, and each "
        f"model's time to it over SBM's (DYNASTY Fig. 7's measure). `median_epoch_s` is the median epoch's wall "
        f"time (training and evaluation) with {sharing}; "
        f"`epoch_time_x_float32` divides it by float32's."))


if __name__ == "__main__":
    main()
