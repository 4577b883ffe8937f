"""Number formats, rounding, quantizers, autograd primitives and quantized layers (docs/formats.md)."""
