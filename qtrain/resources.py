"""Where qtrain's data files lie: the config tree and the published tables, inside the installed package or
beside it in a source checkout. Imports nothing of qtrain, so any module may ask it."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """The config tree: installed inside the package, or ``conf/`` beside it in a source checkout."""
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"qtrain's config tree (conf/config.yaml) is missing beside {_PACKAGE}")


def paper_dir() -> Path:
    """The transcribed tables: installed inside the package, or ``results/paper/`` in a source checkout."""
    for candidate in (_PACKAGE / "paper", _PACKAGE.parent / "results" / "paper"):
        if candidate.is_dir() and any(candidate.glob("*.csv")):
            return candidate
    raise FileNotFoundError(f"the paper tables (results/paper/*.csv) are missing beside {_PACKAGE}")
