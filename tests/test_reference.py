"""``qtrain-report --reference``: runs set beside a hand-made reference curve, every expected figure worked out by
hand from the numbers written here; and the learning-curve figure."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from qtrain.report.cli import report
from qtrain.report.figure_style import groups
from qtrain.report.run_plots import learning_curve_plot
from qtrain.report.runs import ReportError, find_runs

from .test_report import fake_run

# as the logs print them: accuracies in percent
REFERENCE = {"epoch": [1, 2, 3], "train_loss": [2.0, 1.0, 0.5], "train_acc": [30.0, 50.0, 60.0],
             "test_acc": [40.0, 50.0, 60.0], "cp": [3.0, 3.0, 3.0]}
FLOOR = ["most chosen the same", "majority skips the same", "same and share within 0.15"]  # the noise floor's counts


def _precision(epoch: int, blocks: list[list[tuple[int, int, float]]]) -> list[dict]:
    """Precision rows of DFQ-like gated blocks: each block's two convolutions at the given (FW, BW, share) options."""
    return [{"epoch": epoch, "step": 10 * epoch, "layer": f"layer1.{b}.block.conv{c}", "format": "range-linear",
             "share": share, "weight_bits": 4, "act_bits": fw, "grad_bits": bw, "grad_weight_bits": bw, "density": 1.0}
            for b, options in enumerate(blocks) for c in (1, 2) for fw, bw, share in options]


@pytest.fixture
def runs_and_reference(tmp_path):
    root = tmp_path / "runs"
    blocks = [[(4, 6, 0.6), (6, 8, 0.1)], [(6, 8, 0.55), (4, 6, 0.45)]]
    for seed, train_acc, loss in ((0, [0.31, 0.52, 0.58], [2.2, 1.1, 0.5]), (1, [0.33, 0.50, 0.60], [2.0, 1.0, 0.6])):
        fake_run(root, f"dfq{seed}", "dfq", [0.41, 0.52, 0.61], [1e9, 2e9, 3e9], seed=seed, model="resnet38",
                 data="cifar10", precision=_precision(3, blocks),
                 metrics_extra={"train_acc": train_acc, "train_loss": loss, "cp": [2.9, 3.1, 3.2]})
    reference = tmp_path / "ref.csv"
    pd.DataFrame(REFERENCE).to_csv(reference, index=False)
    pd.DataFrame({"epoch": [2, 3, 3], "block": [0, 0, 1], "opt0_skip": [1.0, 0.3, 0.0], "opt1_fw4_bw6": [0.0, 0.7, 0.4],
                  "opt2_fw6_bw8": [0.0, 0.0, 0.6]}).to_csv(tmp_path / "ref_gates.csv", index=False)
    return root, reference


def _section(text: str, heading: str) -> pd.DataFrame:
    """The markdown table under the heading that starts with ``heading``, its missing figures (``-``) as NaN."""
    lines = [*text.split(f"## {heading}", 1)[1].splitlines()[2:], ""]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[:lines.index("")]]
    return pd.DataFrame(rows[2:], columns=rows[0]).replace("-", math.nan)


