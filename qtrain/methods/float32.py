"""float32: the plain baseline, same trainer and cost accounting (32/32/32 bits) as every method."""

from qtrain.methods.base import Method


class Float32(Method):
    name = "float32"
