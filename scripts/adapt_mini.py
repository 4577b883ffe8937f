"""AdaPT's comparison in miniature on real CIFAR-10: float32 vs AdaPT vs MuPPET vs SBM 8-bit, AlexNet.

    python scripts/adapt_mini.py --root DIR [--jobs 2] [--out results/adapt_mini_cifar10]

DIR holds ``cifar-10-batches-py`` (CIFAR-10's python version, as torchvision downloads it). Sized for a
2-core CPU machine: the CIFAR AlexNet of the AdaPT paper, the whole training and test sets, EPOCHS
epochs, batch 128 without accumulation for every method, the learning rate constant. Each method as its
paper ran AlexNet, scaled down:
- float32 and SBM FW-8/BW-8: SGD lr 0.01 (MuPPET's AlexNet rate), momentum 0.9, weight decay 1e-4;
- MuPPET: the same optimizer, word lengths 8 -> 12 -> 14 -> 16 -> float32, diversity windows of 2
  epochs with patience 1 (the reference's 3 and 2 leave no room for a switch in EPOCHS epochs);
- AdaPT: lr 0.01 on its unit-norm layer gradients, L2 1e-8 in the loss and no weight decay, 4 buffer
  bits (its AlexNet/CIFAR-10 config and Sec. 4.1.1), lookback 25..100 steps, resolution 50..150, from
  <8,4>. Its config's lr 0.1 is for batches of 512 with 4 accumulation steps; at 16 times as many
  optimizer steps (batch 128, none) it did not learn in a trial (training loss 2.26 then 2.32 over two
  epochs of half the training set), and lr 0.01 did.
The table gives accuracy, FracTrain's cost (effective MACs of the three training GEMMs, % of float32),
AdaPT's performance model for AdaPT and MuPPET (SU against float32 at the same batch and epochs, MEM,
inference SU and SZ, final and average sparsity), the precision switches and the epoch time.
Runs live in outputs/adapt_mini/<method>; the table goes to <out>.csv and <out>.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from mini_runs import machine, parser, train_all, write_results

RUNS_DIR = Path("outputs/adapt_mini")
EPOCHS = 10
PLAIN = ["optim.lr=0.01", "optim.weight_decay=1e-4"]
RUNS = {  # shortest first
    "float32": ("float32", PLAIN),
    "sbm": ("FW-8/BW-8", PLAIN),
    "muppet": ("8-12-14-16-32, r=2, patience 1", [*PLAIN, "method.resolution=2", "method.patience=1"]),
    "adapt": ("<8,4> start, buff 4", ["optim.lr=0.01", "optim.weight_decay=0", "method.l2=1e-8", "method.buffer_bits=4"]),
}


def row(method: str, setting: str, run_dir: Path) -> dict:
    """One table row from a run's metrics.csv and summary (a run cut short shows the epochs it completed)."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    last = metrics.iloc[-1]
    summary_path = run_dir / "summary.json"
    report = json.loads(summary_path.read_text()).get(method, {}) if summary_path.exists() else {}
    model = report.get("performance_model", {})
    switches = words = ""
    if method == "adapt":
        switches = report.get("switches", "")
        lengths = [wl for wl, _ in report.get("formats", {}).values()]
        words = f"{min(lengths)}-{max(lengths)}" if lengths else ""
    elif method == "muppet":
        switches = int(metrics["switched"].sum())
        words = "/".join(str(w) for w in metrics["word_length"].drop_duplicates())
    return {
        "method": method, "setting": setting, "epochs": f"{int(last.epoch)}/{EPOCHS}",
        "test_acc": round(100 * last.test_acc, 2), "best_test_acc": round(100 * metrics.test_acc.max(), 2),
        "percent_of_float32": round(last.percent_of_float32, 3),
        "SU1": round(model["baselines"]["same"]["SU"], 3) if model else None,
        "SU1_printed": round(model["baselines"]["same"]["SU_printed"], 3) if model else None,
        "MEM": round(model["MEM"], 3) if model else None,
        "inference_SU": round(model["inference"]["SU"], 3) if model else None,
        "inference_SZ": round(model["inference"]["SZ"], 3) if model else None,
        "final_sparsity": round(model["sparsity"]["final"], 3) if model else None,
        "average_sparsity": round(model["sparsity"]["average"], 3) if model else None,
        "switches": switches, "word_lengths": words,
        "switch_seconds": round(report["switch_seconds"], 1) if "switch_seconds" in report else None,
        "median_epoch_s": round(metrics.epoch_seconds.median(), 1),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0], "results/adapt_mini_cifar10").parse_args()
    if not args.report_only:
        common = ["model=alexnet", "data=cifar10", f"data.root={args.root}", f"train.epochs={EPOCHS}", "sched=constant"]
        train_all({m: [f"method={m}", *common, *extra] for m, (_, extra) in RUNS.items()}, RUNS_DIR, args.jobs)
    table = pd.DataFrame([row(method, setting, RUNS_DIR / method) for method, (setting, _) in RUNS.items()])
    described, sharing = machine(RUNS_DIR / "float32", args.jobs)
    write_results(args.out, table, EPOCHS, "AdaPT in miniature: AlexNet on real CIFAR-10", (
        f"Made by `python scripts/adapt_mini.py --root DIR --jobs {args.jobs}` (DIR: an offline CIFAR-10 copy in "
        f"torchvision's python layout, images JPEG-re-encoded at quality 75) "
        f"on {described}.\n\n"
        f"Data: the whole 50,000-image training set and 10,000-image test set, crop 32 pad 4 and flips. The CIFAR "
        f"AlexNet of the AdaPT paper, {EPOCHS} epochs, batch 128 without accumulation, constant learning rate, "
        f"seed 0, one run each. float32, SBM and MuPPET: SGD lr 0.01, momentum 0.9, weight decay 1e-4; MuPPET with "
        f"diversity windows of 2 epochs and patience 1 (the reference's 3 and 2 leave no room for a switch in "
        f"{EPOCHS} epochs). AdaPT: lr 0.01 on unit-norm layer gradients (its config's 0.1 is for batches of 512 "
        f"with 4 accumulation steps, 16 times fewer optimizer steps; at batch 128 it did not learn in a trial), "
        f"L2 1e-8 in the loss, 4 buffer bits, the paper's lookback (25..100 steps), resolution (50..150) and "
        f"<8,4> start, PushDown over the whole range, KL tolerance 1e-3 bits.\n\n"
        f"`percent_of_float32`: FracTrain's cost (effective MACs of the three training GEMMs) over float32's. "
        f"AdaPT's performance model (Sec. 4.1.2) for AdaPT and MuPPET: `SU1` against float32 at the same batch, "
        f"accumulation and epochs (the reference code's formula, which Table 3 prints), `SU1_printed` Sec. 4.1.2's, "
        f"`MEM` memory over float32's, `inference_SU`/`inference_SZ` as Table 6, sparsity as Table 5. `switches`: AdaPT's layer "
        f"format switches, MuPPET's word-length switches; `word_lengths`: AdaPT's range over layers at the end, "
        f"MuPPET's in order; `switch_seconds`: the time AdaPT spent in PushDown and PushUp. `median_epoch_s` is "
        f"the median epoch's wall time (training and evaluation) with {sharing}; `epoch_time_x_float32` "
        f"divides it by float32's."))


if __name__ == "__main__":
    main()
