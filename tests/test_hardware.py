"""The hardware models on a two-layer example computed by hand, their rules, and time to a target accuracy."""

import math

import pytest
import torch
from torch import nn

from qtrain.cost import CostMeter, OperandSizes, bitfusion, operand_sizes, to_target
from qtrain.cost.hardware import HardwareMeter
from qtrain.precision import Bits, LayerPrecision
from qtrain.quant.block_maps import BlockMapped
from qtrain.run import run

from .conftest import TINY, make_config

# layer a: 100 MACs per sample, a 50-element weight, 20 inputs and 30 outputs per sample; layer b: 10, 6, 4, 5
MACS = {"a": 100, "b": 10}
SIZES = {"a": OperandSizes(50, 20, 30), "b": OperandSizes(6, 4, 5)}
RECORD = {"a": LayerPrecision.uniform(Bits(weight=4, act=8, grad=8, grad_weight=8), "range-linear")}  # b: float32
SAMPLES = 2

UNPU_BIT_MACS_PER_CYCLE = 345.6e9 / 2 / 200e6 * 16  # 13,824: UNPU's 345.6 GOPS at 16-bit weights, 200 MHz


def test_bit_serial_by_hand():
    meter = HardwareMeter(MACS, SIZES)
    meter.add(RECORD, SAMPLES)
    # a: forward and error GEMMs serialize the 4-bit weight, the weight-gradient GEMM 8 bits; b: float32 taken as
    # 32-bit integers, 32 serial bits x 2 passes of the 16-bit parallel operand, in each of its three GEMMs
    cycles = (SAMPLES * 100 * (4 + 4 + 8) + SAMPLES * 10 * 3 * 32 * 2) / UNPU_BIT_MACS_PER_CYCLE
    baseline = (SAMPLES * 110 * 3 * 8) / UNPU_BIT_MACS_PER_CYCLE
    totals = meter.totals()["bit_serial"]
    assert totals["seconds"] == pytest.approx(cycles / 200e6)
    assert totals["joules"] == pytest.approx(0.297 * cycles / 200e6)
    assert totals["baseline_seconds"] == pytest.approx(baseline / 200e6)
    assert totals["speedup_vs_8bit"] == pytest.approx(baseline / cycles)


def test_bit_serial_charges_the_dynasty_module_on_its_layers():
    meter = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    meter.add({"a": LayerPrecision.uniform(Bits(weight=2, act=8, grad=8, grad_weight=8, act_weight=2), BlockMapped.fmt)}, 1)
    seconds = 100 * 3 * 2 / UNPU_BIT_MACS_PER_CYCLE / 200e6
    module = 10.3e-3 * 100 * 3 * 4 / UNPU_BIT_MACS_PER_CYCLE / 200e6  # Table 2's power over the step's 4-bit time
    totals = meter.totals()["bit_serial"]
    assert totals["seconds"] == pytest.approx(seconds)
    assert totals["joules"] == pytest.approx(0.297 * seconds + module)
    assert totals["energy_vs_8bit"] == pytest.approx((0.297 * seconds + module) / (0.297 * seconds * 4))


def _bitfusion_gemm(macs, rate, a_bits, b_bits, out_bits):
    compute = macs / rate
    dram = a_bits + b_bits + out_bits
    cycles = max(compute, dram / 128)
    joules = (compute * 3_673_500e-9 * 4 / 500e6 + a_bits * 0.1997e-12 + b_bits * 0.1072e-12 + out_bits * 0.1137e-12
              + dram * 15e-12)
    return cycles / 500e6, joules


def test_bitfusion_by_hand():
    meter = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    meter.add({"a": RECORD["a"]}, SAMPLES)
    macs = SAMPLES * 100
    # forward: 8-bit activations (20 per sample) x 4-bit weights: 1 x 2 MACs per fusion unit, 64 units, 32-bit outputs
    forward = _bitfusion_gemm(macs, 64 * 2, SAMPLES * 20 * 8, 50 * 4, SAMPLES * 30 * 32)
    error = _bitfusion_gemm(macs, 64 * 2, SAMPLES * 30 * 8, 50 * 4, SAMPLES * 20 * 32)
    weight_gradient = _bitfusion_gemm(macs, 64, SAMPLES * 20 * 8, SAMPLES * 30 * 8, 50 * 32)
    totals = meter.totals()["bitfusion"]
    assert totals["seconds"] == pytest.approx(forward[0] + error[0] + weight_gradient[0])
    assert totals["joules"] == pytest.approx(forward[1] + error[1] + weight_gradient[1])


