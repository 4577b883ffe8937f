"""ResNet-34/110/164 under every method: the MAC profile, the layer swapping, a short run, DFQ's gated blocks."""

import pytest
from torch import nn

from qtrain.catalog import METHOD_NAMES
from qtrain.methods import build_method
from qtrain.models import build_model
from qtrain.quant.layers import QConv2d
from qtrain.run import run

from .conftest import make_config

NEW = ("resnet34", "resnet110", "resnet164")
# one epoch of 16 synthetic 8x8 images in batches of 8: two steps, an epoch's end and an evaluation
SHORT = ["data=synthetic", "data.n_train=16", "data.n_test=8", "train.epochs=1", "train.batch_size=8",
         "train.eval_batch_size=8", "progress=false", "fused=false"]


@pytest.mark.parametrize("method", [m for m in METHOD_NAMES if m != "float32"])
@pytest.mark.slow
def test_every_method_quantizes_every_bottleneck_convolution(method):
    built = build_method(make_config(f"method={method}", "model=resnet164").method)
    net = built.prepare(build_model("resnet164", in_channels=3, num_classes=10, input_size=(8, 8)))
    names = [n for n, m in net.named_modules() if n.startswith("layer") and isinstance(m, nn.Conv2d) and ".embed." not in n]
    assert len(names) == 3 * 54 + 3  # three convolutions a block, the three projections (not DFQ's gate embeddings)
    assert all(isinstance(net.get_submodule(n), QConv2d) for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHOD_NAMES))
def test_every_method_trains_resnet164(method, tmp_path):
    cycles = ["method.cycles=2"] if method == "cpt" else []  # CPT refuses more cycles than the run's 2 steps
    summary = run(make_config(f"method={method}", "model=resnet164", *SHORT, *cycles), tmp_path)
    assert summary["status"] == "completed"
    percent = summary["cost"]["percent_of_float32"]
    assert percent == 100 if method == "float32" else 0 < percent < 100
