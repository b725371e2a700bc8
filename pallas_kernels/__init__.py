"""Pallas kernels."""
