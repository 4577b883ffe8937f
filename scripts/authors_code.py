"""Run the FracTrain authors' own ``train_base.py`` (or, with ``--dfq``, their DFQ script) on this machine's CPU and
data, and tabulate its log per epoch.

qtrain's static FW6/BW8 ResNet-38 runs leave the authors' published log from epoch 3 on
(``results/reference_runs/``). Running the authors' code on the same data copy and machine tells the two causes
apart: if their code leaves their own log the same way, the data copy or the machine moves the curve; if it stays on
the log, qtrain departs from their code.

    python scripts/authors_code.py GIT_DIR --data DATA --out OUT [--iters 1950] [--seed 0] [--fc-init torch] [--dfq]
    python scripts/authors_code.py GIT_DIR --data DATA --out OUT --dfq --iters 3900 --seed 0 --resume  # after a kill
    python scripts/authors_code.py GIT_DIR --data DATA --out OUT --dfq --iters 4680 --start-from CHECKPOINT  # crossover
    python scripts/authors_code.py --log OUT/authors_code_seed0.log --csv FILE [--dfq]   # tabulate only

GIT_DIR is a git directory of the Tubbz-alt/FracTrain snapshot (as for ``scripts/reference_curves.py``); DATA holds
``cifar-10-batches-py/``. Nothing of the authors' code is part of qtrain: the script takes their
``fractrain_cifar`` files from GIT_DIR (``git archive``) into ``OUT/code`` when it runs, and starts their
``train_base.main()`` with ``--num_bits 6 --num_grad_bits 8`` (the log's run; ``--num-bits``/``--num-grad-bits``
for others) through a launcher of ours that makes it run where it was not written to:

- ``.cuda()`` on tensors and modules returns them unchanged (the code calls it unconditionally; no GPU here);
- torchvision's CIFAR md5 checks pass (an offline copy's files are not the originals), and batches pickled with
  ``bytes`` keys (as qtrain reads either) are rewritten with ``str`` keys into ``OUT/data``, as torchvision reads them;
- ``util_swa.py``'s ``.cuda(async=True)`` (a syntax error since Python 3.7) becomes ``.cuda()`` (SWA is off);
- one torch thread and one loader worker (``--threads``), the seed set for torch, NumPy and ``random`` first;
- ``--fc-init torch``: the classifier re-initialized as torch initializes ``nn.Linear`` (qtrain's choice; the
  authors' code draws it from N(0, 2/(in*out))), to test that difference alone.

``--dfq`` runs the script that wrote the published DFQ and FracTrain logs, ``train_dp_lr.py`` (their warnings' line
numbers are its), as the DFQ log's run: ``--arch cifar10_rnn_gate_38 --target_ratio 3 --weight_bits 4``. The released
script and model do not run together as they are: the script prices a skip option first (its costs start with 0,
the gate has one output more than the run options) while the gated model's forward has that candidate's line
commented out and mixes only the run options, so the first step fails on the missing mask. The launcher restores the
line (:func:`restore_skip`: the block's input as the first candidate, mixed with the others) and sets the script's
run options to the log's four, FW4/BW6, FW6/BW8, FW6/BW12 and FW8/BW16 (the released list has five, with an
FW8/BW8 the log's gates never show). The log is then tabulated as the published gated logs are: the curve and, per
evaluation, each gated block's option shares (``OUT/<name>_gates.csv``).

``--start-from CHECKPOINT`` (with ``--dfq``) trains on from a model checkpoint (``scripts/crossover.py
to-authors`` writes one from a qtrain run) through their script's own ``--resume FILE --proceed True``: the model
only, with fresh optimizers and log averages, counting iterations on from the checkpoint's.

A DFQ run resumes exactly: ``--resume`` (the same arguments otherwise) continues the run in OUT from its last
evaluation, every 390 iterations, as if it had not stopped (same batches, same random draws, same printed averages),
with the code it was started with (``OUT/code``, not extracted again).
The released script's checkpoints hold the model only; ``scripts/authors_resume.py`` edits it at extraction to save
and restore the rest (its docstring says how), and the run's output is cut back to that evaluation and continued.

The run's whole output, ``OUT/<name>.log`` (the log's lines and what the script prints besides, the gates' shares
among them, as in the published logs, which are such captures; ``OUT/save/<arch>/log_train.txt`` holds the log's
lines only), is tabulated by ``scripts/reference_curves.py``'s own reader into ``OUT/<name>.csv``, the same columns
as ``results/reference/``'s CSVs of the published logs.

``--check-layers`` (with GIT_DIR, ``--data`` and ``--out``) compares the two implementations instead of training:
qtrain's SBM ResNet-38 (FW6/BW8, global activation range, classifier in float32) and the authors' model with the
same weights, on the first 128 training images in training mode: the first convolution's output, the weights'
and an activation's quantized levels, and one layer at a time the input and weight gradients for one upstream
gradient, with both sides' gradient rounding set to nearest (stochastic rounding draws differ by design).
``--check-gates`` does the same for DFQ (cp 3 %, 4-bit weights, every option run for every sample) against their
gated ResNet-38 (``cifar10_rnn_gate_38``), block by block on the same inputs, forward and backward: see
:func:`check_gates`.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import authors_resume  # noqa: E402
from reference_curves import DEFAULT_COMMIT, SKIP_SET, Run, epoch_table, gate_table, parse_log  # noqa: E402

CODE = "fractrain_cifar"
FILES = [f"{CODE}/{name}" for name in ("train_base.py", "train_dp_lr.py", "models.py", "data.py", "util_swa.py",
                                        "modules")]
DFQ_OPTIONS = SKIP_SET[1:]  # the DFQ log's run options (activation, gradient bits); the skip comes first
DFQ_TARGET_CP, DFQ_WEIGHT_BITS = 3, 4  # the DFQ log's run
CIFAR = "cifar-10-batches-py"
LAUNCHER = '''"""qtrain's launcher of the FracTrain authors' training scripts on a CPU (written by scripts/authors_code.py)."""
import importlib, os, random, sys
import numpy as np
import torch, torchvision
import torchvision.datasets.cifar as cifar

torch.set_num_threads(int(os.environ["AUTHORS_THREADS"]))
torch.Tensor.cuda = lambda self, *a, **k: self
torch.nn.Module.cuda = lambda self, *a, **k: self
cifar.check_integrity = lambda *a, **k: True
torchvision.datasets.CIFAR10._check_integrity = lambda self: True
seed = int(os.environ["AUTHORS_SEED"])
torch.manual_seed(seed); random.seed(seed); np.random.seed(seed)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fractrain_cifar"))
script = importlib.import_module(os.environ["AUTHORS_SCRIPT"])
import authors_resume, models
script.authors_resume = authors_resume
_prepare_train_data = script.prepare_train_data
script.prepare_train_data = lambda *a, **k: authors_resume.ResumableLoader(_prepare_train_data(*a, **k))
arch = os.environ["AUTHORS_ARCH"]
if os.environ.get("AUTHORS_FC_INIT") == "torch":
    _build = getattr(models, arch)
    def _torch_fc(*a, **k):
        m = _build(*a, **k)
        m.fc.reset_parameters()
        return m
    setattr(models, arch, _torch_fc)
if os.environ.get("AUTHORS_OPTIONS"):  # the gated script's run options, "FW/BW FW/BW ..."
    options = [tuple(int(b) for b in o.split("/")) for o in os.environ["AUTHORS_OPTIONS"].split()]
    script.bits, script.grad_bits = [o[0] for o in options], [o[1] for o in options]
sys.argv = [script.__name__ + ".py"] + sys.argv[1:]
script.main()
'''


def extract_code(git_dir: Path, commit: str, out: Path) -> Path:
    """The authors' files, from the snapshot into ``out/code``, with the one line Python 3 cannot parse mended."""
    code = out / "code"
    code.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", commit, *FILES], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    swa = code / CODE / "util_swa.py"
    swa.write_text(swa.read_text().replace(".cuda(async=True)", ".cuda()"))
    models = code / CODE / "models.py"
    models.write_text(restore_skip(models.read_text()))
    gated = code / CODE / "train_dp_lr.py"
    gated.write_text(authors_resume.make_resumable(gated.read_text()))
    (code / "authors_resume.py").write_text(Path(authors_resume.__file__).read_text())
    (code / "launch.py").write_text(LAUNCHER)
    return code


