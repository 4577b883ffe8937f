"""The hashed uniform source and the rounding: distribution, reproducibility, exactness, the per-kernel compile
fallback (fused == eager bit for bit: test_fused.py)."""

import math

import pytest
import torch

from qtrain.quant import formats, rounding
from qtrain.quant.rounding import hashed_uniform

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
    out = rounding.round_codes(torch.full((N,), 0.3), _key(), stochastic=True)
    assert set(out.unique().tolist()) == {0.0, 1.0}
    assert abs(out.mean().item() - 0.3) < 2e-3


def test_lane_count_is_the_rows_power_of_two_divisor_within_bounds():
    assert rounding.lane_count(128 * 16 * 32 * 32) == 1024
    assert rounding.lane_count(16 * 3 * 3 * 3) == 16  # 432 = 16 * 27
    assert rounding.lane_count(27) == 1 and rounding.lane_count(8) == 1  # odd, or below MIN_LANES
    assert rounding.lane_count(0) == 1
    assert rounding.lane_count(3 << 31) == 1  # 64-bit indices: no lanes
    assert rounding.lane_count(100 * 48, 48) == 16  # rows of 48: lanes divide the row, not only the tensor


@pytest.mark.parametrize("shape", [(8, 16), (3, 1024), (2, 5, 64)])
def test_draws_in_lanes_are_the_draws_of_the_flat_indices(shape):
    key = _key()
    lanes = shape[-1]
    by_lanes = hashed_uniform(torch.Size(shape), rounding.lane_keys(key, lanes), torch.device("cpu"))
    flat = rounding.uniform_at(torch.arange(math.prod(shape), dtype=torch.int32), key)
    assert torch.equal(by_lanes.reshape(-1), flat)


def test_a_key_of_one_element_draws_as_the_0_d_key():
    key = _key()
    for shape in [(100,), (4, 16), (2, 1024)]:
        assert torch.equal(hashed_uniform(torch.Size(shape), key.reshape(1), torch.device("cpu")),
                           hashed_uniform(torch.Size(shape), key, torch.device("cpu")))


@pytest.mark.parametrize("numel", [4096, 432, 27])
def test_stochastic_fixed_point_rounds_each_element_with_its_flat_index_draw(numel):
    """Whether or not its draws are taken in lanes, element i rounds up iff uniform_at(i) < its fraction."""
    x = torch.randn(numel) * 5
    key = _key()
    u = rounding.uniform_at(torch.arange(numel, dtype=torch.int32), key)
    t = x * 16
    expected = (torch.floor(t) + (u < t - torch.floor(t)).float()).clamp(-128, 127) / 16
    assert torch.equal(formats.fixed_point(x, 8, 4, "stochastic", key=key), expected)


def test_compiler_failure_falls_back_per_kernel_to_the_same_eager_result(monkeypatch):
    def codes(t: torch.Tensor, key: torch.Tensor, *, stochastic: bool) -> torch.Tensor:
        return rounding.round_codes(t, key, stochastic=stochastic)

    args = (torch.randn(8, 100) * 10, torch.tensor(7, dtype=torch.int32))
    compiled: list[str] = []

    def compile_failing_stochastic(fn, **kwargs):  # the nearest-rounding kernel compiles, the stochastic one fails
        compiled.append(fn.__name__)
        if "True" in fn.__name__:
            def fail(*args):
                raise RuntimeError("no C++ compiler")
            return fail
        return fn

    monkeypatch.setattr(torch, "compile", compile_failing_stochastic)
    kernel = rounding.fused(codes)  # a kernel cache of its own, so compile is called
    rounding.set_fused(True)
    with pytest.warns(UserWarning, match=r"torch.compile failed for codes .*no C\+\+ compiler") as caught:
        assert torch.equal(kernel(*args, stochastic=True), codes(*args, stochastic=True))
        assert torch.equal(kernel(*args, stochastic=True), codes(*args, stochastic=True))  # no second compile
    assert len(caught) == 1
    assert rounding._FUSED["enabled"]  # the other kernels stay fused
    assert torch.equal(kernel(*args, stochastic=False), torch.round(args[0]))
    assert compiled == ["codes__True_nnx", "codes__False_nnx"]