def test_each_epoch_beside_the_reference_with_the_differences_counted_by_hand(runs_and_reference, tmp_path):
    root, reference = runs_and_reference
    text = report([str(root), "--reference", str(reference), "--reference-from", "2", "--plots", str(tmp_path / "p")])
    epochs = _section(text, "Against the reference ref (dfq, 2 runs): per epoch").astype(float).set_index("epoch")
    # training accuracy: the seeds' mean 32, 51, 59 % against 30, 50, 60 %
    assert epochs["train_acc diff (points)"].tolist() == pytest.approx([2.0, 1.0, -1.0])
    assert epochs["train_acc seeds' range"].tolist() == pytest.approx([2.0, 2.0, 2.0])  # 31/33, 52/50, 58/60 %
    # training loss: the mean 2.1, 1.05, 0.55 against 2.0, 1.0, 0.5, in percent of the reference's
    assert epochs["train_loss diff (%)"].tolist() == pytest.approx([5.0, 5.0, 10.0])
    assert epochs["cp diff (points)"].tolist() == pytest.approx([-0.1, 0.1, 0.2])
    assert epochs["test_acc diff (points)"].tolist() == pytest.approx([1.0, 2.0, 1.0])
    summary = _section(text, "Against the reference ref: the differences from epoch 2").set_index("figure")
    assert summary.loc["train_acc", "epochs"] == "2-3"
    assert float(summary.loc["train_acc", "mean"]) == pytest.approx(0.0)
    assert float(summary.loc["train_acc", "largest size"]) == pytest.approx(1.0)
    assert float(summary.loc["train_loss", "largest size"]) == pytest.approx(10.0)
    shares = _section(text, "Against the reference ref: each gated block's most chosen option").set_index("block")
    assert shares["ours: most chosen"].tolist() == ["FW4/BW6", "FW6/BW8"]
    assert shares["same"].tolist() == ["True", "True"]
    # block 0: FW4/BW6 at 0.6 against 0.7; block 1: FW6/BW8 at 0.55 against 0.6
    assert [float(v) for v in shares["share diff (reference's option)"]] == pytest.approx([-0.1, -0.05])
    names = {path.name.split("-")[0] for path in (tmp_path / "p").glob("*.png")}
    assert {"reference", "learning"} <= names


def test_the_learning_curve_figure_has_a_panel_for_each_curve_a_run_records(tmp_path):
    fake_run(tmp_path / "runs", "a", "sbm", [0.4, 0.5], [1e9, 2e9], metrics_extra={"train_acc": [0.3, 0.6]})
    group, = groups(find_runs([tmp_path / "runs"]))
    path = learning_curve_plot(group, tmp_path)
    assert path is not None and path.name.startswith("learning-curves-")
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("make,args,message", [
    (lambda d: pd.DataFrame({"step": [1]}).to_csv(d / "bad.csv", index=False), ["--reference", "bad.csv"],
     "needs an epoch column"),
    (lambda d: pd.DataFrame({"epoch": [0], "train_acc": [0.1]}).to_csv(d / "bad.csv", index=False),
     ["--reference", "bad.csv"], "whole numbers from 1"),
    (lambda d: None, ["--reference", "none.csv"], "no such file"),
    (lambda d: None, ["--shares-at", "5"], "not allowed without --reference"),
    (lambda d: fake_run(d / "runs", "other", "sbm", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], model="resnet38", data="cifar10"),
     ["--reference", "ref.csv"], "compares the seeds of one configuration"),
    # the same method and setting, another key outside the method: not a third seed of the fixture's configuration
    (lambda d: fake_run(d / "runs", "longer", "dfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], model="resnet38", seed=2,
                        data="cifar10", train_keys={"epochs": 4}),
     ["--reference", "ref.csv"], "these runs are 2: dfq train.epochs=2; dfq train.epochs=4"),
])
def test_bad_reference_input_is_one_line(runs_and_reference, tmp_path, monkeypatch, make, args, message):
    root, _ = runs_and_reference
    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    with pytest.raises(ReportError, match=message):
        report([str(root), *args])


def test_a_run_without_a_cp_column_is_charged_each_epoch_from_its_cumulative_cost(tmp_path):
    # cumulative 1e9 then 3e9 effective MACs at 10 % then 15 % of float32: float32's 1e10 then 2e10, so the second
    # epoch alone cost 2e9 of 1e10, 20 %
    fake_run(tmp_path / "runs", "a", "sbm", [0.4, 0.5], [1e9, 3e9], metrics_extra={"percent_of_float32": [10.0, 15.0]})
    pd.DataFrame({"epoch": [1, 2], "cp": [10.0, 21.0]}).to_csv(tmp_path / "ref.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv")])
    epochs = _section(text, "Against the reference ref (sbm, 1 run): per epoch").astype(float)
    assert epochs["cp ours"].tolist() == pytest.approx([10.0, 20.0])
    assert epochs["cp diff (points)"].tolist() == pytest.approx([0.0, -1.0])