SKIP_EDITS = [("# output_candidates.append(prev)", "output_candidates.append(prev)"),
              ("if bits[k] == 0:", "if False:  # qtrain's launcher: 0 bits runs the block in float32"),
              ("for j in range(len(bits)):", "for j in range(len(bits) + 1):"),
              ("for k in range(len(bits))])", "for k in range(len(bits) + 1)])")]


def restore_skip(models_text: str) -> str:
    """The authors' ``models.py`` with the gated ResNet's skip candidate restored (see ``--dfq`` above): in
    ``ResNetRecurrentGateSP.forward``, the commented-out line that puts the block's input first among the candidates
    made live, the mask's and the mixture's loops over one candidate more, and a run option of 0 bits run in float32
    (their convolution's meaning of 0 bits) where the released forward made it a skip: the script's full-precision
    evaluation passes 0 bits for every run option, and the logs' full-precision test top-1 (39.94 % at the DFQ log's
    first evaluation, against 38.89 % quantized) is a network's, not a stack of skips'. Each edit is made once, at its
    first place after the class statement; a text without one of them is refused."""
    head, found, body = models_text.partition("class ResNetRecurrentGateSP")
    if not found:
        raise ValueError("models.py has no class ResNetRecurrentGateSP")
    for old, new in SKIP_EDITS:
        if old not in body:
            raise ValueError(f"models.py's ResNetRecurrentGateSP has no line {old!r} to restore the skip with")
        body = body.replace(old, new, 1)
    return head + found + body