def test_scale_pow2_is_exact_over_the_whole_exponent_range():
    k = torch.arange(-252, 253, dtype=torch.int32)
    x = torch.full(k.shape, 1.5)
    expected = torch.tensor([1.5 * 2.0**i for i in k.tolist()]).float()  # Python doubles, rounded once
    assert torch.equal(rounding.scale_pow2(x, k), expected)
    assert torch.equal(rounding.pow2(torch.arange(-126, 128, dtype=torch.int32)),
                       torch.tensor([2.0**i for i in range(-126, 128)]).float())


# --- the 64-bit index path of the hashed uniform -------------------------------------------------

def _key(seed: int = 11) -> torch.Tensor:
    torch.manual_seed(seed)
    return rounding.draw_key(torch.device("cpu"))


def test_uniform_at_int64_equals_int32_below_two_to_the_31():
    key = _key()
    low = torch.cat([torch.arange(0, 1 << 16), torch.arange((1 << 31) - (1 << 16), 1 << 31)])
    by32 = rounding.uniform_at(low.to(torch.int32), key)
    by64 = rounding.uniform_at(low.to(torch.int64), key)
    assert torch.equal(by32, by64)
    assert torch.equal(by32[: 1 << 10], hashed_uniform(torch.Size([1 << 10]), key, torch.device("cpu")))


@pytest.mark.parametrize("base", [1 << 31, 1 << 32, 1 << 40, (1 << 62) + 12345])
def test_uniform_at_large_indices_is_uniform(base):
    u = rounding.uniform_at(torch.arange(base, base + N, dtype=torch.int64), _key()).double()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=64, min=0, max=1)
    assert (((counts - N / 64) ** 2) / (N / 64)).sum().item() < 120


@pytest.mark.parametrize("offset", [1 << 32, 1 << 33, 1 << 40])
@pytest.mark.slow
def test_indices_two_to_the_32_apart_are_uncorrelated(offset):
    key = _key()
    index = torch.arange(N, dtype=torch.int64) + (1 << 20)
    a = rounding.uniform_at(index, key).double() - 0.5
    b = rounding.uniform_at(index + offset, key).double() - 0.5
    assert abs((a * b).mean().item() / a.var().item()) < 5e-3  # standard error ~ 1e-3
    assert (a == b).double().mean().item() < 1e-3  # not the same stream (equal by chance: 2^-24)


def test_tensors_of_two_to_the_31_elements_take_the_64_bit_path(monkeypatch):
    seen = []
    real = rounding.uniform_at

    def spy(index, key):
        seen.append(index.dtype)
        return real(index, key)

    key = _key()
    small = hashed_uniform(torch.Size([40, 25]), key, torch.device("cpu"))
    monkeypatch.setattr(rounding, "uniform_at", spy)
    monkeypatch.setattr(rounding, "INT32_INDEX_LIMIT", 1000)  # pretend 1000 elements is 2^31
    assert torch.equal(hashed_uniform(torch.Size([40, 25]), key, torch.device("cpu")), small)
    hashed_uniform(torch.Size([999]), key, torch.device("cpu"))
    assert seen == [torch.int64, torch.int32]
    monkeypatch.undo()
    assert rounding.INT32_INDEX_LIMIT == 1 << 31


# --- stochastic rounding from the fractional part, in every format that rounds stochastically -----

def _fixed(wl: int, fl: int):
    return lambda x: formats.fixed_point(x, wl, fl, "stochastic")


def _block24(x: torch.Tensor) -> torch.Tensor:
    """Block floating point, 24-bit mantissas; an anchor of 2^22 in the block makes the step 1."""
    anchored = torch.cat([x, torch.tensor([2.0**22])])
    return formats.block_floating_point(anchored, 24, "stochastic")[:-1]


def _float(exp: int, man: int):
    return lambda x: formats.floating_point(x, exp, man, "stochastic")


def _range16(x: torch.Tensor) -> torch.Tensor:
    """Range-linear over [0, 65535] at 16 bits: step 1, codes equal to the values."""
    return formats.range_linear(x, 16, torch.zeros(1, 1), torch.full((1, 1), 65535.0), "stochastic")