def test_bitfusion_fusion_rule_and_wide_operands():
    # floor(8 / b) per operand, 2-bit bricks: 3 bits cost like 4, 5-7 like 8, 1 like 2
    assert [bitfusion.lanes(b) for b in (1, 2, 3, 4, 5, 6, 8)] == [4, 4, 2, 2, 1, 1, 1]
    assert bitfusion.macs_per_cycle(2, 2) == 64 * 16
    # wider than 8 bits: ceil(b / 8) passes of 8 bits (FracTrain's 12- and 16-bit gradients, float32 as 32-bit)
    assert bitfusion.macs_per_cycle(8, 12) == 64 / 2 and bitfusion.macs_per_cycle(32, 32) == 64 / 16
    assert bitfusion.macs_per_cycle(0, 8) == 0


def test_skipped_work_costs_nothing_on_either_model():
    meter = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    meter.add({"a": LayerPrecision((), "skipped")}, SAMPLES)  # every option's share skipped (DFQ's 0-bit block)
    for model in ("bit_serial", "bitfusion"):
        assert meter.totals()[model]["seconds"] == 0 and meter.totals()[model]["joules"] == 0
    half = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    half.add({"a": LayerPrecision(((0.5, Bits(8, 8, 8, 8)),), "skipped half")}, SAMPLES)
    whole = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    whole.add({"a": LayerPrecision.uniform(Bits(8, 8, 8, 8), "8 bit")}, SAMPLES)
    assert half.totals()["bit_serial"]["seconds"] == pytest.approx(whole.totals()["bit_serial"]["seconds"] / 2)
    assert half.totals()["bitfusion"]["joules"] == pytest.approx(whole.totals()["bitfusion"]["joules"] / 2)


def test_an_8_bit_run_is_its_own_baseline():
    meter = HardwareMeter(MACS, SIZES)
    meter.add({name: LayerPrecision.uniform(Bits(8, 8, 8, 8), "range-linear") for name in MACS}, SAMPLES)
    for model in ("bit_serial", "bitfusion"):
        assert meter.totals()[model]["speedup_vs_8bit"] == pytest.approx(1.0)
        assert meter.totals()[model]["energy_vs_8bit"] == pytest.approx(1.0)


def test_operand_sizes_of_a_small_net():
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 5 * 5, 7))
    sizes = operand_sizes(net, torch.zeros(3, 2, 5, 5))
    assert sizes == {"0": OperandSizes(4 * 2 * 9, 2 * 25, 4 * 25), "2": OperandSizes(100 * 7, 100, 7)}


def test_meter_keeps_hardware_figures_across_a_resume():
    meter = CostMeter(MACS, SIZES)
    meter.add(RECORD, SAMPLES)
    other = CostMeter(MACS, SIZES)
    other.load_state_dict(meter.state_dict())
    assert other.hardware.totals() == meter.hardware.totals()
    assert {"bit_serial_seconds", "bitfusion_joules"} <= set(meter.table().columns)


def test_time_to_target_reads_the_first_epoch_that_reaches_it():
    history = [{"epoch": e, "test_acc": acc, "bit_serial_seconds": 10.0 * e, "bit_serial_joules": e,
                "bitfusion_seconds": 1.0 * e, "bitfusion_joules": 0.5 * e} for e, acc in ((1, 0.3), (2, 0.74), (3, 0.8))]
    reached = to_target(history, 0.74, ["bit_serial", "bitfusion"])
    assert reached == {"target_acc": 0.74, "epoch": 2, "bit_serial_seconds": 20.0, "bit_serial_joules": 2,
                       "bitfusion_seconds": 2.0, "bitfusion_joules": 1.0}
    assert to_target(history, 0.9, ["bit_serial"]) is None


