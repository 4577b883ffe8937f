"""Text corpora for language modelling: a word- or character-level corpus of three UTF-8 files under ``data.root``
as token ids (:func:`read_corpus`), and their batch stream (:class:`TokenStream`). The namings, the tokens and the
vocabulary: docs/data.md."""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import compress, count
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from qtrain.data.base import rank_slice
from qtrain.errors import ConfigError, DataError
from qtrain.task import LANGUAGE_MODEL, Task

SPLITS = ("train", "valid", "test")
UNK, EOS = 0, 1
SPECIALS = ("<unk>", "<eos>")  # at ids UNK and EOS
# The namings a corpus's files carry, as (prefix, suffix) around the split's name; "<name>." is any prefix.
FIXED_NAMINGS = (("wiki.", ".tokens"), ("", ".txt"))
NAMED_SUFFIX = ".txt"


@dataclass
class TextData:
    """A language-modelling corpus: its vocabulary (id -> token) and each split's token ids (1-D int64)."""

    name: str
    vocab: tuple[str, ...]
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    task: Task = LANGUAGE_MODEL

    def model_inputs(self) -> dict[str, Any]:
        return {"vocab_size": len(self.vocab)}

    def streams(self, cfg: DictConfig, device: torch.device, rank: int, world: int) -> tuple[TokenStream, TokenStream]:
        """Training batches of ``train.batch_size`` rows and test batches of ``train.eval_batch_size`` rows, both
        ``model.seq_len`` tokens long (the trainer evaluates on the test split)."""
        seq_len = cfg.model.seq_len
        return (TokenStream(self.train.to(device), cfg.train.batch_size, seq_len, rank, world,
                            f"training split of {self.name}", "train.batch_size", whole_batches=True, seed=cfg.seed),
                TokenStream(self.test.to(device), cfg.train.eval_batch_size, seq_len, rank, world,
                            f"test split of {self.name}", "train.eval_batch_size"))


class TokenStream:
    """Contiguous language-model batches of one split (PyTorch's "batchify").

    The split's tokens are cut into ``rows`` rows of ``len // rows`` consecutive tokens (the remainder dropped);
    batch ``i`` holds columns ``[i*T, i*T+T)`` of every row as inputs and ``[i*T+1, i*T+T+1)`` as targets, the
    last batch shorter where the columns run out. A sample is a row: a batch holds ``rows`` samples over all ranks
    and each rank takes its :func:`~qtrain.data.base.rank_slice` of the rows. Without a ``seed`` (evaluation)
    every epoch gives the batches in order: each row is one stretch of running text, read from start to end.

    For training, ``whole_batches`` leaves the short last batch out, so every batch is ``seq_len`` tokens long:
    the cost meter charges each row the MACs profiled on a full sequence (attention's grow as its square), and
    DYNASTY's activation maps are laid out for one sequence length; and a ``seed`` shuffles the order of the
    batches in every epoch (drawn from (seed, epoch)), so that consecutive steps do not read adjacent text. A
    Transformer carries nothing from one batch to the next, so nothing is lost by it (fairseq shuffles its
    blocks too); each batch stays contiguous text.
    """

    def __init__(self, tokens: torch.Tensor, rows: int, seq_len: int, rank: int = 0, world: int = 1,
                 what: str = "split", key: str = "train.batch_size", whole_batches: bool = False,
                 seed: int | None = None) -> None:
        columns = len(tokens) // rows
        needed = seq_len + 1 if whole_batches else 2
        if columns < needed:
            raise DataError(f"the {what} holds {len(tokens)} tokens, too few for {rows} rows of at least {needed} tokens "
                            f"(lower {key}{' or model.seq_len' if whole_batches else ''})")
        self.tokens, self.rows, self.seq_len, self.columns, self.world = tokens, rows, seq_len, columns, world
        self.whole_batches, self.seed = whole_batches, seed
        self.part = tokens[:rows * columns].view(rows, columns)[rank_slice(rows, rank, world)]

    def __len__(self) -> int:
        if self.whole_batches:
            return (self.columns - 1) // self.seq_len
        return -(-(self.columns - 1) // self.seq_len)

    @property
    def samples(self) -> int:
        return self.rows * len(self)

    def global_size(self, i: int) -> int:
        return self.rows

    def smallest_part(self) -> int:
        return self.rows // self.world

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = (torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
                 if self.seed is not None else torch.arange(len(self)))
        for batch in order[start:].tolist():
            first = batch * self.seq_len
            end = min(first + self.seq_len, self.columns - 1)
            yield self.part[:, first:end], self.part[:, first + 1:end + 1]

    def example(self, n: int) -> torch.Tensor:
        """``n`` rows of ``seq_len`` tokens: the split's first tokens (repeated where it is shorter)."""
        index = torch.arange(n * self.seq_len, device=self.tokens.device) % len(self.tokens)
        return self.tokens[index].view(n, self.seq_len)


def _naming(prefix: str, suffix: str) -> str:
    return f"{prefix}{{{','.join(SPLITS)}}}{suffix}"


def find_corpus(root: str | Path) -> dict[str, Path]:
    """The files of the one complete naming under ``root``, by split."""
    root = Path(root).expanduser()
    named = sorted({p.name[:-len(f"train{NAMED_SUFFIX}")] for p in root.glob(f"?*.train{NAMED_SUFFIX}")})
    candidates = [*FIXED_NAMINGS, *((prefix, NAMED_SUFFIX) for prefix in named)]
    complete, missing = [], []
    for prefix, suffix in candidates:
        files = {split: root / f"{prefix}{split}{suffix}" for split in SPLITS}
        absent = [path.name for path in files.values() if not path.is_file()]
        if not absent:
            complete.append((_naming(prefix, suffix), files))
        elif len(absent) < len(SPLITS):
            missing.extend(absent)
    if not complete:
        looked = ", ".join([*(_naming(p, s) for p, s in FIXED_NAMINGS), _naming("<name>.", NAMED_SUFFIX)])
        lacking = f" ({', '.join(missing)} missing)" if missing else ""
        raise DataError(f"no corpus under {root}: looked for {looked}{lacking}")
    if len(complete) > 1:
        raise DataError(f"two corpora under {root}: {complete[0][0]} and {complete[1][0]} (keep one naming's files there)")
    return complete[0][1]


def _lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err.reason}") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None


