"""One run on two CPU processes (gloo): the ranks decide alike, the loss falls, the cost counts every sample once,
a killed two-process run resumes to the same results; and the pieces in-process (batch slices, identity)."""

import math
import os
import pickle
import socket

import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from qtrain import distributed
from qtrain.config import digest, first_difference, identity, recorded
from qtrain.data import BatchStream, load_data
from qtrain.methods.dfq import DFQ
from qtrain.run import run
from qtrain.train import Trainer

from .conftest import TINY, make_config

METHODS = {
    "sbm": ["method=sbm"],
    # the indicator's window of 2 epochs fills at epoch 2 and its epsilon passes any loss: a switch there
    "pfq": ["method=pfq", "method.window=2", "method.epsilon=100"],
    "dfq": ["method=dfq"],
}
TIMING = ("epoch_seconds", "wall_seconds")


class Stop(Exception):
    """The kill of the interrupted run: raised on both ranks once epoch 1's results are written."""


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN and tensors compared element by element."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _traced_run(overrides, run_dir, stop_after=None):
    """Run with every epoch's metrics, precision record and meter recorded, what this rank charged itself, and (DFQ)
    what its gates counted each epoch before and after the sum over ranks."""
    trace, charged, gate_counts = [], [0.0], []
    fit, end_epoch, sum_ = Trainer.fit, DFQ.end_epoch, distributed.sum_

    def traced_end_epoch(self, epoch, metrics):
        local = torch.stack([torch.stack([torch.zeros(self.num_options, dtype=torch.float64) if getattr(b, name) is None
                                          else getattr(b, name).double().clone() for b in self.blocks])
                             for name in ("train_probs", "eval_choices")])
        sums = []
        distributed.sum_ = lambda tensor: sums.append(sum_(tensor)) or sums[-1]
        try:
            end_epoch(self, epoch, metrics)
        finally:
            distributed.sum_ = sum_
        gate_counts.append((local, sums))

    def traced_fit(self, on_epoch_end):
        meter_add = self.meter.add

        def counted_add(record, samples):
            before = self.meter.total()
            meter_add(record, samples)
            charged[0] += self.meter.total() - before

        self.meter.add = counted_add

        def record(progress):
            on_epoch_end(progress)
            trace.append({"metrics": {k: v for k, v in progress.history[-1].items() if k not in TIMING},
                          "precision": self.epoch_precision.record(), "method": self.method.state_dict(),
                          "meter": self.meter.state_dict()})
            if progress.epoch == stop_after:
                raise Stop
        return fit(self, record)

    Trainer.fit, DFQ.end_epoch = traced_fit, traced_end_epoch
    try:
        summary = run(make_config(*overrides), run_dir)
    finally:
        Trainer.fit, DFQ.end_epoch = fit, end_epoch
    return {"trace": trace, "charged": charged[0], "summary": summary, "gate_counts": gate_counts}


