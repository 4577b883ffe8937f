"""scripts/gate_start.py: the gates' start it prints is what a run of the same config and seed chose at its first step,
and the probabilities it chose from, read back from the run's own precision.csv (one batch an epoch: the epoch's mean
shares and probabilities are the first step's)."""

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

from qtrain.run import run
from tests.conftest import TINY, make_config, once

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gate_start.py"
spec = importlib.util.spec_from_file_location("gate_start", SCRIPT)
gate_start = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_start)


def _runs_first_step(precision: pd.DataFrame, event: str = "epoch") -> dict[str, float]:
    """Each option's share of the block runs (its mean probability: ``gates_probability``), from each gated block's
    first convolution's ``event`` rows: its run options at their (activation, gradient) bits, the skip the rest."""
    rows = precision.query("event == @event and epoch == 1 and layer.str.endswith('.block.conv1')")
    blocks = rows["layer"].nunique()
    shares = rows.groupby(["act_bits", "grad_bits"])["share"].sum() / blocks
    found = {f"FW{fw}/BW{bw}": share for (fw, bw), share in shares.items()}
    return {"skip": 1.0 - sum(found.values()), **found}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_start_is_the_runs_first_step(seed, tmp_path):
    overrides = once(*TINY, "method=dfq", "method.execution=mix_all", "train.epochs=1", "train.batches_per_epoch=1")
    run(make_config(*overrides, f"seed={seed}"), tmp_path)
    precision = pd.read_csv(tmp_path / "precision.csv")
    expected = _runs_first_step(precision)
    start = gate_start.first_step(overrides, seed)
    names = ["skip", "FW2/BW6", "FW3/BW6", "FW4/BW6", "FW4/BW12", "FW6/BW8", "FW6/BW12"]
    assert list(start) == [f"choice {n}" for n in names] + [f"p {n}" for n in names]
    chosen = {n: start[f"choice {n}"] for n in names}
    assert chosen == pytest.approx({n: expected.get(n, 0.0) for n in names}, abs=1e-6)
    assert sum(start[f"p {n}"] for n in names) == pytest.approx(1.0)
    probable = _runs_first_step(precision, "gates_probability")
    assert {n: start[f"p {n}"] for n in names} == pytest.approx({n: probable.get(n, 0.0) for n in names}, abs=1e-6)
    # every gate chooses its most probable option: no option is chosen where its mean probability is zero
    assert all(start[f"p {n}"] > 0 for n in names if chosen[n] > 0)


def test_the_logit_drift_is_autograds_through_the_softmax():
    """The drift of logit b against a from the straight-through gates' gradient, against autograd on the logits."""
    torch.manual_seed(0)
    z = torch.randn(2, 5, 4, requires_grad=True)  # blocks, samples, options
    probs = z.softmax(-1)
    gates = [torch.nn.functional.one_hot(p.argmax(1), 4).float() + (p - p.detach()) for p in probs]
    for g in gates:
        g.retain_grad()
    weights = torch.randn(2, 5, 4)
    sum(((g * w) ** 2).sum() for g, w in zip(gates, weights)).backward()
    drift = gate_start.logit_drift([g.grad for g in gates], [p.detach() for p in probs], 1, 3)
    assert drift == pytest.approx((z.grad[..., 1] - z.grad[..., 3]).sum().item(), rel=1e-5)


@pytest.mark.slow
def test_the_pairs_drift_splits_the_steps_gradient_into_task_and_cost():
    overrides = once(*TINY, "method=dfq", "method.execution=mix_all", "method.beta=0.01")
    start = gate_start.first_step([*overrides, "method.target_cp=0.5"], 0, ("FW6/BW8", "FW6/BW12"))
    assert start["task drift"] != 0 and start["cost drift"] != 0
    # the cost term's sign follows cp against the target: a target above the untrained cp pushes the other way
    below = gate_start.first_step([*overrides, "method.target_cp=99"], 0, ("FW6/BW8", "FW6/BW12"))
    assert below["task drift"] == pytest.approx(start["task drift"], rel=1e-6)
    # not to the bit: the cost's gradient also reaches a gate through the later blocks' quantized backward (the
    # later gates' inputs), and a gradient quantized over its own range is not an odd function of it
    assert below["cost drift"] == pytest.approx(-start["cost drift"], rel=1e-3)


def test_a_method_without_gates_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        gate_start.main(["method=sbm", "data=synthetic", "--seeds", "0"])
    assert exit_.value.code == 2
    assert "method=sbm is not allowed here: it has no gates (choose dfq or fractrain)" in capsys.readouterr().err


def test_a_pair_outside_the_options_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        gate_start.main(["method=dfq", "data=synthetic", "--seeds", "0", "--pair", "FW6/BW8", "FW8/BW8"])
    assert exit_.value.code == 2
    assert "--pair FW6/BW8 FW8/BW8 is not allowed: both must be options of this config (skip, FW2/BW6" in \
        capsys.readouterr().err
