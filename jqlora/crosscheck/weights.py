"""Cross-check stage 1, weights: each quantized linear weight of a jqlora model checked against
bitsandbytes and an independent numpy decode of the raw bitsandbytes state (run by
`jqlora.crosscheck.crosscheck` before the layer stage, on the float32 torch model).

Every quantized linear weight is dequantized three ways: by jqlora, by bitsandbytes
(`dequantize_4bit` / `int8_vectorwise_dequant`, the calls its forward makes) and by an independent
decode in numpy (code table x absmax in float64, the double-quantized absmax de-nested in float32 as
the format defines it; int8: CB x SCB / 127). A side whose weight differs from the independent
decode by more than its output dtype's rounding is named with the tensor and shape. A bitsandbytes
weight that disagrees is a bitsandbytes problem, not a jqlora failure (bitsandbytes 0.50.2's CPU
`dequantize_4bit` is wrong when in_features is not a multiple of the blocksize): the torch reference
then uses the independent decode for that weight, so the layer comparison
(`jqlora.crosscheck.layers`) still tests jqlora. A jqlora weight that disagrees fails the check in
every dtype. This stage proves that all runs of the layer stage start from the same weights.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

JQLORA_WEIGHT_RTOL = 1e-6  # jqlora dequantizes in float32: a few float32 roundings of max |w|


@dataclasses.dataclass
class WeightCheck:
    """One quantized weight decoded three ways; errors relative to max |independent decode|."""

    name: str
    shape: tuple
    kind: str  # "nf4" | "fp4" | "int8"
    stored_dtype: str
    jqlora_rel: float  # jqlora's float32 dequantization vs the independent decode
    bnb_rel: float  # bitsandbytes' dequantization (in its output dtype) vs the independent decode
    bnb_rtol: float  # what bnb_rel may be: its output dtype's rounding
    same_bytes: bool  # jqlora and bitsandbytes hold the same packed codes and scales

    @property
    def jqlora_ok(self) -> bool:
        return self.same_bytes and self.jqlora_rel <= JQLORA_WEIGHT_RTOL

    @property
    def bnb_ok(self) -> bool:
        return self.bnb_rel <= self.bnb_rtol

    def to_dict(self):
        return dict(dataclasses.asdict(self), shape=list(self.shape), jqlora_ok=self.jqlora_ok, bnb_ok=self.bnb_ok)



def format_weights(weights) -> list:
    """Report lines for stage 1: the worst jqlora error, then each weight either side got wrong."""
    if not weights:
        return ["  weights: no quantized weights"]
    bad_bnb = [w for w in weights if not w.bnb_ok]
    bad_jq = [w for w in weights if not w.jqlora_ok]
    worst = max(w.jqlora_rel for w in weights)
    out = [f"  weights: {len(weights)} quantized tensors decoded by jqlora, bitsandbytes and an independent float64 "
           f"decode; jqlora worst relative error {worst:.1e}"
           + ("" if bad_bnb or bad_jq else ", bitsandbytes within its output rounding: all agree")]
    for w in bad_jq:
        why = "holds other packed codes or scales than bitsandbytes loaded" if not w.same_bytes else \
            f"differs from the independent decode (relative error {w.jqlora_rel:.2e})"
        out.append(f"  jqlora problem: {w.name} {tuple(w.shape)} {w.kind}: jqlora's weight {why}")
    for w in bad_bnb:
        out.append(f"  bitsandbytes problem: {w.name} {tuple(w.shape)} {w.kind}: bitsandbytes dequantizes it to "
                   f"{w.bnb_rel:.2e} relative error against the independent decode (its {w.stored_dtype} rounding "
                   f"allows {w.bnb_rtol:.1e}); jqlora's {w.jqlora_rel:.1e}. Not a jqlora failure: the torch "
                   "reference uses the independent decode for this weight")
    return out


# ------------------------------------------------------------------------------ independent decode
def _to_np(t) -> np.ndarray:
    from interop.torch_bridge import torch_to_numpy

    return np.asarray(torch_to_numpy(t))


def _denest_absmax(qs) -> np.ndarray:
    """Per-block float32 scales of a bitsandbytes QuantState, de-nested in numpy as the format
    defines it: float32(nested_code[byte] * nested_absmax[block]) + offset, two float32 roundings."""
    absmax = _to_np(qs.absmax)
    if not qs.nested:
        return absmax.astype(np.float32)
    s2 = qs.state2
    code2 = _to_np(s2.code).astype(np.float32)
    am2 = _to_np(s2.absmax).astype(np.float32)
    idx = absmax.astype(np.int64)
    scale = np.repeat(am2, s2.blocksize)[: idx.size]
    return (code2[idx] * scale).astype(np.float32) + np.float32(float(qs.offset))


def decode_4bit(packed, quant_state) -> np.ndarray:
    """The float64 weight of a bitsandbytes 4-bit tensor: code[nibble] x absmax[block] (element 2j
    in the high nibble), computed in numpy from the raw state alone.

    Args:
      packed: the packed uint8 tensor (any shape; read flat).
      quant_state: its `bitsandbytes.functional.QuantState`.
    """
    qs = quant_state
    raw = _to_np(packed).reshape(-1)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    shape = tuple(int(d) for d in qs.shape)
    n = int(np.prod(shape))
    codes = np.stack([raw >> 4, raw & 0xF], axis=-1).reshape(-1)[:n].astype(np.int64)
    table = _to_np(qs.code).astype(np.float64)
    absmax = _denest_absmax(qs).astype(np.float64)
    scale = np.repeat(absmax, qs.blocksize)[:n]
    return (table[codes] * scale).reshape(shape)


def decode_int8(cb, scb) -> np.ndarray:
    """The float64 weight of an LLM.int8 tensor: CB x SCB / 127 per row."""
    return _to_np(cb).astype(np.float64) * (_to_np(scb).astype(np.float64)[:, None] / 127.0)


def _rel(a, ref) -> float:
    a = np.asarray(a, np.float64)
    m = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(a - ref))) if ref.size else 0.0
    if not np.isfinite(err):
        return math.inf
    return err / m if m > 0 else (0.0 if err == 0 else math.inf)


def _rtol(dtype_name: str) -> float:
    import ml_dtypes

    dt = {"bfloat16": ml_dtypes.bfloat16}.get(dtype_name, dtype_name)
    return max(float(ml_dtypes.finfo(dt).eps), JQLORA_WEIGHT_RTOL)


def torch_quantized_linears(tm) -> dict:
    """{HF module name: bnb Linear4bit / Linear8bitLt} of a transformers (+ PEFT) model."""
    import bitsandbytes as bnb

    base = tm.get_base_model() if hasattr(tm, "get_base_model") else tm
    out = {}
    for name, mod in base.named_modules():
        if isinstance(mod, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            out[name.removesuffix(".base_layer")] = mod
    return out


def check_weights(tm, jax_model) -> tuple[list, dict]:
    """Stage 1 (see the module docstring): (list of WeightCheck, {module name: corrected torch
    weight} for the bitsandbytes weights that disagree with the independent decode)."""
    import jax
    import jax.numpy as jnp
    import bitsandbytes.functional as F

    from jqlora import quant
    from jqlora.lora import named_linears

    dq = jax.jit(quant.dequantize, static_argnums=(1,))
    mods = torch_quantized_linears(tm)
    checks, fixes = [], {}
    for name, layer in named_linears(jax_model):
        q = layer.base.get_value()
        if not isinstance(q, (quant.Weight4bit, quant.Int8Weight)):
            continue
        mod = mods.get(name)
        if mod is None:
            raise RuntimeError(f"{name}: quantized in jqlora but not a bitsandbytes layer in transformers")
        p = mod.weight
        if isinstance(q, quant.Weight4bit):
            qs = p.quant_state
            ref = decode_4bit(p.data, qs)
            bnb_w = F.dequantize_4bit(p.data, qs)
            stored = str(qs.dtype).removeprefix("torch.")
            kind = q.quant_type
            same = _same_bytes_4bit(q, p.data, qs)
        else:
            from interop.torch_bridge import int8_parts

            cb, scb, _, _ = int8_parts(mod)
            ref = decode_int8(cb, scb)
            bnb_w = F.int8_vectorwise_dequant(cb, scb)
            stored, kind = "float32", "int8"
            same = np.array_equal(_to_np(cb), np.asarray(q.cb)) and np.array_equal(_to_np(scb), np.asarray(q.scb))
        bnb_np = _to_np(bnb_w.float()) if str(bnb_w.dtype) != "torch.float32" else _to_np(bnb_w)
        c = WeightCheck(name=name, shape=tuple(ref.shape), kind=kind, stored_dtype=stored,
                        jqlora_rel=_rel(np.asarray(dq(q, jnp.float32)), ref), bnb_rel=_rel(bnb_np, ref),
                        bnb_rtol=_rtol(str(bnb_w.dtype).removeprefix("torch.")), same_bytes=bool(same))
        checks.append(c)
        if not c.bnb_ok:
            fixes[name] = ref
    return checks, fixes


def _same_bytes_4bit(q, packed, qs) -> bool:
    """jqlora's Weight4bit holds the packed codes and (nested) scales bitsandbytes loaded."""
    raw = _to_np(packed).reshape(-1)
    raw = raw if raw.dtype == np.uint8 else raw.view(np.uint8)
    pairs = [(np.asarray(q.packed).reshape(-1).view(np.uint8), raw), (np.asarray(q.absmax), _to_np(qs.absmax))]
    if qs.nested:
        if not q.nested:
            return False
        pairs += [(np.asarray(q.nested_absmax), _to_np(qs.state2.absmax)),
                  (np.asarray(q.offset, np.float32).reshape(()), _to_np(qs.offset.float()).reshape(()))]
    elif q.nested:
        return False
    return all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in pairs)