def _worker(rank, world, port, jobs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results = {}
    for name, overrides, run_dir, stop_after in jobs:
        try:
            results[name] = _traced_run(overrides, run_dir, stop_after)
        except Stop:
            results[name] = "stopped"
    with open(f"{out}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every job on two gloo processes, in one process group: SBM, PFQ, DFQ; SBM killed after epoch 1, then resumed."""
    root = tmp_path_factory.mktemp("ddp")
    jobs = [(m, [*TINY, *o], str(root / m), None) for m, o in METHODS.items()]
    jobs += [("killed", [*TINY, "method=sbm"], str(root / "resumed"), 1),
             ("resumed", [*TINY, "method=sbm"], str(root / "resumed"), None)]
    mp.spawn(_worker, args=(2, _free_port(), jobs, str(root)), nprocs=2, join=True)
    ranks = []
    for rank in range(2):
        with open(root / f"rank{rank}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    return root, ranks


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.slow
def test_both_ranks_decide_alike_and_the_loss_falls(two_ranks, method):
    _, (zero, one) = two_ranks
    assert _same(zero[method]["trace"], one[method]["trace"])  # metrics, precision records, method state, meter
    losses = [epoch["metrics"]["train_loss"] for epoch in zero[method]["trace"]]
    assert losses[-1] < losses[0]
    if method == "pfq":  # the indicator read the same loss on both ranks and turned at epoch 2
        assert [e["method"]["schedule"]["stage"] for e in zero[method]["trace"]] == [0, 1]


# Per sample and layer, the share of float32 that a one-process run charges (FracTrain's CC): SBM at 8 bits
# everywhere; PFQ's first stage FW-3/BW-6 with the classifier (the last layer) in float32. DFQ's gates see
# per-rank BatchNorm statistics, so no one-process run picks the same options: its cost is checked as the sum of
# what each rank charged at its own records.
ONE_PROCESS_SHARE = {"sbm": (3 * 8 * 8 / 1024, 3 * 8 * 8 / 1024),
                     "pfq": ((3 * 3 + 6 * 3 + 3 * 6) / 1024, 3.0)}  # (every layer but the last, the last)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.slow
def test_cost_counts_every_sample_once(two_ranks, method):
    root, (zero, one) = two_ranks
    summary = zero[method]["summary"]
    samples = 2 * 256  # two epochs of the 256 synthetic samples
    cost = pd.read_csv(root / method / "cost.csv")
    assert summary["world_size"] == 2 and zero[method]["trace"][-1]["meter"]["samples"] == samples
    written = OmegaConf.to_container(OmegaConf.load(root / method / ".hydra" / "config.yaml"), resolve=True)
    assert written["world_size"] == summary["config"]["world_size"] == 2
    assert digest(identity(written)) == summary["run_id"]
    assert summary["cost"]["float32_effective_macs"] == samples * 3 * cost["macs_per_sample"].sum()
    assert cost["effective_macs"].sum() == pytest.approx(summary["cost"]["effective_macs"], rel=1e-12)
    if method == "dfq":
        charged = zero[method]["charged"] + one[method]["charged"]
        assert summary["cost"]["effective_macs"] == pytest.approx(charged, rel=1e-12)
        return
    body, last = ONE_PROCESS_SHARE[method]
    macs = cost["macs_per_sample"]
    expected = samples * (body * macs.iloc[:-1].sum() + last * macs.iloc[-1])
    assert summary["cost"]["effective_macs"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_the_gates_records_count_both_ranks_samples(two_ranks):
    root, (zero, one) = two_ranks
    counts = [rank["dfq"]["gate_counts"] for rank in (zero, one)]
    assert len(counts[0]) == len(counts[1]) == 2  # two epochs
    precision = pd.read_csv(root / "dfq" / "precision.csv")
    for epoch, ((local0, sums0), (local1, sums1)) in enumerate(zip(*counts), start=1):
        assert len(sums0) == len(sums1) == 1  # one all-reduce an epoch, both events in it
        summed0, summed1 = sums0[0], sums1[0]
        assert torch.equal(summed0, local0 + local1) and torch.equal(summed1, summed0)
        assert not torch.equal(local0, local1)  # the ranks' own samples: a sum of one rank's twice would differ
        for event, sums in zip(("gates_probability", "gates_eval"), summed0):
            assert sums.sum(1).gt(0).all()
            rows = precision[(precision.epoch == epoch) & (precision.event == event)]
            first = rows.layer.iloc[0]  # the first gated block's first layer: a row per option it ran at
            mine = rows[rows.layer == first].share.to_numpy()
            shares = (sums[0] / sums[0].sum()).tolist()[1:]  # ResNet-20's first option is the skip
            assert sorted(mine) == pytest.approx(sorted(s for s in shares if s > 0), abs=1e-12)


@pytest.mark.slow
def test_only_rank_0_writes_and_a_killed_run_resumes_to_the_same_results(two_ranks):
    root, (zero, one) = two_ranks
    assert zero["killed"] == one["killed"] == "stopped"
    assert _same(zero["resumed"]["trace"], one["resumed"]["trace"])
    assert len(zero["resumed"]["trace"]) == 1  # it went on after epoch 1
    assert _same(zero["resumed"]["trace"][-1], zero["sbm"]["trace"][-1])
    whole, resumed = (pd.read_csv(root / d / "metrics.csv").drop(columns=list(TIMING)) for d in ("sbm", "resumed"))
    pd.testing.assert_frame_equal(whole, resumed)
    assert sorted(p.name for p in (root / "sbm").iterdir()) == [
        ".hydra", "checkpoint.pt", "cost.csv", "metrics.csv", "precision.csv", "summary.json"]
    assert len(torch.load(root / "sbm" / "checkpoint.pt", weights_only=True)["rank_rng"]) == 2


def _wrap_worker(rank, world, port, new_api, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    distributed.ddp_takes_forward_sync_buffers = lambda: new_api
    dist.init_process_group("gloo")
    layer = torch.nn.BatchNorm1d(3)
    layer.running_mean.fill_(rank + 1.0)
    torch.nn.init.constant_(layer.weight, rank + 1.0)
    wrapped = distributed.wrap(layer, torch.device("cpu"), unused_parameters=False)
    torch.manual_seed(rank)
    batches = [torch.randn(4, 3) for _ in range(2)]
    expected = torch.ones(3)  # rank 0's running mean, then this rank's own batches (momentum 0.1)
    for batch in batches:
        wrapped(batch)
        expected = 0.9 * expected + 0.1 * batch.mean(0)
    torch.save({"weight": layer.weight.detach(), "mean": layer.running_mean, "expected": expected},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("new_api", [
    pytest.param(True, marks=pytest.mark.skipif(not distributed.ddp_takes_forward_sync_buffers(),
                                                reason="this torch's DDP has no forward_sync_buffers")),
    False], ids=["forward_sync_buffers", "before_torch_2.13"])
@pytest.mark.slow
def test_wrapping_syncs_weights_and_buffers_from_rank_0_once(tmp_path, new_api):
    """DDP's first sync sends rank 0's weights and buffers to every rank on either DDP API (before torch 2.13 qtrain
    sends the buffers itself); no forward syncs them again: each rank's running mean goes on from rank 0's with
    its own batches alone."""
    mp.spawn(_wrap_worker, args=(2, _free_port(), new_api, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert torch.equal(r["weight"], torch.ones(3))  # rank 0's weights everywhere
        torch.testing.assert_close(r["mean"], r["expected"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_ranks_slice_each_batch_into_the_one_process_batch():
    data = load_data(make_config(*TINY, "data.n_train=70").data)  # the last batch of 6 splits 3/3
    kw = dict(crop_padding=2, flip=True)
    alone = list(BatchStream(data, data.train, 64, 5, True, **kw).epoch(1))
    parts = [list(BatchStream(data, data.train, 64, 5, True, rank=r, world=2, **kw).epoch(1)) for r in range(2)]
    assert [len(y) for _, y in parts[0]] == [32, 3] and [len(y) for _, y in parts[1]] == [32, 3]
    for (x, y), (x0, y0), (x1, y1) in zip(alone, *parts):
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
    short = load_data(make_config(*TINY, "data.n_train=65").data)  # a last batch of 1: rank 1 would get nothing
    assert BatchStream(short, short.train, 64, 5, True, rank=1, world=2).smallest_part() == 0


def test_world_size_is_part_of_the_identity(monkeypatch):
    cfg = make_config(*TINY)
    one = identity(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    two = identity(cfg)
    assert "world_size" not in one and first_difference(one, two) == "world_size (absent) → 2"


def test_the_record_of_a_run_on_several_processes_gives_its_identity(monkeypatch):
    # a run in progress is known by its .hydra/config.yaml alone: read outside the process group, it must give the
    # identity the run computed inside it, not a one-process run's
    cfg = make_config(*TINY)
    assert OmegaConf.to_container(recorded(cfg)) == OmegaConf.to_container(cfg)  # one process: records as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    in_run = identity(cfg)
    record = OmegaConf.to_container(recorded(cfg), resolve=True)
    monkeypatch.delenv("WORLD_SIZE")
    assert record["world_size"] == 2 and "world_size" not in cfg
    assert identity(record) == in_run and digest(identity(record)) != digest(identity(cfg))


@pytest.mark.slow
def test_a_process_group_of_one_trains_as_one_process(tmp_path, monkeypatch, device):
    """Every distributed step switched on for one rank (gloo on the CPU, nccl on CUDA: one GPU holds one NCCL rank):
    DistributedDataParallel with unused parameters (DFQ's gates), the reductions and the buffer averaging change
    nothing in the metrics."""
    import torch.distributed as dist

    overrides = [*TINY, "method=dfq", "train.epochs=1", f"device={device}"]
    alone = run(make_config(*overrides), tmp_path / "alone")
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "atexit", type("NoExit", (), {"register": staticmethod(lambda fn: None)}))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "1" if name == "WORLD_SIZE" else "0")
    try:
        grouped = run(make_config(*overrides), tmp_path / "grouped")
        assert dist.get_backend() == ("nccl" if device.type == "cuda" else "gloo")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert grouped["world_size"] == 1 and grouped["final"] == alone["final"]
    whole, one_rank = (pd.read_csv(tmp_path / d / "metrics.csv").drop(columns=list(TIMING)) for d in ("alone", "grouped"))
    pd.testing.assert_frame_equal(whole, one_rank, check_exact=True)
