"""The methods' registry (:data:`METHODS`, filled by :func:`register_method`) and their typed config schemas
(``conf/method/<name>.yaml``), torch-free, on :mod:`qtrain.config.schema`; option groups that methods share are one
base class each. :func:`check_method` reads ``cfg.method`` against its schema before any work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar, TypeVar

from omegaconf import DictConfig, ListConfig

from qtrain.config.schema import Bits, bounded, is_integer, not_allowed, read
from qtrain.errors import ConfigError
from qtrain.quant import choices


class Choice(str, Enum):
    """A value a key chooses from. A member is equal to its text and hashes, prints and formats as it, so the kernels
    (:mod:`qtrain.quant`), which know no config schema, take it where they take the text."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _choices(name: str, values: tuple[str, ...]) -> type[Choice]:
    """The Choice of the kernels' values (:mod:`qtrain.quant.choices`), a member per value under its upper-case name."""
    return Choice(name, {value.upper(): value for value in values})


class Precision(Choice):
    """Of a layer, a projection shortcut, a gradient: quantized or float32."""

    QUANTIZED = "quantized"
    FLOAT32 = "float32"


class ActRange(Choice):
    TENSOR = "tensor"  # global min/max
    SAMPLE_MEAN = "sample_mean"  # mean of per-sample min/max


class Init(Choice):
    TNVS = "tnvs"  # AdaPT's truncated-normal fan-in variance scaling
    MODEL = "model"


@dataclass(frozen=True)
class MethodConfig:
    """The key every method has: its name."""

    allocating: ClassVar[bool] = False  # chooses precision per layer or per sample as it trains (a bit-allocation plot)
    implementation: ClassVar[str]  # the class that trains the method, as "module:Class" (see register_method)
    name: str

    def __post_init__(self) -> None:
        """The end of every schema's chain of checks across keys."""

    def check_steps_per_epoch(self, steps: int, *, exact: bool) -> None:
        """Refuse a run of ``steps`` optimizer steps an epoch that the method cannot train (``exact``: the run's own
        count; else a bound on it, known before the data loads)."""


METHODS: dict[str, type[MethodConfig]] = {}  # every method's schema by name, in the order the report lists them
S = TypeVar("S", bound=type[MethodConfig])


def register_method(name: str, implementation: str) -> Callable[[S], S]:
    """Register the schema of the method ``name``, trained by ``implementation`` ("module:Class", imported only when
    a run builds the method, so that checking a config imports no torch)."""

    def register(schema: S) -> S:
        schema.implementation = implementation
        METHODS[name] = schema
        return schema
    return register


@dataclass(frozen=True)
class FwBw:
    """FracTrain's FW-a/BW-g: activation (and weight) bits and gradient bits."""

    fw: Bits
    bw: Bits


@dataclass(frozen=True)
class FloatEnds(MethodConfig):
    """Whether the first and last Conv2d/Linear are quantized or stay float32."""

    first_layer: Precision
    last_layer: Precision


@dataclass(frozen=True)
class RangeLinear(MethodConfig):
    """The options of SBM's range-linear quantizers, shared by SBM, PFQ, DFQ and FracTrain."""

    act_range: ActRange
    act_momentum: float = bounded(0, 1, high_open=True)  # the running range's weight on its old value
    depthwise_bits: FwBw | None


# ---- float32 ----

@register_method("float32", "qtrain.methods.float32:Float32")
@dataclass(frozen=True)
class Float32(MethodConfig):
    """AdaPT's initialization and L1 term, which its float32 baselines share."""

    init: Init
    init_scale: float = bounded(0, low_open=True)
    l1: float = bounded(0)


@register_method("sbm", "qtrain.methods.sbm:SBM")
@dataclass(frozen=True)
class SBM(RangeLinear, FloatEnds):
    weight_bits: Bits
    act_bits: Bits
    grad_bits: Bits
    grad_weight_bits: Bits



# ---- MuPPET and AdaPT: priced by AdaPT's performance model ----

@dataclass(frozen=True)
class Baseline:
    """A float32 baseline run of AdaPT's performance model (qtrain.cost.adapt_model); null: this run's value."""

    batch_size: int | None = bounded(1)
    accum_steps: int | None = bounded(1)
    epochs: float | None = bounded(0, low_open=True)


