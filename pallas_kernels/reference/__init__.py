"""The jnp side of the kernels, one module per kernel family: reference oracles, operand checks,
and the jnp steps a kernel shares with its oracle. `fourbit` (NF4/FP4), `int8` (weight-only and
LLM.int8), `grouped` (the mixture-of-experts products). No Pallas here: both lowerings
(`triton/`, `mosaic/`) and `jqlora.ops.products` (the xla path of LLM.int8) import from these
modules, and nothing in them needs a GPU.

Each oracle names the numerics class it defines (`registry.NUMERICS`, docs/numerics.md); each
kernel module re-exports the oracles of its variants, so a kernel still sits beside its
reference.
"""
