"""Per-epoch learning curves from the FracTrain authors' published CIFAR training logs.

The FracTrain authors published the logs behind their learning-curve figures in an early copy of their repository
(Tubbz-alt/FracTrain, a copy of GATECH-EIC/FracTrain; commit a8abd463abb7a543074bbc7efd310d45ab36cd42 was read
for this script). This script reads those files straight from a git directory of that snapshot (``git show
COMMIT:PATH``; no work tree needed), turns each into per-epoch CSVs and writes a README listing every CSV with its
provenance (repository, commit, path, git blob) and the run it is:

    python scripts/reference_curves.py GIT_DIR [--commit SHA] [--out results/reference]

Inputs (under ``fractrain_cifar/visualization/``):

- ``learning_curve_dyn/learning_curve/train_logs_resnet{38,74}_cifar{10,100}_{6_8,cr3_w4,11.52.53,22.533.5}.txt``:
  static FW6/BW8 (``train_base.py``), DFQ at target cp 3 % with 4-bit weights, and FracTrain-A/B (``train_dp.py``
  with a target-cp schedule) -- the runs the authors' ``draw_lc.py`` plots as loss and accuracy against MACs.
- ``learning_curve_pfq/train_logs_*.txt`` and ``train_logs_{6_8,3456_5678,3468_6688}.txt``: static and PFQ runs
  (``train_base.py`` with a precision schedule).
- ``learning_curve_dyn/baseline/{IBM8,WAGEUBN,DoReFa}/cifar{10,100}_resnet38/record.txt``: per-epoch records of
  the baselines (train loss, train top-1, test top-1 per line; written by a code base that is not in the
  repository). The IBM8 and WAGEUBN files are byte-identical (the same git blob).

Log format (iteration-based training, ``--iters 64000 --batch_size 128 --print_freq 10 --eval_every 390``):

- every 10 iterations ``Iter: [i/64000] ... Loss v (A) Prec@1 v (A)`` and, for the gated runs,
  ``Computation_Percentage: v(A)`` with its ``_FW``/``_EB``/``_GC`` parts: ``v`` is the current batch's value and
  ``A`` the running average since the run started (never reset). Loss and top-1 are averaged over images (each
  batch weighted by its size); cp and its parts over iterations (each batch weighted 1).
- every 390 iterations (and at iteration 64,000) a test evaluation ``Step N * Prec@1 X[, Loss Y]`` (the quantized
  model), ``Step N * Full Prec@1 X`` (a second evaluation the released code no longer makes) and, for the gated
  runs, the test-set share of every precision option per gated block (``layerN_decision`` then ``k_ratioS``; block
  ``N - 2`` counted from 0) with the test-time cp (the last ``Iter: [78/79]`` line of the evaluation).

An epoch here is the span between two evaluations: 390 iterations (the log's own ``eval_every``), not a pass of
the data. CIFAR's 50,000 training images make passes of 391 batches (390 x 128 + one of 80; the loader keeps the
short batch), so a 390-iteration epoch holds 49,920 images, or 49,872 when the pass's 80-image batch falls into it,
and the evaluation points drift one batch a pass against the passes. The last evaluation (iteration 64,000) closes
a 40-iteration epoch 165. The epoch's own values come from the running averages at its last iteration ``n`` and
at the previous evaluation ``p``: ``(N(n) A_n - N(p) A_p) / (N(n) - N(p))`` with ``N`` the images (loss, top-1)
or iterations (cp) since the run started -- ``k A_k - (k-1) A_(k-1)`` for epoch ``k`` up to the short batches
(under 0.1 % of the weight). The logs print 3 decimals, so a derived value carries a rounding error of up to
about ``0.0005 (2k - 1)``: 0.16 (loss, or points of top-1) at epoch 164, and about 1.6 for the 40-iteration epoch
165 (``train_rounding_bound`` and ``cp_rounding_bound`` give each row's bound). The ``*_sampled`` columns give a
second estimate free of that error but with sampling noise instead: the mean of the 39 single-batch values (``v``)
printed in the epoch. For the gated runs the logged loss is the training objective, cross-entropy plus the signed
cost term (about +-0.2 per batch at cp 3 %), not the cross-entropy.

Outputs (``--out``, default ``results/reference/``): ``<run>.csv`` per log (one row per evaluation), ``<run>_gates.csv``
for the gated runs (one row per evaluation and gated block, one column per option: the share of the test images
that took it, the option's bits in the column name) and ``README.md``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

REPOSITORY = "Tubbz-alt/FracTrain"
DEFAULT_COMMIT = "a8abd463abb7a543074bbc7efd310d45ab36cd42"
VIS = "fractrain_cifar/visualization"

BATCH_SIZE = 128
TRAIN_IMAGES = 50_000
BATCHES_PER_PASS = -(-TRAIN_IMAGES // BATCH_SIZE)  # 391
SHORT_BATCH = TRAIN_IMAGES - (BATCHES_PER_PASS - 1) * BATCH_SIZE  # 80
EVAL_EVERY = 390
TEST_BATCHES = 79  # 10,000 test images in batches of 128

Option = tuple[int, int] | None  # (activation bits, gradient bits); (0, 0) skips the block; None: not identified
SKIP_SET: tuple[Option, ...] = ((0, 0), (4, 6), (6, 8), (6, 12), (8, 16))
NO_SKIP_SET: tuple[Option, ...] = ((3, 6), (4, 6), (6, 8), None, (8, 16))


@dataclass(frozen=True)
class Run:
    """One log: where it is, what to call its CSV and what run it is."""

    path: str
    name: str
    method: str
    description: str
    kind: str = "iter"  # iter: an iteration log | record: a record.txt
    bits: tuple[int, int] | None = None  # static runs: (FW, BW); None where the log states its schedule
    target_cp: float | None = None  # DFQ: the target cp its file name gives (the log does not print it)
    options: tuple[Option, ...] = field(default_factory=tuple)  # gated runs: the gate's options


def _lc(model: str, data: str, tag: str) -> str:
    return f"{VIS}/learning_curve_dyn/learning_curve/train_logs_{model}_{data}_{tag}.txt"


def published_runs() -> list[Run]:
    """Every published log this script tabulates, with what run it is (log_beta.py reads the same list)."""
    runs = []
    for model in ("resnet38", "resnet74"):
        for data in ("cifar10", "cifar100"):
            runs.append(Run(_lc(model, data, "6_8"), f"{model}_{data}_static_fw6_bw8", "static FW6/BW8",
                            "train_base.py --num_bits 6 --num_grad_bits 8: weights and activations 6-bit, gradients "
                            "8-bit, whole training (draw_lc.py's \"SBM[5]-FW6/BW8\", cp 4.3 %)", bits=(6, 8)))
            runs.append(Run(_lc(model, data, "cr3_w4"), f"{model}_{data}_dfq_cp3_w4", "DFQ cp 3 %, 4-bit weights",
                            "train_dp.py --weight_bits 4 --target_ratio 3: DFQ, gate options "
                            + ("skip, 4/6, 6/8, 6/12, 8/16" if model == "resnet38" else
                               "3/6, 4/6, 6/8, ? (never chosen), 8/16 (no skip); resumed at iteration 32,370, "
                               "the log holds the second half only")
                            + " (draw_lc.py's \"DFQ-CP=3\")", target_cp=3.0,
                            options=SKIP_SET if model == "resnet38" else NO_SKIP_SET))
            runs.append(Run(_lc(model, data, "11.52.53"), f"{model}_{data}_fractrain_a_cp1-1.5-2.5-3",
                            "FracTrain-A: cp 1/1.5/2.5/3 %",
                            "train_dp.py with a fixed target-cp schedule 1, 1.5, 2.5, 3 % switching at about "
                            "iterations 8,000/16,000/24,000 (the name concatenates 1|1.5|2.5|3; there is no 2 % "
                            "stage) and a cost-accounting weight-bit schedule 4/4/4/6 (folder suffix _4446); "
                            "options skip, 4/6, 6/8, 6/12, 8/16 (draw_lc.py's \"FracTrain-A\")", options=SKIP_SET))
            runs.append(Run(_lc(model, data, "22.533.5"), f"{model}_{data}_fractrain_b_cp2-2.5-3-3.5",
                            "FracTrain-B: cp 2/2.5/3/3.5 %",
                            "as FracTrain-A with targets 2, 2.5, 3, 3.5 % and cost-accounting weight bits 4/4/6/6 "
                            "(folder suffix _4466) (draw_lc.py's \"FracTrain-B\")", options=SKIP_SET))
    pfq = f"{VIS}/learning_curve_pfq"
    runs += [
        Run(f"{pfq}/train_logs_resnet38_cifar100_3468_6688.txt", "resnet38_cifar100_pfq_fw3-4-6-8_bw6-6-8-8",
            "PFQ FW 3/4/6/8, BW 6/6/8/8", "train_base.py with a fixed precision schedule (switches at about "
            "iterations 8,000/16,000/24,000)"),
        Run(f"{pfq}/train_logs_resnet38_cifar100_8_8.txt", "resnet38_cifar100_static_fw8_bw8", "static FW8/BW8",
            "train_base.py --num_bits 8 --num_grad_bits 8 (PFQ's static baseline)", bits=(8, 8)),
        Run(f"{pfq}/train_logs_resnet74_cifar10_3468_681012.txt", "resnet74_cifar10_pfq_fw3-4-6-8_bw6-8-10-12",
            "PFQ FW 3/4/6/8, BW 6/8/10/12", "train_base.py with a fixed precision schedule (switches at about "
            "iterations 8,000/16,000/24,000)"),
        Run(f"{pfq}/train_logs_resnet74_cifar10_8_12.txt", "resnet74_cifar10_static_fw8_bw12", "static FW8/BW12",
            "train_base.py --num_bits 8 --num_grad_bits 12 (PFQ's static baseline)", bits=(8, 12)),
        Run(f"{VIS}/train_logs_6_8.txt", "vis_resnet38_cifar100_static_fw6_bw8", "static FW6/BW8",
            "train_base.py --num_bits 6 --num_grad_bits 8; another run than learning_curve_dyn's CIFAR-100 6_8 log",
            bits=(6, 8)),
        Run(f"{VIS}/train_logs_3456_5678.txt", "vis_resnet38_cifar100_pfq_fw3-4-5-6_bw5-6-7-8",
            "PFQ FW 3/4/5/6, BW 5/6/7/8", "train_base.py with a fixed precision schedule"),
        Run(f"{VIS}/train_logs_3468_6688.txt", "vis_resnet38_cifar100_pfq_fw3-4-6-8_bw6-6-8-8",
            "PFQ FW 3/4/6/8, BW 6/6/8/8", "train_base.py with a fixed precision schedule; another run than "
            "learning_curve_pfq's"),
    ]
    baselines = (
        ("IBM8", "IBM8 (8-bit)", "160 data epochs, the loss dropping after epochs 80 and 120; byte-identical to "
         "the WAGEUBN record, which is the one the authors' plot draws"),
        ("WAGEUBN", "WAGEUBN FW8/BW8", "160 data epochs, the loss dropping after epochs 80 and 120; draw_lc.py's "
         "\"WAGEUBN[44]-FW8/BW8\""),
        ("DoReFa", "DoReFa FW4/BW32", "200 data epochs, the loss dropping after epochs 100 and 150, train top-1 "
         "rounded to 2 decimals; draw_lc.py's \"DoReFa[49]-FW4/BW32\""),
    )
    for base, label, what in baselines:
        for data in ("cifar10", "cifar100"):
            runs.append(Run(f"{VIS}/learning_curve_dyn/baseline/{base}/{data}_resnet38/record.txt",
                            f"resnet38_{data}_record_{base.lower()}", f"baseline record: {label}",
                            "per-epoch record (train loss, train top-1 over the epoch's 50,000 images, test top-1) "
                            f"from a code base not in the repository: {what}", kind="record"))
    return runs


NOT_CONVERTED = {
    f"{VIS}/train_logs_dp68.txt": "early epoch-based DFQ log (Iter: [epoch][i/391], Epoch N * Prec@1), CIFAR-100 "
                                  "ResNet-38 gated, 133 epochs; another format, not converted",
    f"{VIS}/train_logs_dp88.txt": "early epoch-based DFQ log, CIFAR-100 ResNet-38 gated, 131 epochs; another format, "
                                  "not converted",
}

NUM = r"(-?\d+(?:\.\d*)?(?:e-?\d+)?)"  # the training loss of a gated run goes negative (the signed cost term)
TRAIN_RE = re.compile(rf"Iter: \[(\d+)/(\d+)\]\t.*?Loss {NUM} \({NUM}\)\tPrec@1 {NUM} \({NUM}\)(.*)")
CP_RE = re.compile(rf"Computation_Percentage(_FW|_EB|_GC)?: {NUM}\({NUM}\)")
STATIC_TEST_RE = re.compile(rf"Test: \[(\d+)/(\d+)\]\t.*Loss: {NUM}\({NUM}\)")
STEP_RE = re.compile(rf"Step (\d+) \* (Full )?Prec@1 {NUM}(?:, Loss {NUM})?")
LR_RE = re.compile(rf"Iter \[(\d+)\] learning rate = {NUM}")
TARGET_RE = re.compile(rf"Iter \[(\d+)\] target_ratio = {NUM}")
BITS_RE = re.compile(r"Iter \[(\d+)\] num_bits = (\d+) num_grad_bits = (\d+)")
RESUME_RE = re.compile(r"=> loaded checkpoint .*\(iter: (\d+)\)")
ARCH_RE = re.compile(r"start training (\S+)")
LAYER_RE = re.compile(r"^layer(\d+)_decision$")
RATIO_RE = re.compile(rf"^(\d+)_ratio{NUM}$")
CP_PARTS = ("", "_fw", "_eb", "_gc")


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


@dataclass
class Log:
    """What one iteration log holds, keyed by iteration."""

    arch: str = ""
    start: int = 0
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    target: dict[int, float] = field(default_factory=dict)
    bits: dict[int, tuple[int, int]] = field(default_factory=dict)
    decisions: dict[int, dict[int, list[float]]] = field(default_factory=dict)


def parse_log(text: str) -> Log:
    log = Log()
    test_cp: dict[str, float] = {}
    test_loss = float("nan")
    decisions: dict[int, list[float]] | None = None
    layer = -1
    for line in text.splitlines():
        if m := TRAIN_RE.search(line):
            i, den = int(m[1]), int(m[2])
            cps = {f"cp{CP_PARTS[('', '_FW', '_EB', '_GC').index(c[0])]}": (float(c[1]), float(c[2]))
                   for c in CP_RE.findall(m[7])}
            if den == TEST_BATCHES:  # a gated run's test batch: keep the evaluation's running values
                test_cp = {k: avg for k, (_, avg) in cps.items()}
                test_loss = float(m[4])
                continue
            row = {"loss_val": float(m[3]), "loss_avg": float(m[4]), "acc_val": float(m[5]), "acc_avg": float(m[6])}
            for k, (val, avg) in cps.items():
                row[f"{k}_val"], row[f"{k}_avg"] = val, avg
            log.train[i] = row
        elif m := STATIC_TEST_RE.search(line):
            test_loss = float(m[4])
        elif m := STEP_RE.search(line):
            step, full = int(m[1]), bool(m[2])
            loss = float(m[4]) if m[4] else test_loss
            ev = log.evals.setdefault(step, {})
            if full:
                ev["test_acc_full"], ev["test_loss_full"] = float(m[3]), loss
            else:
                ev["test_acc"], ev["test_loss"] = float(m[3]), loss
                ev.update({f"test_{k}": v for k, v in test_cp.items()})
                decisions = log.decisions.setdefault(step, {})
            test_cp, test_loss = {}, float("nan")
        elif m := LR_RE.search(line):
            log.lr[int(m[1])] = float(m[2])
        elif m := TARGET_RE.search(line):
            log.target[int(m[1])] = float(m[2])
        elif m := BITS_RE.search(line):
            log.bits[int(m[1])] = (int(m[2]), int(m[3]))
        elif m := RESUME_RE.search(line):
            log.start = int(m[1])
        elif m := ARCH_RE.search(line):
            log.arch = m[1]
        elif (m := LAYER_RE.match(line)) and decisions is not None:
            layer = int(m[1])
            decisions[layer] = []
        elif (m := RATIO_RE.match(line)) and decisions is not None and layer in decisions:
            if int(m[1]) != len(decisions[layer]):
                raise ValueError(f"option {m[1]} of layer {layer} out of order")
            decisions[layer].append(float(m[2]))
    return log


def images_seen(iteration: int, start: int) -> int:
    """Training images through ``iteration`` since the run (or its resumption) started at ``start``: every
    391st batch of a pass holds 80 images, the others 128."""
    n = iteration - start
    return n * BATCH_SIZE - (BATCH_SIZE - SHORT_BATCH) * (n // BATCHES_PER_PASS)


def static_cp(fw: int, bw: int) -> float:
    """cp of a static FW/BW setting as train_base.py counts it: forward fw*fw, both backward GEMMs fw*bw, over 3 x 32*32."""
    return 100.0 * (fw * fw + 2 * fw * bw) / 3 / 32 / 32


def at_or_before(table: dict[int, float] | dict[int, tuple[int, int]], iteration: int) -> object:
    keys = [k for k in table if k <= iteration]
    return table[max(keys)] if keys else None


def derive(end: dict[str, float], begin: dict[str, float], key: str, n_end: int, n_begin: int) -> float:
    """The mean over (begin, end] from running means over n_end and n_begin items (no begin: the run's start)."""
    return (n_end * end[key] - n_begin * begin.get(key, 0.0)) / (n_end - n_begin)


def epoch_table(log: Log, run: Run) -> pd.DataFrame:
    rows = []
    steps = sorted(s for s in log.evals if s > log.start)
    prev = log.start
    for step in steps:
        ev = log.evals[step]
        row: dict[str, object] = {"epoch": -(-step // EVAL_EVERY), "iteration": step, "iterations": step - prev,
                                  "images": images_seen(step, log.start) - images_seen(prev, log.start)}
        row["lr"] = at_or_before(log.lr, prev)
        target = at_or_before(log.target, prev)
        row["target_cp"] = target if target is not None else run.target_cp
        bits = at_or_before(log.bits, prev) or run.bits
        row["fw_bits"], row["bw_bits"] = bits if bits else (None, None)
        end, begin = log.train.get(step), log.train.get(prev) if prev > log.start else {}
        window = [log.train[i] for i in sorted(log.train) if prev < i <= step]
        derived = end is not None and begin is not None
        n_end, n_begin = images_seen(step, log.start), images_seen(prev, log.start)
        for key in ("loss", "acc"):
            col = f"train_{key}"
            row[col] = derive(end, begin, f"{key}_avg", n_end, n_begin) if derived else None
            row[f"{col}_sampled"] = float(np.mean([w[f"{key}_val"] for w in window])) if window else None
        # the most a derived value can be off by from the 3-decimal rounding of the two running averages
        row["train_rounding_bound"] = 0.0005 * (n_end + n_begin) / (n_end - n_begin) if derived else None
        i_end, i_begin = step - log.start, prev - log.start
        for part in CP_PARTS:
            key = f"cp{part}"
            row[key] = derive(end, begin, f"{key}_avg", i_end, i_begin) if derived and f"{key}_avg" in end else None
        row["cp_rounding_bound"] = 0.0005 * (i_end + i_begin) / (i_end - i_begin) if row["cp"] is not None else None
        sampled = [w["cp_val"] for w in window if "cp_val" in w]
        row["cp_sampled"] = float(np.mean(sampled)) if sampled else None
        if row["cp"] is not None:
            row["cp_source"] = "logged"
        elif bits:
            row["cp"], row["cp_source"] = static_cp(*bits), "bits"
        else:
            row["cp_source"] = None
        for key in ("test_acc", "test_loss", "test_acc_full", "test_loss_full"):
            row[key] = ev.get(key)
        for part in CP_PARTS:
            row[f"test_cp{part}"] = ev.get(f"test_cp{part}")
        row["test_weight_bits"] = implied_weight_bits(log.decisions.get(step), ev, run.options)
        rows.append(row)
        prev = step
    df = pd.DataFrame(rows)
    for col in df.columns:
        if col not in ("cp_source",):
            df[col] = pd.to_numeric(df[col])
    for col in ("train_loss", "train_acc", "train_loss_sampled", "train_acc_sampled", "train_rounding_bound",
                *[f"cp{p}" for p in CP_PARTS], "cp_rounding_bound", "cp_sampled"):
        df[col] = df[col].round(4)
    return df


def mean_shares(decisions: dict[int, list[float]] | None) -> np.ndarray | None:
    """The option shares averaged over the gated blocks (each block weighs 1, as the logged cp does)."""
    if not decisions or len({len(v) for v in decisions.values()}) != 1:
        return None
    return np.array(list(decisions.values())).mean(0)


def implied_weight_bits(decisions: dict[int, list[float]] | None, ev: dict[str, float],
                        options: tuple[Option, ...]) -> float | None:
    """The weight bits the evaluation's logged forward cp implies: FW% = 100 * sum_k s_k a_k w / 32^2."""
    shares, fw = mean_shares(decisions), ev.get("test_cp_fw")
    if shares is None or fw is None or not options or any(o is None and s > 1e-3 for o, s in zip(options, shares)):
        return None
    act = sum(s * o[0] for o, s in zip(options, shares) if o is not None)
    return round(fw * 1024 / 100 / act, 2) if act > 0 else None


def option_column(k: int, opt: Option) -> str:
    if opt is None:
        return f"opt{k}_unidentified"
    return f"opt{k}_skip" if opt == (0, 0) else f"opt{k}_fw{opt[0]}_bw{opt[1]}"


def gate_table(log: Log, run: Run) -> pd.DataFrame:
    """One row per evaluation and gated block, one column per option: the share of the test images that took it."""
    rows = []
    for step, decisions in sorted(log.decisions.items()):
        if step <= log.start or not decisions:
            continue
        per_stage = len(decisions) // 3
        for layer, shares in sorted(decisions.items()):
            block = layer - 2
            row: dict[str, float] = {"epoch": -(-step // EVAL_EVERY), "iteration": step, "block": block,
                                     "stage": block // per_stage + 1, "stage_block": block % per_stage}
            for k, share in enumerate(shares):
                row[option_column(k, run.options[k] if k < len(run.options) else None)] = round(share, 5)
            rows.append(row)
    return pd.DataFrame(rows)


def fit_option_costs(log: Log) -> list[float] | None:
    """Least squares of the logged test-time GC cp on the block-mean option shares: each option's a*g (its
    activation bits times its gradient bits), which identifies the option set independently of the weight bits."""
    xs, ys = [], []
    for step, decisions in log.decisions.items():
        shares, gc = mean_shares(decisions), log.evals[step].get("test_cp_gc")
        if shares is not None and gc is not None:
            xs.append(shares)
            ys.append(gc)
    if not xs:
        return None
    a, y = np.array(xs), np.array(ys)
    used = a.max(0) > 1e-3
    coef = np.full(a.shape[1], np.nan)
    coef[used] = np.linalg.lstsq(a[:, used], y, rcond=None)[0] * 1024 / 100
    return [round(float(c), 2) for c in coef]


def record_table(text: str) -> tuple[pd.DataFrame, float | None]:
    """A record.txt: one line per epoch, train loss, train top-1, test top-1; where its writer put the best test
    top-1 into the last line's first field (a value no loss takes), that field is returned apart."""
    data = np.array([[float(x) for x in line.split(",")] for line in text.splitlines() if line.strip()])
    df = pd.DataFrame(data, columns=["train_loss", "train_acc", "test_acc"])
    df.insert(0, "epoch", np.arange(1, len(df) + 1))
    best = None
    last = df["train_loss"].iloc[-1]
    if last > 10 and abs(last - df["test_acc"].max()) < 0.01:
        best = float(last)
        df.loc[df.index[-1], "train_loss"] = np.nan
    return df, best


def model_and_data(arch: str) -> tuple[str, str]:
    m = re.match(r"(cifar\d+)_(?:resnet|rnn_gate)_(\d+)", arch)
    return (f"resnet{m[2]}", m[1]) if m else ("?", "?")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("git_dir", type=Path, help="git directory of the Tubbz-alt/FracTrain snapshot")
    ap.add_argument("--commit", default=DEFAULT_COMMIT, help=f"commit to read (default {DEFAULT_COMMIT})")
    ap.add_argument("--out", type=Path, default=Path("results/reference"), help="output folder")
    args = ap.parse_args(argv)

    commit = git(args.git_dir, "rev-parse", f"{args.commit}^{{commit}}").strip()
    tree = set(git(args.git_dir, "ls-tree", "-r", "--name-only", commit, VIS).split())
    blobs = {line.split()[3]: line.split()[2] for line in git(args.git_dir, "ls-tree", "-r", commit, VIS).splitlines()}
    args.out.mkdir(parents=True, exist_ok=True)

    listing = []
    for run in published_runs():
        if run.path not in tree:
            print(f"missing at {commit[:12]}: {run.path}", file=sys.stderr)
            continue
        text = git(args.git_dir, "show", f"{commit}:{run.path}")
        entry = {"run": run, "blob": blobs[run.path], "files": [f"{run.name}.csv"], "note": ""}
        if run.kind == "record":
            df, best = record_table(text)
            entry.update(model="resnet38", data=run.name.split("_")[1], epochs=len(df),
                         last=df["test_acc"].iloc[-1], best=best if best is not None else df["test_acc"].max())
            if best is not None:
                entry["note"] = "last line's first field is the best test top-1 (train_loss left empty there)"
            df.to_csv(args.out / f"{run.name}.csv", index=False)
        else:
            log = parse_log(text)
            df = epoch_table(log, run)
            model, data = model_and_data(log.arch)
            entry.update(model=model, data=data, epochs=len(df), last=df["test_acc"].iloc[-1], best=df["test_acc"].max(),
                         first_iteration=log.start, last_iteration=int(df["iteration"].iloc[-1]))
            df.to_csv(args.out / f"{run.name}.csv", index=False)
            if any(log.decisions.values()):
                gate_table(log, run).to_csv(args.out / f"{run.name}_gates.csv", index=False)
                entry["files"].append(f"{run.name}_gates.csv")
                entry["fit"] = fit_option_costs(log)
        listing.append(entry)
        print(f"{run.name}: {entry['epochs']} rows, last test top-1 {entry['last']:.2f}")
    same = {}
    for e in listing:
        same.setdefault(e["blob"], []).append(e["run"].name)
    write_readme(args.out / "README.md", commit, listing, same)
    return 0


def write_readme(path: Path, commit: str, listing: list[dict], same: dict[str, list[str]]) -> None:
    url = f"https://github.com/{REPOSITORY}/blob/{commit}"
    lines = [
        "# FracTrain reference learning curves",
        "",
        f"Per-epoch CSVs made by `scripts/reference_curves.py` from the FracTrain authors' published CIFAR logs in "
        f"[{REPOSITORY}](https://github.com/{REPOSITORY}) (an early copy of GATECH-EIC/FracTrain), commit "
        f"`{commit}`. The script's docstring gives the log format and how each column is derived; in short:",
        "",
        "- one row per test evaluation; an *epoch* is the log's evaluation interval, 390 iterations of batch 128 "
        "(49,920 images; 49,872 where the pass's 80-image batch falls in it), not a pass of the 50,000 images; "
        "the last row of a complete run is a 40-iteration epoch 165 (iterations 63,961-64,000);",
        "- `train_loss`, `train_acc`, `cp`, `cp_fw/eb/gc`: the epoch's own mean, derived from the logged running "
        "averages (never reset) at the epoch's last iteration and at the previous evaluation, images-weighted for loss "
        "and top-1 and iteration-weighted for cp, as the meters are; rounding of the 3-decimal logs leaves up to "
        "about 0.0005 x (2k - 1) of error at epoch k (the bound in each row's `train_rounding_bound`; the short "
        "epoch 165 carries about 1.6, which is how its train top-1 can read above 100 %); `*_sampled`: the mean of "
        "the epoch's 39 printed single-batch values;",
        "- `cp_source`: `logged` (the gated runs' training cp) or `bits` (static and PFQ runs: "
        "(FW*FW + 2*FW*BW) / 3 / 32^2, train_base.py's count, from the bits in force at the epoch's start);",
        "- `lr`, `target_cp`, `fw_bits`, `bw_bits`: in force at the epoch's start (the logs print them every 390 "
        "iterations; a switch inside an epoch shows in the next row); DFQ's `target_cp` comes from the file name;",
        "- `test_acc`/`test_loss`: the quantized model's evaluation (`Step N * Prec@1`); `test_acc_full`: the logs' "
        "second evaluation (`Full Prec@1`, made by code the repository no longer holds); `test_cp*`: the gated runs' "
        "test-time cp; `test_weight_bits`: the weight bits that test-time forward cp implies given the option set "
        "(the cost accounting's weight bits, see below);",
        "- `*_gates.csv`: one row per evaluation and gated block (`block` from 0 = the log's "
        "`layer{block+2}_decision`; `stage` 1-3, `stage_block` from 0), one column per gate option with the share of "
        "the test images that took it; the column names give the option's activation/gradient bits (`opt0_skip`, "
        "`opt1_fw4_bw6`, ...; `unidentified`: never chosen, so its bits cannot be read off the logged cp).",
        "",
        "| CSV | run | model | data | rows | last / best test top-1 | source (git blob) |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in listing:
        run = e["run"]
        files = ", ".join(f"`{f}`" for f in e["files"])
        src = f"[`{run.path.removeprefix('fractrain_cifar/')}`]({url}/{run.path}) (`{e['blob'][:10]}`)"
        lines.append(f"| {files} | {run.method} | {e['model']} | {e['data']} | {e['epochs']} | "
                     f"{e['last']:.2f} / {e['best']:.2f} | {src} |")
    lines += ["", "## What each run is", ""]
    for e in listing:
        run = e["run"]
        extra = []
        if e.get("first_iteration"):
            extra.append(f"log starts at iteration {e['first_iteration']:,}")
        if e.get("last_iteration") and e["last_iteration"] < 64000:
            extra.append(f"log ends at the evaluation of iteration {e['last_iteration']:,} (truncated)")
        if e.get("fit"):
            fit = ", ".join("n/a" if np.isnan(c) else f"{abs(c) if abs(c) < 0.05 else c:g}" for c in e["fit"])
            extra.append(f"activation x gradient bits per option, fitted to the test-time GC cp: {fit}")
        if e["note"]:
            extra.append(e["note"])
        dup = [n for n in same[e["blob"]] if n != run.name]
        if dup:
            extra.append("byte-identical to " + ", ".join(f"`{d}.csv`'s source" for d in dup))
        lines.append(f"- `{run.name}`: {run.description}." + (" " + "; ".join(extra) + "." if extra else ""))
    lines += ["", "Not converted:", ""]
    lines += [f"- [`{p.removeprefix('fractrain_cifar/')}`]({url}/{p}): {why}." for p, why in NOT_CONVERTED.items()]
    lines += ["", *SETTINGS]
    path.write_text("\n".join(lines) + "\n")


SETTINGS = [
    "## How the runs were configured (read from the logs and the repository's code at this commit)",
    "",
    "Script and file names are those at this commit; the logs were written by slightly earlier versions of these "
    "scripts (their warnings cite other line numbers, and they print lines the released files do not).",
    "",
    "- All iteration logs: 64,000 iterations of batch 128 (`--iters`, `--batch_size` defaults), SGD momentum 0.9, "
    "weight decay 1e-4 on every parameter, lr 0.1, /10 at iterations 32,000 and 48,000 (`adjust_learning_rate`, "
    "'piecewise'; the logs show 0.1 -> 0.01 -> 0.001 at the first evaluation after each); evaluation every 390 "
    "iterations; RandomCrop 32 with 4 zero-padding + horizontal flip, normalization mean (0.4914, 0.4822, 0.4465), "
    "std (0.2023, 0.1994, 0.2010) (data.py); convolutions initialized N(0, sqrt(2/(k*k*out))), the classifier "
    "N(0, sqrt(2/(in*out))), batch-norm weight 1, bias 0 (models.py).",
    "- Quantizers (modules/quantize.py): weights per output channel min/max, nearest; activations per tensor "
    "(global min/max of the batch; running range with weight 0.9 on the old value at evaluation), nearest; the "
    "conv output's gradient per tensor min/max, stochastic rounding, one precision for both backward GEMMs. "
    "Batch norm float32.",
    "- Static FW/BW and PFQ (train_base.py, `cifar*_resnet_*`): every convolution quantized, the first one and the "
    "1x1 projection shortcuts included; the classifier float32. PFQ logs: `--schedule` fixed iterations (the bits "
    "change between the evaluations of 7,800 and 8,190, 15,990 and 16,380, 23,790 and 24,180), not PFQ's loss "
    "indicator.",
    "- DFQ / FracTrain (train_dp.py, `cifar*_rnn_gate_*`): per gated residual block one of 5 options picked per "
    "sample by an LSTM gate (embedding: average pool, 1x1 conv to 32, ReLU, 1x1 conv to 16; LSTM 16; linear to 5; "
    "straight-through argmax); every option's block output is computed and mixed (reference execution); skip "
    "(0/0) passes the input, through the float32 projection shortcut where the block changes shape; stem, "
    "projection on the skip path and classifier float32, the block's own projection at the option's bits. "
    "Controller: loss = CE + 1e-3 x batch cost x sign (cp vs target, `--relax 0`); cp counts the gated blocks, "
    "one weight each (`conv_info` unset), FW = a*w, EB = g*w, GC = a*g over 32^2.",
    "- FracTrain-A/B logs: the training-time cp prints FW = EB = 0 throughout: the cost accounting's weight bits "
    "were 0 when training started (no `--weight_bits`), so the controller steered GC/3 alone to the target, and "
    "the model's convolutions, built with weight bits 0, kept float32 weights (a weight-bit schedule, read from "
    "the evaluations' FW/EB cp, changed only the accounting: 4 bits, then 6 from the 24,000 (A) or 16,000 (B) "
    "switch). Their test-time cp (with weights charged) is about twice the training target.",
    "- The gated runs' logged training loss is the objective, cross-entropy plus the signed cost term "
    "(about +-0.2 at cp 3 %, its sign flipping with the controller batch to batch), not the cross-entropy; so are "
    "`train_loss` and `train_loss_sampled` here. Their test loss is the cross-entropy.",
    "- Which paper numbers these runs are: the best test top-1 of the DFQ logs equals the paper's Table 3 DFQ "
    "entries where the log is complete enough (ResNet-38 CIFAR-100 69.81, ResNet-74 CIFAR-10 93.09), and the "
    "static FW8/BW8 ResNet-38 CIFAR-100 log's (learning_curve_pfq) equals Table 3's SBM FW-8/BW-8 entry (69.78): "
    "the paper's SBM baseline is train_base.py. The FracTrain-A/B logs are the curves draw_lc.py plots "
    "against MACs (fractrain.pdf), not Table 3's cp 1.5/2/2.5/3 runs.",
    "- Baseline records: 160 (IBM8/WAGEUBN) or 200 (DoReFa) data epochs; the IBM8/WAGEUBN loss drops after "
    "epochs 80 and 120; train top-1 is an exact count over 50,000 images. No IBM8, WAGEUBN or DoReFa training "
    "code is in the repository (nor in GATECH-EIC/FracTrain); the authors' plotting script draws only the "
    "WAGEUBN file (as \"WAGEUBN[44]-FW8/BW8\") and comments the IBM8 one out.",
]


if __name__ == "__main__":
    raise SystemExit(main())