@dataclass(frozen=True)
class Priced(MethodConfig):
    """A method priced by AdaPT's performance model against the float32 baselines it names."""

    performance_model: Any  # baseline name -> Baseline

    def __post_init__(self) -> None:
        super().__post_init__()
        key, baselines = "method.performance_model", self.performance_model
        if not isinstance(baselines, DictConfig):
            raise not_allowed(key, baselines, "it maps baseline names to {batch_size, accum_steps, epochs}")
        for name, baseline in baselines.items():
            if not isinstance(baseline, DictConfig) or set(baseline.keys()) != {f.name for f in fields(Baseline)}:
                raise not_allowed(f"{key}.{name}", baseline, "a baseline has exactly batch_size, accum_steps and epochs "
                                  "(null: this run's value)")
            read(Baseline, baseline, f"{key}.{name}")


@dataclass(frozen=True)
class Threshold:
    """MuPPET's T(e) = base + scale * exp(-decay * e)."""

    base: float = bounded(0)
    scale: float = bounded(0)
    decay: float = bounded(0)


@dataclass(frozen=True)
class Float32Lr:
    """The float32 stage's learning-rate decay and stop."""

    gamma: float = bounded(0, 1)
    every: int = bounded(1)
    decays: int | None = bounded(0)


class DiversityInput(Choice):
    REFERENCE = "reference"
    WEIGHT_GRADS = "weight_grads"


@register_method("muppet", "qtrain.methods.muppet:MuPPET")
@dataclass(frozen=True)
class MuPPET(Priced):
    schedule: list[Bits] = bounded(2, 32)  # word lengths; 32: float32
    resolution: int = bounded(2)  # epochs per window: the diversity of one gradient is always 1
    patience: int = bounded(1)
    threshold: Threshold
    diversity_input: DiversityInput
    grad: Precision
    float32_lr: Float32Lr

    def __post_init__(self) -> None:
        schedule = list(self.schedule)
        if not schedule or any(a >= b for a, b in zip(schedule, schedule[1:])):
            raise not_allowed("method.schedule", schedule, "strictly increasing word lengths from 2 to 32, at least one "
                              "(32, float32, can only be the last)")
        super().__post_init__()


@dataclass(frozen=True)
class InitialFormat:
    wl: int = bounded(2, 32)
    fl: int = bounded(0)

    def __post_init__(self) -> None:
        if self.fl > self.wl - 1:
            raise not_allowed("method.initial.fl", self.fl, f"it must be an integer from 0 to method.initial.wl - 1 = "
                              f"{self.wl - 1}")


@dataclass(frozen=True)
class Span:
    """A lower and an upper bound that AdaPT's switching adapts a value between."""

    group: ClassVar[str]
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise not_allowed(f"method.{self.group}.high", self.high, f"it must be an integer >= method.{self.group}.low "
                              f"({self.low})")


@dataclass(frozen=True)
class Lookback(Span):
    group = "lookback"
    low: int = bounded(1)
    high: int = bounded(1)
    momentum: float = bounded(0, 1)


@dataclass(frozen=True)
class Resolution(Span):
    group = "resolution"
    low: int = bounded(2)
    high: int = bounded(2)


class Params(Choice):
    ALL = "all"
    WEIGHTS = "weights"


class PushdownSearch(Choice):
    REFERENCE = "reference"
    RANGE = "range"
    CURRENT = "current"


class Pushup(Choice):
    REFERENCE = "reference"
    PAPER = "paper"


class Strategy(Choice):
    MIN = "min"
    MEAN = "mean"
    MAX = "max"


@register_method("adapt", "qtrain.methods.adapt:AdaPT")
@dataclass(frozen=True)
class AdaPT(Float32, Priced):
    initial: InitialFormat
    grad: Precision
    params: Params
    buffer_bits: int = bounded(1, 31)
    lookback: Lookback
    resolution: Resolution
    pushdown_search: PushdownSearch
    kl_epsilon: float = bounded(0)
    pushup: Pushup
    strategy: Strategy
    normalize_grads: bool
    l2: float = bounded(0)
    penalty: bool


# ---- DYNASTY ----

STATIC_BITS = choices.DYNASTY_STATIC_BITS


Rounding = _choices("Rounding", choices.ROUNDINGS)  # how a format rounds onto its grid


