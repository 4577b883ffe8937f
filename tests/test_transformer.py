"""The Transformer language model: causal attention, its GEMMs' MACs, quantized attention, perplexity."""

import logging
import math

import pandas as pd
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qtrain.cost import CostMeter, profile_macs
from qtrain.errors import ConfigError
from qtrain.methods import build_method
from qtrain.models import build_model
from qtrain.precision import Bits
from qtrain.quant.layers import MatMul, OperandQuantizers, QMatMul
from qtrain.quant.quantizers import RangeLinear
from qtrain.quant.rounding import set_fused
from qtrain.task import LANGUAGE_MODEL
from qtrain.train import Trainer
from tests.conftest import TINY_TEXT, make_config

SIZES = {"layers": 2, "d_model": 32, "heads": 4, "ffn": 48, "dropout": 0.0, "seq_len": 12}
VOCAB = 37


def _model(**sizes) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("transformer", {"name": "transformer", **{**SIZES, **sizes}}, vocab_size=VOCAB)


def _tokens(batch: int = 3, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def test_scores_depend_on_earlier_tokens_only():
    model = _model().eval()
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    before, after = model(tokens), model(changed)
    assert before.shape == (3, 12, VOCAB)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("length", [12, 5])
def test_macs_of_every_gemm_match_the_closed_form(length):
    d, ffn, t = SIZES["d_model"], SIZES["ffn"], length
    per_block = {"attention.qkv": t * d * 3 * d, "attention.scores": t * t * d, "attention.mix": t * t * d,
                 "attention.out": t * d * d, "ffn1": t * d * ffn, "ffn2": t * ffn * d}
    expected = {f"blocks.{i}.{name}": macs for i in range(2) for name, macs in per_block.items()}
    expected["head"] = t * d * VOCAB
    assert profile_macs(_model(), _tokens(2, length)) == expected


def test_macs_match_torch_flop_counter():
    model, tokens = _model(), _tokens(2)
    macs = profile_macs(model, tokens)
    with FlopCounterMode(display=False) as counter:
        model.eval()(tokens)
    assert 2 * sum(macs.values()) * 2 == counter.get_total_flops()


def test_the_meter_charges_attention_at_its_operands_bits():
    set_fused(False)
    method = build_method(make_config("method=sbm", "method.grad_bits=16", "method.grad_weight_bits=16",
                                      "method.act_bits=4").method)
    model = method.prepare(_model())
    assert isinstance(model.blocks[0].attention.scores, QMatMul)
    meter = CostMeter(method.profile(model, _tokens(2)))
    meter.add(method.precision(), samples=5)
    row = meter.table().set_index("layer").loc["blocks.1.attention.mix"]
    # forward a (4 bits) x b (in the weight's place, 8 bits); error GEMM 16 x 8; weight-gradient place 4 x 16
    assert row.effective_macs == pytest.approx(5 * 12 * 12 * 32 * (4 * 8 + 16 * 8 + 4 * 16) / 1024)


def _attention_grads(layer: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = layer(a, b)
    out.backward(grad)
    return out, a.grad, b.grad


def test_quantized_attention_with_every_operand_at_32_bits_is_float_attention():
    a, b, grad = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 5)
    float32 = MatMul()
    quantized = QMatMul()
    quantized.quant = OperandQuantizers()  # every operand float32: charged 32 bits
    assert quantized.quant.bits() == Bits(32, 32, 32, 32)
    for ours, reference in zip(_attention_grads(quantized, a, b, grad), _attention_grads(float32, a, b, grad)):
        assert torch.equal(ours, reference)


def test_a_model_at_muppets_float32_word_length_computes_as_the_float_model():
    tokens = _tokens()
    reference = _model()(tokens)
    method = build_method(make_config("method=muppet", "method.schedule=[32]").method)
    model = method.prepare(_model())
    assert isinstance(model.blocks[0].attention.scores, QMatMul)
    assert torch.equal(model(tokens), reference)


def test_quantized_attention_is_the_gemm_of_its_quantized_operands():
    set_fused(False)
    a, b, grad = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 5)
    layer = QMatMul()
    layer.quant = OperandQuantizers(weight=RangeLinear(3, "tensor", "nearest"), act=RangeLinear(4, "tensor", "nearest"),
                                    grad=RangeLinear(5, "tensor", "nearest"), grad_weight=RangeLinear(6, "tensor", "nearest"))
    out, grad_a, grad_b = _attention_grads(layer, a, b, grad)
    qa, qb = RangeLinear(4, "tensor", "nearest")(a), RangeLinear(3, "tensor", "nearest")(b)
    assert len(qa.unique()) <= 16 and len(qb.unique()) <= 8
    assert torch.equal(out, qa @ qb)
    assert torch.equal(grad_a, RangeLinear(5, "tensor", "nearest")(grad) @ qb.transpose(-2, -1))
    assert torch.equal(grad_b, qa.transpose(-2, -1) @ RangeLinear(6, "tensor", "nearest")(grad))


