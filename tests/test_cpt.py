"""CPT: the cyclic schedule against hand-computed cosines, its bounds and cycles, the bits each step trains and is
charged at, the cost against the reference code's own formula, resume mid-cycle, and bad values refused (a run killed
mid-cycle: tests/test_run.py's test_killed_run_resumes_to_the_same_metrics)."""

import numpy as np
import pandas as pd
import pytest
import torch

from qtrain.errors import ConfigError
from qtrain.methods import RunFacts, StepInfo, build_method
from qtrain.methods.cpt import cycle_period, cyclic_bits, steps_per_epoch
from qtrain.run import run

from .conftest import TINY, make_config, prepared, run_cli

# TINY trains 256 images in batches of 64: 4 optimizer steps an epoch, every batch full.
TINY_STEPS_PER_EPOCH, TINY_BATCH = 4, 64


def reference_num_bits(i: int, iters: int, cycles: int, low: int, high: int) -> float:
    """cpt_cifar/train.py's forward bits at iteration ``i`` (from 0): ``cyclic_period = int(iters / num_cyclic_period)``
    in its loop, then ``cyclic_adjust_precision``'s rounded cosine."""
    period = int(iters / cycles)
    return np.rint(low + 0.5 * (high - low) * (1 + np.cos(np.pi * ((i % period) / period) + np.pi)))


def reference_flops_ratio(bits: list[float], grad_bits: int) -> float:
    """cpt_cifar/train.py's "Training FLOPS ratio" ``cr.avg``: per iteration ``fw_cost = b*b/32/32``,
    ``eb_cost = b*g/32/32``, ``gc_cost = eb_cost``, ``cr.update((fw_cost + eb_cost + gc_cost) / 3)``, averaged over
    iterations (``n=1`` each)."""
    costs = []
    for b in bits:
        fw_cost = b * b / 32 / 32
        eb_cost = b * grad_bits / 32 / 32
        gc_cost = eb_cost
        costs.append((fw_cost + eb_cost + gc_cost) / 3)
    return sum(costs) / len(costs)


def test_the_schedule_is_a_rising_half_cosine_per_cycle_rounded_half_to_even():
    # the paper's CIFAR run: 64,000 iterations, 32 cycles of 2,000, 3..8 bits.
    # 3 + 2.5 (1 - cos(pi t)): t=0 -> 3; t=1/4 -> 3.73 -> 4; t=1/2 -> 5.5 -> 6 (half to even);
    # t=3/4 -> 7.27 -> 7; t=1999/2000 -> 8.0 -> 8; the next cycle starts at 3 again.
    assert cycle_period(64000, 32) == 2000
    steps = [0, 500, 1000, 1500, 1999, 2000, 2500, 63999]
    assert [cyclic_bits(s, 2000, 3, 8) for s in steps] == [3, 4, 6, 7, 8, 3, 4, 8]
    assert [cyclic_bits(s, 2000, 3, 8) for s in steps] == [reference_num_bits(s, 64000, 32, 3, 8) for s in steps]


@pytest.mark.parametrize("iters,cycles,low,high", [(64000, 32, 3, 8), (1000, 32, 3, 8), (101, 4, 4, 8), (50, 7, 2, 6)])
def test_the_schedule_is_the_reference_codes_at_every_step(iters, cycles, low, high):
    period = cycle_period(iters, cycles)
    assert period == int(iters / cycles)
    assert [cyclic_bits(i, period, low, high) for i in range(iters)] == [
        reference_num_bits(i, iters, cycles, low, high) for i in range(iters)]


# int(iters / cycles) steps a cycle: where cycles do not divide the run, the rest starts one more (the reference's).
# A cycle's last step is its highest, at t = (period - 1) / period: with cycles of 3 steps 3 + 2.5 * 1.5 = 6.75 -> 7,
# short of bits_max (reached from cycles of 5 steps: 3 + 2.5 (1 - cos(0.8 pi)) = 7.52 -> 8).
@pytest.mark.parametrize("iters,cycles,started,top", [(64000, 32, 32, 8), (1000, 32, 33, 8), (96, 32, 32, 7),
                                                      (97, 32, 33, 7), (160, 32, 32, 8)])
def test_the_bits_stay_in_bounds_and_restart_once_a_cycle(iters, cycles, started, top):
    period = cycle_period(iters, cycles)
    bits = [cyclic_bits(i, period, 3, 8) for i in range(iters)]
    assert min(bits) == 3 and max(bits) == bits[period - 1] == top
    starts = [i for i in range(iters) if i % period == 0]
    assert len(starts) == started and all(bits[i] == 3 for i in starts)
    # within a cycle the bits never fall: they drop exactly where a cycle starts
    assert [i for i in range(1, iters) if bits[i] < bits[i - 1]] == starts[1:]


