"""Model registry: the CIFAR ResNet family's layout, AlexNet's shapes, input-size checks."""

import pytest
import torch
from torch import nn

from qtrain.errors import ConfigError
from qtrain.models import build_model


@pytest.mark.parametrize("name,blocks", [("resnet20", 3), ("resnet38", 6), ("resnet74", 12)])
def test_resnet_family_is_6n_plus_2(name, blocks):
    model = build_model(name, in_channels=3, num_classes=10, input_size=(32, 32))
    for stage in (model.layer1, model.layer2, model.layer3):
        assert len(stage) == blocks
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 6 * blocks + 2  # depth counts 3x3 convs and the classifier
    assert [s[0].conv1.out_channels for s in (model.layer1, model.layer2, model.layer3)] == [16, 32, 64]


def test_resnet20_has_the_known_parameter_count():
    # He et al. report 0.27M for ResNet-20; 1x1-conv shortcuts add 2 x (conv + bn) = 2,784
    model = build_model("resnet20", in_channels=3, num_classes=10, input_size=(32, 32))
    assert sum(p.numel() for p in model.parameters()) == 272_474


@pytest.mark.parametrize("channels,size", [(1, 8), (3, 32), (1, 28), (3, 5)])
def test_resnet_takes_any_input(channels, size):
    model = build_model("resnet20", in_channels=channels, num_classes=7, input_size=(size, size))
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)


@pytest.mark.parametrize("size", [29, 32, 64])
def test_alexnet_shapes(size):
    model = build_model("alexnet", in_channels=3, num_classes=100, input_size=(size, size))
    assert model(torch.randn(2, 3, size, size)).shape == (2, 100)


def test_alexnet_rejects_mnist_sized_input():
    with pytest.raises(ConfigError, match="input 1x28x28 is too small for model alexnet"):
        build_model("alexnet", in_channels=1, num_classes=10, input_size=(28, 28))


def test_mobilenetv2_cifar_layout():
    model = build_model("mobilenetv2", in_channels=3, num_classes=100, input_size=(32, 32))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    blocks = list(model.blocks)
    # MobileNetV2's table: 1+2+3+4+3+3+1 inverted residual blocks; as in FracTrain's reference code, every
    # stride-1 block is residual: 10 keep the width, 4 change it through a 1x1 projection shortcut
    assert len(blocks) == 17 and sum(b.identity for b in blocks) == 10
    projected = [(b.conv1.in_channels, b.conv3.out_channels) for b in blocks if b.projection_name is not None]
    assert projected == [(32, 16), (16, 24), (64, 96), (160, 320)]
    assert blocks[0].conv1.out_channels == 32  # the expansion conv is there even at expansion 1
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17 and all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    # CIFAR strides: 32x32 in, three stride-2 stages, 4x4 at the last block
    out = model.head(model.blocks(model.stem(torch.randn(1, 3, 32, 32))))
    assert out.shape == (1, 1280, 4, 4)


def _torchvision_resnet18(num_classes, cifar):
    from torchvision.models import resnet18

    net = resnet18(num_classes=num_classes)
    if cifar:
        net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    return net


@pytest.mark.parametrize("size,classes,form", [(224, 1000, "imagenet"), (32, 100, "cifar"), (64, 10, "cifar"),
                                               (96, 10, "imagenet")])
def test_resnet18_matches_torchvision_in_both_forms(size, classes, form):
    ours = build_model("resnet18", in_channels=3, num_classes=classes, input_size=(size, size))
    theirs = _torchvision_resnet18(classes, form == "cifar")
    assert ours.form == form
    shapes = [tuple(p.shape) for p in ours.parameters()]
    assert sorted(shapes) == sorted(tuple(p.shape) for p in theirs.parameters())
    if size == 224:
        assert sum(p.numel() for p in ours.parameters()) == 11_689_512  # torchvision's documented count


def test_resnet18_stem_from_the_config_and_its_output():
    model = build_model("resnet18", {"name": "resnet18", "stem": "imagenet"}, in_channels=3, num_classes=10, input_size=(32, 32))
    assert model.form == "imagenet" and model.conv1.kernel_size == (7, 7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="model.stem='big' is not allowed"):
        build_model("resnet18", {"name": "resnet18", "stem": "big"}, in_channels=3, num_classes=10, input_size=(32, 32))
