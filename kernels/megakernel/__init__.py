"""Pallas TPU decode megakernel: one pallas_call per decode step, all layers (see docs)."""
