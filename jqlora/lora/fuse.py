"""Linear layers that read one input, run as one layer: a decoder layer's q, k and v (gate and up)
while decoding. At one token a 4-bit product costs about 4 us however small its weight (one H200:
k_proj of Llama-3.2-1B 4.3 us, q|k|v as one product 4.5 us; benchmarks/results/JOURNAL.md), so
fewer, larger products are most of what a decoded token can save in its projections.

The fused layer computes what the layers compute, concatenated along the output: its base is the
bases' rows stacked (`jqlora.quant.stacked_rows`); its LoRA branch stacks the A matrices and places each
B in its own rows and rank columns of one block matrix (zeros elsewhere), so no layer's output
reads another's LoRA. Where the layers' LoRA scales differ, each B carries its own scale and the
fused scale is 1 (one more rounding of B, in the LoRA arrays' dtype). Biases concatenate
(zeros for a layer without one). The fused layer has no dropout: it is built for inference."""
from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from jqlora.lora.linear import QLoRALinear
from jqlora.quant.stacked_rows import concat_rows, rows_problem


def fusion_problem(linears: Sequence[QLoRALinear]) -> Optional[str]:
    """Why `linears` cannot run as one layer, or None when they can."""
    if len(linears) < 2:
        return "fewer than two layers"
    settings = {(str(m.compute_dtype), m.backend, m.numerics, str(m.param_dtype)) for m in linears}
    if len(settings) > 1:
        return f"different settings (compute dtype, backend, numerics, LoRA dtype): {sorted(settings)}"
    if any(m._dropout_active() for m in linears):
        return "LoRA dropout is active (training mode)"
    if any(m.lora_A[...].ndim != 2 for m in linears if m.rank):
        return "stacked LoRA matrices (a layer stack, not one layer)"
    return rows_problem([m.base.get_value() for m in linears])


def fuse_linears(linears: Sequence[QLoRALinear]) -> QLoRALinear:
    """One `QLoRALinear` whose output is the layers' outputs concatenated in order; ValueError
    naming the reason when they cannot be fused (`fusion_problem`)."""
    problem = fusion_problem(linears)
    if problem:
        raise ValueError(f"fuse_linears: {problem}")
    first = linears[0]
    bias = None
    if any(m.bias is not None for m in linears):
        bias_dtype = next(m.bias[...].dtype for m in linears if m.bias is not None)
        bias = jnp.concatenate([m.bias[...].astype(bias_dtype) if m.bias is not None
                                else jnp.zeros((m.out_features,), bias_dtype) for m in linears])
    with_lora = [m for m in linears if m.rank]
    # the LoRA arrays' own dtype: rollouts cast them to the compute dtype once, before their loop
    dtype = jnp.result_type(*(m.lora_A[...] for m in with_lora)) if with_lora else first.param_dtype
    fused = QLoRALinear(concat_rows([m.base.get_value() for m in linears]), bias=bias,
                        compute_dtype=first.compute_dtype, backend=first.backend, param_dtype=dtype,
                        numerics=first.numerics)
    if not with_lora:
        return fused
    scales = {m.scale for m in with_lora}
    scale = scales.pop() if len(scales) == 1 else 1.0
    rank = sum(m.rank for m in with_lora)
    blocks, col = [], 0
    for m in linears:
        block = jnp.zeros((m.out_features, rank), dtype)
        if m.rank:
            b = m.lora_B[...].astype(dtype)
            if scale != m.scale:
                b = b * jnp.asarray(m.scale, dtype)
            block = block.at[:, col:col + m.rank].set(b)
            col += m.rank
        blocks.append(block)
    lora_a = jnp.concatenate([m.lora_A[...].astype(dtype) for m in with_lora])
    fused.attach_lora(rank, rank, use_rslora=False, lora_A=lora_a)
    fused.set_lora(lora_a, jnp.concatenate(blocks))
    fused.scale = scale  # exactly the layers' scale (alpha / rank would round it again)
    return fused
