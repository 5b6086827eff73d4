"""Cross-check: the same tokens through transformers + bitsandbytes (+ PEFT) in torch and through
jqlora in JAX, in three stages, one module each:

  weights    every quantized weight dequantized by jqlora, by bitsandbytes and by an independent
             float64 decode (:mod:`jqlora.crosscheck.weights`)
  layers     every decoder layer's output and the logits, for each numerics, against torch
             float32 with the same numerics; the verdict (:mod:`jqlora.crosscheck.layers`, with
             the torch side in :mod:`~jqlora.crosscheck.torch_side`, jqlora's in
             :mod:`~jqlora.crosscheck.jax_side` and the report in :mod:`~jqlora.crosscheck.report`)
  products   (LLM.int8) every 8-bit product recomputed on the inputs bitsandbytes received
             (:mod:`jqlora.crosscheck.products`)

:func:`crosscheck` runs all three and returns a :class:`CrosscheckResult` (``format()`` is the
report ``jqlora crosscheck`` prints).
"""
from .jax_side import jax_states, perturb_model, random_tokens, torch_numerics_model, with_int8_numerics
from .layers import crosscheck
from .report import BF16_RATIO, DEFAULT_TOLERANCE, RUN_TITLES, CrosscheckResult, Diff, diff
from .torch_side import load_torch_model, set_int8_inference, torch_model_states, torch_states

__all__ = ["Diff", "CrosscheckResult", "crosscheck", "torch_states", "jax_states", "diff",
           "perturb_model", "random_tokens", "torch_numerics_model", "with_int8_numerics", "set_int8_inference",
           "load_torch_model", "torch_model_states", "DEFAULT_TOLERANCE", "BF16_RATIO", "RUN_TITLES"]
