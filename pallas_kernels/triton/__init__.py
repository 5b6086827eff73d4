"""Kernels in the Pallas Triton lowering: any CUDA GPU of Ampere or later; interpret mode on CPU."""
