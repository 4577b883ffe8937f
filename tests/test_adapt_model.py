"""AdaPT's performance model (Sec. 4.1.2) on a two-layer example computed by hand."""

import math

import pytest
import torch

from qtrain.cost.adapt_model import BaselineRun, LayerState, PerformanceModel, pushdown_ops, pushup_ops
from qtrain.methods import StepInfo, build_method
from qtrain.methods.base import RunFacts
from qtrain.methods.priced import NonzeroShares

from .conftest import make_config


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
    report = model.report(batch_size=4, samples_per_epoch=16, epochs=1,
                          baselines={"f32": BaselineRun(batch_size=8, accum_steps=1, epochs=1)})
    assert report["train_cost"] == pytest.approx(4 * train)
    assert report["overhead_cost"] == pytest.approx(overhead)  # per optimizer step, not per sample
    assert (report["pushdown_cost"], report["pushup_cost"]) == pytest.approx((pushdown, pushup))
    # Sec. 4.1.2's formula: float32 baseline of 16 samples / 8 = 2 steps of 100 * (32 + 32) + 10 * (32 + 32), times 8
    printed = 8 * 2 * 110 * 64 / (4 * train + overhead)
    # the reference's: (E_b / E) 64 / (x + overhead per sample + 32 (bs_b accs_b) / (bs accs)), x the MAC-weighted sp WL
    x = ((100 * 4 + 10 * 16) + (100 * 3 + 10 * 8)) / (2 * 110)
    su = 64 / (x + overhead / (4 * 2 * 110) + 32 * 8 / (4 * 2))
    memory = ((0.5 * 8 + 32) + (16 + 32) + (0.25 * 12 + 32) + (0.5 * 16 + 32)) / 2
    size = 0.25 * 12 + 0.5 * 16  # the last step's
    assert report["x"] == pytest.approx(x)
    assert report["baselines"]["f32"] == pytest.approx(
        {"batch_size": 8, "accum_steps": 1, "epochs": 1, "SU": su, "SU_printed": printed})
    assert report["memory"] == pytest.approx(memory) and report["model_size"] == pytest.approx(size)
    assert report["MEM"] == pytest.approx(memory / 64)  # float32 holds one 32-bit copy of each of the 2 layers
    assert report["SZ"] == pytest.approx(64 / size)
    # inference (Table 6): 32-bit dense over the final sparse, quantized forward; size ours over float32
    assert report["inference"] == pytest.approx({"SU": 32 * 110 / (100 * 3 + 10 * 8), "SZ": size / 64})
    # Table 5: the mean over the two layers of their zero shares; beside it weighted by weight counts
    assert report["sparsity"] == pytest.approx({
        "final": 1 - (0.25 + 0.5) / 2, "average": 1 - ((0.5 + 1.0) / 2 + (0.25 + 0.5) / 2) / 2,
        "final_weighted": 1 - (4 * 0.25 + 2 * 0.5) / 6, "average_weighted": 1 - ((2 + 2) / 6 + (1 + 1) / 6) / 2})


# Tables 3-4's AdaPT rows (SU1, SU3) and the runs' settings (reference configs, configs/image_recognition/
# *_msgd_fp_*.ini): batch 512, 100 epochs, accumulation 4 (ResNet-20 on CIFAR-100: 2).
PUBLISHED = [("AlexNet CIFAR10", 4, 1.42, 6.42), ("ResNet CIFAR10", 4, 1.20, 4.01),
             ("AlexNet CIFAR100", 4, 1.32, 5.23), ("ResNet CIFAR100", 2, 1.13, 3.36)]


@pytest.mark.parametrize(("row", "accs", "su1", "su3"), PUBLISHED)
def test_the_reference_speedups_reproduce_the_published_rows(row, accs, su1, su3):
    # x inverted from SU3 = 1.5 * 64 / (x + 32 * (128 / 512) / accs): SU3 is printed to three digits, SU1 to two
    # (1.20 stands for 1.195..1.205, which alone moves x by 0.4 bits); a single x must then give both figures
    x = 1.5 * 64 / su3 - 32 * 128 / 512 / accs
    model = PerformanceModel({"conv": 1000}, {"conv": 100}, accum_steps=accs)
    for _ in range(3):
        model.add_step({"conv": LayerState(wl=2 * x, density=0.5)})  # sp * WL = x, no switching overhead
    baselines = {"same": BaselineRun(512, accs, 100), "muppet": BaselineRun(128, 1, 150)}
    report = model.report(batch_size=512, samples_per_epoch=50_000, epochs=100, baselines=baselines)
    assert report["x"] == pytest.approx(x)
    assert report["baselines"]["same"]["SU"] == pytest.approx(su1, rel=0.025)
    assert report["baselines"]["muppet"]["SU"] == pytest.approx(su3, rel=1e-9)