class Average(Choice):
    MACS = "macs"  # weighted by each block's computation
    BLOCKS = "blocks"


class ActMap(Choice):
    WEIGHT_GRADIENT = "weight_gradient"
    FORWARD = "forward"


@register_method("dynasty", "qtrain.methods.dynasty:Dynasty")
@dataclass(frozen=True)
class Dynasty(FloatEnds):
    allocating = True
    target_bits: float = bounded(0, low_open=True)
    max_bits: int = bounded(1, STATIC_BITS)
    levels: list[int] = bounded(0, STATIC_BITS)
    initial_bits: int = bounded(0, STATIC_BITS)
    smoothing: float = bounded(0, 1)
    iterations: int = bounded(1)
    weight_rounding: Rounding
    act_rounding: Rounding
    grad_rounding: Rounding
    average: Average
    act_map: ActMap

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_bits > self.max_bits:
            raise not_allowed("method.target_bits", self.target_bits, f"it must be a number in (0, {self.max_bits}] "
                              "(the average bit-width, at most method.max_bits)")
        levels = list(self.levels)
        if not levels or levels != sorted(set(levels)) or levels[-1] > self.max_bits:
            raise not_allowed("method.levels", levels, "a non-empty ascending list of distinct integers from 0 to "
                              f"method.max_bits ({self.max_bits})")
        if self.initial_bits not in levels:
            raise not_allowed("method.initial_bits", self.initial_bits, "it must be one of method.levels "
                              f"({', '.join(map(str, levels))})")


# ---- PFQ ----

class Switch(Choice):
    AUTO = "auto"  # the loss indicator's turning points
    MANUAL = "manual"  # after manual_epochs


@dataclass(frozen=True)
class Progressive(MethodConfig):
    """When a progressive schedule (PFQ's precisions, FracTrain's cp targets) moves to its next stage."""

    switch: Switch
    epsilon: float = bounded(0, low_open=True)
    alpha: float = bounded(0, low_open=True)
    window: int = bounded(2)
    scale_epochs: int = bounded(1)
    manual_epochs: list[int] | None = bounded(1)

    def stages(self) -> int:
        """How many stages the schedule has."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        super().__post_init__()
        stages, epochs = self.stages(), list(self.manual_epochs or [])
        if self.switch is Switch.MANUAL and (len(epochs) != stages - 1 or epochs != sorted(set(epochs))):
            raise ConfigError(f"method.manual_epochs={epochs} is not allowed: with switch=manual it lists the "
                              f"{stages - 1} increasing epochs (>= 1) after which the next of the {stages} stages starts")
        if self.switch is Switch.AUTO and epochs:
            raise ConfigError(f"method.manual_epochs={epochs} is not allowed with method.switch=auto, which moves on at "
                              "the loss indicator's turning points: set method.switch=manual, or leave manual_epochs empty")


@register_method("pfq", "qtrain.methods.pfq:PFQ")
@dataclass(frozen=True)
class PFQ(RangeLinear, FloatEnds, Progressive):
    fw: list[Bits]
    bw: list[Bits]

    def stages(self) -> int:
        return len(self.fw)

    def __post_init__(self) -> None:
        if len(self.fw) != len(self.bw) or not self.fw:
            raise ConfigError(f"method.fw={list(self.fw)} and method.bw={list(self.bw)} are not allowed: "
                              "the schedule needs one FW and one BW bit-width per stage, at least one stage")
        super().__post_init__()


# ---- DFQ and FracTrain: gated blocks ----

class CpScope(Choice):
    BLOCKS = "blocks"  # cp of the gated blocks
    MODEL = "model"  # of the whole model


class CpWeights(Choice):
    BLOCKS = "blocks"  # one each
    MACS = "macs"  # each block's MACs


class CpGemms(Choice):
    ALL = "all"  # the forward, error and weight-gradient GEMMs
    WEIGHT_GRADIENT = "weight_gradient"  # the weight-gradient GEMM alone, over the same three-GEMM float32 cost


class Execution(Choice):
    PER_SAMPLE = "per_sample"
    MIX_ALL = "mix_all"


class SkipDownsample(Choice):
    PROJECTION = "projection"
    NEVER = "never"


class SkipCharge(Choice):
    NONE = "none"
    PROJECTION = "projection"


@dataclass(frozen=True)
class Gate:
    """A gate's embedding width (null: one conv straight to the embedding), embedding size and LSTM hidden size."""

    width: int | None = bounded(1)
    embed: int = bounded(1)
    hidden: int = bounded(1)


