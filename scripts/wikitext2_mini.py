"""FracTrain Table 2's language rows in miniature on real WikiText-2: float32 vs SBM FW-8/BW-16 vs PFQ.

    python scripts/wikitext2_mini.py --root DIR [--out results/fractrain_wikitext2_mini] [--jobs 1]

DIR holds ``wiki.{train,valid,test}.tokens`` (WikiText-2's tokenized release). Each run is ``qtrain
experiment=fractrain_wikitext103 scale=mini data=wikitext2`` (the experiment's mini scale,
conf/scale/fractrain_wikitext103/mini.yaml: the small Transformer, 16 sequences of 64 tokens a batch, 6 epochs
over the first 200,000 training tokens, Adam (0.9, 0.98, 1e-9) with the inverse-square-root schedule after 100
warm-up steps, the first 50,000 test tokens) with the settings of FracTrain Table 2:
- SBM FW-8/BW-16 as FracTrain's baseline (both backward GEMMs at 16 bits, global activation range);
- PFQ FW(3,4,6,8)/BW(6,8,12,16), its loss indicator over 2-epoch windows (conf/scale/method/mini_pfq.yaml);
both with every GEMM quantized, the vocabulary projection and attention's two products included. Each run
lives in outputs/wikitext2_mini/<method> (rerunning resumes unfinished runs and reports finished ones); the
table goes to <out>.csv and <out>.md.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from mini_runs import add_savings_vs_sbm, machine, parser, train_all, turning_points, write_results

RUNS_DIR = Path("outputs/wikitext2_mini")
EPOCHS = 6
COMMON = ["experiment=fractrain_wikitext103", "scale=mini", "data=wikitext2"]
RUNS = {
    "float32": ("float32", ["method=float32"]),
    "sbm": ("FW-8/BW-16", ["method=sbm", "method.grad_bits=16", "method.grad_weight_bits=16", "method.act_range=tensor"]),
    "pfq": ("FW(3,4,6,8)/BW(6,8,12,16)", ["method=pfq", "method.last_layer=quantized"]),
}


def row(method: str, setting: str, run_dir: Path) -> dict:
    """One table row from a run's metrics.csv (a run cut short shows the epochs it completed)."""
    metrics = pd.read_csv(run_dir / "metrics.csv")
    last = metrics.iloc[-1]
    return {
        "method": method, "precision": setting, "epochs": f"{int(last.epoch)}/{EPOCHS}",
        "test_ppl": round(last.test_ppl, 2), "best_test_ppl": round(metrics.test_ppl.min(), 2),
        "next_token_acc": round(100 * last.test_acc, 2),
        "effective_macs": f"{last.effective_macs:.3e}", "bit_macs": f"{1024 * last.effective_macs:.3e}",
        "percent_of_float32": round(last.percent_of_float32, 3), "turning_points_after_epoch": turning_points(metrics),
        "median_epoch_s": round(metrics.epoch_seconds.median(), 1),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0], "results/fractrain_wikitext2_mini", "wiki.{train,valid,test}.tokens").parse_args()
    if not args.report_only:
        train_all({m: [*COMMON, f"data.root={args.root}", *extra] for m, (_, extra) in RUNS.items()}, RUNS_DIR, args.jobs)
    table = pd.DataFrame([row(method, setting, RUNS_DIR / method) for method, (setting, _) in RUNS.items()])
    add_savings_vs_sbm(table)
    described, threads_text = machine(RUNS_DIR / "sbm", args.jobs)
    command = f"python scripts/wikitext2_mini.py --root DIR --jobs {args.jobs}"
    write_results(args.out, table, EPOCHS, "FracTrain Table 2's Transformer rows in miniature: WikiText-2", (
        f"Made by `{command}` (DIR: an offline WikiText-2 copy, `wiki.{{train,valid,test}}.tokens`) "
        f"on {described}.\n\n"
        f"Model and data: the small Transformer preset (2 layers, d_model 128, 4 heads, FFN 512, dropout 0.1, "
        f"sequences of 64 tokens), WikiText-2's word vocabulary of the whole training split (33,278 words with "
        f"`<unk>` and `<eos>`), trained on its first 200,000 tokens (16 sequences, 1,024 tokens, a batch: 195 steps an "
        f"epoch), tested on the first 50,000 test tokens. {EPOCHS} epochs of Adam (0.9, 0.98, 1e-9), lr 7e-4 at the end "
        f"of 100 warm-up steps then falling as 1/sqrt(step), seed 0, one run each (`experiment=fractrain_wikitext103 "
        f"scale=mini data=wikitext2`). SBM: FW-8/BW-16 with both backward GEMMs at 16 bits and the global activation "
        f"range (FracTrain's baseline). PFQ: FW(3,4,6,8)/BW(6,8,12,16), loss indicator over 2-epoch windows, L_scale "
        f"from the first 2 epochs, epsilon 0.05 and alpha 0.3 (the paper's). Both quantize every GEMM: the linear "
        f"layers, the vocabulary projection and attention's QK^T and attention x V. `test_ppl` is exp of the mean test "
        f"loss per token (lower is better), `next_token_acc` the share of test tokens predicted first. Cost: effective "
        f"MACs of the three training GEMMs of every layer, bit-MACs = 1024 x effective MACs. `median_epoch_s` is the "
        f"median epoch's wall time (training and evaluation) with {threads_text}; `epoch_time_x_float32` divides it by "
        f"float32's."))


if __name__ == "__main__":
    main()
