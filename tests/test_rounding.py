"""The hashed uniform source and the grid kernel: distribution, reproducibility, fused == eager."""

import pytest
import torch

from qtrain.quant import rounding
from qtrain.quant.rounding import hashed_uniform, round_to_grid

N = 1 << 20


def _uniforms(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return hashed_uniform(torch.Size([N]), rounding.draw_key(torch.device("cpu")), torch.device("cpu")).double()


def test_hashed_uniform_is_uniform_on_unit_interval():
    u = _uniforms()
    assert u.min() >= 0 and u.max() < 1
    # mean and variance of U[0,1): 1/2 and 1/12; standard errors ~ 3e-4 and 3e-4 for 2^20 draws
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = N / 64
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 120  # 63 degrees of freedom: P(chi2 > 120) < 1e-5


def test_neighbouring_elements_are_uncorrelated():
    u = _uniforms() - 0.5
    for lag in (1, 2, 16, 1024):
        corr = (u[:-lag] * u[lag:]).mean() / u.var()
        assert abs(corr.item()) < 5e-3  # standard error ~ 1e-3
    # the low bit of neighbours must not alternate or repeat
    bits = (_uniforms() * (1 << 24)).long() & 1
    assert abs((bits[:-1] == bits[1:]).double().mean().item() - 0.5) < 5e-3


def test_draws_follow_torch_seed_and_differ_between_calls():
    assert torch.equal(_uniforms(3), _uniforms(3))
    torch.manual_seed(3)
    key = rounding.draw_key(torch.device("cpu"))
    first = hashed_uniform(torch.Size([N]), key, torch.device("cpu"))
    second = hashed_uniform(torch.Size([N]), rounding.draw_key(torch.device("cpu")), torch.device("cpu"))
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 5e-3


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1, N), 0.3)
    one = torch.ones(1, 1)
    out = round_to_grid(x, one, torch.zeros(1, 1), -10, 10, stochastic=True)
    assert set(out.unique().tolist()) == {0.0, 1.0}
    assert abs(out.mean().item() - 0.3) < 2e-3


def test_fused_kernel_matches_eager_bit_for_bit():
    x = torch.randn(37, 113)
    scale = torch.rand(37, 1) * 50 + 1
    zero = torch.round(torch.randn(37, 1) * 3)
    results = []
    for fused in (False, True):
        rounding.set_fused(fused)
        torch.manual_seed(7)
        results.append([round_to_grid(x, scale, zero, 0, 255, s) for s in (True, False)])
    for eager, fused in zip(*results):
        assert torch.equal(eager, fused)


def test_compiler_failure_falls_back_to_the_same_eager_result(monkeypatch):
    x = torch.randn(8, 100)
    args = (x, torch.full((8, 1), 10.0), torch.zeros(8, 1), torch.tensor([-50.0, 50.0]), torch.tensor(7, dtype=torch.int32))
    expected = rounding.grid_codes(*args, stochastic=True)

    def broken_compile(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    kernel = rounding.fused(rounding.grid_codes)  # a kernel cache of its own, so compile is called
    rounding.set_fused(True)
    with pytest.warns(UserWarning, match=r"torch.compile failed .*no C\+\+ compiler"):
        got = kernel(*args, stochastic=True)
    assert torch.equal(got, expected)
    assert not rounding._FUSED["enabled"]
