"""Developer profiling tools: per-kernel breakdowns, the training-step trace, Nsight Compute."""