@dataclass(frozen=True)
class GateLr:
    """The gates' own learning rate: the network's divided by ``divide_by`` from optimizer step ``from_step`` (0-based)
    on, the same before."""

    from_step: int = bounded(0)
    divide_by: float = bounded(0, low_open=True)


def gate_options(options: Any) -> list[tuple[int, int]]:
    """The [fw, bw] pairs of ``method.options``; a leading [0, 0] is the skip option."""
    error = ConfigError(f"method.options={options!r} is not allowed: a list of [fw, bw] pairs with bit-widths "
                        "from 1 to 32, optionally led by [0, 0] (skip the block), with at least one pair to run")
    lists = (list, ListConfig)  # a list, also where a resolver's default gives a plain one (the table experiments)
    if not isinstance(options, lists) or not all(isinstance(p, lists) and len(p) == 2 for p in options):
        raise error
    pairs = [(p[0], p[1]) for p in options]
    run = pairs[int(bool(pairs) and pairs[0] == (0, 0)):]
    if not run or any(not is_integer(b) or not 1 <= b <= 32 for pair in run for b in pair):
        raise error
    return pairs


@dataclass(frozen=True)
class Gated(RangeLinear):
    """DFQ's options, which FracTrain shares: the options the gates pick from, their cost and how blocks run."""

    allocating = True
    options: Any  # the model config's [fw, bw] pairs (gate_options)
    weight_bits: Bits | None  # None: the weights stay float32
    cp_scope: CpScope
    cp_weights: CpWeights
    cp_gemms: CpGemms
    beta: float = bounded(0, low_open=True)
    execution: Execution
    skip_downsample: SkipDownsample
    skip_charge: SkipCharge
    projection: Precision
    outside: FwBw | None
    gate: Gate | None
    gate_lr: GateLr | None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.options is None or self.gate is None:
            raise ConfigError(f"method {self.name} needs a model with residual blocks to gate; this model config has no "
                              "dfq_options (choose a ResNet or mobilenetv2)")
        gate_options(self.options)
        if self.cp_scope is CpScope.MODEL and self.cp_weights is CpWeights.BLOCKS:
            raise ConfigError("method.cp_weights=blocks is not allowed with method.cp_scope=model: the whole model's "
                              "cp weighs every layer by its MACs (set method.cp_weights=macs)")


@register_method("dfq", "qtrain.methods.dfq:DFQ")
@dataclass(frozen=True)
class DFQ(Gated):
    target_cp: float = bounded(0, 100, low_open=True)  # percent of float32


class IndicatorLoss(Choice):
    TOTAL = "total"  # the task loss and the signed cost term
    TASK = "task"


def appendix_g_targets(cp_total: float, stages: int, step: float) -> list[float]:
    """Stage targets rising by ``step`` whose mean is ``cp_total`` (FracTrain Eq. (3))."""
    return [cp_total + (i - (stages - 1) / 2) * step for i in range(stages)]


@register_method("fractrain", "qtrain.methods.fractrain:FracTrain")
@dataclass(frozen=True)
class FracTrain(Gated, Progressive):
    cp_schedule: list[float] = bounded(0, 100, low_open=True)
    cp_total: float | None = bounded(0, 100, low_open=True)
    cp_step: float = bounded(0, low_open=True)
    indicator_loss: IndicatorLoss

    def stages(self) -> int:
        return len(self.cp_schedule)

    def __post_init__(self) -> None:
        if not self.cp_schedule:
            raise not_allowed("method.cp_schedule", self.cp_schedule, "it must be a non-empty list of finite numbers "
                              "in (0, 100]")
        if self.cp_total is not None:
            targets = appendix_g_targets(self.cp_total, self.stages(), self.cp_step)
            if not (0 < targets[0] and targets[-1] <= 100):
                raise ConfigError(f"method.cp_total={self.cp_total} is not allowed with {len(targets)} stages "
                                  f"{self.cp_step} apart: the stages' targets {targets[0]:g}..{targets[-1]:g} "
                                  "must lie in (0, 100]")
        super().__post_init__()


# ---- CPT ----

