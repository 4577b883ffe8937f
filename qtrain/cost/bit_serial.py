"""A bit-serial accelerator (UNPU, Lee et al. 2018/2019), the hardware DYNASTY extends (DYNASTY paper Sec. 4-5).

Time is linear in the serial operand's bit-width (DYNASTY paper Sec. 4: "linear speedup as the
operation bit-width shrinks"). Figures:

- UNPU (Lee et al., IEEE JSSC 54(1):173-185, 2019, abstract): 200 MHz, 345.6 GOPS peak at 16-bit
  weights, so 345.6e9 / 2 ops per MAC / 200e6 Hz * 16 bits = 13,824 weight-bit-MACs per cycle; its
  activations are 16 bits wide. Its 7,372 GOPS at 1-bit weights is 21x the 16-bit figure, not the
  16x a linear model gives; the linear model is calibrated at 16 bits.
- DYNASTY Table 2 (UNPU's figures as the paper uses them): main accelerator 297 mW at 200 MHz;
  DYNASTY module 10.3 mW (4-bit, ImageNet).

Model: in each GEMM the narrower operand is serial and the wider one parallel, in passes of 16 bits
(``ceil(b / 16)``; DYNASTY's static 8-bit operand takes one); a 0-bit operand takes no cycles.
Energy is the accelerator's power times the time. DYNASTY's layers (format ``block-fp-map``) also pay
the DYNASTY module: it analyses a fixed amount of data per step, so its energy per step is its Table 2
power times the time the step takes at 4 bits; its overhead is then 3.5 % at 4 bits and 6.9 % at 2,
close to the 4.1 % and 8.2 % that Fig. 8's energy and time imply (the paper's text: at most 7.9 %).
UNPU has no float unit (the paper leaves float32 out of Fig. 7): a float32 operand is priced as a
32-bit integer one, a stand-in for comparison only.
"""

from __future__ import annotations

import math

from qtrain.quant.block_maps import BlockMapped

FREQUENCY_HZ = 200e6
BIT_MACS_PER_CYCLE = 345.6e9 / 2 / FREQUENCY_HZ * 16
PARALLEL_BITS = 16
POWER_W = 297e-3
MODULE_POWER_W = {BlockMapped.fmt: 10.3e-3}  # the DYNASTY module, at the 4-bit operating point of Table 2
MODULE_BITS = 4


def cycles_per_mac(bits_a: float, bits_b: float) -> float:
    """Cycles of one MAC: the narrower operand's bits times the wider one's 16-bit passes, over the array."""
    serial, parallel = min(bits_a, bits_b), max(bits_a, bits_b)
    if serial <= 0:
        return 0.0
    return serial * math.ceil(parallel / PARALLEL_BITS) / BIT_MACS_PER_CYCLE


class BitSerial:
    name = "bit_serial"

    def gemm(self, options: list[tuple[float, float, float]], macs: float,
             _elements: tuple[int, int, int]) -> tuple[float, float]:
        """(seconds, joules) of a GEMM of ``macs`` MACs whose operand bits are ``(share, a, b)`` options."""
        seconds = sum(share * macs * cycles_per_mac(a, b) for share, a, b in options) / FREQUENCY_HZ
        return seconds, seconds * POWER_W

    def layer_overhead(self, fmt: str, macs: float) -> tuple[float, float]:
        """The DYNASTY module's energy for a layer of ``macs`` MACs per GEMM (three GEMMs); no time (it runs alongside)."""
        power = MODULE_POWER_W.get(fmt, 0.0)
        return 0.0, power * 3 * macs * cycles_per_mac(MODULE_BITS, 8) / FREQUENCY_HZ
