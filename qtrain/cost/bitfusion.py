"""BitFusion (Sharma et al., ISCA 2018), the accelerator behind FracTrain's energy and latency columns, with figures
from the authors' simulator (hsharma35/bitfusion, commit 04ec1c8, default ``conf.ini``). The sources of each figure
and where the model is simpler than the simulator: docs/cost.md."""

from __future__ import annotations

import math

FREQUENCY_HZ = 500e6
FUSION_UNITS = 8 * 8
CORE_J_PER_CYCLE = 3_673_500e-9 * 4 / FREQUENCY_HZ
WEIGHT_READ_J_PER_BIT = 0.1072e-12
INPUT_READ_J_PER_BIT = 0.1997e-12
OUTPUT_WRITE_J_PER_BIT = 0.1137e-12
DRAM_J_PER_BIT = 15e-12
DRAM_BITS_PER_CYCLE = 128
OUTPUT_BITS = 32


def lanes(bits: float) -> float:
    """An operand's factor in MACs per fusion unit and cycle: 8-bit units split into 2-bit bricks, wider ones pass again."""
    if bits <= 8:
        return math.floor(8 / max(bits, 2))
    return 1 / math.ceil(bits / 8)


def macs_per_cycle(bits_a: float, bits_b: float) -> float:
    """MACs per cycle of the array for operands of ``bits_a`` and ``bits_b`` bits (0 where either is 0 bits)."""
    if bits_a <= 0 or bits_b <= 0:
        return 0.0
    return FUSION_UNITS * lanes(bits_a) * lanes(bits_b)


class BitFusion:
    name = "bitfusion"

    def gemm(self, options: list[tuple[float, float, float, float, float]], macs: float,
             elements: tuple[int, int, int]) -> tuple[float, float]:
        """(seconds, joules) of a GEMM of ``macs`` MACs on operands of ``elements`` = (input-side, weight-side, output),
        options ``(share, a, b, a_mac, b_mac)``: bits moved per element, widths the fusion units multiply."""
        a_elems, b_elems, out_elems = elements
        compute = a_bits = b_bits = done = 0.0
        for share, a, b, a_mac, b_mac in options:
            rate = macs_per_cycle(a_mac, b_mac)
            if rate:  # a skipped (0-bit) share moves and computes nothing
                compute += share * macs / rate
                a_bits += share * a_elems * a
                b_bits += share * b_elems * b
                done += share
        out_bits = done * out_elems * OUTPUT_BITS
        dram_bits = a_bits + b_bits + out_bits
        cycles = max(compute, dram_bits / DRAM_BITS_PER_CYCLE)
        joules = (compute * CORE_J_PER_CYCLE + a_bits * INPUT_READ_J_PER_BIT + b_bits * WEIGHT_READ_J_PER_BIT
                  + out_bits * OUTPUT_WRITE_J_PER_BIT + dram_bits * DRAM_J_PER_BIT)
        return cycles / FREQUENCY_HZ, joules

    def layer_overhead(self, fmt: str, macs: float) -> tuple[float, float]:
        return 0.0, 0.0
