"""The miniatures are experiment configs: the runs of each one's sweeps are the runs its earlier script trained, so the
results that script measured (results/README.md) belong to them."""

from pathlib import Path

import pytest

from qtrain.config import digest, identity

from .conftest import make_config
from .test_run_table import run_table

# The runs of scripts/wikitext2_mini.py (removed), which measured results/fractrain_wikitext2_mini.md: its overrides
# of every run, then each run's own.
WIKITEXT2_MINI_COMMON = ["experiment=fractrain_wikitext103", "scale=mini", "data=wikitext2"]
WIKITEXT2_MINI_RUNS = [
    ["method=float32"],
    ["method=sbm", "method.grad_bits=16", "method.grad_weight_bits=16", "method.act_range=tensor"],
    ["method=pfq", "method.last_layer=quantized"],
]


def _sweep_identities(experiment: str, data: Path, out: Path) -> list[str]:
    """The identity digest of each run of ``experiment``'s sweeps at mini scale, as scripts/run_table.py fills it."""
    commands = [run_table.filled(words, data, out, "mini") for words in run_table.table_commands(experiment)]
    runs = [run for command in commands if command[0] == "qtrain" for run in run_table.expanded(command)]
    return [digest(identity(make_config(*(w for w in run[1:] if not w.startswith(("-", "hydra.")))))) for run in runs]


@pytest.mark.slow
def test_fractrain_wikitext2_trains_the_runs_of_the_wikitext2_miniature(tmp_path):
    earlier = [digest(identity(make_config(*WIKITEXT2_MINI_COMMON, f"data.root={tmp_path / 'wikitext-2'}", *run)))
               for run in WIKITEXT2_MINI_RUNS]
    assert _sweep_identities("fractrain_wikitext2", tmp_path, tmp_path / "out") == earlier