@pytest.mark.slow
def test_every_run_reports_both_models_and_its_time_to_target(tmp_path):
    summary = run(make_config(*TINY, "method=float32", "hardware.target_acc=0.05"), tmp_path)
    models = summary["hardware"]["models"]
    assert set(models) == {"bit_serial", "bitfusion"}
    # float32 as 32-bit integers: 32 serial bits x 2 parallel passes against 8 x 1
    assert models["bit_serial"]["speedup_vs_8bit"] == pytest.approx(8 / 64)
    assert models["bitfusion"]["seconds"] > models["bitfusion"]["baseline_seconds"]
    assert summary["hardware"]["to_target"]["epoch"] == 1
    assert math.isclose(summary["hardware"]["to_target"]["bit_serial_seconds"], models["bit_serial"]["seconds"] / 2,
                        rel_tol=0.05)


def test_an_attention_product_moves_its_second_operand_per_sample_in_the_weights_place():
    from qtrain.cost.hardware import price_layer
    from qtrain.quant.layers import MatMul

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.scores = MatMul()

        def forward(self, q):
            return self.scores(q, q.transpose(-2, -1))  # (batch, heads, T, d) x (batch, heads, d, T)

    sizes = operand_sizes(Attention(), torch.zeros(3, 2, 5, 4))
    assert sizes == {"scores": OperandSizes(2 * 4 * 5, 2 * 5 * 4, 2 * 5 * 5, weight_per_sample=True)}

    class Recorder:
        name = "recorder"

        def __init__(self):
            self.seen = []

        def gemm(self, options, macs, elements):
            self.seen.append(elements)
            return 0.0, 0.0

        def layer_overhead(self, fmt, macs):
            return 0.0, 0.0

    recorder = Recorder()
    price_layer(recorder, LayerPrecision.uniform(Bits(8, 8, 8, 8), "range-linear"), 200, sizes["scores"], samples=6)
    a, b, out = 6 * 40, 6 * 40, 6 * 50  # every operand scales with the samples: no weight is shared
    assert recorder.seen == [(a, b, out), (out, b, a), (a, out, b)]


@pytest.mark.parametrize("bits", [0, 2, 3, 4, 6, 8])
def test_bit_serial_dynasty_time_is_b_over_8_of_the_8bit_step(bits):
    # every GEMM of a DYNASTY layer has one mapped operand at b bits and a static 8-bit one: b serial cycles against
    # the baseline's 8; energy adds the module's 10.3 mW for the time the step takes at 4 bits (4/8 of the baseline's)
    meter = HardwareMeter({"a": 100}, {"a": SIZES["a"]})
    uniform = Bits(weight=bits, act=8, grad=8, grad_weight=8, act_weight=bits)
    meter.add({"a": LayerPrecision.uniform(uniform, BlockMapped.fmt)}, SAMPLES)
    totals = meter.totals()["bit_serial"]
    assert totals["seconds"] / totals["baseline_seconds"] == pytest.approx(bits / 8)
    assert totals["joules"] / totals["baseline_joules"] == pytest.approx(bits / 8 + 10.3 / 297 * 4 / 8)


def _fig8_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "dynasty_fig8.py"
    spec = importlib.util.spec_from_file_location("dynasty_fig8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dynasty_fig8_overheads_and_the_resnet18_step():
    fig8 = _fig8_script()
    # Fig. 8 and Sec. 5.2: 1 - reduction = time x (1 + overhead)
    assert fig8.implied_overhead(40.0, 58.3) == pytest.approx(100 * (60.0 / 58.3 - 1))
    assert [round(fig8.implied_overhead(r, t), 1) for _, r, t in fig8.PAPER] == [2.9, 4.1, 5.5, 8.2]
    step = fig8.bit_serial_step(2, batch=4)
    assert step["time"] == pytest.approx(25.0)
    assert step["overhead"] == pytest.approx(100 * 10.3 / 297 * 4 / 2)  # the module's 4-bit time over the 2-bit step's
    assert step["reduction"] == pytest.approx(100 - step["energy"])
