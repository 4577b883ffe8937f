"""The exact resumption of the authors' gated script (scripts/authors_resume.py, scripts/authors_code.py --resume):
a run stopped at an evaluation and restarted from its checkpoint in a fresh state gives the steps the uninterrupted
run gave, to the bit; the edit of their script and the log's cut at the checkpoint, on hand-written text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import authors_code  # noqa: E402
import authors_resume  # noqa: E402


class NoisyIndices(Dataset):
    """Each sample draws from its worker's generator, as their augmentation does."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(float(i)), torch.rand(())


class Meter:
    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def update(self, value: float) -> None:
        self.sum += value
        self.count += 1


def parts(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = authors_resume.ResumableLoader(DataLoader(NoisyIndices(), batch_size=3, shuffle=True, num_workers=1))
    return model, optimizer, Meter(), loader


def train(model, optimizer, meter, loader, start: int, stop: int, save_at: int | None = None,
          path: Path | None = None) -> list[tuple]:
    """Their loop's shape: passes over the loader inside a while, a stochastic draw in each step, an evaluation that
    draws from the global generator (their test loader's seed) and a checkpoint at ``save_at``."""
    steps, i = [], start
    while i < stop:
        for index, noise in loader:
            i += 1
            x = (index + noise).unsqueeze(1) + torch.rand(len(index), 1)  # stochastic rounding's draws
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter.update(loss.item())
            steps.append((i, index.tolist(), noise.tolist(), loss.item()))
            if i == save_at:
                torch.rand(5)  # the evaluation's draws
                torch.save({"iter": i, "state_dict": model.state_dict(), "best_prec1": 0.0,
                            "resume": authors_resume.run_state([optimizer], 1.5, [meter], loader)}, path)
            if i >= stop:
                break
    return steps


@pytest.mark.parametrize("save_at", [6, 8])  # inside a pass (4 batches of 10 samples) and at its end
def test_a_resumed_run_continues_the_uninterrupted_one_exactly(tmp_path: Path, save_at: int) -> None:
    path = tmp_path / "checkpoint.pth.tar"
    model, optimizer, meter, loader = parts(seed=0)
    whole = train(model, optimizer, meter, loader, 0, 13, save_at, path)

    model2, optimizer2, meter2, loader2 = parts(seed=7)  # a fresh process: other weights, other generator state
    best, best_full, start = authors_resume.restore_run(str(path), model2, [optimizer2], [meter2], loader2)
    assert (best, best_full, start) == (0.0, 1.5, save_at)
    rest = train(model2, optimizer2, meter2, loader2, start, 13)

    assert rest == whole[save_at:]
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert (meter2.sum, meter2.count) == (meter.sum, meter.count)


def test_a_run_launched_otherwise_or_an_old_checkpoint_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pth.tar"
    monkeypatch.setenv("AUTHORS_SEED", "0")
    train(*parts(seed=0), 0, 2, 2, path)
    model, optimizer, meter, loader = parts(seed=0)
    monkeypatch.setenv("AUTHORS_SEED", "1")
    with pytest.raises(SystemExit, match="'AUTHORS_SEED': '0'"):
        authors_resume.restore_run(str(path), model, [optimizer], [meter], loader)
    torch.save({"iter": 2, "state_dict": model.state_dict(), "best_prec1": 0.0}, path)
    with pytest.raises(SystemExit, match="holds no run state"):
        authors_resume.restore_run(str(path), model, [optimizer], [meter], loader)


SCRIPT = """\
def run_training(args):
    best_full_prec = 0
    i = args.start_iter
    while i < args.iters:
        save_checkpoint({
            'iter': i,
            'best_prec1':  best_prec1,
        })
"""


def test_their_script_is_edited_to_save_and_restore_the_run() -> None:
    edited = authors_resume.make_resumable(SCRIPT)
    assert edited.count("authors_resume.run_state([optimizer1, optimizer2], best_full_prec,") == 1
    assert edited.index("'best_prec1':  best_prec1,") < edited.index("'resume': authors_resume.run_state(")
    restore = edited.index("authors_resume.restore_run(")
    assert edited.index("best_full_prec = 0") < restore < edited.index("    i = args.start_iter")
    assert "*sum(layerwise_decision_statistics, [])]" in edited
    compile(edited, "train_dp_lr.py", "exec")
    with pytest.raises(ValueError, match="no line 'i = args.start_iter'"):
        authors_resume.make_resumable(SCRIPT.replace("    i = args.start_iter\n", ""))


def test_the_log_is_cut_where_the_checkpoint_was_saved() -> None:
    log = ("start training\n"
           "11-30-26 14:31:Iter: [390/3900]\tLoss 1.9 (2.1)\n"
           "Current Best Full Prec@1:  39.9\n"
           "11-30-26 14:58:Iter [390] learning rate = 0.1\n"
           "11-30-26 14:59:Iter: [400/3900]\tLoss 1.8 (2.0)\n")
    assert authors_code.log_until(log, 390) == "".join(log.splitlines(keepends=True)[:3])
    assert authors_code.log_until(log, 780) == log  # no line after the checkpoint yet: nothing to cut
