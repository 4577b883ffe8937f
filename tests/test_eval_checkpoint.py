"""scripts/eval_checkpoint.py: a finished run's checkpoint, evaluated again, gives the run's own last test accuracy."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import make_config

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_checkpoint.py"
spec = importlib.util.spec_from_file_location("eval_checkpoint", SCRIPT)
eval_checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sbm", "dfq"])
def test_the_checkpoint_gives_the_runs_last_test_accuracy(method, tmp_path):
    from qtrain.run import run

    cfg = make_config("experiment=fractrain_table3", "scale=smoke", "model=resnet20", f"method={method}")
    run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # as a run made before the keys added since recorded its config: without them, at the value it ran at
    assert summary["config"]["train"].pop("eval_every") == 1
    if method == "dfq":
        assert summary["config"]["method"].pop("cp_gemms") == "all"
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    row = eval_checkpoint.evaluate(tmp_path)
    assert (row["method"], row["model"]) == (method, "resnet20")
    assert row["test"] == summary["final"]["test_acc"]  # the gates and quantizers as the run left them
    assert 0.0 <= row["train (eval mode)"] <= 1.0
