"""A bit-serial accelerator (UNPU, Lee et al. 2018/2019), the hardware DYNASTY extends (DYNASTY paper Sec. 4-5):
time linear in the serial operand's bit-width, energy its power times the time, plus the DYNASTY module's for
DYNASTY's layers. The figures' sources and the model's fit to Fig. 8: docs/cost.md."""

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

    def gemm(self, options: list[tuple[float, float, float, float, float]], macs: float,
             _elements: tuple[int, int, int]) -> tuple[float, float]:
        """(seconds, joules) of a GEMM of ``macs`` MACs whose options are ``(share, a, b, a_mac, b_mac)``: the serial
        and parallel widths are the multiplied ones (a scaled format's significands)."""
        seconds = sum(share * macs * cycles_per_mac(a, b) for share, _, _, a, b in options) / FREQUENCY_HZ
        return seconds, seconds * POWER_W

    def layer_overhead(self, fmt: str, macs: float) -> tuple[float, float]:
        """The DYNASTY module's energy for a layer of ``macs`` MACs per GEMM (three GEMMs); no time (it runs alongside)."""
        power = MODULE_POWER_W.get(fmt, 0.0)
        return 0.0, power * 3 * macs * cycles_per_mac(MODULE_BITS, 8) / FREQUENCY_HZ