ON_GRID = {
    # (quantizer, values on its grid where t = x / step is large)
    "fixed<24,0>": (_fixed(24, 0), torch.arange(-(1 << 22) - 4096, -(1 << 22) + 4096) * 1.0),
    "fixed<16,10>": (_fixed(16, 10), (torch.arange(20000 - 4096, 20000 + 4096) * 1.0) / 1024),
    "block24": (_block24, torch.arange((1 << 22) - 8192, (1 << 22)) * 1.0),
    "float<8,23>": (_float(8, 23), torch.randn(8192) * 1e3),
    "float<8,20>": (_float(8, 20), torch.ldexp(torch.randint(1 << 20, 1 << 21, (8192,)) * 1.0, torch.randint(-60, 40, (8192,)))),
    "range16": (_range16, torch.arange(65535 - 8192, 65536) * 1.0),
}


@pytest.mark.parametrize("name", ON_GRID)
def test_stochastic_rounding_never_moves_values_on_the_grid(name):
    quantize, x = ON_GRID[name]
    torch.manual_seed(0)
    many = x.repeat(256)
    assert torch.equal(quantize(many), many)


CASES = [
    # (name, quantizer, x, lower grid point, upper grid point, P(up) = fraction of a step above lower)
    ("fixed<24,0>", _fixed(24, 0), 2.0**20 + 0.25, 2.0**20, 2.0**20 + 1, 0.25),
    ("fixed<24,0>-", _fixed(24, 0), -(2.0**20 + 0.25), -(2.0**20) - 1, -(2.0**20), 0.75),
    ("fixed<16,10>", _fixed(16, 10), (4 + 2.0**-20) / 1024, 4 / 1024, 5 / 1024, 2.0**-20),
    ("fixed<16,10>hi", _fixed(16, 10), (5 - 2.0**-20) / 1024, 4 / 1024, 5 / 1024, 1 - 2.0**-20),
    ("block24", _block24, 2.0**20 + 0.25, 2.0**20, 2.0**20 + 1, 0.25),
    ("block24-tiny", _block24, 4 + 2.0**-20, 4.0, 5.0, 2.0**-20),
    ("float<8,20>", _float(8, 20), 2.0**20 + 0.25, 2.0**20, 2.0**20 + 1, 0.25),
    ("float<8,3>", _float(8, 3), 8 + 2.0**-20, 8.0, 9.0, 2.0**-20),
    ("float<8,3>hi", _float(8, 3), 9 - 2.0**-20, 8.0, 9.0, 1 - 2.0**-20),
    ("range16", _range16, 2.0**15 + 0.25, 2.0**15, 2.0**15 + 1, 0.25),
    ("range16-tiny", _range16, 4 + 2.0**-20, 4.0, 5.0, 2.0**-20),
]


@pytest.mark.parametrize("name,quantize,x,lower,upper,p", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_probability_of_rounding_up_is_the_fraction(name, quantize, x, lower, upper, p):
    n = 1 << 22
    torch.manual_seed(1)
    out = quantize(torch.full((n,), x))
    assert torch.all((out == lower) | (out == upper))
    p_up = (out == upper).double().mean().item()
    assert abs(p_up - p) <= 5 * math.sqrt(p * (1 - p) / n) + 2.0**-24


def test_device_constants_are_made_once_and_keys_follow_the_cpu_generator():
    a = rounding.device_constant((-8.0, 7.0), torch.float32, torch.device("cpu"))
    assert a is rounding.device_constant((-8.0, 7.0), torch.float32, torch.device("cpu"))  # shared, not rebuilt
    assert a.tolist() == [-8.0, 7.0] and rounding.device_constant(3, torch.int32, torch.device("cpu")).item() == 3
    torch.manual_seed(5)
    expected = torch.randint(-(1 << 31), 1 << 31, (), dtype=torch.int32).item()
    torch.manual_seed(5)
    key = rounding.draw_key(torch.device("cpu"))
    assert key.dtype == torch.int32 and key.shape == () and key.item() == expected
