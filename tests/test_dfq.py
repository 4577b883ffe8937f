"""DFQ and FracTrain: gates, per-sample execution, skipped blocks, the cost of mixtures, the cp controller."""

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qtrain.cost import CostMeter
from qtrain.errors import ConfigError
from qtrain.methods import StepInfo, build_method
from qtrain.methods.fractrain import appendix_g_targets
from qtrain.methods.gates import GatedBlock
from qtrain.models import build_model
from qtrain.run import run

from .conftest import TINY, make_config

OPTIONS = "method.options=[[0,0],[2,6],[4,12]]"


def _prepared(*overrides, model="resnet20", size=8):
    dfq = build_method(make_config("method=dfq", f"model={model}", *overrides).method)
    net = dfq.prepare(build_model(model, 3, 10, (size, size)))
    meter = CostMeter(dfq.profile(net, torch.zeros(2, 3, size, size)))
    return dfq, net, meter


def _step(dfq, net, meter, x):
    y = torch.arange(len(x)) % 10
    loss = dfq.loss(F.cross_entropy(net(x), y), StepInfo(0, 0, len(x)))
    meter.add(dfq.precision(), len(x))
    return loss


def test_every_block_is_gated_and_the_gates_stay_float32():
    dfq, net, _ = _prepared(OPTIONS)
    assert len(dfq.blocks) == 9 and all(isinstance(b, GatedBlock) for b in net.layer1)
    assert type(net.layer1[0].embed[0]) is nn.Conv2d and type(net.gate_controller.proj) is nn.Linear
    assert len(net.layer2[1].block.conv1.quants) == 2 and len(net.conv1.quants) == 1
    # shape-changing blocks (first of stages 2 and 3) can never take the skip option
    assert [b.mask_skip for b in dfq.blocks] == [False] * 3 + [True, False, False] * 2


def test_gates_choose_one_option_per_sample_and_gradients_reach_them():
    torch.manual_seed(0)
    dfq, net, meter = _prepared(OPTIONS)
    loss = _step(dfq, net, meter, torch.randn(16, 3, 8, 8))
    for block in dfq.blocks:
        gates = block.gates.detach()
        assert gates.shape == (16, 3)
        assert torch.equal(gates.sum(1), torch.ones(16)) and set(gates.unique().tolist()) <= {0.0, 1.0}
    loss.backward()
    gate_params = [*net.gate_controller.parameters(), *net.layer1[1].embed.parameters()]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate_params)


def test_each_sample_runs_its_block_at_its_own_option():
    torch.manual_seed(1)
    dfq, net, meter = _prepared(OPTIONS)
    for option in (1, 2):  # every option's activation quantizers track a running range for evaluation
        net.gate_controller.forced = option
        _step(dfq, net, meter, torch.randn(32, 3, 8, 8))
    net.gate_controller.forced = None
    net.eval()
    block = net.layer1[1]
    h = torch.randn(12, 16, 8, 8)
    with torch.no_grad():
        net.gate_controller.reset()  # the block alone: a fresh recurrent state
        out = block(h)
        choice = block.gates.argmax(1)
        for n in range(len(h)):
            k = int(choice[n])
            alone = h[n:n + 1] if k == 0 else block._run(h[n:n + 1], ((k, 1),))
            assert torch.allclose(out[n:n + 1], alone, atol=1e-6)


def test_a_skipped_block_is_the_identity_and_costs_nothing():
    dfq, net, meter = _prepared(OPTIONS)
    net.gate_controller.forced = 0
    x = torch.randn(4, 16, 8, 8)
    with torch.no_grad():
        net.gate_controller.reset()
        assert torch.equal(net.layer1[2](x), x)
    _step(dfq, net, meter, torch.randn(4, 3, 8, 8))
    costs = meter.table().set_index("layer")["effective_macs"]
    assert costs["layer1.2.block.conv1"] == 0 and costs["layer3.1.block.conv2"] == 0
    assert costs["layer2.0.block.conv1"] > 0  # cannot be skipped: ran at the first run option


def test_forced_option_costs_the_closed_form_and_cp_matches_the_meter():
    dfq, net, meter = _prepared(OPTIONS)
    net.gate_controller.forced = 2  # every block at FW-4/BW-12
    _step(dfq, net, meter, torch.randn(8, 3, 8, 8))
    table = meter.table().set_index("layer")
    macs = table["macs_per_sample"]
    gates = [n for n in macs.index if ".embed." in n or n.startswith("gate_controller")]
    block = [n for n in macs.index if ".block." in n]
    outside = [n for n in macs.index if n not in gates and n not in block]
    per_sample = (macs[gates].sum() * 3 + macs[outside].sum() * 3 * 64 / 1024
                  + macs[block].sum() * (16 + 48 + 48) / 1024)
    assert meter.total() == pytest.approx(8 * per_sample)
    assert dfq._cp_sum / dfq._samples == pytest.approx(meter.percent_of_float32())