def str_keyed_copy(data: Path, out: Path) -> Path:
    """``data`` itself if torchvision can read its CIFAR-10 batches, else a copy under ``out/data`` with str keys."""
    batches = sorted((data / CIFAR).glob("*_batch*")) + [data / CIFAR / "batches.meta"]
    with open(batches[0], "rb") as f:
        if "data" in pickle.load(f, encoding="latin1"):
            return data
    target = out / "data" / CIFAR
    target.mkdir(parents=True, exist_ok=True)
    for path in batches:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="bytes")
        entry = {key.decode() if isinstance(key, bytes) else key: value for key, value in entry.items()}
        if "label_names" in entry:
            entry["label_names"] = [n.decode() if isinstance(n, bytes) else n for n in entry["label_names"]]
        with open(target / path.name, "wb") as f:
            pickle.dump(entry, f)
    return out / "data"


def log_until(text: str, iteration: int) -> str:
    """A run's captured output as it stood when its checkpoint at ``iteration`` was saved: the lines after it (a
    stopped run's unfinished epoch) are dropped, so that the resumed run's output continues it. The first line the
    script writes after saving is its learning rate for the iteration after."""
    head, found, _ = text.partition(f"Iter [{iteration}] learning rate")
    return head[: head.rfind("\n") + 1] if found else text


def tabulate(log: Path, csv: Path, bits: tuple[int, int], dfq: bool = False) -> None:
    """The log per epoch (390 iterations), as ``scripts/reference_curves.py`` tabulates the published ones; a DFQ
    run's gates beside, in ``<csv stem>_gates.csv``, and printed as each stage's share of block runs skipped."""
    if dfq:
        run = Run(str(log), csv.stem, f"DFQ cp {DFQ_TARGET_CP} %, {DFQ_WEIGHT_BITS}-bit weights",
                  "the authors' train_dp_lr.py on this machine", target_cp=float(DFQ_TARGET_CP), options=SKIP_SET)
    else:
        run = Run(str(log), csv.stem, f"static FW{bits[0]}/BW{bits[1]}", "the authors' train_base.py on this machine",
                  bits=bits)
    parsed = parse_log(log.read_text())
    if not parsed.evals:
        print(f"{log}: no evaluation yet (one comes every 390 iterations)")
        return
    if dfq and not any(parsed.decisions.values()):
        raise SystemExit(f"{log}: no gate shares (layerN_decision); the DFQ script prints them: tabulate its whole "
                         "output (OUT/<name>.log), not save/<arch>/log_train.txt")
    table = epoch_table(parsed, run)
    csv.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(csv, index=False)
    shown = ["epoch", "train_loss", "train_acc", "test_acc", "test_loss"]
    if dfq:
        gates = gate_table(parsed, run)
        gates.to_csv(csv.with_name(f"{csv.stem}_gates.csv"), index=False)
        skipped = gates.pivot_table(index="epoch", columns="stage", values="opt0_skip").round(3)
        skipped.columns = [f"skipped: layer{stage}" for stage in skipped.columns]
        table = table.merge(skipped, left_on="epoch", right_index=True)
        shown += ["cp", *skipped.columns]
    print(table[shown].to_string(index=False))


def _nearest_gradients(model: Any, their_quantize: Any) -> None:
    """Both sides' gradient rounding to nearest: stochastic rounding's draws differ between the codes by design."""
    their_quantize.quantize_grad.__defaults__ = tuple(False if d is True else d
                                                     for d in their_quantize.quantize_grad.__defaults__)
    for layer in model.modules():
        grad = getattr(getattr(layer, "quant", None), "grad", None)
        if grad is not None:
            grad.rounding = "nearest"


