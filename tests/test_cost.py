"""MAC profiles against torch's flop counter, the meter against hand computation and FracTrain's figures."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qtrain.cost import CostMeter, profile_macs
from qtrain.models import build_model
from qtrain.precision import Bits, LayerPrecision


@pytest.mark.parametrize("name,size", [("resnet20", 32), ("resnet38", 16), ("alexnet", 32), ("mobilenetv2", 32),
                                       ("resnet34", 16), ("resnet164", 8)])
@pytest.mark.slow
def test_profile_matches_torch_flop_counter(name, size):
    model = build_model(name, in_channels=3, num_classes=10, input_size=(size, size))
    x = torch.zeros(3, 3, size, size)
    macs = profile_macs(model, x)
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert 2 * sum(macs.values()) * 3 == counter.get_total_flops()
    assert len(macs) == sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())


def test_profile_of_a_small_net_by_hand():
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, groups=2), nn.Flatten(), nn.Linear(4 * 5 * 5, 7))
    macs = profile_macs(net, torch.zeros(2, 2, 5, 5))
    # grouped conv: 4 out channels x 25 positions x (2/2 in channels x 9 taps); linear 100 x 7
    assert macs == {"0": 4 * 25 * 9, "2": 700}


def test_meter_charges_each_gemm_at_its_bits():
    meter = CostMeter({"a": 100, "b": 10})
    record = {"a": LayerPrecision.uniform(Bits(weight=8, act=4, grad=16, grad_weight=32), "fixed")}
    meter.add(record, samples=3)
    # layer a: 3 x 100 x (4*8 + 16*8 + 4*32) / 1024; layer b float32: 3 x 10 x 3
    assert meter.total() == pytest.approx(300 * (32 + 128 + 128) / 1024 + 90)
    assert meter.float32_total() == 3 * 3 * 110


def test_meter_charges_a_mixture_by_shares_and_skips_cost_nothing():
    meter = CostMeter({"block": 1000})
    # 50 % of samples at 4/6, 30 % at 8/8, 20 % skipped (the 0-bit option)
    mixture = LayerPrecision(((0.5, Bits(4, 4, 6, 6)), (0.3, Bits(8, 8, 8, 8))), "fixed")
    meter.add({"block": mixture}, samples=10)
    per_sample = 0.5 * (16 + 24 + 24) / 1024 + 0.3 * 3 * 64 / 1024
    assert meter.total() == pytest.approx(10 * 1000 * per_sample)
    meter.add({"block": LayerPrecision((), "skipped")}, samples=10)
    assert meter.total() == pytest.approx(10 * 1000 * per_sample)


@pytest.mark.slow
def test_fw8_bw8_is_6_25_percent_and_near_fractrain_table3():
    # FracTrain Table 3: SBM FW-8/BW-8 on CIFAR-10, 160 epochs: 1.18e14 MACs (ResNet-38), 2.62e14 (ResNet-74)
    for name, paper in (("resnet38", 1.18e14), ("resnet74", 2.62e14)):
        model = build_model(name, in_channels=3, num_classes=10, input_size=(32, 32))
        meter = CostMeter(profile_macs(model, torch.zeros(1, 3, 32, 32)))
        record = {layer: LayerPrecision.uniform(Bits(8, 8, 8, 8), "range-linear") for layer in meter.macs}
        meter.add(record, samples=160 * 50_000)
        assert meter.percent_of_float32() == pytest.approx(6.25)
        assert meter.total() == pytest.approx(paper, rel=0.08)


def test_meter_state_round_trip():
    meter = CostMeter({"a": 5})
    meter.add({}, samples=2)
    other = CostMeter({"a": 5})
    other.load_state_dict(meter.state_dict())
    assert other.total() == meter.total() == 30 and other.samples == 2