def test_a_random_mixture_is_charged_exactly_what_cp_says():
    torch.manual_seed(2)
    dfq, net, meter = _prepared()
    _step(dfq, net, meter, torch.randn(64, 3, 8, 8))
    shares = torch.stack([b.gates.detach().mean(0) for b in dfq.blocks])
    assert (shares > 0).sum(1).max() > 1  # samples of one block took different options
    assert dfq._cp_sum / dfq._samples == pytest.approx(meter.percent_of_float32(), rel=1e-6)


def test_mix_all_gives_the_same_outputs_and_a_gradient_to_every_option():
    torch.manual_seed(3)
    per_sample, net, meter = _prepared(OPTIONS)
    _, mixed, _ = _prepared(OPTIONS, "method.execution=mix_all")
    x = torch.randn(16, 3, 8, 8)
    for option in (1, 2):  # every option's activation quantizers track a running range
        net.gate_controller.forced = option
        _step(per_sample, net, meter, x)
    net.gate_controller.forced = None
    mixed.load_state_dict(net.state_dict())
    net.eval(), mixed.eval()
    with torch.no_grad():
        assert torch.allclose(net(x), mixed(x), atol=1e-5)
    mixed.train()
    mixed.zero_grad()
    F.cross_entropy(mixed(x), torch.arange(16) % 10).backward()  # accuracy loss only: no cp term
    assert (mixed.gate_controller.proj.weight.grad.abs().sum(1) > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("target", [2.0, 4.5])
def test_cp_controller_drives_cp_to_the_target(tmp_path, target):
    overrides = ["method=dfq", f"method.target_cp={target}", "train.epochs=12", "train.batch_size=32", "sched=constant"]
    run(make_config(*TINY, *overrides), tmp_path)
    cp = pd.read_csv(tmp_path / "metrics.csv")["cp"]
    assert abs(cp.iloc[-4:].mean() - target) < 0.15 * target


def test_fractrain_raises_its_target_at_each_turning_point(tmp_path):
    overrides = ["method=fractrain", "method.cp_schedule=[1.5,4.0]", "method.switch=manual", "method.manual_epochs=[1]"]
    run(make_config(*TINY, *overrides), tmp_path)
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["stage"].tolist() == [0, 1] and metrics["target_cp"].tolist() == [1.5, 4.0]
    shares = pd.read_csv(tmp_path / "precision.csv").query("layer == 'layer1.1.block.conv1'")
    assert shares.groupby("epoch")["share"].sum().le(1 + 1e-9).all()


def test_appendix_g_targets_by_hand():
    assert appendix_g_targets(2.25, 4, 0.5) == pytest.approx([1.5, 2.0, 2.5, 3.0])
    assert appendix_g_targets(3.0, 1, 0.5) == [3.0]
    method = build_method(make_config("method=fractrain", "method.cp_total=4").method)
    assert method.targets == pytest.approx([3.25, 3.75, 4.25, 4.75])
    with pytest.raises(ConfigError, match="method.cp_total=0.5 is not allowed with 4 stages"):
        build_method(make_config("method=fractrain", "method.cp_total=0.5").method)


@pytest.mark.parametrize("override,message", [
    ("method.options=[[2,6],[0,0]]", "method.options="),
    ("method.options=[[0,0]]", "method.options="),
    ("method.target_cp=0", "method.target_cp=0 is not allowed"),
    ("method.execution=sometimes", "method.execution='sometimes' is not allowed"),
])
def test_bad_dfq_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        build_method(make_config("method=dfq", override).method)


def test_mobilenetv2_depthwise_convs_stay_at_fw8_bw16():
    dfq, net, meter = _prepared(model="mobilenetv2")
    assert dfq.num_options == 5  # the model config's options: [0,0], [4,8], [6,8], [6,10], [8,8]
    _step(dfq, net, meter, torch.randn(4, 3, 8, 8))
    depthwise = [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17
    for name in depthwise:
        for _, bits in dfq.precision()[name].options:
            assert (bits.weight, bits.act, bits.grad, bits.grad_weight) == (8, 8, 16, 16)
    sbm = build_method(make_config("method=sbm").method)
    model = sbm.prepare(build_model("mobilenetv2", 3, 10, (8, 8)))
    assert model.blocks[3].body[3].quant.grad.bits == 16 and model.blocks[3].body[0].quant.grad.bits == 8