def patch_torch_weights(tm, fixes: dict, stored: dict, rounding: str) -> None:
    """Make each named bnb layer compute F.linear(x, W) with W = the independent decode rounded
    as a correct bitsandbytes forward rounds it (`bnb_weight_rounding`): to float32 (the product),
    then to the input's dtype, or first to the layer's stored dtype."""
    import torch
    import torch.nn.functional as tF

    mods = torch_quantized_linears(tm)
    for name, ref in fixes.items():
        mod = mods[name]
        w = torch.from_numpy(ref.astype(np.float32))
        if rounding == "stored":
            w = w.to(getattr(torch, stored.get(name, "float32")))
        bias = mod.bias

        def forward(x, *args, _w=w, _b=bias, **kwargs):
            b = None if _b is None else _b.to(x.dtype)
            return tF.linear(x, _w.to(x.dtype), b)

        mod.forward = forward



def bnb_weight_rounding() -> str:
    """How the installed bitsandbytes computes a Linear4bit forward (training mode, float32 input)
    for a weight stored in bf16: "compute" when it dequantizes straight into the input's dtype
    (bitsandbytes 0.50: `gemm_4bit` -> `dequantize_4bit(..., A.dtype)`), "stored" when it first
    rounds the weight to the stored dtype (`F.dequantize_4bit(...).to(A.dtype)`, as older
    releases and its [K, N] path do). Measured on one small layer, so it follows the version."""
    import torch
    import torch.nn.functional as tF
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 128, generator=gen) * 0.05).to(torch.bfloat16)
    mod = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    mod.load_state_dict({"weight": w})
    mod = mod.to(torch.bfloat16)
    with torch.compiler.set_stance("force_eager"):
        mod = mod.to("cpu")  # quantizes, quant_state dtype bf16
    mod.train()
    x = torch.randn(4, 128, generator=gen)
    qs = mod.weight.quant_state
    with torch.no_grad():
        y = mod(x)
        y_stored = tF.linear(x, F.dequantize_4bit(mod.weight.data, qs).float())
        y_compute = tF.linear(x, torch.from_numpy(decode_4bit(mod.weight.data, qs).astype(np.float32)))
    e_stored = float((y - y_stored).abs().max())
    e_compute = float((y - y_compute).abs().max())
    return "stored" if e_stored < e_compute else "compute"


__all__ = ["WeightCheck", "check_weights", "decode_4bit", "decode_int8", "bnb_weight_rounding", "JQLORA_WEIGHT_RTOL",
           "format_weights", "patch_torch_weights", "torch_quantized_linears"]