def check_layers(code: Path, data: Path) -> None:
    """qtrain's quantized ResNet-38 against the authors' on one batch, forward and layer by layer backward."""
    import torch.nn.functional as F

    from qtrain.config.command_line import compose_config
    from qtrain.data.vision import load_cifar
    from qtrain.methods import build_method
    from qtrain.models import build_model
    from qtrain.resources import conf_dir

    torch.Tensor.cuda = lambda self, *a, **k: self
    sys.path.insert(0, str(code / CODE))
    import models
    import modules.quantize as theirs_quantize

    models.ACT_FW = models.ACT_BW = models.GRAD_ACT_ERROR = models.GRAD_ACT_GC = models.WEIGHT_BITS = 0
    models.MOMENTUM = 0.9
    torch.manual_seed(0)
    cfg = compose_config(conf_dir(), ["method=sbm", "method.weight_bits=6", "method.act_bits=6", "method.grad_bits=8",
                                      "method.act_range=tensor", "method.last_layer=float32"])
    ours = build_method(cfg.method).prepare(build_model("resnet38", in_channels=3, num_classes=10, input_size=(32, 32)))
    theirs = models.cifar10_resnet_38()
    names = {}
    for key in ours.state_dict():
        found = re.match(r"layer(\d)\.(\d+)\.(.*)", key)
        names[key] = _their_block_state(6 * (int(found[1]) - 1) + int(found[2]), found[3]) if found else key
    their_state = theirs.state_dict()
    theirs.load_state_dict({**their_state, **{names[k]: v for k, v in ours.state_dict().items() if names[k] in their_state}})
    cifar = load_cifar(data, 10)  # qtrain's own reader and normalization: the batch a qtrain run would see unaugmented
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (cifar.mean, cifar.std))
    x = (cifar.train.images[:128].float() / cifar.pixel_max - mean) / std
    ours.train()
    theirs.train()
    print("first convolution's output, max |ours - theirs|:", (ours.conv1(x) - theirs.conv1(x, 6, 8)).abs().max().item())
    stem = F.relu(ours.bn1(ours.conv1(x)))
    block, their_block = ours.layer1[0], theirs.group1_layer0
    weight = block.conv1.weight.detach()
    their_weight = theirs_quantize.quantize(weight, qparams=theirs_quantize.calculate_qparams(
        weight, num_bits=6, flatten_dims=(1, -1), reduce_dim=None))
    print("block 1.0 conv1 weight levels differing:", (block.conv1.quant.weight(weight) != their_weight).sum().item(),
          "of", weight.numel())
    inner = F.relu(block.bn1(block.conv1(stem)))
    differing = (block.conv2.quant.act(inner) != their_block.conv2.quantize_input_fw(inner, 6)).sum().item()
    print("block 1.0 conv2 input levels differing:", differing, "of", inner.numel())
    _nearest_gradients(ours, theirs_quantize)
    torch.manual_seed(1)
    for ours_name, their_name in (("conv1", "conv1"), ("layer1.0.conv1", "group1_layer0.conv1"),
                                  ("layer2.0.shortcut.0", "group2_layer0.downsample")):
        mine, yours = dict(ours.named_modules())[ours_name], dict(theirs.named_modules())[their_name]
        given = torch.randn(64, mine.in_channels, 16, 16)
        given = given if mine.in_channels == 3 else torch.relu(given)
        a, b = given.clone().requires_grad_(), given.clone().requires_grad_()
        out_a, out_b = mine(a), yours(b, 6, 8)
        upstream = torch.randn_like(out_a) * 1e-3
        out_a.backward(upstream)
        out_b.backward(upstream)
        print(f"{ours_name}: forward max |diff| {(out_a - out_b).abs().max().item():.3g}, input gradient relative "
              f"difference {((a.grad - b.grad).norm() / b.grad.norm()).item():.2e}, weight gradient "
              f"{((mine.weight.grad - yours.weight.grad).norm() / yours.weight.grad.norm()).item():.2e}")


def _their_block(b: int) -> str:
    """The authors' name of ResNet-38's residual block ``b`` (0-17)."""
    return f"group{b // 6 + 1}_layer{b % 6}"


def _their_gate(b: int) -> str:
    """The authors' name of the gate that decides block ``b``: the one before the first block, else the one after
    block ``b - 1``."""
    return "gate_layer1" if b == 0 else f"group{(b - 1) // 6 + 1}_gate{(b - 1) % 6}"


def _their_block_state(b: int, rest: str) -> str:
    """The authors' name of block ``b``'s state entry ``rest`` (qtrain's name within the block)."""
    return f"{_their_block(b)}." + rest.replace("shortcut.0", "downsample").replace("shortcut.1", "bn3")


