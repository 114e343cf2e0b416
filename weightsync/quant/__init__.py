"""Quantized weights on the wire: block FP8 (:mod:`weightsync.quant.fp8`) and which tensors an engine holds so
(:mod:`weightsync.quant.config`)."""