def _attached(*overrides: str, samples: int = 256, batch: int = TINY_BATCH, accum: int = 1):
    method, model = prepared("cpt", *overrides)
    method.attach(torch.optim.SGD(model.parameters(), lr=0.1), RunFacts(batch, accum, samples))
    return method, model


@pytest.mark.parametrize("samples,batch,accum,epochs,cycles,total,period", [
    (50000, 128, 1, 160, 32, 160 * 391, 1955),  # CIFAR passes: 391 batches, the last short
    (51151, 128, 1, 160, 32, 64000, 2000),  # the experiment's epochs of 400 batches (train.batches_per_epoch=400)
    (256, 64, 1, 3, 2, 12, 6),
    (256, 16, 3, 2, 5, 2 * 6, 2),  # 16 batches an epoch, a step every 3 and at the epoch's end
])
def test_the_cycles_divide_the_runs_optimizer_steps(samples, batch, accum, epochs, cycles, total, period):
    method, _ = _attached(f"method.epochs={epochs}", f"method.cycles={cycles}", samples=samples, batch=batch,
                          accum=accum)
    assert (method.total_steps, method.period) == (total, period)


def _train_step(method, model, x):
    model.train()
    model(x)
    method.after_step(StepInfo(0, method.steps_taken, len(x)))


def test_each_training_forward_takes_its_steps_bits_and_evaluation_keeps_the_last_steps():
    method, model = _attached("method.epochs=3", "method.cycles=2")  # 12 steps, cycles of 6
    x = torch.randn(2, 3, 8, 8)
    seen = []
    for _ in range(12):
        model.train()
        model(x)
        seen.append(method.precision()["layer2.0.conv1"].options[0][1])
        method.after_step(StepInfo(0, method.steps_taken, 2))
    expected = [reference_num_bits(i, 12, 2, 3, 8) for i in range(12)]
    assert [b.weight for b in seen] == [b.act for b in seen] == expected
    assert {b.grad for b in seen} == {b.grad_weight for b in seen} == {8}
    model.eval()
    model(x)
    assert model.layer2[0].conv1.quant.act.bits == expected[-1]


def test_depthwise_convs_are_held_and_the_classifier_stays_float32():
    method, model = prepared("cpt", model="mobilenetv2")
    record = method.precision()
    depthwise = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1]
    assert depthwise and all(record[n].options[0][1].weight == 8 for n in depthwise)
    assert all(record[n].options[0][1].grad == 16 for n in depthwise)
    assert "fc" not in record and record["stem.0"].options[0][1].weight == record["head.0"].options[0][1].weight == 3


def test_a_resumed_method_continues_the_cycle_where_it_stopped():
    method, model = _attached("method.epochs=3", "method.cycles=2")
    x = torch.randn(2, 3, 8, 8)
    for _ in range(4):
        _train_step(method, model, x)
    evaluated, _ = prepared("cpt", "method.epochs=3", "method.cycles=2")  # scripts/eval_checkpoint.py: no attach
    evaluated.load_state_dict(method.state_dict())
    assert evaluated.precision() == method.precision()
    resumed, again = _attached("method.epochs=3", "method.cycles=2")
    resumed.load_state_dict(method.state_dict())
    assert resumed.steps_taken == 4
    assert resumed.precision() == method.precision()  # the last step's bits, as the unbroken run holds them
    for _ in range(4):
        _train_step(method, model, x)
        _train_step(resumed, again, x)
        assert resumed.precision() == method.precision()


@pytest.mark.parametrize("overrides,message", [
    (["method.bits_min=9"], "method.bits_min=9 is not allowed: it must be at most method.bits_max (8)"),
    (["method.bits_min=6", "method.bits_max=4"], "method.bits_min=6 is not allowed: it must be at most method.bits_max (4)"),
    (["method.cycles=0"], "method.cycles=0 is not allowed: it must be an integer >= 1"),
    (["method.bits_max=33"], "method.bits_max=33 is not allowed: bit-widths are integers from 1 to 32"),
    (["method.grad_bits=0"], "method.grad_bits=0 is not allowed: bit-widths are integers from 1 to 32"),
    (["method.epochs=0"], "method.epochs=0 is not allowed: it must be an integer >= 1"),
])
def test_bad_values_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        build_method(make_config("method=cpt", *overrides).method)


def test_more_cycles_than_steps_is_refused_once_the_run_knows_its_steps():
    with pytest.raises(ConfigError, match=r"^method.cycles=32 is not allowed: the run trains 12 optimizer steps, "
                                          r"and a cycle needs one at least \(at most 12 cycles\)$"):
        _attached("method.epochs=3")