def _their_gated_names(ours: dict) -> dict[str, str]:
    """qtrain's DFQ ResNet-38 state names -> the authors' gated ResNet-38's (``cifar10_rnn_gate_38``)."""
    lstm = {"weight_ih": "weight_ih_l0", "weight_hh": "weight_hh_l0", "bias_ih": "bias_ih_l0", "bias_hh": "bias_hh_l0"}
    names = {}
    for key in ours:
        found = re.match(r"layer(\d)\.(\d+)\.(block|embed)\.(.*)", key)
        if found:
            stage, index, part, rest = found.groups()
            b = 6 * (int(stage) - 1) + int(index)
            if part == "embed":  # their gate: pool, conv, ReLU, conv; ours: conv, ReLU, conv
                names[key] = f"{_their_gate(b)}.{int(rest[0]) + 1}{rest[1:]}"
            else:
                names[key] = _their_block_state(b, rest)
        elif key.startswith("gate_controller.cell."):
            names[key] = "control.rnn_one." + lstm[key.rsplit(".", 1)[1]]
        elif key.startswith("gate_controller.proj."):
            names[key] = key.replace("gate_controller", "control")
        else:
            names[key] = key
    return names


GATE_CHECK = ["experiment=fractrain_table3", "model=resnet38", "data=cifar10", "method=dfq", "method.target_cp=3",
              "method.weight_bits=4", "method.execution=mix_all"]  # the DFQ reference run's settings


def dfq_resnet38(cfg: Any) -> tuple[Any, Any]:
    """qtrain's DFQ method of ``cfg`` and the CIFAR-10 ResNet-38 it has prepared."""
    from qtrain.methods import build_method
    from qtrain.models import build_model

    method = build_method(cfg.method)
    return method, method.prepare(build_model("resnet38", cfg.model, in_channels=3, num_classes=10, input_size=(32, 32)))


def _gated_pair(their_models: Any, cfg: Any, seed: int, sample: Any) -> tuple[Any, Any, Any]:
    """qtrain's DFQ method and model, built after seeding torch with ``seed`` and profiled on ``sample``, and the
    authors' gated ResNet-38 holding the same weights; both in training mode."""
    torch.manual_seed(seed)
    method, ours = dfq_resnet38(cfg)
    ours.eval()
    method.profile(ours, sample)  # in evaluation: no batch-norm update
    theirs = their_models.cifar10_rnn_gate_38(False, proj_dim=len(cfg.method.options))
    names, state = _their_gated_names(ours.state_dict()), theirs.state_dict()
    theirs.load_state_dict({names[k]: v.clone() for k, v in ours.state_dict().items() if names[k] in state}, strict=False)
    return method, ours.train(), theirs.train()


def _block_inputs(method: Any, model: Any, x: Any, y: Any) -> tuple[dict, float]:
    """Each gated block's input in one training forward of ``model``, and the cost term its method's loss adds."""
    import torch.nn.functional as F

    from qtrain.methods import StepInfo

    inputs: dict = {}
    hooks = [block.register_forward_pre_hook(lambda m, args, kept=inputs: kept.__setitem__(m, args[0].detach()))
             for block in method.blocks]
    task_loss = F.cross_entropy(model(x), y)
    term = (method.loss(task_loss, StepInfo(0, 0, len(x))) - task_loss).item()
    for hook in hooks:
        hook.remove()
    return inputs, term


def _their_cost_term(choices: Any, options: list[tuple[int, int]], weight_bits: int, target: float,
                     beta: float) -> tuple[Any, float]:
    """The cost term of ``choices`` (blocks, samples, options) as train_dp.py prices it: an option's forward, error and
    weight-gradient GEMMs at (act x weight, grad x weight, act x grad) bits over 32 x 32 each, every block alike,
    signed by whether the batch's cp reaches ``target``; with that cp. The term keeps ``choices``' gradient."""
    price = torch.tensor([(weight_bits * (a + g) + a * g) / 1024 for a, g in options])
    cost = (choices.sum(1) * price).sum()
    cp = cost.item() / choices.shape[1] / (3 * choices.shape[0]) * 100
    return (1 if cp >= target else -1) * beta * cost, cp