@pytest.mark.parametrize(("schedule", "su3"), [([(8, 16), (12, 10), (14, 14), (16, 14), (32, 45)], 1.2),
                                              ([(8, 22), (12, 22), (14, 10), (16, 15), (32, 45)], 1.25)])
def test_muppets_rows_from_its_published_schedule(schedule, su3):
    # Table 3's MuPPET SU3 (AlexNet, ResNet-20): MuPPET at batch 128 against its own baseline, 64 / (x + 32), x the
    # epoch-weighted word length of the schedule (epochs at 8, 12, 14, 16 and 32 bits) the reference takes from MuPPET
    model = PerformanceModel({"conv": 1000, "fc": 10}, {"conv": 100, "fc": 10}, accum_steps=1)
    for wl, epochs in schedule:
        for _ in range(epochs):
            model.add_step(dict.fromkeys(("conv", "fc"), LayerState(wl, 1.0)))
    epochs = sum(e for _, e in schedule)
    report = model.report(128, 50_000, epochs, {"same": BaselineRun(128, 1, epochs)})
    assert report["baselines"]["same"]["SU"] == pytest.approx(su3, rel=0.025)


def test_the_overhead_is_paid_per_optimizer_step():
    # one layer of 50 weights at density 0.8, lookback 2 optimizer steps, resolution 60, 2 micro-batches per
    # optimizer step: 4 optimizer steps (8 micro-batches) hold 2 switches, each 32 (sp ops_pd + ops_pu)
    per_switch = 32 * (0.8 * 2 * math.log2(24) * 60 * 3 * 50 + ((2 + 1) * 50 + 1))
    reports = []
    for batch in (1, 512):
        model = PerformanceModel({"conv": 7}, {"conv": 50}, accum_steps=2)
        for _ in range(8):
            model.add_step({"conv": LayerState(8, 0.8, lookback=2, resolution=60)})
        reports.append(model.report(batch, 8 * batch, 1, {"same": BaselineRun(batch, 2, 1)}))
    for batch, report in zip((1, 512), reports):
        assert report["overhead_cost"] == pytest.approx(2 * per_switch)  # whatever the batch size
        train = batch * 8 * 7 * (0.8 * 8 + 32 / 2)
        assert report["train_cost"] == pytest.approx(train)
        baseline = batch * 8 * 7 * (32 + 32 / 2)  # 8 micro-batches of float32, same batch and accumulation
        assert report["baselines"]["same"]["SU_printed"] == pytest.approx(baseline / (train + 2 * per_switch))
        assert report["overhead_bits"] == pytest.approx(2 * per_switch / (batch * 8 * 7))


def test_table_5s_sparsity_is_the_mean_over_tensors():
    # a hand-made model: a large, barely sparse layer and a small, half-empty one, and two other tensors
    big, small = torch.nn.Linear(40, 25, bias=False), torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        big.weight.view(-1)[:100] = 0  # 100 of 1000 zero
        small.weight.view(-1)[:4] = 0  # 4 of 8 zero
    layers = {"big": big, "small": small}
    density = {name: float(torch.count_nonzero(layer.weight)) / layer.weight.numel() for name, layer in layers.items()}
    model = PerformanceModel({"big": 1000, "small": 8}, {n: layer.weight.numel() for n, layer in layers.items()}, 1)
    model.add_step({name: LayerState(8, d) for name, d in density.items()})
    sparsity = model.report(1, 1, 1, {})["sparsity"]
    assert sparsity["final"] == pytest.approx((0.1 + 0.5) / 2) == sparsity["average"]
    assert sparsity["final_weighted"] == pytest.approx(104 / 1008) == sparsity["average_weighted"]
    # with a bias of 25 values, none zero, and a batch-norm bias all zero: the mean over four tensors; then a
    # second step where the bias is 40 % zero
    model.add_step({name: LayerState(8, d) for name, d in density.items()}, others=[0.6, 1.0])
    sparsity = model.report(1, 1, 2, {})["sparsity"]
    assert sparsity["final"] == pytest.approx((0.1 + 0.5 + 0.4 + 0.0) / 4)
    assert sparsity["average"] == pytest.approx(((0.1 + 0.5) / 2 + (0.1 + 0.5 + 0.4) / 4) / 2)
    assert sparsity["final_weighted"] == pytest.approx(104 / 1008) == sparsity["average_weighted"]


