"""SBM: which layers get which quantizers, the precision record, running ranges, bifurcation, learning."""

import pytest
import torch
from torch import nn

from qtrain.errors import ConfigError
from qtrain.quant import formats
from qtrain.quant.layers import QConv2d, QLinear
from qtrain.run import run

from .conftest import TINY, make_config, prepared


def test_every_conv_and_linear_is_quantized_and_recorded():
    method, model = prepared("sbm")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert all(isinstance(m, (QConv2d, QLinear)) for m in layers.values())
    record = method.precision()
    assert set(record) == set(layers)
    bits = record["layer2.0.conv1"].options[0][1]
    assert (bits.weight, bits.act, bits.grad, bits.grad_weight) == (8, 8, 8, 8)
    q = model.layer2[0].conv1.quant
    assert q.weight.granularity == "channel" and q.weight.rounding == "nearest"
    assert q.grad.rounding == "stochastic" and q.grad_weight is None


@pytest.mark.parametrize("first,last", [("float32", "float32"), ("quantized", "float32"), ("float32", "quantized")])
def test_first_and_last_layers_can_stay_float32(first, last):
    method, model = prepared("sbm", f"method.first_layer={first}", f"method.last_layer={last}")
    assert isinstance(model.conv1, QConv2d) == (first == "quantized")
    assert isinstance(model.fc, QLinear) == (last == "quantized")
    assert ("conv1" in method.precision()) == (first == "quantized") and "layer1.0.conv1" in method.precision()


def test_a_bad_layer_precision_is_named():
    with pytest.raises(ConfigError, match="method.last_layer='fp16' is not allowed"):
        prepared("sbm", "method.last_layer=fp16")


@pytest.mark.parametrize("experiment,grad_weight_bits,percent", [
    ("sbm_bw16_bifurcation", 16, 100 * (64 + 64 + 128) / 3 / 1024),  # Banner: error path 8, weight gradient 16: 8.33 %
    ("sbm_bw16_both_paths", 16, 100 * (64 + 128 + 128) / 3 / 1024),  # FracTrain's tables: both at 16: 10.42 %
])
def test_the_two_readings_of_fw8_bw16(experiment, grad_weight_bits, percent):
    method, model = prepared("sbm", f"experiment={experiment}")
    q = model.layer1[0].conv2.quant
    assert q.grad_weight is None or q.grad_weight.bits == grad_weight_bits
    bits = method.precision()["layer1.0.conv2"].options[0][1]
    assert bits.grad_weight == 16 and bits.grad == (8 if experiment.endswith("bifurcation") else 16)
    assert 100 * sum(bits.gemm_fractions()) / 3 == pytest.approx(percent)


def test_weights_are_quantized_per_output_channel_to_256_levels():
    _, model = prepared("sbm")
    layer = model.layer3[1].conv2
    wq = layer.quantized_weight()
    for row, qrow in zip(layer.weight.detach(), wq):
        assert qrow.unique().numel() <= 256
        assert torch.isclose(qrow.min(), row.min()) and torch.isclose(qrow.max(), row.max())
    lo, hi = formats.tensor_range(layer.weight.detach(), "channel")
    assert torch.equal(wq, formats.range_linear(layer.weight.detach(), 8, lo, hi))


def test_running_range_weighs_its_old_value_by_the_momentum():
    _, model = prepared("sbm", "method.act_momentum=0.9")
    act = model.layer1[0].conv1.quant.act
    model.train()
    first, second = torch.randn(4, 16, 8, 8), torch.randn(4, 16, 8, 8) * 3
    act(first)
    act(second)
    lo = [formats.tensor_range(t, "sample_mean")[0].item() for t in (first, second)]
    hi = [formats.tensor_range(t, "sample_mean")[1].item() for t in (first, second)]
    assert act.running_range.tolist() == pytest.approx([0.9 * lo[0] + 0.1 * lo[1], 0.9 * hi[0] + 0.1 * hi[1]])


def test_a_training_forward_reads_nothing_back_to_the_host():
    # on a GPU a value read back (bool(t), t.item()) waits for all queued work: once per layer, the CPU could no
    # longer run ahead of the GPU (the running range's first update was chosen on the host)
    _, model = prepared("sbm", "method.act_momentum=0.9")
    model.train()
    x = torch.randn(4, 3, 8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
        model(x)
    reads = [e.key for e in prof.key_averages() if e.key in ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")]
    assert reads == []
    assert model.layer1[0].conv1.quant.act.tracked


@pytest.mark.slow
def test_evaluation_uses_the_running_activation_range():
    _, model = prepared("sbm", "method.act_momentum=0.5")
    act = model.layer1[0].conv1.quant.act
    model.train()
    model(torch.randn(4, 3, 8, 8))
    first = act.running_range.clone()
    model(torch.randn(4, 3, 8, 8) * 3)
    assert not torch.equal(first, act.running_range)
    model.eval()
    x = torch.randn(2, 16, 8, 8) * 10
    lo, hi = act.running_range
    assert torch.equal(act(x), formats.range_linear(x, 8, lo.view(1, 1), hi.view(1, 1)))


@pytest.mark.slow
def test_sbm_learns_the_synthetic_task(tmp_path):
    summary = run(make_config(*TINY, "train.epochs=3"), tmp_path)
    assert summary["final"]["test_acc"] > 0.9


@pytest.mark.parametrize("bits,saved_dtype", [(2, torch.uint8), (12, torch.int16), (16, torch.float32)])
@pytest.mark.slow
def test_activation_codes_take_the_smallest_dtype_and_train(tmp_path, bits, saved_dtype, device):
    _, model = prepared("sbm", f"method.act_bits={bits}")
    layer = model.layer1[0].conv2.to(device)
    saved = []
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(4, 16, 8, 8, device=device))
    assert any(t.dtype == saved_dtype and t.numel() == 4 * 16 * 8 * 8 and t.device.type == device.type for t in saved)
    summary = run(make_config(*TINY, f"method.act_bits={bits}", "train.epochs=1", f"device={device}"), tmp_path)
    assert summary["status"] == "completed"
    assert summary["cost"]["percent_of_float32"] == pytest.approx(100 * (bits * 8 + 64 + bits * 8) / 3 / 1024)
