"""Model registry: the CIFAR ResNet family's layout, ResNet-18/34 against torchvision, AlexNet's shapes, input-size checks."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qtrain.errors import ConfigError
from qtrain.models import build_model


@pytest.mark.parametrize("name,blocks", [("resnet20", 3), ("resnet38", 6), ("resnet74", 12), ("resnet110", 18)])
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


def _conv_bn(cin, cout, k):
    """Parameters of a bias-free k x k convolution and the batch norm after it."""
    return cin * cout * k * k + 2 * cout


def _cifar_resnet_count(n, classes, bottleneck):
    """A hand count of the CIFAR ResNets' parameters: stem, three stages of n blocks, 1x1-conv projections, classifier."""
    total, cin = _conv_bn(3, 16, 3), 16
    for planes in (16, 32, 64):
        cout = 4 * planes if bottleneck else planes
        for i in range(n):
            if bottleneck:
                total += _conv_bn(cin, planes, 1) + _conv_bn(planes, planes, 3) + _conv_bn(planes, cout, 1)
            else:
                total += _conv_bn(cin, planes, 3) + _conv_bn(planes, planes, 3)
            if i == 0 and (cin != cout or planes != 16):
                total += _conv_bn(cin, cout, 1)
            cin = cout
    return total + cin * classes + classes


@pytest.mark.parametrize("name,n,bottleneck", [("resnet20", 3, False), ("resnet110", 18, False), ("resnet164", 18, True)])
@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_resnets_have_the_published_parameter_counts(name, n, bottleneck, classes):
    model = build_model(name, in_channels=3, num_classes=classes, input_size=(32, 32))
    count = sum(p.numel() for p in model.parameters())
    assert count == _cifar_resnet_count(n, classes, bottleneck)
    if name != "resnet20":  # published: 1.7M each (He et al. 2016; "Identity Mappings")
        assert 1.65e6 < count < 1.75e6


@pytest.mark.slow
def test_resnet164_is_9n_plus_2_bottlenecks():
    model = build_model("resnet164", in_channels=3, num_classes=10, input_size=(32, 32))
    convs = [m for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and "shortcut" not in n]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 164
    stages = (model.layer1, model.layer2, model.layer3)
    assert [len(s) for s in stages] == [18, 18, 18]
    assert [(s[0].conv1.out_channels, s[0].conv3.out_channels) for s in stages] == [(16, 64), (32, 128), (64, 256)]
    assert [s[0].conv2.stride for s in stages] == [(1, 1), (2, 2), (2, 2)]  # the stride on the 3x3, as in the reference
    # the first block of every stage changes the shape (layer1's the width) and has a projection; the rest are identities
    assert [b.identity for s in stages for b in s] == ([False] + [True] * 17) * 3
    assert all(s[0].projection_name == "shortcut.0" for s in stages)
    x = torch.randn(2, 3, 32, 32)
    assert model(x).shape == (2, 10)
    assert model.layer3(model.layer2(model.layer1(model.bn1(model.conv1(x))))).shape == (2, 256, 8, 8)


def test_a_bottleneck_block_is_post_activation_and_its_projection_is_the_shortcut():
    torch.manual_seed(0)
    block = build_model("resnet164", in_channels=3, num_classes=10, input_size=(8, 8)).layer2[0].eval()
    x = torch.randn(2, 64, 8, 8)
    out = F.relu(block.bn1(F.conv2d(x, block.conv1.weight)))
    out = F.relu(block.bn2(F.conv2d(out, block.conv2.weight, stride=2, padding=1)))
    out = block.bn3(F.conv2d(out, block.conv3.weight))
    shortcut = block.shortcut[1](F.conv2d(x, block.shortcut[0].weight, stride=2))
    torch.testing.assert_close(block.projection(x), shortcut)
    torch.testing.assert_close(block(x), F.relu(out + shortcut))


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


@pytest.mark.slow
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