def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    result = run_cli("method=cpt", "method.bits_min=8", "method.bits_max=3", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["qtrain: error: method.bits_min=8 is not allowed: it must be at most "
                                          "method.bits_max (3)"]
    assert not (tmp_path / "outputs").exists()


def _cost_run(tmp_path, *overrides: str) -> tuple[dict, list[float]]:
    """A 12-step run of 2 cycles; its summary and the reference's bits at each of its iterations."""
    summary = run(make_config(*TINY, "method=cpt", "train.epochs=3", "method.cycles=2", *overrides), tmp_path)
    return summary, [reference_num_bits(i, 12, 2, 3, 8) for i in range(12)]


@pytest.mark.slow
def test_the_cost_is_the_reference_codes_training_flops_ratio(tmp_path):
    # Every layer quantized, every batch full: qtrain's % of float32 is 100 x the reference's cr.avg.
    summary, bits = _cost_run(tmp_path, "method.last_layer=quantized")
    ratio = reference_flops_ratio(bits, grad_bits=8)
    assert summary["cost"]["percent_of_float32"] == pytest.approx(100 * ratio, rel=1e-12)
    assert summary["cpt"]["training_flops_ratio"] == pytest.approx(ratio, rel=1e-12)
    assert (summary["cpt"]["total_steps"], summary["cpt"]["period_steps"]) == (12, 6)
    precision = pd.read_csv(tmp_path / "precision.csv")
    conv = precision[(precision.layer == "layer2.0.conv1") & (precision.event == "epoch")]
    for epoch in (1, 2, 3):  # each epoch's bits, in shares of its samples (4 equal steps)
        rows = conv[conv.epoch == epoch]
        trained = pd.Series(bits[4 * (epoch - 1):4 * epoch]).value_counts(normalize=True)
        assert dict(zip(rows.weight_bits, rows.share)) == pytest.approx({int(b): s for b, s in trained.items()})


@pytest.mark.slow
def test_with_the_classifier_in_float32_the_cost_adds_its_float32_macs_to_the_reference_ratio(tmp_path):
    # The reference's ratio counts every MAC at the cycle's bits; its classifier (nn.Linear) is float32.
    summary, bits = _cost_run(tmp_path)
    macs = pd.read_csv(tmp_path / "cost.csv").set_index("layer")["macs_per_sample"]
    quantized, float32 = macs.drop("fc").sum(), macs["fc"]
    # per iteration, per sample: the quantized layers at the reference's ratio, the classifier at 1 (3 GEMMs each)
    expected = sum(TINY_BATCH * 3 * (quantized * reference_flops_ratio([b], 8) + float32) for b in bits)
    assert summary["cost"]["effective_macs"] == pytest.approx(expected, rel=1e-12)
    assert summary["cost"]["percent_of_float32"] == pytest.approx(
        100 * (quantized * reference_flops_ratio(bits, 8) + float32) / (quantized + float32), rel=1e-12)


def test_the_cifar_experiment_is_the_reference_command_in_its_iterations():
    cfg = make_config("experiment=cpt_cifar")
    method = cfg.method
    assert (method.name, method.bits_min, method.bits_max, method.grad_bits, method.cycles) == ("cpt", 3, 8, 8, 32)
    assert (method.act_range, method.first_layer, method.last_layer) == ("tensor", "quantized", "float32")
    # --iters 64000 of --batch_size 128, the piecewise lr /10 at 32,000 and 48,000, no warm-up
    batches = cfg.train.batches_per_epoch
    assert (cfg.train.epochs * batches, cfg.train.batch_size, cfg.train.accum_steps) == (64000, 128, 1)
    assert [m * batches for m in cfg.sched.milestones] == [32000, 48000] and cfg.sched.warmup_epochs == 0
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay, cfg.sched.gamma) == (0.1, 0.9, 1e-4, 0.1)
    # CIFAR's 50,000 images in epochs of 400 batches (qtrain.data.base.Periods' samples per epoch): cycles of 2,000
    method, _ = _attached("method.epochs=160", samples=round(batches * 50000 / 391), batch=128)
    assert (method.total_steps, method.period) == (64000, 2000)


def test_the_mini_scale_ends_at_the_top_of_its_last_cycle():
    cfg = make_config("experiment=cpt_cifar", "scale=mini")
    facts = RunFacts(cfg.train.batch_size, cfg.train.accum_steps, cfg.data.sample.train)
    total = cfg.train.epochs * steps_per_epoch(facts)
    period = cycle_period(total, cfg.method.cycles)
    assert period * cfg.method.cycles == total  # no partial cycle at the end
    assert cyclic_bits(total - 1, period, cfg.method.bits_min, cfg.method.bits_max) == cfg.method.bits_max


def test_an_epoch_of_batches_over_passes_counts_its_batches():
    # 2,000 batches of 128 over five passes of 50,000 images, each pass ending in a batch of 80: 2,000 steps, though
    # the samples fill only 1,999 batches of 128 and a bit
    facts = RunFacts(128, 1, samples_per_epoch=2000 * 128 - 5 * 48, batches_per_epoch=2000)
    assert steps_per_epoch(facts) == 2000
    assert steps_per_epoch(RunFacts(128, 2, 50_000)) == 196  # 391 batches, a step every 2 and at the end