class _Batches:
    """A stream of given (tokens, targets) batches."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def epoch(self, epoch):
        return iter(self.batches)


class _Uniform(torch.nn.Module):
    """Equal scores for every word: the uniform distribution over the vocabulary."""

    def forward(self, tokens):
        return torch.zeros(*tokens.shape, VOCAB)


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity():
    targets = _tokens(4, 9)
    trainer = Trainer(_Uniform(), None, None, None, None, None, _Batches([(targets, targets), (targets[:1], targets[:1])]),
                      LANGUAGE_MODEL, epochs=1)
    metrics = trainer.evaluate()
    assert metrics["test_ppl"] == pytest.approx(VOCAB, rel=1e-6)
    assert metrics["test_loss"] == pytest.approx(math.log(VOCAB), rel=1e-6)


@pytest.mark.parametrize("key,value,message", [
    ("heads", 5, "model.d_model=32 is not allowed with model.heads=5"),
    ("layers", 0, "model.layers=0 is not allowed: it must be an integer >= 1"),
    ("dropout", 1.0, "model.dropout=1.0 is not allowed: it must be a finite number in [0, 1)"),
])
def test_bad_sizes_are_named(key, value, message):
    from omegaconf import OmegaConf

    from qtrain.config.models import check_model

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_model(OmegaConf.create({"name": "transformer", "preset": "tiny", **SIZES, key: value}))


def test_a_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="longer than the model's seq_len=12"):
        _model()(_tokens(1, 13))


@pytest.mark.parametrize("method,attention_quantized", [
    ("float32", False), ("sbm", True), ("pfq", True), ("muppet", True), ("adapt", False), ("dynasty", False),
])
@pytest.mark.slow
def test_every_method_that_applies_trains_the_transformer_on_text(tmp_path, method, attention_quantized):
    from qtrain.run import run

    summary = run(make_config(*TINY_TEXT, f"method={method}", "train.epochs=1"), tmp_path)
    assert summary["status"] == "completed" and summary["task"] == "language_model"
    final = summary["final"]
    assert math.isfinite(final["test_ppl"]) and final["test_ppl"] == pytest.approx(math.exp(final["test_loss"]))
    assert summary["best_test_ppl"] == final["test_ppl"]
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert {"train_ppl", "test_ppl", "train_acc", "test_acc"} <= set(metrics.columns)
    cost = pd.read_csv(tmp_path / "cost.csv").set_index("layer")
    scores = cost.loc["blocks.0.attention.scores"]
    assert scores.macs_per_sample == 16 * 16 * 32  # T^2 * d_model of the tiny preset
    assert (scores.percent_of_float32 < 100) == attention_quantized


@pytest.mark.slow
def test_a_language_model_trains_with_adam_and_inverse_sqrt_unless_the_command_line_says_otherwise():
    from omegaconf import OmegaConf

    from qtrain.config import check_command_line, digest, identity
    from qtrain.resources import conf_dir

    def group(name: str, option: str) -> dict:
        return OmegaConf.to_container(OmegaConf.load(conf_dir() / name / f"{option}.yaml"))

    lm = make_config("model=transformer", "data=text")
    assert OmegaConf.to_container(lm.optim, resolve=True) == {"name": "adam", "_target_": "torch.optim.Adam", "_partial_": True,
                                                               "lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-9, "weight_decay": 0.0}
    assert OmegaConf.to_container(lm.sched, resolve=True) == {"name": "inverse_sqrt", "warmup_steps": 100}
    base = make_config("model=transformer", "model.preset=base", "data=text")  # Vaswani's (d_model * warmup)^-0.5
    assert base.optim.lr == pytest.approx((512 * 4000) ** -0.5, rel=0.01) and base.sched.warmup_steps == 4000
    for chosen, name in (("optim=sgd", "optim"), ("sched=cosine", "sched"), ("sched=multistep", "sched")):
        explicit = make_config("model=transformer", "data=text", chosen)
        check_command_line(["model=transformer", "data=text", chosen], conf_dir(), multirun=False)
        assert OmegaConf.to_container(explicit[name]) == group(name, chosen.partition("=")[2])
        other = "sched" if name == "optim" else "optim"
        assert explicit[other].name == lm[other].name
    mine = make_config("model=transformer", "data=text", "optim.lr=5e-4", "sched.warmup_steps=7")
    assert (mine.optim.lr, mine.sched.warmup_steps) == (5e-4, 7)
    paper = make_config("experiment=fractrain_wikitext103")  # the experiment's own values stay
    assert (paper.optim.lr, paper.sched.warmup_steps, list(paper.optim.betas)) == (7e-4, 4000, [0.9, 0.98])
    image = make_config("model=resnet20")  # an image model keeps the image recipe, and its run identity
    assert OmegaConf.to_container(image.optim) == group("optim", "sgd")
    assert OmegaConf.to_container(image.sched) == group("sched", "cosine")
    assert digest(identity(image)) == digest(identity(make_config("model=resnet20", "optim=sgd", "sched=cosine")))


@pytest.mark.parametrize("method,kept", [("pfq", ["head"]), ("sbm", []), ("pfq", [])])
@pytest.mark.slow
def test_a_run_states_the_layers_it_keeps_in_float32_and_their_share_of_the_cost(tmp_path, caplog, method, kept):
    from qtrain.run import run

    last = [] if kept else ["method.last_layer=quantized"]
    with caplog.at_level(logging.INFO, logger="qtrain"):
        summary = run(make_config(*TINY_TEXT, f"method={method}", "train.epochs=1", *last), tmp_path)
    d, ffn, length, vocab = 32, 64, 16, summary["data_sizes"]["vocab_size"]  # the tiny preset, one block
    # MACs a token: qkv 3d^2, out d^2, the FFN 2 d ffn, attention's two products T d each, the projection d V
    share = d * vocab / (4 * d * d + 2 * d * ffn + 2 * length * d + d * vocab) if kept else 0.0
    stated = summary["float32_layers"]
    assert stated["names"] == kept and stated["share_of_float32_cost"] == pytest.approx(share)
    cost = pd.read_csv(tmp_path / "cost.csv").set_index("layer")
    assert stated["share_of_cost"] == pytest.approx(cost.effective_macs[kept].sum() / cost.effective_macs.sum())
    assert all(cost.percent_of_float32[name] == pytest.approx(100) for name in kept)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float32 layers")]
    assert lines == ([f"float32 layers (method {method}): head: {100 * share:.1f}% of float32's cost"] if kept else [])


@pytest.mark.slow
def test_a_character_level_corpus_reports_bits_per_character_and_a_word_level_one_does_not(tmp_path, caplog):
    from qtrain.run import run

    with caplog.at_level(logging.INFO, logger="qtrain"):
        summary = run(make_config(*TINY_TEXT, "data.level=char", "method=float32"), tmp_path / "char")
    metrics = pd.read_csv(tmp_path / "char" / "metrics.csv")
    for split in ("train", "test"):  # bits per character: log2 of the perplexity per character
        assert metrics[f"{split}_bpc"].tolist() == pytest.approx([math.log2(p) for p in metrics[f"{split}_ppl"]])
        assert summary["final"][f"{split}_bpc"] == pytest.approx(metrics[f"{split}_bpc"].iloc[-1])
    assert 0 < summary["final"]["test_bpc"] < math.log2(summary["data_sizes"]["vocab_size"]) + 1
    epoch_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert len(epoch_lines) == 2 and all(" bpc " in line for line in epoch_lines)
    assert f"test loss {metrics.test_loss.iloc[-1]:.4f}  ppl {metrics.test_ppl.iloc[-1]:.4f}  bpc " \
           f"{metrics.test_bpc.iloc[-1]:.4f} |" in epoch_lines[-1]
    words = run(make_config(*TINY_TEXT, "method=float32", "train.epochs=1"), tmp_path / "word")
    assert "test_bpc" not in words["final"]
    assert not any(c.endswith("_bpc") for c in pd.read_csv(tmp_path / "word" / "metrics.csv").columns)


@pytest.mark.parametrize("overrides,message", [
    (["model=transformer"], "model=transformer is not allowed with data=digits: the data is for classification and "
                            "the model for language model"),
    (["data=text"], "model=resnet20 is not allowed with data=text: the data is for language model and the model for "
                    "classification"),
    (["model=transformer", "data=text", "method=dfq"], "method dfq needs a model with residual blocks to gate"),
])
def test_a_model_for_another_task_or_a_method_that_cannot_apply_is_refused_before_any_work(tmp_path, overrides, message):
    from qtrain.run import run

    with pytest.raises(ConfigError, match=message):
        run(make_config(*overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_both_gradients_of_attention_take_the_error_paths_bits_under_banners_bifurcation():
    method = build_method(make_config("method=sbm", "method.grad_bits=8", "method.grad_weight_bits=16").method)
    model = method.prepare(_model())
    record = method.precision()
    attention, linear = model.blocks[0].attention.scores, model.blocks[0].attention.qkv
    assert attention.quant.grad_weight is None and linear.quant.grad_weight.bits == 16
    assert record["blocks.0.attention.scores"].options[0][1] == Bits(8, 8, 8, 8)
    assert record["blocks.0.attention.qkv"].options[0][1] == Bits(8, 8, 8, 16)
