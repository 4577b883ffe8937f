"""Entry points: ``qtrain`` (the Hydra app over ``conf/``).

torch and pandas are imported only once a run starts, so ``--help`` and a bad choice answer at once.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from qtrain.config import check_overrides
from qtrain.errors import DivergedError, QtrainError


def conf_dir() -> Path:
    """The config tree: installed inside the package, or ``conf/`` beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"qtrain's config tree (conf/config.yaml) is missing beside {here}")


def result_table(summary: dict) -> str:
    """The closing table: accuracy, cost in effective MACs and as % of float32, savings."""
    import pandas as pd
    cost = summary["cost"]
    acc = summary["final"]["test_acc"]
    row = {
        "method": summary["method"], "model": summary["model"], "data": summary["data"],
        "status": summary["status"], "epochs": summary["epochs_completed"],
        "test acc %": "-" if acc is None else f"{100 * acc:.2f}",
        "cost (eff. MACs)": f"{cost['effective_macs']:.3e}",
        "% of float32": f"{cost['percent_of_float32']:.2f}",
        "savings %": f"{cost['savings_percent']:.2f}",
    }
    return pd.DataFrame([row]).to_string(index=False)


def _task(cfg: DictConfig) -> None:
    from qtrain.run import run

    hydra_cfg = HydraConfig.get()
    try:
        summary = run(cfg, hydra_cfg.runtime.output_dir)
    except QtrainError as err:
        print(f"qtrain: error: {err}", file=sys.stderr)
        if isinstance(err, DivergedError) and hydra_cfg.mode == RunMode.MULTIRUN:
            return  # recorded in the job's summary.json; the other jobs of the sweep go on
        sys.exit(err.exit_code)
    print(result_table(summary))
    print(f"results: {hydra_cfg.runtime.output_dir}")


def main() -> None:
    """``qtrain``: check group choices, then hand over to Hydra."""
    configs = conf_dir()
    try:
        check_overrides(sys.argv[1:], configs)
    except QtrainError as err:
        print(f"qtrain: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    logging.getLogger("torch._inductor").setLevel(logging.ERROR)
    hydra.main(config_path=str(configs), config_name="config", version_base="1.3")(_task)()


if __name__ == "__main__":
    main()