def _compare_block(b: int, block: Any, theirs: Any, given: Any, act_bits: list[int], weight_bits: int,
                   their_quantize: Any) -> dict[str, float]:
    """Block ``b`` on both sides, on the same input: its first convolution's input levels at each run option and its
    weight levels (counts differing and compared), the skip path, the gate's embedding and the choice from it."""
    import torch.nn.functional as F

    their_block = getattr(theirs, _their_block(b))
    conv, their_conv = block.block.conv1, their_block.conv1
    found = {"levels": 0, "values": 0, "weight_levels": 0, "weights": conv.weight.numel(), "skip": 0.0}
    for bits in act_bits:
        mine = conv.quant.act(given, torch.full((len(given),), float(bits)))
        found["values"] += mine.numel()
        found["levels"] += int((mine != their_conv.quantize_input_fw(given, bits)).sum())
    qparams = their_quantize.calculate_qparams(conv.weight, num_bits=weight_bits, flatten_dims=(1, -1), reduce_dim=None)
    found["weight_levels"] = int((conv.quant.weight(conv.weight) != their_quantize.quantize(conv.weight, qparams=qparams)).sum())
    if block.skip_by_projection:
        yours = their_block.bn3(their_block.downsample(given, 0, 0))
        found["skip"] = (block.block.projection(given) - yours).abs().max().item()
    embedding = getattr(theirs, _their_gate(b))(given).flatten(1)
    found["embedding"] = (block.embed(F.adaptive_avg_pool2d(given, 1)).flatten(1) - embedding).abs().max().item()
    block.shared[0].reset()  # the first step of both recurrences, from the same embedding
    theirs.control.hidden_one = theirs.control.init_hidden(len(given))
    mine = block.shared[0](embedding).argmax(1)
    found["flipped"] = int((mine != theirs.control(embedding).flatten(1).argmax(1)).sum())  # theirs: one-hot gates
    return found


def _block_backward(block: Any, their_block: Any | None, b: int, given: Any, hard: Any) -> dict:
    """Block ``b`` under ``mix_all`` on ``given``, every option run and mixed by the gates ``hard`` (one-hot, the
    probabilities' gradient passed straight through), backward from a random upstream gradient drawn from
    the generator seeded ``b`` (so every call on block ``b`` draws the same): the output, the gradients of the
    input, of the probabilities (each option's output against that upstream gradient) and of the block's weights
    (qtrain's names). Option 0 is the skip, as in the check's option set. With ``their_block`` the authors' block
    runs instead, mixed as their model's forward mixes it (the skip option's output: the input, or the float32
    projection and its batch norm)."""
    x = given.clone().requires_grad_()
    probs = torch.full_like(hard, 1 / hard.shape[1]).requires_grad_()
    gates = hard - probs.detach() + probs
    if their_block is None:
        block.zero_grad()
        y = block._mix_all(x, gates)
    else:
        their_block.zero_grad()
        skip = their_block.bn3(their_block.downsample(x, 0, 0)) if block.skip_by_projection else x
        outputs = [skip] + [their_block(x, a, g) for a, g in block.option_bits.int().tolist()]
        y = sum(gates[:, k].view(-1, 1, 1, 1) * out for k, out in enumerate(outputs))
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(b)) * 1e-3)
    if their_block is None:
        weights = {key: w.grad for key, w in block.block.named_parameters()}
    else:
        theirs = dict(their_block.named_parameters())
        weights = {key: theirs[_their_block_state(b, key).split(".", 1)[1]].grad for key, _ in block.block.named_parameters()}
    return {"output": y.detach(), "input": x.grad, "gates": probs.grad,
            "weights": torch.cat([w.flatten() for w in weights.values() if w is not None])}


def _relative(mine: Any, yours: Any) -> float:
    """``|mine - yours| / |yours|`` (0 where both are zero)."""
    if yours.norm() == 0:
        return float("inf") if mine.norm() > 0 else 0.0
    return ((mine - yours).norm() / yours.norm()).item()


def _compare_block_backward(b: int, block: Any, theirs: Any, given: Any, choices: Any) -> tuple[dict, dict]:
    """Block ``b``'s backward on both sides, on the same input, gates (one-hot at ``choices``) and random upstream
    gradient, both sides' gradient rounding at nearest: the relative differences of the output and of the input's,
    the gates' and the weights' gradients; and the floor near-ties set, qtrain against itself on the input scaled by
    1 + 2**-22, 2**-20, 2**-18 and 2**-16 (every value moved by under 16 millionths: a level moves only where it was
    that near a rounding boundary), the largest of the four."""
    import torch.nn.functional as F

    their_block = getattr(theirs, _their_block(b))
    hard = F.one_hot(choices, block.option_bits.shape[0] + 1).float()
    ours = _block_backward(block, None, b, given, hard)
    yours = _block_backward(block, their_block, b, given, hard)
    nudged = [_block_backward(block, None, b, given * (1 + 2.0 ** -e), hard) for e in (22, 20, 18, 16)]
    return ({part: _relative(ours[part], yours[part]) for part in ours},
            {part: max(_relative(n[part], ours[part]) for n in nudged) for part in ours})


