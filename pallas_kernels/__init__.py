"""Pallas kernels for moejax: FP8 block-scaled and grouped GEMMs, token movement."""