def _torchvision_resnet(name, num_classes, cifar):
    import torchvision.models

    net = getattr(torchvision.models, name)(num_classes=num_classes)
    if cifar:
        net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    return net


@pytest.mark.parametrize("name,documented", [("resnet18", 11_689_512), ("resnet34", 21_797_672)])
@pytest.mark.parametrize("size,classes,form", [(224, 1000, "imagenet"), (32, 100, "cifar"), (64, 10, "cifar"),
                                               (96, 10, "imagenet")])
@pytest.mark.slow
def test_imagenet_resnets_match_torchvision_in_both_forms(name, documented, size, classes, form):
    ours = build_model(name, in_channels=3, num_classes=classes, input_size=(size, size))
    theirs = _torchvision_resnet(name, classes, form == "cifar")
    assert ours.form == form
    shapes = [tuple(p.shape) for p in ours.parameters()]
    assert sorted(shapes) == sorted(tuple(p.shape) for p in theirs.parameters())
    if size == 224:
        assert sum(p.numel() for p in ours.parameters()) == documented  # torchvision's documented count
        assert ours(torch.randn(1, 3, size, size)).shape == (1, classes)


@pytest.mark.slow
def test_resnet34_stages_and_feature_maps():
    model = build_model("resnet34", in_channels=3, num_classes=1000, input_size=(224, 224))
    assert [len(s) for s in (model.layer1, model.layer2, model.layer3, model.layer4)] == [3, 4, 6, 3]
    x = model.pool(F.relu(model.bn1(model.conv1(torch.randn(1, 3, 224, 224)))))
    sides = []
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        x = stage(x)
        sides.append(tuple(x.shape[1:]))
    assert sides == [(64, 56, 56), (128, 28, 28), (256, 14, 14), (512, 7, 7)]


def test_resnet18_stem_from_the_config_and_its_output():
    model = build_model("resnet18", {"name": "resnet18", "stem": "imagenet"}, in_channels=3, num_classes=10, input_size=(32, 32))
    assert model.form == "imagenet" and model.conv1.kernel_size == (7, 7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="model.stem='big' is not allowed"):
        build_model("resnet18", {"name": "resnet18", "stem": "big"}, in_channels=3, num_classes=10, input_size=(32, 32))


def test_the_reference_classifier_init_is_its_normal_draw_and_leaves_every_other_draw_alone():
    """``classifier_init=normal_in_out``: the classifier's weight is N(0, 2/(in*out)) (FracTrain's reference code),
    drawn from the random state that follows the model's construction, which it leaves in place: the same seed then
    makes every other parameter, the bias and the next draw as with torch's initialization."""
    def build(init):
        torch.manual_seed(5)
        model = build_model("resnet38", {"name": "resnet38", "classifier_init": init}, in_channels=3, num_classes=10,
                            input_size=(32, 32))
        return model, torch.rand(3)

    torch_init, after_torch = build("torch")
    reference, after_reference = build("normal_in_out")
    torch.manual_seed(5)
    build_model("resnet38", {"name": "resnet38"}, in_channels=3, num_classes=10, input_size=(32, 32))
    expected = torch.empty(10, 64).normal_(0.0, math.sqrt(2.0 / 640))  # in 64, out 10
    assert torch.equal(reference.fc.weight, expected)
    assert torch.equal(after_reference, after_torch)
    assert not torch.equal(reference.fc.weight, torch_init.fc.weight)
    others = {name: p for name, p in torch_init.named_parameters() if name != "fc.weight"}
    assert all(torch.equal(p, others[name]) for name, p in reference.named_parameters() if name != "fc.weight")
    assert len(others) == len(list(reference.parameters())) - 1
    with pytest.raises(ConfigError, match=r"^model.classifier_init='big' is not allowed"):
        build_model("resnet20", {"name": "resnet20", "classifier_init": "big"}, in_channels=3, num_classes=10)
