"""The embedded text corpus (``data=text``): Python's own documentation (``pydoc_data.topics``), tokenized as
WikiText, so a language model trains with no download; its splits are written at first use (:func:`cache_dir`).
See docs/data.md."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

from qtrain.errors import DataError
from qtrain.results import atomic_write

SHARES = {"train": 0.9, "valid": 0.05, "test": 0.05}
WORD = re.compile(r"\w+|[^\w\s]")
NAME = "pydoc"


def cache_dir() -> Path:
    """``$QTRAIN_CACHE/text`` where set, else ``$XDG_CACHE_HOME/qtrain/text``, else ``~/.cache/qtrain/text``."""
    if os.environ.get("QTRAIN_CACHE"):
        return Path(os.environ["QTRAIN_CACHE"]).expanduser() / "text"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "qtrain" / "text"


def _topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(f"data=text needs the standard library's pydoc_data, which Python {platform.python_version()} "
                        "here lacks (use data=corpus with files in data.root)") from None
    return topics


def split_topics(topics: dict[str, str]) -> dict[str, list[str]]:
    """The tokenized lines of each split: every topic's lines, whole, in the split furthest below its share."""
    lines: dict[str, list[str]] = {split: [] for split in SHARES}
    written = dict.fromkeys(SHARES, 0)
    total = 0
    for key in sorted(topics):
        tokenized = [" ".join(WORD.findall(line)) for line in topics[key].splitlines()]
        size = sum(len(line.split()) + 1 for line in tokenized)  # with each line's <eos>
        total += size
        split = max(SHARES, key=lambda s: SHARES[s] * total - written[s])
        written[split] += size
        lines[split].extend(tokenized)
    return lines


def pydoc_corpus() -> Path:
    """The folder that holds the embedded corpus's three files, written there first if need be."""
    folder = cache_dir() / f"python-{platform.python_version()}"
    paths = {split: folder / f"{NAME}.{split}.txt" for split in SHARES}
    if all(path.is_file() for path in paths.values()):
        return folder
    try:
        for split, lines in split_topics(_topics()).items():
            atomic_write(paths[split], lambda tmp, lines=lines: tmp.write_text("".join(f"{line}\n" for line in lines),
                                                                               encoding="utf-8"))
    except OSError as err:
        raise DataError(f"cannot write the embedded text corpus to {folder}: {err.strerror} "
                        "(set QTRAIN_CACHE to a writable folder)") from None
    return folder
