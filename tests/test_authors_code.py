"""scripts/authors_code.py without the authors' code: the names its gate check gives qtrain's DFQ ResNet-38 state in
the authors' gated ResNet-38 (``group{stage}_layer{i}``, ``group{stage}_gate{i}`` after block i, ``gate_layer1``
before the first block, ``control`` for the shared LSTM), written out by hand from their model's attribute names; and
the edit that restores their gated forward's skip candidate, on a hand-written forward of the same shape, run."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("authors_code", ROOT / "scripts" / "authors_code.py")
authors_code = importlib.util.module_from_spec(spec)
spec.loader.exec_module(authors_code)

# the shape of their models.py: code before the gated ResNet, its forward (where 0 bits makes a skip), then code with the
# same loops (their gated MobileNetV2's) that must stay as it is
MODELS = """
def earlier(bits):
    return [j for j in range(len(bits))]

class ResNetRecurrentGateSP:
    def forward(self, prev, block, mask, bits):
        output_candidates = []
        # output_candidates.append(prev)
        for k in range(len(bits)):
            if bits[k] == 0:
                output_candidates.append(prev)
            else:
                output_candidates.append(block(prev, bits[k]))
        mask_list = []
        for j in range(len(bits)):
            mask_list.append(mask[j])
        return sum([mask_list[k] * output_candidates[k] for k in range(len(bits))])

def later(bits):
    seen = []
    for j in range(len(bits)):
        seen.append(j)
    return seen
"""


def test_restore_skip_mixes_the_block_input_first_and_one_candidate_more():
    namespace: dict = {}
    exec(authors_code.restore_skip(MODELS), namespace)
    forward = namespace["ResNetRecurrentGateSP"].forward
    block = lambda x, bits: x * 10 + bits  # noqa: E731
    bits = [4, 6]
    assert forward(None, 1, block, [1, 0, 0], bits) == 1  # option 0: the input itself (skipped)
    assert forward(None, 1, block, [0, 1, 0], bits) == 14  # option 1: the first run option
    assert forward(None, 1, block, [0, 0, 1], bits) == 16
    assert forward(None, 1, block, [0, 1, 0], [0, 0]) == 10  # 0 bits: the block run (in float32 there), not a skip
    assert namespace["earlier"]([4, 6]) == namespace["later"]([4, 6]) == [0, 1]  # the rest untouched
    exec(MODELS, namespace)  # as released: two candidates only, the mask's last entry unused
    assert namespace["ResNetRecurrentGateSP"].forward(None, 1, block, [1, 0, 0], bits) == 14


def test_restore_skip_refuses_a_models_file_without_the_lines():
    with pytest.raises(ValueError, match="output_candidates.append"):
        authors_code.restore_skip(MODELS.replace("# output_candidates.append(prev)", ""))
    with pytest.raises(ValueError, match="no class ResNetRecurrentGateSP"):
        authors_code.restore_skip("class ResNet:\n    pass\n")


def test_qtrain_dfq_state_names_map_to_the_authors_gated_resnet():
    from qtrain.config.command_line import compose_config
    from qtrain.methods import build_method
    from qtrain.models import build_model
    from qtrain.resources import conf_dir

    cfg = compose_config(conf_dir(), ["experiment=fractrain_table3", "model=resnet38", "data=cifar10", "method=dfq",
                                      "method.weight_bits=4", "method.execution=mix_all"])
    model = build_method(cfg.method).prepare(build_model("resnet38", cfg.model, in_channels=3, num_classes=10,
                                                         input_size=(32, 32)))
    names = authors_code._their_gated_names(model.state_dict())
    expected = {
        "conv1.weight": "conv1.weight",
        "fc.bias": "fc.bias",
        "layer1.0.embed.0.weight": "gate_layer1.1.weight",  # their gate: pool, conv, ReLU, conv
        "layer1.0.embed.2.bias": "gate_layer1.3.bias",
        "layer1.1.embed.0.weight": "group1_gate0.1.weight",  # the gate after block 1.0 decides block 1.1
        "layer2.0.embed.2.weight": "group1_gate5.3.weight",
        "layer3.5.embed.0.bias": "group3_gate4.1.bias",
        "layer2.0.block.conv1.weight": "group2_layer0.conv1.weight",
        "layer2.0.block.shortcut.0.weight": "group2_layer0.downsample.weight",
        "layer3.0.block.shortcut.1.running_var": "group3_layer0.bn3.running_var",
        "layer1.4.block.bn2.weight": "group1_layer4.bn2.weight",
        "gate_controller.cell.weight_ih": "control.rnn_one.weight_ih_l0",
        "gate_controller.cell.bias_hh": "control.rnn_one.bias_hh_l0",
        "gate_controller.proj.weight": "control.proj.weight",
    }
    assert {key: names[key] for key in expected} == expected
    gates = {name.split(".")[0] for name in names.values() if "gate" in name.split(".")[0]}
    assert gates == {"gate_layer1"} | {f"group{g}_gate{i}" for g in (1, 2, 3) for i in range(6)} - {"group3_gate5"}
