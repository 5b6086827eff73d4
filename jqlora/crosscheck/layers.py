"""Cross-check stage 2, layers: the same tokens through transformers + bitsandbytes (+ PEFT) in torch
and through jqlora in JAX, every decoder layer's output compared; and `crosscheck`, which runs the
three stages (weights: `jqlora.crosscheck.weights`, first; LLM.int8 products:
`jqlora.crosscheck.products`, recorded during this stage's torch forward) and gives the verdict.

What is compared (names in the report):

  embed            the token embeddings (input of layer 0)
  layer.N          the output hidden state of decoder layer N (torch: a forward hook on
                   `model.layers[N]`; JAX: `CausalLM.__call__(..., return_states=True)`, the
                   production forward)
  norm             the final RMSNorm output
  logits           the model output

For each: max |jax - torch| and relative error = max |jax - torch| / max |torch|, always against
torch float32 computing with the same numerics as the column (like with like). The jqlora runs:

  own              the model as it trains and generates: 4-bit weights dequantized straight into
                   the compute dtype inside qmatmul, 8-bit weights weight-only (dequantize, then
                   matmul). Reference: torch float32 with bitsandbytes' exact-weight path.
  stored-rounded   (4-bit checkpoints) each 4-bit weight dequantized into its stored dtype (bf16
                   or fp16 in real checkpoints), then cast to the compute dtype: what older
                   bitsandbytes forwards compute. Built here, for the cross-check only, by
                   replacing the model's Weight4bit bases with those dense weights (no
                   re-quantization). Against a bf16-stored checkpoint in float32 it differs from
                   `own` by the bf16 rounding of the weights (1e-2 relative is normal).
  llm_int8         (8-bit checkpoints, `int8_numerics="llm_int8"`, the default) jqlora's
                   reproduction of bitsandbytes' inference path: int8 activations, 16-bit
                   outlier columns. Reference: torch float32 with its Linear8bitLt layers in
                   eval mode (bitsandbytes' LLM.int8 inference).

The stored-rounded place is the cross-check's model build rather than a flag on qmatmul /
QLoRALinear: the rounding is a property of the comparison (what the reference computes), not a
numerics a user should train with. Stage 1 (weights) proves that all runs start from the same
weights. End to end, LLM.int8 is no fine instrument (a float32 ulp upstream moves an activation
across an int8 rounding boundary sooner or later): its products (stage 3) are where a wrong LLM.int8
computation shows.

Verdict. float32: the verdict run's logits relative error <= tolerance (default 1e-3); the verdict
run is `own` or `stored-rounded` (`weight_rounding`) and, for 8-bit checkpoints, `own`
(weight-only: deterministic, so it pins everything around the products), plus every LLM.int8
product agreeing. bfloat16 and float16: a fixed tolerance says little (a real model's residual
stream reaches 1e4), so the bar is torch's own error: torch runs in float32 and in the low dtype
on the same tokens, with the same numerics, and the check passes when jqlora's low-precision
logits (`own`; `llm_int8` for LLM.int8) are within `bf16_ratio` (default 2) times torch's
low-precision error, both measured against torch float32, and (LLM.int8) every product agrees.
An explicit `tolerance` replaces the ratio by a fixed bound on the same error. Any jqlora weight
that disagrees with the independent decode fails the check in every dtype.

Which bitsandbytes path is the reference: on CPU, an eval-mode `Linear4bit` on a machine with
AVX512-BF16 repacks the weight and runs a fused kernel that rounds activations and scales to
bf16 (~1e-2 relative error by itself). By default the torch side runs bitsandbytes' reference
path instead (the bnb linear layers in training mode: dequantize exactly, then F.linear; nothing
else depends on the mode because dropout modules stay in eval mode). `bnb_cpu_kernel=True` keeps
the fused kernel. LLM.int8 layers run both ways: training mode (MatMul8bitFp: x @ (CB * SCB /
127).T) for `own`, eval mode (MatMul8bitLt) for `llm_int8`; `int8_numerics="weight_only"` leaves
the eval mode out. LLM.int8 weights are not rounded to a stored dtype by bitsandbytes, so there is
no stored-rounded run for them.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Optional

import numpy as np

from .jax_side import (jax_states, perturb_model, random_tokens, torch_numerics_model, with_fp8_base_products,
                       with_int8_numerics)
from .products import Int8ProductRecorder
from .report import BF16_RATIO, DEFAULT_TOLERANCE, RUN_TITLES, CrosscheckResult, diff
from .torch_side import load_torch_model, set_int8_inference, share_experts, torch_model_states
from .weights import bnb_weight_rounding, check_weights, patch_torch_weights


def _diffs(names, ours, ref) -> list:
    return [diff(n, ours[n], ref[n]) for n in names]


def crosscheck(path, *, adapter=None, ids: Optional[np.ndarray] = None, tokens: int = 16, batch: int = 2,
               seed: int = 0, dtype: str = "float32", tolerance: Optional[float] = None, jax_model=None,
               bnb_cpu_kernel: bool = False, int8_numerics: str = "llm_int8", perturb: float = 0.0,
               backend: str = "auto", bf16_ratio: float = BF16_RATIO,
               weight_rounding: str = "auto", quantize_experts: str = "none",
               base_matmul: str = "compute") -> CrosscheckResult:
    """Compare jqlora (JAX) with transformers + bitsandbytes (+ PEFT) on the same tokens: weights,
    every layer with each numerics, and LLM.int8 products (the stages: `jqlora.crosscheck.weights`,
    the module docstring, `jqlora.crosscheck.products`; the verdict: the module docstring).

    Args:
      path: the checkpoint folder (bitsandbytes 4/8-bit or plain).
      adapter: a PEFT adapter folder, applied on both sides.
      ids: (batch, tokens) token ids; None: `batch` x `tokens` random ids from `seed`.
      dtype: the compute dtype of both sides: "float32", "bfloat16" or "float16".
      tolerance: float32: bound on the verdict run's logits relative error (default
        DEFAULT_TOLERANCE). Lower precision: None applies the relative rule (`bf16_ratio`); a
        number bounds jqlora's logits error against torch float32 instead.
      jax_model: use this model instead of loading `path` (+ adapter) with jqlora (not modified,
        except by `perturb`; its 8-bit layers run with each numerics, whatever it was built with).
      bnb_cpu_kernel: keep bitsandbytes' fused eval-mode CPU 4-bit kernel (module docstring).
      int8_numerics: "llm_int8" (default): 8-bit checkpoints are also compared in bitsandbytes'
        LLM.int8 inference numerics, with the product stage; "weight_only": only the weight-only run.
      perturb: scale the JAX model's layer-0 input norm by (1 + perturb): a self-test.
      backend: the qmatmul backend of the JAX model jqlora loads.
      bf16_ratio: the low-precision rule's factor.
      weight_rounding: which jqlora run the float32 verdict is about on 4-bit checkpoints: "own"
        (4-bit weights dequantized into the compute dtype), "stored" (rounded to the stored dtype
        first), or "auto": the one the installed bitsandbytes computes (`bnb_weight_rounding`).
        Both runs are always reported.
      quantize_experts: the format of a mixture-of-experts model's dense experts on the JAX side
        (`load_causal_lm`; "none": as stored, as transformers holds them). Quantized, the torch
        side gets the same dequantized experts (`share_experts`).
      base_matmul: "fp8" adds a run ("fp8") of the JAX model with FP8 base products for its 4-bit
        weights, against the same torch float32 reference, reported beside the others and never
        part of the verdict. The FP8 products run from `FP8_MIN_ROWS` rows (batch x tokens) up.
    """
    import jax.numpy as jnp

    from jqlora import quant
    from jqlora.adapters import load_model_with_adapter
    from jqlora.lora import named_linears

    if dtype not in DEFAULT_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(DEFAULT_TOLERANCE)}, got {dtype!r}")
    if int8_numerics not in ("llm_int8", "weight_only"):
        raise ValueError(f"int8_numerics must be 'llm_int8' or 'weight_only', got {int8_numerics!r}")
    if base_matmul not in ("compute", "fp8"):
        raise ValueError(f"base_matmul must be 'compute' or 'fp8', got {base_matmul!r}")
    if weight_rounding not in ("auto", "own", "stored"):
        raise ValueError(f"weight_rounding must be 'auto', 'own' or 'stored', got {weight_rounding!r}")
    path = Path(path)
    notes = []
    if jax_model is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax_model, report, _ = load_model_with_adapter(path, adapter, compute_dtype=jnp.dtype(dtype),
                                                           int8_numerics=int8_numerics, backend=backend,
                                                           quantize_experts=quantize_experts)
        for w in caught:
            # transformers builds its layers from that list, so the torch side cannot run this folder
            if "llm_int8_skip_modules" in str(w.message):
                from interop.errors import CheckpointError

                raise CheckpointError(f"the torch side cannot load this checkpoint: {w.message}")
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if report is not None:
            notes.append(f"adapter: {len(report['matched'])} LoRA modules applied on both sides")
    if perturb:
        perturb_model(jax_model, perturb)
        notes.append(f"JAX side deliberately perturbed: layer 0 input_layernorm weight x (1 + {perturb})")
    bases = [l.base.get_value() for _, l in named_linears(jax_model)]
    has_4bit = any(isinstance(b, quant.Weight4bit) for b in bases)
    int8_act = int8_numerics == "llm_int8" and any(isinstance(b, quant.Int8Weight) for b in bases)
    if ids is None:
        ids = random_tokens(jax_model.config.vocab_size, tokens, batch, seed)
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (batch, tokens), got shape {ids.shape}")
    from jqlora.ops.fp8 import FP8_MIN_ROWS

    if base_matmul == "fp8" and ids.size < FP8_MIN_ROWS:
        raise ValueError(f"base_matmul='fp8' needs at least {FP8_MIN_ROWS} rows (batch x tokens), got "
                         f"{ids.shape[0]} x {ids.shape[1]}: fewer rows run the compute-dtype products")
    if base_matmul == "fp8" and not has_4bit:
        notes.append("--base-matmul fp8: no 4-bit weights, so no FP8 run")
    lowp = dtype != "float32"
    explicit_tol = tolerance is not None
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE[dtype]
    kw = dict(adapter=adapter, bnb_cpu_kernel=bnb_cpu_kernel)
    own_model = with_int8_numerics(jax_model, "weight_only")
    int8_model = with_int8_numerics(jax_model, "llm_int8") if int8_act else None

    # stage 1: weights (on the float32 torch model, before any forward can repack bnb weights);
    # the exact reference: float32, LLM.int8 layers on bitsandbytes' weight-only path
    tm32 = load_torch_model(path, dtype="float32", int8_numerics="weight_only", **kw)
    shared = share_experts(tm32, jax_model)
    if shared:
        notes.append(f"{shared} expert stacks quantized on the JAX side; the torch side multiplies the same "
                     "dequantized experts")
    weights, fixes = check_weights(tm32, jax_model)
    fixes = {n: r for n, r in fixes.items() if next(w for w in weights if w.name == n).kind != "int8"}
    stored = {w.name: w.stored_dtype for w in weights}
    torch_rounding = bnb_weight_rounding()
    patch_torch_weights(tm32, fixes, stored, torch_rounding)
    refs = {"own": torch_model_states(tm32, ids)}
    references = {"own": "torch float32", "stored": "torch float32", "fp8": "torch float32"}
    products = []
    if int8_act:  # the same float32 model, its LLM.int8 layers on the inference path
        set_int8_inference(tm32)
        with _recording(tm32, int8_model, not lowp) as rec:
            refs["llm_int8"] = torch_model_states(tm32, ids)
        products = rec.checks if rec else []
        references["llm_int8"] = "torch float32 LLM.int8"
    del tm32
    if bnb_cpu_kernel:
        notes.append("torch side uses bitsandbytes' eval-mode CPU kernel (may round to bf16 internally)")
    names = ["embed"] + [f"layer.{i}" for i in range(len(jax_model.model.layers))] + ["norm"]
    missing = [n for n in names + ["logits"] if n not in refs["own"]]
    if missing:
        raise RuntimeError(f"torch side produced no {missing} (hooks did not fire)")
    all_names = names + ["logits"]

    # stage 2: layers, each numerics against torch float32 with the same numerics
    cdt = jnp.dtype(dtype)
    runs = {}
    if int8_act:
        runs["llm_int8"] = _diffs(all_names, jax_states(int8_model, ids), refs["llm_int8"])
    runs["own"] = _diffs(all_names, jax_states(own_model, ids), refs["own"])
    if has_4bit:
        runs["stored"] = _diffs(all_names, jax_states(torch_numerics_model(own_model, cdt), ids), refs["own"])
    if has_4bit and base_matmul == "fp8":  # reported beside the others, never the verdict's run
        runs["fp8"] = _diffs(all_names, jax_states(with_fp8_base_products(own_model), ids), refs["own"])
    jq_bad = [w.name for w in weights if not w.jqlora_ok]
    if not lowp:
        key = "own"
        if has_4bit:
            key = weight_rounding if weight_rounding != "auto" else ("stored" if torch_rounding == "stored" else "own")
        err = runs[key][-1].rel
        passed = bool(np.isfinite(err) and err <= tolerance)
        others = "; ".join(f"jqlora {RUN_TITLES[k].removeprefix('jqlora ')}: {runs[k][-1].rel:.3e}"
                           for k in runs if k != key)
        rule = (f"logits relative error {err:.3e} (jqlora {key}) {'<=' if passed else '>'} tolerance "
                f"{tolerance:.1e}" + (f"; {others} (for information)" if others else ""))
        if int8_act:
            rule += ("; LLM.int8 end to end is judged by its products: once a near-tie of an int8 activation "
                     "code falls the other way, the runs differ by an int8 step")
        torch_lowp_rel, ratio, what = None, None, dtype
    else:
        key = "llm_int8" if int8_act else "own"  # the low-precision verdict: like with like
        what = dtype + (" LLM.int8" if int8_act else "")
        tml = load_torch_model(path, dtype=dtype, int8_numerics=int8_numerics, **kw)  # torch's own low precision
        share_experts(tml, jax_model)
        patch_torch_weights(tml, fixes, stored, torch_rounding)
        with _recording(tml, int8_model, int8_act) as rec:
            refl = torch_model_states(tml, ids)
        products = rec.checks if rec else products
        del tml
        runs = {"torch_lowp": _diffs(all_names, refl, refs[key]), **runs}
        references["torch_lowp"] = references[key]
        err, torch_lowp_rel, ratio = runs[key][-1].rel, runs["torch_lowp"][-1].rel, float(bf16_ratio)
        if explicit_tol:
            passed = bool(np.isfinite(err) and err <= tolerance)
            rule = (f"jqlora {what} logits error {err:.3e} vs {references[key]} {'<=' if passed else '>'} "
                    f"tolerance {tolerance:.1e} (torch's own {what} error: {torch_lowp_rel:.3e})")
        else:
            bound = ratio * torch_lowp_rel
            passed = bool(np.isfinite(err) and err <= bound)
            rule = (f"jqlora {what} logits error {err:.3e} vs {references[key]} {'<=' if passed else '>'} "
                    f"{ratio:g} x torch's own {what} error {torch_lowp_rel:.3e}")
    bad_products = [p.name for p in products if not p.ok]
    if bad_products:
        passed = False
        rule += (f"; LLM.int8 products: {len(bad_products)} of {len(products)} differ from bitsandbytes by more "
                 f"than one {dtype} ulp: {', '.join(bad_products[:4])}" + (" ..." if len(bad_products) > 4 else ""))
    elif products:
        rule += f"; LLM.int8 products: all {len(products)} within one {dtype} ulp of bitsandbytes"
    if jq_bad:
        passed = False
        rule += f"; jqlora's weights disagree with the independent decode: {', '.join(jq_bad[:4])}" + \
            (" ..." if len(jq_bad) > 4 else "")
    if lowp and "fp8" in runs:
        rule += f"; jqlora fp8 base products: logits error {runs['fp8'][-1].rel:.3e} (for information)"
    if fixes:
        rule += f"; {len(fixes)} bitsandbytes weight(s) decoded wrongly by bitsandbytes (see above), not a jqlora failure"
    verdict_runs = runs[key]
    return CrosscheckResult(path=str(path), adapter=None if adapter is None else str(adapter), dtype=dtype,
                            tokens_shape=tuple(ids.shape), tolerance=float(tolerance), layers=verdict_runs[:-1],
                            logits=verdict_runs[-1], passed=passed, notes=notes, verdict_numerics=key,
                            reference=references[key], references={k: references[k] for k in runs},
                            runs=runs, weights=weights, products=products, rule=rule,
                            torch_rounding=torch_rounding, lowp_label=what,
                            torch_lowp_rel=torch_lowp_rel, bf16_ratio=ratio)


def _recording(tm, jax_model, on: bool):
    """An `Int8ProductRecorder` on `tm` when `on`, else a context that yields None."""
    return Int8ProductRecorder(tm, jax_model) if on else contextlib.nullcontext()


__all__ = ["crosscheck"]