def _backward_summary(backward: Sequence[dict], floor: Sequence[dict]) -> str:
    """The blocks' backward differences, largest over the blocks whose outputs agree to the bit and over the rest,
    beside qtrain's against itself on the nudged input, largest over all blocks."""
    same = [f for f in backward if f["output"] == 0]
    other = [f for f in backward if f["output"] != 0]

    def largest(found: Sequence[dict]) -> str:
        return ", ".join(f"{part} {max(f[part] for f in found):.1e}" for part in ("input", "gates", "weights"))

    return (f"blocks under mix_all, relative differences of the gradients: in the {len(same)} blocks whose outputs "
            f"agree to the bit {largest(same) if same else '-'}; in the {len(other)} others (output up to "
            f"{max((f['output'] for f in other), default=0):.1e}) {largest(other) if other else '-'}; qtrain against "
            f"itself on the nudged input {largest(floor)} (output up to {max(f['output'] for f in floor):.1e})")


def check_gates(code: Path, data: Path) -> None:
    """qtrain's DFQ ResNet-38 (cp 3 %, 4-bit weights, every option run for every sample) against the authors' gated
    ResNet-38 with the same weights, block by block on the same inputs (one training forward of qtrain's on 32 training
    images gives each block's input), for four initial seeds: each option's quantized input and weight levels of the
    block's first convolution, a downsampling block's skip path, the gate's embedding and the choices from it, the
    cost term of qtrain's choices priced as their script prices them, and each block's backward under mix_all with
    qtrain's gates (:func:`_compare_block_backward`). The whole models' outputs are not compared:
    a near-tie that the two round one level apart (qtrain multiplies by the step's inverse, theirs divides) moves the
    batch norm's statistics and the next quantizer's batch-wide range, and with them most later levels."""

    from qtrain.config.command_line import compose_config
    from qtrain.data.vision import load_cifar
    from qtrain.resources import conf_dir

    torch.Tensor.cuda = lambda self, *a, **k: self
    sys.path.insert(0, str(code / CODE))
    import models
    import modules.quantize as their_quantize

    cfg = compose_config(conf_dir(), GATE_CHECK)
    options = [tuple(o) for o in cfg.method.options]
    models.WEIGHT_BITS = cfg.method.weight_bits  # read when their layers are built
    cifar = load_cifar(data, 10)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (cifar.mean, cifar.std))
    x = (cifar.train.images[:32].float() / cifar.pixel_max - mean) / std
    y = cifar.train.labels[:32].long()
    print(f"options {options}; 32 training images, training mode")
    for seed in range(4):
        method, ours, theirs = _gated_pair(models, cfg, seed, x[:2])
        inputs, ours_term = _block_inputs(method, ours, x, y)
        choices = torch.stack([block.gates.detach() for block in method.blocks])  # (blocks, samples, options)
        term = _their_cost_term(choices, options, cfg.method.weight_bits, cfg.method.target_cp,
                                cfg.method.beta)[0].item()
        with torch.no_grad():
            found = [_compare_block(b, block, theirs, inputs[block], [a for a, _ in options[1:]],
                                    cfg.method.weight_bits, their_quantize) for b, block in enumerate(method.blocks)]
        total = {key: sum(f[key] for f in found) for key in ("levels", "values", "weight_levels", "weights", "flipped")}
        _nearest_gradients(ours, their_quantize)
        backward, floor = zip(*(_compare_block_backward(b, block, theirs, inputs[block], choices[b].argmax(1))
                                for b, block in enumerate(method.blocks)))
        print(f"seed {seed}: {(choices.argmax(2) > 0).float().mean().item():.0%} of block runs not skipped at the "
              f"first step; first convolutions' input levels differing: {total['levels']} of {total['values']} "
              f"({len(options) - 1} options), weight levels {total['weight_levels']} of {total['weights']}; skip paths "
              f"max |diff| {max(f['skip'] for f in found):.1e}; gate embeddings max |diff| "
              f"{max(f['embedding'] for f in found):.1e}; gate choices from them differing: {total['flipped']} of "
              f"{len(x) * len(found)}; cost term {ours_term:+.6f} (qtrain) / {term:+.6f} (theirs, of qtrain's choices); "
              + _backward_summary(backward, floor))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("git_dir", type=Path, nargs="?", help="git directory of the Tubbz-alt/FracTrain snapshot")
    ap.add_argument("--commit", default=DEFAULT_COMMIT)
    ap.add_argument("--data", type=Path, help="the folder holding cifar-10-batches-py/")
    ap.add_argument("--out", type=Path, help="a folder for the code, the run and its CSV")
    ap.add_argument("--iters", type=int, default=1950, help="iterations to train (390 an epoch; default 5 epochs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-bits", type=int, default=6)
    ap.add_argument("--num-grad-bits", type=int, default=8)
    ap.add_argument("--fc-init", choices=("authors", "torch"), default="authors")
    ap.add_argument("--dfq", action="store_true", help="run (or tabulate) the DFQ log's run of train_dp_lr.py")
    ap.add_argument("--resume", action="store_true",
                    help="with --dfq: continue the run in OUT exactly from its last evaluation (after a kill)")
    ap.add_argument("--start-from", type=Path, metavar="CHECKPOINT",
                    help="with --dfq: train on from CHECKPOINT's model (scripts/crossover.py to-authors) with fresh "
                         "optimizers, through their script's own --resume")
    check = ap.add_mutually_exclusive_group()
    check.add_argument("--check-layers", action="store_true", help="compare qtrain's quantized layers with theirs")
    check.add_argument("--check-gates", action="store_true", help="compare qtrain's DFQ blocks with their gated model's")
    ap.add_argument("--log", type=Path, help="tabulate this log only (with --csv)")
    ap.add_argument("--csv", type=Path, help="where --log's table goes")
    args = ap.parse_args(argv)
    bits = (args.num_bits, args.num_grad_bits)
    if args.log is not None:
        if args.csv is None:
            ap.error("--log needs --csv")
        tabulate(args.log, args.csv, bits, args.dfq)
        return 0
    if args.git_dir is None or args.data is None or args.out is None:
        ap.error("GIT_DIR, --data and --out are needed to run (or --log and --csv to tabulate)")
    if args.resume and not args.dfq:
        ap.error("--resume continues a DFQ run (--dfq); the static script's checkpoints cannot be resumed exactly")
    start = None
    if args.start_from is not None:
        if not args.dfq or args.resume:
            ap.error("--start-from starts a DFQ run (--dfq) afresh from a checkpoint; it does not go with --resume")
        if not args.start_from.is_file():
            ap.error(f"--start-from {args.start_from} is not allowed: no such file")
        start = torch.load(args.start_from, map_location="cpu", weights_only=False)["iter"]  # a file of one's own
        if args.iters <= start:
            ap.error(f"--iters {args.iters} is not allowed: the checkpoint is at iteration {start}; give more")
    out = args.out.resolve()
    code = out / "code" if args.resume else extract_code(args.git_dir, args.commit, out)  # a run keeps its code
    if args.check_layers or args.check_gates:
        (check_layers if args.check_layers else check_gates)(code, args.data.resolve())
        return 0
    if args.dfq:
        script, arch, name = "train_dp_lr", "cifar10_rnn_gate_38", f"authors_dfq_seed{args.seed}"
        run_args = ["--target_ratio", str(DFQ_TARGET_CP), "--weight_bits", str(DFQ_WEIGHT_BITS)]
        if start is not None:
            run_args += ["--resume", str(args.start_from.resolve()), "--proceed", "True"]
        options = " ".join(f"{a}/{g}" for a, g in DFQ_OPTIONS)
    else:
        script, arch, name = "train_base", "cifar10_resnet_38", f"authors_code_seed{args.seed}"
        run_args, options = ["--num_bits", str(bits[0]), "--num_grad_bits", str(bits[1])], ""
    env = {**os.environ, "AUTHORS_THREADS": str(args.threads), "AUTHORS_SEED": str(args.seed),
           "AUTHORS_FC_INIT": args.fc_init, "AUTHORS_SCRIPT": script, "AUTHORS_ARCH": arch,
           "AUTHORS_OPTIONS": options, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONUNBUFFERED": "1"}  # the printed gate shares stay in order with the logged evaluation
    log = out / f"{name}.log"
    if args.resume:
        checkpoint = out / "save" / arch / "checkpoint_latest.pth.tar"
        if not checkpoint.is_file() or not log.is_file() or not (code / "launch.py").is_file():
            ap.error(f"--resume: no run to continue in {out} (needs {checkpoint}, {log} and {code})")
        env["AUTHORS_RESUME"] = str(checkpoint)
        log.write_text(log_until(log.read_text(), torch.load(checkpoint)["iter"]))
    data = str_keyed_copy(args.data.resolve(), out)
    with open(log, "a" if args.resume else "w") as output:
        subprocess.run([sys.executable, str(code / "launch.py"), "--arch", arch, *run_args, "--dataset", "cifar10",
                        "--datadir", str(data), "--workers", "1", "--iters", str(args.iters),
                        "--save_folder", str(out / "save")],
                       cwd=out, env=env, stdout=output, stderr=subprocess.STDOUT, check=True)
    tabulate(out / f"{name}.log", out / f"{name}.csv", bits, args.dfq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
