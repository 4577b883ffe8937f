"""AdaPT's performance model (Sec. 4.1.2) on a two-layer example computed by hand."""

import math

import pytest

from qtrain.cost.adapt_model import BaselineRun, LayerState, PerformanceModel, pushdown_ops, pushup_ops


def test_overhead_bounds_are_eqs_6_and_7():
    assert pushdown_ops(50, 4) == pytest.approx(2 * math.log2(24) * 50 * 3 * 4)
    assert pushup_ops(25, 4) == 26 * 4 + 1


def test_two_layer_model_by_hand():
    # layer a: 100 MACs per sample, 4 weights; layer b: 10 MACs, 2 weights; 2 accumulation steps
    model = PerformanceModel({"a": 100, "b": 10}, {"a": 4, "b": 2}, accum_steps=2)
    step1 = {"a": LayerState(8, 0.5, lookback=25, resolution=50), "b": LayerState(16, 1.0, lookback=50, resolution=100)}
    step2 = {"a": LayerState(12, 0.25, lookback=25, resolution=50), "b": LayerState(16, 0.5, lookback=50, resolution=100)}
    model.add_step(step1)
    model.add_step(step2)
    # eq. 8: ops * (sp * WL + 32 / 2)
    train = (100 * (4 + 16) + 10 * (16 + 16)) + (100 * (3 + 16) + 10 * (8 + 16))
    log24 = math.log2(24)
    pd_a, pd_b = 2 * log24 * 50 * 3 * 4, 2 * log24 * 100 * 3 * 2
    pu_a, pu_b = 26 * 4 + 1, 51 * 2 + 1
    # eq. 9: 32 * (sp * pd + pu) / (accs * lb)
    pushdown = 32 * (0.5 * pd_a / 50 + 1.0 * pd_b / 100 + 0.25 * pd_a / 50 + 0.5 * pd_b / 100)
    pushup = 32 * (pu_a / 50 + pu_b / 100 + pu_a / 50 + pu_b / 100)
    overhead = pushdown + pushup
    report = model.report(batch_size=4, samples_per_epoch=16,
                          baselines={"f32": BaselineRun(batch_size=8, accum_steps=1, epochs=1)})
    assert report["train_cost"] == pytest.approx(4 * train)
    assert report["overhead_cost"] == pytest.approx(4 * overhead)
    assert (report["pushdown_cost"], report["pushup_cost"]) == pytest.approx((4 * pushdown, 4 * pushup))
    # float32 baseline: 16 samples / 8 = 2 steps of 100 * (32 + 32) + 10 * (32 + 32), times its batch 8
    su = 8 * 2 * 110 * 64 / (4 * (train + overhead))
    memory = ((0.5 * 8 + 32) + (16 + 32) + (0.25 * 12 + 32) + (0.5 * 16 + 32)) / 2
    size = 0.25 * 12 + 0.5 * 16  # the last step's
    assert report["baselines"]["f32"] == pytest.approx({"batch_size": 8, "accum_steps": 1, "epochs": 1, "SU": su})
    assert report["memory"] == pytest.approx(memory) and report["model_size"] == pytest.approx(size)
    assert report["MEM"] == pytest.approx(memory / 64)  # float32 holds one 32-bit copy of each of the 2 layers
    assert report["SZ"] == pytest.approx(64 / size)
    # the reference code's own-baseline speedup: Σ 64 ops / Σ ops (sp * WL + 32)
    reference = (100 * (4 + 32) + 10 * (16 + 32)) + (100 * (3 + 32) + 10 * (8 + 32))
    assert report["reference_SU1"] == pytest.approx(2 * 64 * 110 / reference)
    # inference (Table 6): 32-bit dense over the final sparse, quantized forward; size ours over float32
    assert report["inference"] == pytest.approx({"SU": 32 * 110 / (100 * 3 + 10 * 8), "SZ": size / 64})
    # sparsity weighted by weight counts: final (4 * 0.25 + 2 * 0.5) / 6 non-zero; average over the two steps
    assert report["sparsity"]["final"] == pytest.approx(1 - 2 / 6)
    assert report["sparsity"]["average"] == pytest.approx(1 - ((2 + 2) / 6 + (1 + 1) / 6) / 2)


def test_state_round_trips():
    model = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    model.add_step({"a": LayerState(8, 0.5, 25, 50)})
    copy = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    copy.load_state_dict(model.state_dict())
    baselines = {"same": BaselineRun(4, 1, 1)}
    assert copy.report(4, 4, baselines) == model.report(4, 4, baselines)


def test_a_layer_without_a_quantized_copy_holds_only_its_float32_weights():
    model = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    model.add_step({"a": LayerState(32, 1.0, quantized=False)})  # MuPPET's float32 stage
    report = model.report(4, 4, {})
    assert report["memory"] == 32 and report["MEM"] == 1.0
