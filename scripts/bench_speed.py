"""Speed and memory of quantized training against float32, measured in one run on this machine.

    python scripts/bench_speed.py [--model resnet20|transformer] [--batch N] [--half-width 0.03] [--max-pairs 300]
                                  [--turn 10] [--min-turns 3] [--alive 4] [--methods sbm pfq ...] [--device cpu|cuda]

Prints, for ResNet-20 on 32x32x3 inputs, batch 128 (``--model transformer``: the small Transformer preset on
sequences of 64 tokens of WikiText-2's 33,278-word vocabulary, batch 16 sequences), on the CPU (``--device cuda``: on
the GPU, each step's time read after a synchronize, and its memory as the allocator's peak above what it held at rest):
- the time of one training step (forward, backward, the method's hooks, the cost meter, optimizer) of each method
  over float32's: both are set up in one process and their steps alternate (A/B, then B/A, after the same warm-up),
  so drift and bursts of other load land on both; the ratio is the median of the pairs' ratios, printed with its
  distribution-free 95 % interval; each method is set up in a process of its own (``--alive`` at a time) and the
  methods take turns of ``--turn`` pairs, so that a change of the machine's speed lands on all of them, until a
  method has had ``--min-turns`` turns and its interval is within ``--half-width`` of the median (or
  ``--max-pairs`` are timed); as in a run, glibc keeps freed tensors for reuse
  (qtrain.launch.keep_freed_memory), so the timed steps take no page faults;
- the peak memory of a training step (the process's high-water mark above its resident size at
  rest after three warm-up steps, measured in a separate process whose allocator returns freed
  tensors to the OS) divided by float32's;
- fixed-point <8,4> stochastic rounding of 4M floats divided by a copy of them (the two timed
  alternately, medians kept), and divided by QPyTorch's fixed_point_quantize (when qtorch is installed).
PFQ runs its first stage (FW-3/BW-6); MuPPET its first (8-bit); DYNASTY its first epoch's 4-bit maps, with
its per-step sensitivity analytics (its epoch-end map update is once per epoch: not in the step).
AdaPT's step includes its per-step work
(loss terms, gradient normalization, lookback windows); its switches (PushDown over the whole range and
PushUp of every layer, timed as one round) are amortized at the paper's
most frequent rate, once every 25 optimizer steps (the lookback's lower bound). DFQ and FracTrain run
with their gates' choices drawn from TRAINED_SHARES, the option shares of a trained run (below), not
from untrained gates (which send most samples past their blocks); dfq_mix_all runs every option for
every sample, as the reference code does (one turn of at most 5 pairs: it has no target and takes
several times as long).
CPT runs its cycle's first step (3 bits forward, 8 backward; a step's work does not depend on its bits). FP8 runs at
its config defaults, the block-scaled recipes (mxfp8, mxfp6, mxfp4, nvfp4) as the league runs them on ResNet-20.
Targets: SBM, both FW-8/BW-16 readings, PFQ and MuPPET <= 1.2x float32 in time, DFQ, FracTrain and
AdaPT <= 1.35x, DYNASTY <= 1.5x, FP8 and MX <= 1.3x; every method <= 1.2x in memory (DYNASTY 1.3x), stochastic
rounding <= 2x a copy.
On the Transformer: SBM and PFQ <= 1.25x in time and 1.2x in memory (the others are measured, with no target;
DFQ and FracTrain do not apply to it); PFQ quantizes the vocabulary projection there, as Table 2's runs do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

# name -> config overrides; DFQ's mix_all is the reference code's way (every option for every sample)
VARIANTS = {
    "sbm_bw16_bifurcation": ["experiment=sbm_bw16_bifurcation"],
    "sbm_bw16_both_paths": ["experiment=sbm_bw16_both_paths"],
    "dfq_mix_all": ["method=dfq", "method.execution=mix_all"],
    # the league's block-scaled recipes (conf/experiment/league.yaml)
    "mxfp8": ["method=mx", "method.weight=mxfp8_e4m3", "method.act=mxfp8_e4m3", "method.grad=mxfp8_e4m3",
              "method.scale_rule=ceil"],
    "mxfp6": ["method=mx"],
    "mxfp4": ["method=mx", "method.weight=mxfp4_e2m1"],
    "nvfp4": ["method=mx", "method.weight=nvfp4", "method.act=nvfp4", "method.grad=nvfp4", "method.grad_rounding=stochastic",
              "method.weight_blocks=2d", "method.hadamard_wgrad=true", "method.first_layer=bf16", "method.last_layer=bf16"],
}
SCALED = ("fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
METHODS = ("float32", "sbm", "sbm_bw16_bifurcation", "sbm_bw16_both_paths", "pfq", "dfq", "dfq_mix_all", "fractrain",
           "muppet", "adapt", "dynasty", "cpt", *SCALED)
TIME_TARGET = 1.2
# others: TIME_TARGET
TIME_TARGETS = {"dfq": 1.35, "fractrain": 1.35, "adapt": 1.35, "dynasty": 1.5, "dfq_mix_all": None,
                **{name: 1.3 for name in SCALED}}
ADAPT_SWITCH_EVERY = 25  # optimizer steps between a layer's switches at the shortest lookback (AdaPT Sec. 4.1.1)
SLOW = {"dfq_mix_all"}  # one turn of at most 5 pairs
MEMORY_TARGET = 1.2
MEMORY_TARGETS = {"dynasty": 1.3}  # others: MEMORY_TARGET
TRANSFORMER_METHODS = ("float32", "sbm", "pfq", "muppet", "adapt", "dynasty", "cpt", *SCALED)
# PFQ as FracTrain Table 2's Transformer runs trains it (fractrain_wikitext103): the vocabulary projection quantized
TRANSFORMER_OVERRIDES = {"pfq": ["method.last_layer=quantized"]}
TRANSFORMER_TIME_TARGETS = {"sbm": 1.25, "pfq": 1.25}  # others: measured only
TRANSFORMER_MEMORY_TARGET = 1.2
WIKITEXT2_VOCAB = 33_278  # words in WikiText-2's training split, <eos> included
TRANSFORMER_PRESET = "small"
# Share of samples at each of ResNet's options [0,0], [2,6], [3,6], [4,6], [4,12], [6,8], [6,12] in the last
# epoch of an earlier miniature's DFQ run (8 epochs, before the gates' fixes of issue 21), averaged over its nine
# blocks. Since per_sample runs each block once over the whole batch, the shares set each sample's rounding bits
# and which samples skip, not the GEMMs' sizes: the step's work is about that of one option whatever they are.
TRAINED_SHARES = (0.420, 0.0, 0.0, 0.0, 0.227, 0.0, 0.353)


def _draw_trained_shares() -> None:
    """Make every gate draw its samples' options from TRAINED_SHARES (a block that cannot skip: the rest), except
    where the method forces an option (its profiles run every block)."""
    from qtrain.methods.gates import GatedBlock

    shares = torch.tensor(TRAINED_SHARES)
    generator = torch.Generator().manual_seed(0)
    own_choice = GatedBlock.choose

    def choose(block: GatedBlock, probs: torch.Tensor) -> torch.Tensor:
        if block.shared[0].forced is not None:
            return own_choice(block, probs)
        weights = shares.clone()
        if block.mask_skip:
            weights[0] = 0
        return torch.multinomial(weights, len(probs), replacement=True, generator=generator).to(probs.device)

    GatedBlock.choose = choose


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _workload(model_name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, int]:
    """The float model, a batch of inputs and targets, and the samples of an epoch."""
    from qtrain.config.models import PRESETS
    from qtrain.models import build_model

    if model_name == "transformer":
        sizes = PRESETS[TRANSFORMER_PRESET]
        model = build_model("transformer", {"name": "transformer", **sizes}, vocab_size=WIKITEXT2_VOCAB)
        tokens = torch.randint(0, WIKITEXT2_VOCAB, (batch, sizes["seq_len"] + 1))
        return model, tokens[:, :-1], tokens[:, 1:], 2_088_628 // sizes["seq_len"]  # WikiText-2's training tokens
    model = build_model("resnet20", in_channels=3, num_classes=10, input_size=(32, 32))
    return model, torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)), 50_000


def _training_step(name: str, batch: int, model_name: str,
                   device: torch.device) -> tuple[Callable[[], float], Callable[[], dict]]:
    """A timed training step of ``name`` (forward, backward, the method's hooks, the cost meter, the optimizer), after
    3 warm-up steps, and a function that tells, once the timing is done, the steps' cost and AdaPT's switch time
    (it switches every layer)."""
    from hydra import compose, initialize_config_dir

    from qtrain.cost import CostMeter
    from qtrain.methods import RunFacts, StepInfo, build_method
    from qtrain.resources import conf_dir
    from qtrain.task import Task

    overrides = VARIANTS.get(name, [f"method={name}"])
    if model_name == "transformer":
        overrides += ["model=transformer", *TRANSFORMER_OVERRIDES.get(name, [])]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    if cfg.method.name in ("dfq", "fractrain"):
        _draw_trained_shares()
    torch.manual_seed(0)
    method = build_method(cfg.method)
    model, x, y, samples_per_epoch = _workload(model_name, batch)
    model, x, y = method.prepare(model.to(device)).to(device), x.to(device), y.to(device)
    sample = x[:2]
    meter = CostMeter(method.profile(model, sample), method.operand_sizes(model, sample))  # hardware models too, as a run
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    method.attach(opt, RunFacts(batch, 1, samples_per_epoch))
    info = StepInfo(0, 0, batch)

    def timed_step() -> float:
        start = time.perf_counter()
        loss = method.loss(Task.loss(model(x), y), info)
        loss.backward()
        meter.add(method.precision(), batch)
        method.after_backward(info)
        opt.step()
        opt.zero_grad(set_to_none=True)
        method.after_step(info)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(3):
        timed_step()
    return timed_step, lambda: {"cost_percent": meter.percent_of_float32(),
                                "switch_s": _switch_round(method, info) if name == "adapt" else 0.0}


def _switch_round(method: Any, info: Any) -> float:
    """Seconds of one round of AdaPT's switches of every layer, each from a format reached in training."""
    from qtrain.methods.adapt_switching import Format

    seconds = 0.0
    for layer, state in method.states.items():
        state.format = Format(20, 12)
        start = time.perf_counter()
        method._switch(layer, 1.0, info)
        seconds += time.perf_counter() - start
    return seconds


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median of ``values`` and its distribution-free 95 % interval: the ``j``-th and ``k``-th smallest values,
    ``j = floor(n/2 - 0.98 sqrt(n))`` and ``k = ceil(n/2 + 1 + 0.98 sqrt(n))`` (the binomial(n, 1/2) count of values
    below the true median, in its normal approximation: 1.96 standard deviations of sqrt(n)/2 either side)."""
    ordered, n = sorted(values), len(values)
    spread = 0.98 * math.sqrt(n)
    low, high = max(math.floor(n / 2 - spread), 1), min(math.ceil(n / 2 + 1 + spread), n)  # ranks, from 1
    return statistics.median(ordered), ordered[low - 1], ordered[high - 1]


class PairTimer:
    """float32 and ``name`` set up in one process, their steps timed in pairs: a float32 step and a ``name`` step,
    the order swapped every pair (counted over every call), so that drift and bursts of other load land on both."""

    def __init__(self, name: str, batch: int, model_name: str, device: torch.device) -> None:
        from qtrain.launch import keep_freed_memory
        from qtrain.run import float32_kernels

        float32_kernels()  # the kernels a run takes
        keep_freed_memory()  # as a run does: no page faults in the timed steps
        self.name = name
        self.reference, _ = _training_step("float32", batch, model_name, device)
        self.measured, self._facts = _training_step(name, batch, model_name, device)
        self.timed = 0

    def pairs(self, n: int) -> tuple[list[float], list[float]]:
        """``n`` more pairs: the method's step times and float32's, after an untimed step of each (the process may
        have waited while others ran: its caches and threads are cold for whichever step comes first)."""
        self.reference()
        self.measured()
        steps, theirs = [], []
        for _ in range(n):
            first, second = (self.reference, self.measured) if self.timed % 2 == 0 else (self.measured, self.reference)
            a, b = first(), second()
            steps.append(b if first is self.reference else a)
            theirs.append(a if first is self.reference else b)
            self.timed += 1
        return steps, theirs

    def facts(self) -> dict:
        """The timed steps' cost; AdaPT's switch round (the median of three) when ``name`` is AdaPT."""
        facts = self._facts()
        if self.name == "adapt":
            facts["switch_s"] = statistics.median([facts["switch_s"], *(self._facts()["switch_s"] for _ in range(2))])
        return facts


def pair_ratio(steps: list[float], theirs: list[float], facts: dict) -> dict:
    """The median of the pairs' ratios and its 95 % interval, AdaPT's switches amortized at their most frequent rate
    (ADAPT_SWITCH_EVERY steps) in its step times."""
    ours = [t + facts["switch_s"] / ADAPT_SWITCH_EVERY for t in steps]
    ratio, low, high = median_interval([t / t32 for t, t32 in zip(ours, theirs)])
    return {"ratio": ratio, "low": low, "high": high, "pairs": len(ours), "step_s": statistics.median(ours),
            "float32_step_s": statistics.median(theirs), **facts}


def settled(steps: list[float], theirs: list[float], half_width: float) -> bool:
    """Whether the median ratio's 95 % interval is within ``half_width`` of it (at least 20 pairs)."""
    if len(steps) < 20:
        return False
    ratio, low, high = median_interval([t / t32 for t, t32 in zip(steps, theirs)])
    return max(ratio - low, high - ratio) <= half_width


def serve(timer: PairTimer) -> None:
    """The child's side of :class:`TimingChild`: ``pairs N`` on stdin times N more pairs and prints their times,
    ``facts`` prints the facts and ends."""
    print("ready", flush=True)
    for line in sys.stdin:
        command, *count = line.split()
        if command == "facts":
            print(json.dumps(timer.facts()), flush=True)
            return
        steps, theirs = timer.pairs(int(count[0]))
        print(json.dumps({"steps": steps, "float32": theirs}), flush=True)


def _child_command(role: str, name: str, args: argparse.Namespace, batch: int) -> list[str]:
    """This script run as ``role`` (``--serve``, ``--peak-memory``) of ``name`` on the parent's workload."""
    return [sys.executable, __file__, role, name, "--batch", str(batch), "--model", args.model, "--device", args.device]


class TimingChild:
    """A process of its own that keeps float32 and ``name`` set up (:func:`serve`), so that the parent can time
    the methods' pairs in turns."""

    def __init__(self, name: str, args: argparse.Namespace, batch: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(_child_command("--serve", name, args, batch), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.steps: list[float] = []
        self.theirs: list[float] = []
        self.turns = 0

    def _ask(self, line: str | None) -> str:
        """Send ``line`` (None: nothing) and read the reply."""
        try:
            if line is not None:
                self.proc.stdin.write(line + "\n")
            reply = self.proc.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if not reply:
            raise RuntimeError(f"the timing process of {self.name} ended (exit status {self.proc.wait()})")
        return reply.strip()

    def wait_ready(self) -> None:
        while self._ask(None) != "ready":  # set-up chatter (compile warnings go to stderr; anything else is skipped)
            pass

    def time_pairs(self, n: int) -> None:
        times = json.loads(self._ask(f"pairs {n}"))
        self.steps += times["steps"]
        self.theirs += times["float32"]
        self.turns += 1

    def result(self) -> dict:
        facts = json.loads(self._ask("facts"))
        self.proc.stdin.close()
        self.proc.wait()
        return pair_ratio(self.steps, self.theirs, facts)


def interleaved_ratios(methods: list[str], args: argparse.Namespace, batch: int) -> Iterator[tuple[str, dict]]:
    """Each method's ratio (:func:`pair_ratio`), its pairs timed ``--turn`` at a time, the methods taking turns, so
    that a change of the machine's speed lands on the methods alike; at most ``--alive`` methods are set up at once
    (each process holds a model pair and its allocator's cache), the next starting as one ends. A method ends once
    it has had ``--min-turns`` turns and its interval is within ``--half-width`` (or it reached ``--max-pairs``), and
    is yielded then; a SLOW method has one turn of at most 5 pairs."""
    waiting, alive = list(methods), []
    try:
        while waiting or alive:
            while waiting and len(alive) < args.alive:
                alive.append(TimingChild(waiting.pop(0), args, batch))
                alive[-1].wait_ready()
            for child in list(alive):
                limit = min(args.max_pairs, 5) if child.name in SLOW else args.max_pairs
                child.time_pairs(min(args.turn, limit - len(child.steps)))
                if (child.name in SLOW or len(child.steps) >= limit
                        or (child.turns >= args.min_turns and settled(child.steps, child.theirs, args.half_width))):
                    alive.remove(child)
                    yield child.name, child.result()
    finally:  # on an error, the other processes go too
        for child in alive:
            child.proc.kill()


def peak_memory(name: str, batch: int, model_name: str, device: torch.device) -> dict:
    """The peak memory of a training step above the resident size at rest (CUDA: the allocator's peak above what it
    held), in a process of its own whose allocator returns freed tensors (:func:`peak_memory_child`)."""
    from qtrain.run import float32_kernels

    float32_kernels()
    step, _ = _training_step(name, batch, model_name, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for _ in range(3):
            step()
        return {"peak_mb": (torch.cuda.max_memory_allocated(device) - base) / 2**20}
    # Reset the high-water mark to the resident size at rest (model, optimizer state, compiled kernels): the peak
    # above it is the memory one training step needs.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kb("VmRSS")
    for _ in range(3):
        step()
    return {"peak_mb": (_rss_kb("VmHWM") - base) / 1024}


def _alternating_medians(fns: dict, repeats: int = 30) -> dict:
    """Median milliseconds of one call of each function, the functions called in turn (so a burst of
    other load on a shared machine lands on all of them alike)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def rounding_ratios(device: torch.device, qtorch: bool) -> dict:
    from qtrain.quant.formats import fixed_point

    x = torch.randn(4_000_000, device=device)

    def synced(fn):  # a GPU call returns once queued: time it to its end
        return (lambda: (fn(), torch.cuda.synchronize(device))) if device.type == "cuda" else fn

    fns = {"copy_ms": synced(x.clone), "ours_sr_ms": synced(lambda: fixed_point(x, 8, 4, "stochastic"))}
    if qtorch:  # its first import compiles its extensions (CUDA's too where there is a GPU)
        try:
            from qtorch.quant import fixed_point_quantize
            fns["qtorch_sr_ms"] = synced(lambda: fixed_point_quantize(x, 8, 4, rounding="stochastic"))
        except Exception:  # noqa: BLE001 - not installed, or its extension failed to build here: no qtorch column
            pass
    return _alternating_medians(fns, repeats=10 if "qtorch_sr_ms" in fns else 30)


def _memory_target(name: str, transformer: bool) -> float:
    """The most ``name``'s step may take in memory, in float32's."""
    return TRANSFORMER_MEMORY_TARGET if transformer else MEMORY_TARGETS.get(name, MEMORY_TARGET)


def peak_memory_child(name: str, args: argparse.Namespace, batch: int) -> float:
    """:func:`peak_memory` of ``name`` in a process of its own, in MB."""
    # A fixed mmap threshold makes glibc return every large tensor to the OS when it is freed, so the resident size
    # follows the live tensors and its high-water mark is the step's peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(_child_command("--peak-memory", name, args, batch), capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet20", "transformer"), default="resnet20")
    parser.add_argument("--batch", type=int, help="samples (images, sequences) per step: 128 for ResNet-20, 16 for "
                                                  "the Transformer")
    parser.add_argument("--half-width", type=float, default=0.03,
                        help="time pairs until the median ratio's 95%% interval is within this of it")
    parser.add_argument("--max-pairs", type=int, default=300, help="at most this many pairs of steps per method")
    parser.add_argument("--turn", type=int, default=10, help="pairs a method times in its turn before the next method's")
    parser.add_argument("--min-turns", type=int, default=3,
                        help="turns every method has at least, so that its pairs are spread over the others' turns")
    parser.add_argument("--alive", type=int, default=4,
                        help="methods set up at once (each process holds about 1.3 GB for ResNet-20 on the CPU)")
    parser.add_argument("--methods", nargs="+", choices=METHODS,
                        help="methods to time against float32 (default: every one that applies)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure each step's peak memory only (it needs no idle machine, as the timing does)")
    parser.add_argument("--no-qtorch", dest="qtorch", action="store_false",
                        help="leave qtorch's stochastic rounding out of the comparison (its first import compiles it)")
    parser.add_argument("--serve", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--peak-memory", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    for flag, value in (("--half-width", args.half_width), ("--max-pairs", args.max_pairs), ("--turn", args.turn),
                        ("--min-turns", args.min_turns), ("--alive", args.alive)):
        if value <= 0:
            parser.error(f"{flag} {value}: must be positive")
    device = torch.device(args.device)
    transformer = args.model == "transformer"
    batch = args.batch or (16 if transformer else 128)
    if args.serve:
        serve(PairTimer(args.serve, batch, args.model, device))
        return
    if args.peak_memory:
        print(json.dumps(peak_memory(args.peak_memory, batch, args.model, device)))
        return
    applicable = TRANSFORMER_METHODS if transformer else METHODS
    refused = sorted(set(args.methods or ()) - set(applicable))
    if refused:
        parser.error(f"--methods {' '.join(refused)} do not apply to --model {args.model} (choose from: "
                     f"{', '.join(applicable)})")
    methods = [m for m in (args.methods or applicable) if m != "float32"]
    workload = (f"Transformer ({TRANSFORMER_PRESET} preset), batch {batch} x 64 tokens, vocabulary {WIKITEXT2_VOCAB:,}"
                if transformer else f"ResNet-20, batch {batch}, 32x32x3")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    how = ("each step's peak memory, in a process of its own" if args.memory_only else
           f"each method's steps alternate with float32's in one process, {args.alive} methods at a time taking turns "
           f"of {args.turn} pairs, until the median ratio's 95% interval is within +-{args.half_width} after "
           f"{args.min_turns} turns at least (at most {args.max_pairs} pairs); rows in the order the methods settle")
    print(f"{workload}, {where}, torch {torch.__version__}; {how}")
    float32_memory = peak_memory_child("float32", args, batch)
    if args.memory_only:
        print(f"{'method':21s} {'peak MB':>8s} {'x float32':>9s} {'target':>7s}")
        for name in methods:
            peak = peak_memory_child(name, args, batch)
            target = _memory_target(name, transformer)
            verdict = "met" if peak / float32_memory <= target else f"missed (<= {target})"
            print(f"{name:21s} {peak:8.1f} {peak / float32_memory:9.2f} {verdict:>7s}", flush=True)
        print(f"float32 peak memory {float32_memory:.1f} MB")
        return
    print(f"{'method':21s} {'step s':>7s} {'x float32':>9s} {'95% interval':>13s} {'pairs':>5s} {'target':>7s} "
          f"{'peak MB':>8s} {'x float32':>9s} {'cost %':>7s}", flush=True)
    adapt_switch = None
    for name, timed in interleaved_ratios(methods, args, batch):
        peak = peak_memory_child(name, args, batch)
        memory_ratio = peak / float32_memory
        target = TRANSFORMER_TIME_TARGETS.get(name) if transformer else TIME_TARGETS.get(name, TIME_TARGET)
        memory_target = _memory_target(name, transformer)
        verdict = "-" if target is None else ("met" if timed["ratio"] <= target and memory_ratio <= memory_target else "missed")
        # below 6 pairs the interval is the pairs' whole range, which holds the median with less than 95 %
        interval = f"{timed['low']:.2f}-{timed['high']:.2f}" + ("*" if timed["pairs"] < 6 else "")
        print(f"{name:21s} {timed['step_s']:7.3f} {timed['ratio']:9.2f} {interval:>13s} {timed['pairs']:5d} {verdict:>7s} "
              f"{peak:8.1f} {memory_ratio:9.2f} {timed['cost_percent']:7.2f}  (float32 step "
              f"{timed['float32_step_s']:.3f} s)", flush=True)
        adapt_switch = timed["switch_s"] if name == "adapt" else adapt_switch
    print(f"float32 peak memory {float32_memory:.1f} MB; * fewer than 6 pairs: the interval is their range, which "
          "holds the median with less than 95 %")
    if transformer:
        print(f"target: SBM and PFQ time <= {TRANSFORMER_TIME_TARGETS['sbm']}x float32, memory <= "
              f"{TRANSFORMER_MEMORY_TARGET}x (the others: no target); cost %: the bit-MAC cost of the measured steps "
              "in percent of float32")
    else:
        print(f"target: time <= {TIME_TARGET}x float32 (DFQ, FracTrain, AdaPT <= {TIME_TARGETS['dfq']}x, DYNASTY <= "
              f"{TIME_TARGETS['dynasty']}x, FP8 and MX <= {TIME_TARGETS['fp8']}x), memory <= {MEMORY_TARGET}x (DYNASTY "
              f"<= {MEMORY_TARGETS['dynasty']}x); cost %: the bit-MAC cost of the measured steps in percent of float32 "
              "(DFQ/FracTrain: gates drawing from TRAINED_SHARES)")
    if adapt_switch is not None:
        print(f"adapt: one round of switches (every layer) {adapt_switch:.3f} s, amortized over "
              f"{ADAPT_SWITCH_EVERY} steps in its step time")
    sr = rounding_ratios(device, args.qtorch)
    ratio = sr["ours_sr_ms"] / sr["copy_ms"]
    print(f"stochastic rounding of 4M floats: {sr['ours_sr_ms']:.2f} ms = {ratio:.2f}x a copy ({sr['copy_ms']:.2f} ms, "
          f"target <= 2x: {'met' if ratio <= 2 else 'missed'})", end="")
    if "qtorch_sr_ms" in sr:
        print(f", {sr['ours_sr_ms'] / sr['qtorch_sr_ms']:.3f}x qtorch ({sr['qtorch_sr_ms']:.1f} ms)")
    else:
        print(" (qtorch not installed)")


if __name__ == "__main__":
    main()
