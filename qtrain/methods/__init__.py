"""Method registry: ``method.name`` in the config picks the class (one file per method), in the order and under the
names of the config schemas (:data:`qtrain.config.methods.METHODS`; a test ties them)."""

from __future__ import annotations

from omegaconf import DictConfig

from qtrain.config.methods import check_method
from qtrain.methods.adapt import AdaPT
from qtrain.methods.base import Method, RunFacts, StepInfo
from qtrain.methods.cpt import CPT
from qtrain.methods.dfq import DFQ
from qtrain.methods.dynasty import Dynasty
from qtrain.methods.float32 import Float32
from qtrain.methods.fp8 import FP8
from qtrain.methods.fractrain import FracTrain
from qtrain.methods.muppet import MuPPET
from qtrain.methods.mx import MX
from qtrain.methods.pfq import PFQ
from qtrain.methods.sbm import SBM

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Float32, SBM, MuPPET, AdaPT, Dynasty, PFQ, DFQ, FracTrain, CPT, FP8, MX)}


def build_method(cfg: DictConfig) -> Method:
    """Instantiate the method ``cfg.name`` with its config, once it is checked against its schema."""
    check_method(cfg)
    return METHODS[cfg.name](cfg)


__all__ = ["METHODS", "Method", "RunFacts", "StepInfo", "build_method"]