def _tokens(line: str, level: str) -> Iterable[str]:
    return line.split() if level == "word" else line.rstrip("\n")


def _encode(path: Path, level: str, index: Callable[[str], int]) -> torch.Tensor:
    """Every token of the file at ``path`` as its id ``index(token)``, each line followed by ``<eos>``."""
    ids = array("q")  # 8 bytes a token: WikiText-103's 100M tokens as Python ints would take gigabytes
    for line in _lines(path):
        ids.extend(map(index, _tokens(line, level)))
        ids.append(EOS)
    return torch.from_numpy(np.frombuffer(ids, dtype=np.int64))


class _Vocabulary(dict):
    """Token -> id, and ``<unk>``'s id for a token it lacks."""

    def __missing__(self, token: str) -> int:
        return UNK


def read_corpus(root: str | Path, name: str, level: str = "word", min_count: int = 1) -> TextData:
    """The corpus under ``root`` (:func:`find_corpus`), tokenized at ``level``, with the training split's vocabulary."""
    files = find_corpus(root)
    # One pass over the training split: ids in order of first appearance, then the rare ones folded into <unk>.
    first_seen: defaultdict[str, int] = defaultdict()
    first_seen.default_factory = first_seen.__len__  # a new token gets the next id
    for special in SPECIALS:
        first_seen[special]
    train = _encode(files["train"], level, first_seen.__getitem__)
    keep = torch.bincount(train, minlength=len(first_seen)) >= min_count
    keep[:len(SPECIALS)] = True
    new_id = torch.where(keep, keep.cumsum(0) - 1, UNK)
    vocab = _Vocabulary(zip(compress(first_seen, keep.tolist()), count()))
    return TextData(name, tuple(vocab), new_id[train], _encode(files["valid"], level, vocab.__getitem__),
                    _encode(files["test"], level, vocab.__getitem__))


def first_tokens(data: TextData, sample: DictConfig | None) -> TextData:
    """``data`` itself, or its first ``sample.train`` training and ``sample.test`` test tokens (a split ``sample``
    leaves out stays whole)."""
    if sample is None:
        return data
    for name in sample:
        if sample[name] > len(getattr(data, name)):
            raise ConfigError(f"data.sample.{name}={sample[name]} is not allowed: the {name} split holds "
                              f"{len(getattr(data, name))} tokens")
    return replace(data, **{name: getattr(data, name)[:sample[name]] for name in sample})