def test_gated_logs_loss_holds_the_cost_term_and_a_fully_skipped_block_keeps_its_number(tmp_path):
    # block 0 skips every sample in epoch 2 (no rows), blocks 1 and 10 of stage 1 keep their numbers 1 and 2
    rows = [{"epoch": e, "step": e, "layer": f"layer1.{b}.block.conv1", "format": "range-linear", "share": 1.0,
             "weight_bits": 4, "act_bits": 6, "grad_bits": 8, "grad_weight_bits": 8, "density": 1.0}
            for e in (1, 2) for b in (0, 1, 10) if not (e == 2 and b == 0)]
    fake_run(tmp_path / "runs", "a", "dfq", [0.4, 0.5], [1e9, 2e9], model="resnet74", precision=rows,
             metrics_extra={"train_loss": [1.0, 0.5], "cost_term": [0.1, -0.1]})
    pd.DataFrame({"epoch": [1, 2], "train_loss": [1.1, 0.4], "cp_source": ["logged", "logged"]}).to_csv(
        tmp_path / "ref.csv", index=False)
    pd.DataFrame({"epoch": [2, 2, 2], "block": [0, 1, 2], "opt0_skip": [1.0, 0.0, 0.0],
                  "opt1_fw6_bw8": [0.0, 1.0, 1.0]}).to_csv(tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv"), "--shares-at", "2"])
    epochs = _section(text, "Against the reference ref (dfq, 1 run): per epoch").astype(float)
    assert epochs["train_loss ours"].tolist() == pytest.approx([1.1, 0.4])  # loss + cost term, as the log's
    shares = _section(text, "Against the reference ref: each gated block's most chosen option").set_index("block")
    assert shares["ours: most chosen"].tolist() == ["skipped", "FW6/BW8", "FW6/BW8"]
    assert shares["same"].tolist() == ["True", "True", "True"]


def test_a_downsampling_blocks_float32_shortcut_is_not_its_option(tmp_path):
    # the first block of a stage: 90 % of the samples skip it through its shortcut in float32, which the record lists
    # first by name (shortcut.0 before conv1) at 32 bits; the gate's choice is the convolutions': skipped at 0.9
    rows = [{"epoch": 1, "step": 1, "layer": f"layer2.0.block.{name}", "format": "range-linear", "share": share,
             "weight_bits": 4, "act_bits": fw, "grad_bits": bw, "grad_weight_bits": bw, "density": 1.0}
            for name, fw, bw, share in (("conv1", 6, 8, 0.1), ("conv2", 6, 8, 0.1), ("shortcut.0", 32, 32, 0.9),
                                        ("shortcut.0", 6, 8, 0.1))]
    fake_run(tmp_path / "runs", "a", "dfq", [0.4], [1e9], model="resnet38", precision=rows,
             metrics_extra={"train_loss": [1.0]})
    pd.DataFrame({"epoch": [1], "train_loss": [1.0]}).to_csv(tmp_path / "ref.csv", index=False)
    pd.DataFrame({"epoch": [1], "block": [0], "opt0_skip": [0.8], "opt2_fw6_bw8": [0.2]}).to_csv(
        tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv"), "--shares-at", "1"])
    shares = _section(text, "Against the reference ref: each gated block's most chosen option").set_index("block")
    assert shares["ours: most chosen"].tolist() == ["skipped"] and shares["same"].tolist() == ["True"]
    assert float(shares["share"].iloc[0]) == pytest.approx(0.9)
    assert float(shares["share diff (reference's option)"].iloc[0]) == pytest.approx(0.1)


def test_a_downsampling_block_skipped_by_every_sample_in_its_first_epoch_is_read_from_its_convolutions(tmp_path):
    # epoch 1: every sample skips (only the float32 shortcut has a row); epoch 2: the convolutions at FW6/BW8
    rows = [{"epoch": epoch, "step": epoch, "layer": f"layer2.0.block.{name}", "format": "range-linear",
             "share": share, "weight_bits": 4, "act_bits": fw, "grad_bits": bw, "grad_weight_bits": bw, "density": 1.0}
            for epoch, name, fw, bw, share in ((1, "shortcut.0", 32, 32, 1.0), (2, "conv1", 6, 8, 0.7),
                                                (2, "shortcut.0", 32, 32, 0.3), (2, "shortcut.0", 6, 8, 0.7))]
    fake_run(tmp_path / "runs", "a", "dfq", [0.4, 0.5], [1e9, 2e9], model="resnet38", precision=rows,
             metrics_extra={"train_loss": [1.0, 0.9], "test_acc": [math.nan, 0.5]})
    pd.DataFrame({"epoch": [1, 2], "train_loss": [1.0, 0.9], "test_acc": [40.0, 48.0]}).to_csv(
        tmp_path / "ref.csv", index=False)
    pd.DataFrame({"epoch": [1, 2], "block": [0, 0], "opt0_skip": [1.0, 0.4], "opt2_fw6_bw8": [0.0, 0.6]}).to_csv(
        tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv"), "--shares-at", "1", "2"])
    shares = _section(text, "Against the reference ref: each gated block's most chosen option")
    assert shares["ours: most chosen"].tolist() == ["skipped", "FW6/BW8"]
    # epoch 1 was not evaluated (train.eval_every): its test accuracy is no difference of the table's
    summary = _section(text, "Against the reference ref: the differences from epoch 1").set_index("figure")
    assert summary.loc["test_acc", "epochs"] == "2-2" and float(summary.loc["test_acc", "mean"]) == pytest.approx(2.0)


def test_gate_shares_are_the_evaluations_where_the_run_records_them(tmp_path):
    """A run with gates_eval rows is compared by its evaluation's shares (the logs' kind), not its training mean."""
    training = _precision(3, [[(4, 6, 0.9)], [(4, 6, 0.2)]])
    evaluation = [{**row, "event": "gates_eval"} for row in _precision(3, [[(6, 8, 0.25)], [(4, 6, 0.4), (6, 8, 0.6)]])]
    fake_run(tmp_path / "runs", "dfq", "dfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], model="resnet38", data="cifar10",
             precision=[{**row, "event": "epoch"} for row in training] + evaluation)
    reference = tmp_path / "ref.csv"
    pd.DataFrame(REFERENCE).to_csv(reference, index=False)
    pd.DataFrame({"epoch": [3, 3], "block": [0, 1], "opt0_skip": [0.7, 0.0], "opt1_fw4_bw6": [0.3, 0.6],
                  "opt2_fw6_bw8": [0.0, 0.4]}).to_csv(tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(reference)])
    shares = _section(text, "Against the reference ref: each gated block's most chosen option")
    assert shares["ours: of"].tolist() == ["evaluation"] * 2
    # block 0: the evaluation skips 75 % (training: 10 %); block 1: FW6/BW8 60 %, FW4/BW6 40 % (training: FW4/BW6)
    assert shares["ours: most chosen"].tolist() == ["skipped", "FW6/BW8"]
    assert shares["share"].astype(float).tolist() == pytest.approx([0.75, 0.6])
    assert shares["share diff (reference's option)"].astype(float).tolist() == pytest.approx([0.75 - 0.7, 0.4 - 0.6])


def test_each_runs_gates_summed_up_per_epoch_beside_the_references(tmp_path):
    """Per stage the skipped share, per option its share over the blocks, and the blocks that agree, by hand."""
    def rows(epoch, event, options):  # (block, FW, BW, share) of each block's first convolution
        return [{"epoch": epoch, "step": epoch, "layer": f"{block}.block.conv1", "format": "range-linear",
                 "share": share, "weight_bits": 4, "act_bits": fw, "grad_bits": bw, "grad_weight_bits": bw,
                 "density": 1.0, "event": event} for block, fw, bw, share in options]

    # seed 0 skips layer1.0 for 28 %, layer1.1 for 15 %, layer2.0 for 80 % of the test images; seed 1 skips
    # layer2.0 for every one of them at epoch 3 (no row), after running it at epoch 2, and takes FW8/BW16, an
    # option the reference's gates never chose
    seed0 = rows(3, "gates_eval", [("layer1.0", 4, 6, 0.42), ("layer1.0", 6, 8, 0.3), ("layer1.1", 6, 8, 0.85),
                                   ("layer2.0", 6, 8, 0.2), ("layer2.1", 6, 8, 1.0)])
    seed1 = rows(2, "gates_eval", [("layer1.0", 6, 8, 1.0), ("layer1.1", 6, 8, 1.0), ("layer2.0", 6, 8, 1.0)]) + \
        rows(3, "gates_eval", [("layer1.0", 6, 8, 0.6), ("layer1.1", 8, 16, 0.3), ("layer2.1", 6, 8, 1.0)])
    for seed, precision in ((0, seed0), (1, seed1)):
        fake_run(tmp_path / "runs", f"dfq{seed}", "dfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], seed=seed, model="resnet38",
                 data="cifar10", precision=precision)
    pd.DataFrame(REFERENCE).to_csv(tmp_path / "ref.csv", index=False)
    # the reference's block 3 (layer2.1) is left empty in its file, and its block 4 is one the runs do not have:
    # neither counts
    nan = math.nan
    pd.DataFrame({"epoch": [1, 3, 3, 3, 3, 3], "block": [0, 0, 1, 2, 3, 4], "opt0_skip": [1.0, 0.1, 0.0, 0.4, nan, 1.0],
                  "opt1_fw4_bw6": [0.0, 0.6, 0.3, 0.0, nan, 0.0], "opt2_fw6_bw8": [0.0, 0.3, 0.7, 0.6, nan, 0.0]}
                 ).to_csv(tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv")])
    gates = _section(text, "Against the reference ref: each run's gates per epoch").set_index("run")
    assert gates.epoch.tolist() == ["3"] * 3  # epoch 1: no run has gate shares for it
    assert gates.of.tolist() == ["", "evaluation", "evaluation"]
    numbers = gates[["skipped: layer1", "skipped: layer2", "skipped: all blocks", "FW4/BW6: all blocks",
                     "FW6/BW8: all blocks", "FW8/BW16: all blocks"]].astype(float)
    assert numbers.loc["reference"].tolist() == pytest.approx([0.05, 0.4, 0.5 / 3, 0.3, 1.6 / 3, 0.0], abs=5e-4)
    assert numbers.loc["seed 0"].tolist() == pytest.approx([0.215, 0.8, 1.23 / 3, 0.14, 0.45, 0.0], abs=5e-4)
    assert numbers.loc["seed 1"].tolist() == pytest.approx([0.55, 1.0, 0.7, 0.0, 0.2, 0.1], abs=5e-4)
    # seed 0: blocks 0 and 1 choose the reference's option, block 2 skips where the reference runs; block 0's
    # FW4/BW6 at 0.42 lies 0.18 from the reference's 0.6, block 1's FW6/BW8 at 0.85 against 0.7 on the band's edge
    agreement = ["most chosen as the reference's", "majority skips as the reference's", "same and share within 0.15"]
    assert gates.loc["seed 0", agreement].tolist() == ["2/3", "2/3", "1/3"]
    # seed 1: FW6/BW8 where the reference's is FW4/BW6, then two blocks skipped for most images where it runs them
    assert gates.loc["seed 1", agreement].tolist() == ["0/3", "1/3", "0/3"]
    assert gates.loc["reference", agreement].tolist() == ["", "", ""]
    # seed 1's layer2.0 (block 2) runs for no sample; seed 0's skips 80 %, the reference's 40 %
    assert gates["blocks skipped by over 99.9 %"].tolist() == ["", "", "2"]
    # the two seeds against each other over the same blocks: block 0 FW4/BW6 against FW6/BW8 (both run by most
    # samples), block 1 FW6/BW8 against the skip, block 2 skipped by both, for 80 and 100 % (0.2 apart); the
    # reference has no epoch 2 to set its epoch 3 against
    floor = _section(text, "Against the reference ref: the gate target's noise floor")
    assert floor[["epoch", "compared"]].values.tolist() == [["3", "seed 1 against seed 0"]]
    assert floor.iloc[0][FLOOR].tolist() == ["1/3", "2/3", "0/3"]


def test_the_references_gates_set_against_its_previous_epoch(tmp_path):
    """The reference's own change from one epoch to the next, over the blocks it has at both and the run has."""
    fake_run(tmp_path / "runs", "dfq0", "dfq", [0.4, 0.5, 0.6], [1e9, 2e9, 3e9], seed=0, model="resnet38",
             data="cifar10", precision=_precision(3, [[(6, 8, 1.0)]] * 4))
    pd.DataFrame(REFERENCE).to_csv(tmp_path / "ref.csv", index=False)
    # epoch 2 -> 3: block 0 keeps FW6/BW8 (0.7 -> 0.6), block 1 from the skip (0.6) to FW6/BW8 (0.55), block 2
    # keeps FW4/BW6 (0.9 -> 0.7, outside the band); block 3 is in the file at epoch 3 only
    pd.DataFrame({"epoch": [2, 2, 2, 3, 3, 3, 3], "block": [0, 1, 2, 0, 1, 2, 3],
                  "opt0_skip": [0.2, 0.6, 0.1, 0.1, 0.45, 0.0, 0.0], "opt1_fw4_bw6": [0.1, 0.0, 0.9, 0.3, 0.0, 0.7, 1.0],
                  "opt2_fw6_bw8": [0.7, 0.4, 0.0, 0.6, 0.55, 0.3, 0.0]}).to_csv(tmp_path / "ref_gates.csv", index=False)
    text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv")])
    floor = _section(text, "Against the reference ref: the gate target's noise floor")
    assert floor[["epoch", "compared"]].values.tolist() == [["3", "the reference against its epoch 2"]]
    assert floor.iloc[0][FLOOR].tolist() == ["2/3", "2/3", "1/3"]


def test_the_per_epoch_gate_tables_show_every_nth_epoch_and_the_last(tmp_path):
    precision = [row for epoch in range(1, 6) for row in _precision(epoch, [[(6, 8, 1.0)]])]
    fake_run(tmp_path / "runs", "dfq0", "dfq", [0.4] * 5, [1e9] * 5, seed=0, model="resnet38", data="cifar10",
             precision=precision)
    pd.DataFrame(REFERENCE).to_csv(tmp_path / "ref.csv", index=False)
    pd.DataFrame({"epoch": range(1, 6), "block": 0, "opt0_skip": 0.0, "opt1_fw6_bw8": 1.0}).to_csv(
        tmp_path / "ref_gates.csv", index=False)
    for every, epochs in ((1, ["1", "2", "3", "4", "5"]), (2, ["2", "4", "5"]), (5, ["5"]), (9, ["5"])):
        text = report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv"), "--gates-every", str(every)])
        gates = _section(text, "Against the reference ref: each run's gates per epoch")
        assert gates[gates.run == "seed 0"].epoch.tolist() == epochs
        floor = _section(text, "Against the reference ref: the gate target's noise floor")
        assert floor.epoch.tolist() == [e for e in epochs if e != "1"]  # the reference has no epoch 0
    with pytest.raises(ReportError, match="--gates-every 0 is not allowed: give a whole number from 1"):
        report([str(tmp_path / "runs"), "--reference", str(tmp_path / "ref.csv"), "--gates-every", "0"])
    with pytest.raises(ReportError, match="not allowed without --reference"):
        report([str(tmp_path / "runs"), "--gates-every", "2"])


def test_a_reference_of_several_seeds_is_their_mean_with_each_seeds_gates_and_the_seeds_range(runs_and_reference,
                                                                                               tmp_path):
    """Two files of one reference run: per epoch their mean (over the files that have the epoch) and range; the
    gates' shares their mean, each seed's summed up on its own row, and the two seeds set against each other."""
    root, _ = runs_and_reference
    first, second = tmp_path / "ref_s0.csv", tmp_path / "ref_s1.csv"
    pd.DataFrame({"epoch": [1, 2, 3], "train_acc": [28.0, 48.0, 61.0], "cp": [3.0, 3.0, 3.0]}).to_csv(first, index=False)
    pd.DataFrame({"epoch": [1, 2], "train_acc": [32.0, 50.0], "cp": [3.0, 3.2]}).to_csv(second, index=False)
    # epoch 3: block 0 skipped by 0.3 / 0.4 of the images (mean 0.35: FW4/BW6's 0.65 leads), block 1 FW6/BW8 1.0 / 0.8
    pd.DataFrame({"epoch": [3, 3], "block": [0, 1], "opt0_skip": [0.3, 0.0], "opt1_fw4_bw6": [0.7, 0.0],
                  "opt2_fw6_bw8": [0.0, 1.0]}).to_csv(tmp_path / "ref_s0_gates.csv", index=False)
    pd.DataFrame({"epoch": [3, 3], "block": [0, 1], "opt0_skip": [0.4, 0.2], "opt1_fw4_bw6": [0.6, 0.0],
                  "opt2_fw6_bw8": [0.0, 0.8]}).to_csv(tmp_path / "ref_s1_gates.csv", index=False)
    text = report([str(root), "--reference", str(first), str(second)])
    name = "mean of ref_s0, ref_s1"
    epochs = _section(text, f"Against the reference {name} (dfq, 2 runs): per epoch").astype(float).set_index("epoch")
    assert epochs["train_acc reference"].tolist() == pytest.approx([30.0, 49.0, 61.0])  # epoch 3: seed 0's alone
    # epoch 3 has one seed: no range
    assert epochs["train_acc reference seeds' range"].tolist() == pytest.approx([4.0, 2.0, math.nan], nan_ok=True)
    assert epochs["train_acc diff (points)"].tolist() == pytest.approx([2.0, 2.0, -2.0])  # ours 32, 51, 59 %
    assert epochs["cp reference"].tolist() == pytest.approx([3.0, 3.1, 3.0])
    shares = _section(text, f"Against the reference {name}: each gated block's most chosen option").set_index("block")
    assert shares["reference: most chosen"].tolist() == ["FW4/BW6", "FW6/BW8"]
    assert shares["reference share"].astype(float).tolist() == pytest.approx([0.65, 0.9])
    gates = _section(text, f"Against the reference {name}: each run's gates per epoch").set_index("run")
    assert gates.index.tolist() == ["reference", "reference: ref_s0", "reference: ref_s1", "seed 0", "seed 1"]
    assert gates["skipped: layer1"].astype(float).tolist()[:3] == pytest.approx([0.225, 0.15, 0.3])
    assert gates.loc["reference: ref_s0", "most chosen as the reference's"] == ""
    floor = _section(text, f"Against the reference {name}: the gate target's noise floor").set_index("compared")
    # block 0: FW4/BW6 by both (0.7 against 0.6, inside the band), block 1: FW6/BW8 (1.0 against 0.8, outside)
    assert floor.loc["ref_s1 against ref_s0", FLOOR].tolist() == ["2/2", "2/2", "1/2"]


@pytest.mark.parametrize("second,message", [
    (pd.DataFrame({"epoch": [1], "train_loss": [2.0], "cp_source": ["logged"]}), "all be gated runs' logs or none"),
    (None, "two files are named ref "),
])
def test_a_reference_of_several_seeds_refuses_mixed_logs_and_a_file_named_twice(runs_and_reference, tmp_path,
                                                                                second, message):
    root, reference = runs_and_reference
    other = reference
    if second is not None:
        other = tmp_path / "other" / "ref_s1.csv"
        other.parent.mkdir()
        second.to_csv(other, index=False)
    with pytest.raises(ReportError, match=message):
        report([str(root), "--reference", str(reference), str(other)])


def test_our_seeds_range_is_none_where_one_run_has_the_epoch(tmp_path):
    root = tmp_path / "runs"
    for seed, train_acc in ((0, [0.31, 0.52, 0.58]), (1, [0.33, 0.50])):  # seed 1 stopped after epoch 2
        fake_run(root, f"dfq{seed}", "dfq", [0.4, 0.5, 0.6][:len(train_acc)], [1e9] * len(train_acc), seed=seed,
                 model="resnet38", data="cifar10", metrics_extra={"train_acc": train_acc})
    reference = tmp_path / "ref.csv"
    pd.DataFrame(REFERENCE).to_csv(reference, index=False)
    text = report([str(root), "--reference", str(reference)])
    epochs = _section(text, "Against the reference ref (dfq, 2 runs): per epoch").astype(float).set_index("epoch")
    assert epochs["train_acc seeds' range"].tolist() == pytest.approx([2.0, 2.0, math.nan], nan_ok=True)
    assert epochs["train_acc ours"].tolist() == pytest.approx([32.0, 51.0, 58.0])  # epoch 3: seed 0's alone
