"""BitFusion (Sharma et al., ISCA 2018), the accelerator behind FracTrain's energy and latency columns.

Figures from the authors' simulator, github.com/hsharma35/bitfusion (commit 04ec1c8), default
``conf.ini``: an 8 x 8 array of fusion units at 500 MHz; weight, input and output buffers of 256,
64 and 16 KiB; 2-bit BitBricks, 8 bits at most; a DRAM interface of 128 bits per cycle.

- Fusion rule (``Accelerator.get_perf_factor``): an 8-bit fusion unit does
  ``floor(8 / max(b_a, 2)) * floor(8 / max(b_w, 2))`` MACs per cycle, so 3 bits cost like 4 and 5-7
  like 8. The simulator cannot run wider operands (its factor becomes 0); here an operand of b > 8
  bits is ``ceil(b / 8)`` 8-bit passes (FracTrain's 12- and 16-bit gradients take 2; a float32
  operand, priced as a 32-bit integer one for comparison only, takes 4). A 0-bit operand takes none.
- Core energy: ``results/systolic_array_synth.csv``'s 4 x 4 array at 8/2 bits, 3,673,500 nW of
  dynamic power at 500 MHz, scaled to 8 x 8 as the simulator does (x 4): 29.39 pJ per cycle.
- SRAM energy per bit (``sram/cacti_sweep.csv``, 45 nm, CACTI's read or write energy per access over
  the 32-bit word, as the simulator divides it): weight buffer read 0.1072 pJ (64 banks of 4 KiB),
  input buffer read 0.1997 pJ (8 banks of 8 KiB), output buffer write 0.1137 pJ (8 banks of 2 KiB;
  the sweep holds that bank only without a read-write port, which is the row used here).
- DRAM: 15 pJ per bit (``Stats.get_energy``'s ``dram_cost``).

Model (simpler than the simulator's tiling search, and stated so): per GEMM, compute cycles are the
MACs over 64 fusion units at the fusion rule's rate; each operand element crosses DRAM and its
buffer once at its bit-width (the input-side operand through the input buffer, the weight-side one
through the weight buffer) and each output element that is computed is written once at 32 bits
(partial sums are 32-bit in the simulator); the GEMM takes the longer of its compute cycles and its DRAM transfer at
128 bits per cycle, as the simulator's memory stall does. Energy is the core's per-cycle energy over
the compute cycles plus the buffer and DRAM traffic; leakage is left out, as in the simulator.
Where a share of a GEMM's work is skipped (a 0-bit block or option), that share moves no operand
and writes no output: the traffic scales with the share done, the finer pattern of which elements
a skipped block would still have read is not modelled.
"""

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

    def gemm(self, options: list[tuple[float, float, float]], macs: float,
             elements: tuple[int, int, int]) -> tuple[float, float]:
        """(seconds, joules) of a GEMM of ``macs`` MACs on operands of ``elements`` = (input-side, weight-side, output)."""
        a_elems, b_elems, out_elems = elements
        compute = a_bits = b_bits = done = 0.0
        for share, a, b in options:
            rate = macs_per_cycle(a, b)
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
