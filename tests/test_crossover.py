"""scripts/crossover.py without the authors' code: qtrain's DFQ ResNet-38 state written into a stand-in for the
authors' gated ResNet-38 state (their names, from the gate check's mapping, checked there against their model's
attribute names; their quantizer ranges as zero point and width; one tensor under two names, as their model registers
a downsampling block's skip path) and read back."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("crossover", ROOT / "scripts" / "crossover.py")
crossover = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crossover)


@pytest.fixture(scope="module")
def ours() -> dict[str, torch.Tensor]:
    _, state = crossover._qtrain_dfq([])
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    state["layer3.1.block.conv1.quant.act.running_range"] = torch.tensor([-1.5, 6.25])
    return state


def _stand_in(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The authors' state's names and shapes for qtrain's entries (zeros), with the skip path's weight under two names
    and a batch norm of theirs that qtrain has no counterpart of."""
    names, theirs = crossover._their_gated_names(ours), {}
    for key, value in ours.items():
        if key.endswith(crossover.TRACKED):
            continue
        if key.endswith(crossover.RANGE):
            conv = crossover._their_conv(names, key)
            theirs[conv + crossover.THEIR_ZERO] = torch.zeros(1, 1, 1, 1)
            theirs[conv + crossover.THEIR_RANGE] = torch.zeros(1, 1, 1, 1)
        else:
            theirs[names[key]] = torch.zeros_like(value)
    theirs["group2_ds0.weight"] = theirs["group2_layer0.downsample.weight"]  # one tensor, two names
    theirs["group1_layer0.bn3.weight"] = torch.full((16,), 7.0)  # built by their blocks, never used
    return theirs


def test_qtrain_state_goes_into_the_authors_names_and_back(ours):
    template = _stand_in(ours)
    assert crossover.aliases(template) == [["group2_layer0.downsample.weight", "group2_ds0.weight"]]
    theirs = crossover.to_theirs(ours, template, crossover.aliases(template))
    assert torch.equal(theirs["group2_ds0.weight"], ours["layer2.0.block.shortcut.0.weight"])  # under both names
    assert torch.equal(theirs["group2_layer0.downsample.weight"], ours["layer2.0.block.shortcut.0.weight"])
    assert torch.equal(theirs["group1_layer0.bn3.weight"], torch.full((16,), 7.0))  # theirs alone: as built
    assert torch.equal(theirs["control.proj.bias"], ours["gate_controller.proj.bias"])
    assert torch.equal(theirs["group3_gate4.1.bias"], ours["layer3.5.embed.0.bias"])
    conv = "group3_layer1.conv1"  # (low, high) = (-1.5, 6.25): zero point -1.5, width 7.75
    assert theirs[f"{conv}.quantize_input_fw.running_zero_point"].flatten().tolist() == [-1.5]
    assert theirs[f"{conv}.quantize_input_fw.running_range"].flatten().tolist() == [7.75]
    back = crossover.to_ours(theirs, ours)
    assert back.keys() == ours.keys()
    for key, value in ours.items():
        if key.endswith(crossover.TRACKED):
            assert back[key].item() is True  # a range read from their model is one it has tracked
        elif key.endswith(crossover.RANGE):
            torch.testing.assert_close(back[key], value, rtol=0, atol=1e-6)  # to the rounding of high - low
        else:
            assert torch.equal(back[key], value), key


def test_an_entry_the_other_side_lacks_is_refused(ours):
    template = _stand_in(ours)
    del template["control.proj.weight"]
    with pytest.raises(ValueError, match=r"qtrain's gate_controller.proj.weight .* has no entry control.proj.weight"):
        crossover.to_theirs(ours, template, [])
    with pytest.raises(ValueError, match=r"the authors' checkpoint has no control.proj.weight .*gate_controller"):
        crossover.to_ours(template, ours)


def test_the_authors_loss_prices_each_blocks_masks_and_signs_by_the_batchs_cp():
    output, y = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    options = [(0, 0), (4, 6), (8, 16)]  # the skip, then FW4/BW6 and FW8/BW16 with 4-bit weights
    one_hot = torch.eye(3)
    block0 = [one_hot[[1, 2], k] for k in range(3)]  # sample 0 at FW4/BW6, sample 1 at FW8/BW16
    block1 = [one_hot[[0, 0], k] for k in range(3)]  # both skip
    task = torch.nn.functional.cross_entropy(output, y)
    # prices: (4 x (4 + 6) + 4 x 6) / 1024 = 64/1024 and (4 x (8 + 16) + 8 x 16) / 1024 = 224/1024; the skip free
    loss, cp = crossover._their_loss(output, [block0, block1], y, options, weight_bits=4, target=3.0, beta=0.01)
    assert cp == pytest.approx(100 * (288 / 1024) / (3 * 2 * 2))  # 2.34 %: below the target, the term subtracts
    assert loss.item() == pytest.approx(task.item() - 0.01 * 288 / 1024)
    loss, cp = crossover._their_loss(output, [block0, block1], y, options, weight_bits=4, target=2.0, beta=0.01)
    assert loss.item() == pytest.approx(task.item() + 0.01 * 288 / 1024)


def test_each_parameter_falls_in_one_group(ours):
    groups = {key: crossover._group(key) for key in ours if not key.endswith(("running_mean", "running_var",
                                                                             "num_batches_tracked", "range", "tracked"))}
    assert groups["gate_controller.cell.weight_ih"] == "gates' LSTM and projection"
    assert groups["layer2.3.embed.2.weight"] == "gates' embeddings"
    assert groups["layer3.0.block.shortcut.1.weight"] == groups["layer1.2.block.bn2.bias"] == groups["bn1.weight"] \
        == "batch norms"
    assert groups["layer3.0.block.shortcut.0.weight"] == groups["layer3.5.block.conv2.weight"] == "stage 3 blocks"
    assert groups["conv1.weight"] == "first convolution" and groups["fc.bias"] == "classifier"