@register_method("cpt", "qtrain.methods.cpt:CPT")
@dataclass(frozen=True)
class CPT(RangeLinear, FloatEnds):
    """CPT's cyclic forward precision between two bounds, its gradients at one precision."""

    bits_min: Bits
    bits_max: Bits
    grad_bits: Bits
    cycles: int = bounded(1)
    epochs: int = bounded(1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits_min > self.bits_max:
            raise not_allowed("method.bits_min", self.bits_min, f"it must be at most method.bits_max ({self.bits_max})")

    def check_steps_per_epoch(self, steps: int, *, exact: bool) -> None:
        total = self.epochs * steps
        if self.cycles > total:
            trains = f"{total}" if exact else f"at most {total}"
            raise not_allowed("method.cycles", self.cycles, f"the run trains {trains} optimizer steps, and a cycle "
                              f"needs one at least (at most {total} cycles)")


# ---- scaled formats: FP8, OCP MX, NVFP4 ----

LayerFormat = _choices("LayerFormat", choices.SCALED_LAYER_FORMATS)


@dataclass(frozen=True)
class ScaledLayers(MethodConfig):
    """Which layers a scaled-format method keeps out of its format: the first and last Conv2d/Linear, the MatMuls."""

    first_layer: LayerFormat
    last_layer: LayerFormat
    matmuls: LayerFormat


class Fp8Element(Choice):
    E4M3 = "e4m3"  # max 448, no infinities
    E5M2 = "e5m2"  # max 57344, IEEE-like


class Scaling(Choice):
    DELAYED = "delayed"  # from the amax history of earlier steps (Transformer Engine's DelayedScaling)
    CURRENT = "current"  # from this tensor's own amax


class AmaxReduction(Choice):
    MAX = "max"
    MOST_RECENT = "most_recent"


@register_method("fp8", "qtrain.methods.fp8:FP8")
@dataclass(frozen=True)
class FP8(ScaledLayers):
    weight: Fp8Element
    act: Fp8Element
    grad: Fp8Element
    scaling: Scaling
    amax_history_len: int = bounded(1)
    amax_compute_algo: AmaxReduction
    margin: int = bounded(0, 127)  # 2^margin must be a float32


BlockFormat = _choices("BlockFormat", choices.BLOCK_FORMATS)
ScaleRule = _choices("ScaleRule", choices.MX_SCALE_RULES)


class WeightBlocks(Choice):
    ONE_D = "1d"  # blocks along each GEMM's reduction dimension
    TWO_D = "2d"  # 16 x 16 tiles, the same in the weight and its transpose (NVFP4's recipe)


@register_method("mx", "qtrain.methods.mx:MX")
@dataclass(frozen=True)
class MX(ScaledLayers):
    weight: BlockFormat
    act: BlockFormat
    grad: BlockFormat
    scale_rule: ScaleRule
    grad_rounding: Rounding
    weight_blocks: WeightBlocks
    hadamard_wgrad: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_rule is ScaleRule.CEIL and all(fmt is BlockFormat.NVFP4 for fmt in (self.weight, self.act, self.grad)):
            raise not_allowed("method.scale_rule", "ceil", "it is the MX formats' shared exponent, and every operand "
                              "is nvfp4 (which has its own): leave it floor")
        if self.weight_blocks is WeightBlocks.TWO_D and self.weight is not BlockFormat.NVFP4:
            raise not_allowed("method.weight_blocks", "2d", f"2-D weight blocks are NVFP4's (method.weight={self.weight.value}: "
                              "use 1d)")
        if self.hadamard_wgrad and BlockFormat.NVFP4 not in (self.act, self.grad):
            raise not_allowed("method.hadamard_wgrad", True, "the weight-gradient GEMM's Hadamard transform is NVFP4's "
                              "recipe: set method.act or method.grad to nvfp4, or hadamard_wgrad to false")


def check_method(method: DictConfig) -> MethodConfig:
    """``method`` (a composed config's ``method`` node) read against the schema of ``method.name``; the method is handed
    the result. What a schema cannot see stays with the method: whatever needs the model itself (DFQ and FracTrain
    refuse a model without residual blocks to gate when they prepare it)."""
    if method.name not in METHODS:
        raise ConfigError(f"unknown method {method.name!r} (choose from: {', '.join(sorted(METHODS))})")
    return read(METHODS[method.name], method, "method")
