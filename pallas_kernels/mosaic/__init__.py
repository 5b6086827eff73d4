"""Kernels in the Pallas Mosaic GPU lowering: Hopper (sm90) only, TMA and inline PTX; no interpret mode."""
