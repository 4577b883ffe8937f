"""scripts/gate_shards.py: a gated run's checkpoint, its training batches whole and in shards, the gates' choices
and the task's pull on them per stage."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from qtrain.errors import ConfigError
from qtrain.run import run
from tests.conftest import TINY, make_config, once, prepared

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # as running it from scripts/ does: it imports gate_start beside it
spec = importlib.util.spec_from_file_location("gate_shards", SCRIPTS / "gate_shards.py")
gate_shards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_shards)

OVERRIDES = once(*TINY, "method=dfq", "method.execution=mix_all", "train.epochs=1")


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dfq")
    run(make_config(*OVERRIDES), run_dir)
    return run_dir


@pytest.mark.slow
def test_a_batch_in_shards_is_its_shards_run_alone_each_weighted_by_its_share(gated_run):
    _, data, method, model, _ = gate_shards.load_run(gated_run)
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    model.train()
    images, labels = torch.randn(8, 3, 8, 8), torch.arange(8) % data.num_classes
    torch.manual_seed(0)
    whole = gate_shards._pass(model, method, images, labels, data.task.loss, 2, buffers)
    torch.manual_seed(0)  # each shard alone, in turn, draws its stochastic rounding as it does among the two
    alone = [gate_shards._pass(model, method, images[part], labels[part], data.task.loss, 1, buffers)
             for part in (slice(0, 4), slice(4, 8))]
    for b in range(len(method.blocks)):
        for part, shard in zip((slice(0, 4), slice(4, 8)), alone):
            assert torch.equal(whole[0][b][part], shard[0][b])  # the hard choices
            assert torch.equal(whole[1][b][part], shard[1][b])  # the probabilities
            assert torch.allclose(whole[2][b][part], shard[2][b] / 2, atol=1e-7)  # the gradient, at half the weight
    # the buffers (batch norms' and ranges' running values) are the checkpoint's again after the passes
    assert all(torch.equal(value, buffers[name]) for name, value in model.named_buffers())
    assert whole[2][0].abs().sum() > 0  # the task reaches the first gate


@pytest.mark.slow
def test_the_table_per_shard_count_and_stage(gated_run):
    table = gate_shards.shard_pull(gated_run, [1, 1, 2], list(gate_shards.DEFAULT_PAIRS), 2)
    assert table.shards.tolist() == [1] * 3 + [2] * 3  # 1 given twice is one count
    assert table.stage.tolist() == ["layer1", "layer2", "layer3"] * 2
    assert table.equals(gate_shards.shard_pull(gated_run, [1, 2], list(gate_shards.DEFAULT_PAIRS), 2))  # again alike
    choices = [c for c in table if c.startswith("choice ")]
    assert choices == [f"choice {n}" for n in ("skip", "FW2/BW6", "FW3/BW6", "FW4/BW6", "FW4/BW12", "FW6/BW8",
                                                   "FW6/BW12")]
    assert table[choices].sum(axis=1).tolist() == pytest.approx([1.0] * 6)
    drifts = ["FW4/BW6 against skip", "FW6/BW8 against FW4/BW6"]
    one, two = (table[table.shards == n].set_index("stage")[drifts] for n in (1, 2))
    assert (one != 0).all().all()
    assert not one.equals(two)  # the shards' own batch statistics move the pull


@pytest.mark.parametrize("model,expected", [
    ("resnet20", ["layer1"] * 3 + ["layer2"] * 3 + ["layer3"] * 3),
    # MobileNetV2's bottleneck sequences (its paper's Table 2: 1, 2, 3, 4, 3, 3, 1 blocks; each starts where the
    # width changes), all under one path, so named by their blocks' first and last index
    ("mobilenetv2", ["blocks.0"] + ["blocks.1-2"] * 2 + ["blocks.3-5"] * 3 + ["blocks.6-9"] * 4
     + ["blocks.10-12"] * 3 + ["blocks.13-15"] * 3 + ["blocks.16"]),
])
def test_a_stage_runs_from_a_block_that_changes_the_shape_to_the_next(model, expected):
    method, built = prepared("dfq", model=model)
    assert gate_shards.stages(built, method) == expected


@pytest.mark.slow
def test_a_pair_with_the_skip_counts_only_the_blocks_that_may_skip(tmp_path):
    run(make_config(*OVERRIDES, "method.skip_downsample=never"), tmp_path)
    table = gate_shards.shard_pull(tmp_path, [1], list(gate_shards.DEFAULT_PAIRS), 1).set_index("stage")
    cfg, data, method, model, state = gate_shards.load_run(tmp_path)
    assert [b.mask_skip for b in method.blocks] == [False] * 3 + [True, False, False] * 2  # layer2.0, layer3.0
    train_batches = data.streams(cfg, torch.device("cpu"), 0, 1)[0]
    images, labels = next(iter(train_batches.epoch(state["progress"]["epoch"])))
    model.train()
    torch.manual_seed(cfg.seed)  # as the table's pass of its first batch draws
    _, probs, grads = gate_shards._pass(model, method, images, labels, data.task.loss, 1,
                                        {name: value.clone() for name, value in model.named_buffers()})
    for stage, blocks in (("layer1", [0, 1, 2]), ("layer2", [4, 5]), ("layer3", [7, 8])):
        drift = gate_shards.logit_drift([grads[b] for b in blocks], [probs[b] for b in blocks], 0, 3)
        assert table.loc[stage, "FW4/BW6 against skip"] == pytest.approx(drift / (len(labels) * len(blocks)))
    # the pair of two run options counts every block
    drift = gate_shards.logit_drift(grads[3:6], probs[3:6], 3, 5)
    assert table.loc["layer2", "FW6/BW8 against FW4/BW6"] == pytest.approx(drift / (len(labels) * 3))


@pytest.mark.parametrize("args,message", [
    ({"shard_counts": [3]}, "--shards 3 is not allowed: give divisors of the batch size 64"),
    ({"pairs": [("skip", "FW5/BW5")]}, "--pair skip FW5/BW5 is not allowed: both must be options of the run"),
])
@pytest.mark.slow
def test_bad_input_is_refused_before_any_pass(gated_run, args, message):
    kwargs = {"shard_counts": [1], "pairs": list(gate_shards.DEFAULT_PAIRS), "batches": 1, **args}
    with pytest.raises(ConfigError, match=message):
        gate_shards.shard_pull(gated_run, **kwargs)


@pytest.mark.slow
def test_the_default_pairs_are_those_the_runs_options_have(tmp_path):
    no_skip = tmp_path / "no_skip"
    run(make_config(*OVERRIDES, "model.dfq_options=[[4,6],[6,8]]", "train.batches_per_epoch=1"), no_skip)
    table = gate_shards.shard_pull(no_skip, [1], None, 1)
    assert [c for c in table if " against " in c] == ["FW6/BW8 against FW4/BW6"]
    bare = tmp_path / "bare"
    run(make_config(*OVERRIDES, "model.dfq_options=[[3,6],[8,8]]", "train.batches_per_epoch=1"), bare)
    with pytest.raises(ConfigError, match="none of the default pairs' options: give --pair A B from FW3/BW6, FW8/BW8"):
        gate_shards.shard_pull(bare, [1], None, 1)
    sbm = tmp_path / "sbm"
    run(make_config(*TINY, "method=sbm", "train.epochs=1", "train.batches_per_epoch=1"), sbm)
    with pytest.raises(ConfigError, match="its method sbm has no gates"):
        gate_shards.load_run(sbm)


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="give a run directory with checkpoint.pt"):
        gate_shards.load_run(tmp_path)