def test_nonzero_shares_match_each_tensors_count():
    tensors = [torch.tensor([0.0, 1.0, 0.0, -2.0]), torch.zeros(3), torch.ones(2, 2), torch.tensor([0.0, 0.0, 5.0])]
    shares = NonzeroShares(tensors)
    assert shares() == [2 / 4, 0.0, 1.0, 1 / 3]
    tensors[1][0] = 7.0  # read anew at every call
    assert shares()[1] == pytest.approx(1 / 3)
    assert NonzeroShares([])() == []


def test_adapts_sparsity_on_a_hand_made_model_covers_every_parameter_tensor():
    # Conv2d (weight 3x2x1x1, bias 3), BatchNorm2d (weight, bias 3 each), Linear (weight 2x12, bias 2)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(12, 2))
    with torch.no_grad():
        net[0].weight.fill_(1.0).view(-1)[:3] = 0  # 3 of 6 zero (exact at <8, 4>)
        net[0].bias.copy_(torch.tensor([0.0, 0.5, 0.25]))  # 1 of 3
        net[3].weight.fill_(-1.0).view(-1)[:6] = 0  # 6 of 24
        net[3].bias.fill_(0.5)  # none; batch norm: weight ones (none zero), bias zeros (all)
    method = build_method(make_config("method=adapt", "method.init=model").method)
    model = method.prepare(net)
    sample = torch.ones(1, 2, 2, 2)
    method.profile(model.eval(), sample)
    method.attach(torch.optim.SGD(model.parameters(), lr=0.1), RunFacts(2, 1, 2))
    model.train()
    method.loss(model(sample.repeat(2, 1, 1, 1)).sum(), StepInfo(0, 0, 2))
    sparsity = method.report(1)["performance_model"]["sparsity"]
    assert sparsity["final"] == pytest.approx((3 / 6 + 1 / 3 + 0 + 1 + 6 / 24 + 0) / 6)
    assert sparsity["final_weighted"] == pytest.approx((3 + 6) / (6 + 24))


def test_state_round_trips():
    model = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    model.add_step({"a": LayerState(8, 0.5, 25, 50)}, others=[0.5, 1.0])
    copy = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    copy.load_state_dict(model.state_dict())
    baselines = {"same": BaselineRun(4, 1, 1)}
    assert copy.report(4, 4, 1, baselines) == model.report(4, 4, 1, baselines)


@pytest.mark.parametrize(("schedule", "mem"), [([(8, 16), (12, 10), (14, 14), (16, 14), (32, 45)], 1.66),
                                              ([(8, 22), (12, 22), (14, 10), (16, 15), (32, 45)], 1.61)])
def test_muppets_memory_from_its_published_schedule(schedule, mem):
    # Table 3's MuPPET MEM (AlexNet, ResNet-20): every epoch holds a WL-bit copy beside the float32 master, the
    # float32 epochs a 32-bit one, so MEM = 1 + mean(WL) / 32 over the epochs: 1 + 2108 / 99 / 32 = 1.665 for
    # AlexNet, 1 + 2260 / 114 / 32 = 1.620 for ResNet-20
    model = PerformanceModel({"conv": 1000, "fc": 10}, {"conv": 100, "fc": 10}, accum_steps=1)
    for wl, epochs in schedule:
        for _ in range(epochs):
            model.add_step(dict.fromkeys(("conv", "fc"), LayerState(wl, 1.0)))
    epochs = sum(e for _, e in schedule)
    report = model.report(128, 50_000, epochs, {})
    by_hand = 1 + sum(wl * e for wl, e in schedule) / epochs / 32
    assert report["MEM"] == pytest.approx(by_hand, rel=1e-12)
    assert report["MEM"] == pytest.approx(mem, rel=0.01)


def test_a_float32_layer_holds_a_32_bit_copy_beside_its_master():
    model = PerformanceModel({"a": 100}, {"a": 4}, accum_steps=1)
    model.add_step({"a": LayerState(32, 1.0)})  # MuPPET's float32 stage, as the AdaPT reference priced it
    report = model.report(4, 4, 1, {})
    assert report["memory"] == 64 and report["MEM"] == 2.0
