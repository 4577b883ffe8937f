"""scripts/gate_start.py: the gates' start it prints is what a run of the same config and seed chose at its first step,
read back from the run's own precision.csv (one batch an epoch: the epoch's mean shares are the first step's)."""

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from qtrain.run import run
from tests.conftest import TINY, make_config, once

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gate_start.py"
spec = importlib.util.spec_from_file_location("gate_start", SCRIPT)
gate_start = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_start)


def _runs_first_step(precision: pd.DataFrame) -> dict[str, float]:
    """Each option's share of the block runs, from each gated block's first convolution's epoch rows: its run options
    at their (activation, gradient) bits, the skip the rest."""
    rows = precision.query("event == 'epoch' and epoch == 1 and layer.str.endswith('.block.conv1')")
    blocks = rows["layer"].nunique()
    shares = rows.groupby(["act_bits", "grad_bits"])["share"].sum() / blocks
    found = {f"FW{fw}/BW{bw}": share for (fw, bw), share in shares.items()}
    return {"skip": 1.0 - sum(found.values()), **found}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_the_start_is_the_runs_first_step(seed, tmp_path):
    overrides = once(*TINY, "method=dfq", "method.execution=mix_all", "train.epochs=1", "train.batches_per_epoch=1")
    run(make_config(*overrides, f"seed={seed}"), tmp_path)
    expected = _runs_first_step(pd.read_csv(tmp_path / "precision.csv"))
    start = gate_start.first_step_shares(overrides, seed)
    assert list(start) == ["skip", "FW2/BW6", "FW3/BW6", "FW4/BW6", "FW4/BW12", "FW6/BW8", "FW6/BW12"]
    assert sum(start.values()) == pytest.approx(1.0)
    assert start == pytest.approx({name: expected.get(name, 0.0) for name in start}, abs=1e-6)


def test_a_method_without_gates_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        gate_start.main(["method=sbm", "data=synthetic", "--seeds", "0"])
    assert exit_.value.code == 2
    assert "method=sbm is not allowed here: it has no gates (choose dfq or fractrain)" in capsys.readouterr().err
