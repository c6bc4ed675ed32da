"""Quantized weights: the one seam (base.QuantizedWeight) through which a Linear runs a product on a weight
held in a quantized format, and the formats that implement it."""
