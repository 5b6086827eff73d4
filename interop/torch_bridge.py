"""Live bitsandbytes / torch objects <-> jqlora JAX types. torch is imported lazily.

``from_torch(obj)``
    * ``bnb.nn.Params4bit`` or ``bnb.nn.Linear4bit`` -> :class:`jqlora.quant.Weight4bit`
      (for a module: its weight only; use ``from_torch_module`` to get the bias too)
    * ``bnb.nn.Int8Params`` or ``bnb.nn.Linear8bitLt`` -> :class:`jqlora.quant.Int8Weight`
      (a module contributes its outlier threshold; a bare Int8Params gets threshold 0.0)
    * ``torch.nn.Linear`` -> its weight as a jax array; any ``torch.Tensor`` -> jax array
``from_torch_module(module) -> (weight, bias or None)`` for Linear4bit / Linear8bitLt / nn.Linear.
``to_torch(x)``
    * Weight4bit -> ``bnb.nn.Params4bit`` with a real ``QuantState`` (built by
      ``Params4bit.from_prequantized`` from the same tensors a checkpoint holds)
    * Int8Weight -> ``bnb.nn.Int8Params`` with ``CB`` and ``SCB`` set (data is CB)
    * jax / numpy array -> ``torch.Tensor``
``to_torch_module(weight, bias=None, compute_dtype=None)`` -> Linear4bit / Linear8bitLt / nn.Linear.

Memory: arrays cross through DLPack, zero-copy where the runtime allows (same device, supported
dtype, alignment); otherwise through a numpy copy. A zero-copy result **shares memory** with its
source: JAX assumes its buffers never change, so do not modify such a torch tensor in place
(optimizer steps, ``.copy_()``, ``.add_()``): pass ``copy=True`` when the torch side will write.
bitsandbytes' own CPU eval-mode repacking assigns new tensors (``weight.data = ...``) and does
not write into the shared buffer.

A Linear4bit that already ran an eval-mode forward on an AVX512-BF16 CPU holds its weight in
bitsandbytes' private CPU layout, with absmax rounded to bf16 (docs/bnb_format.md §8.5); that cannot be
turned back into the checkpoint format exactly, so from_torch raises ValueError for it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jqlora.quant import Int8Weight, Weight4bit
from jqlora.quant.tables import NESTED_BLOCKSIZE
from jqlora.quant.weights import STORED_DTYPES


def _torch():
    import torch

    return torch


def _bnb():
    import bitsandbytes as bnb

    return bnb


# ------------------------------------------------------------------------------------------
# arrays

def torch_to_numpy(t) -> np.ndarray:
    """A torch tensor as a numpy array on the host (bfloat16 and float8 as their ml_dtypes types)."""
    torch = _torch()
    t = t.detach().cpu()
    special = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
    }
    if t.dtype in special:
        via, np_dt = special[t.dtype]
        return t.view(via).numpy().view(np_dt)
    return t.numpy()


def tensor_to_jax(t, *, copy: bool = False, device=None) -> jax.Array:
    """A torch tensor as a jax array (DLPack, zero-copy when possible; see the module notes)."""
    torch = _torch()
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if not t.is_contiguous():
        t = t.contiguous()
    try:
        arr = jax.dlpack.from_dlpack(t)
    except Exception:  # dtype or device DLPack / JAX refuses: go through host memory
        arr = jnp.asarray(np.array(torch_to_numpy(t)))
        copy = False
    if device is not None:
        arr = jax.device_put(arr, device)
    elif copy:
        arr = jnp.array(arr, copy=True)
    return arr


def jax_to_tensor(a, *, copy: bool = False):
    """A jax (or numpy) array as a torch tensor (DLPack, zero-copy when possible)."""
    torch = _torch()
    if isinstance(a, np.ndarray):
        a = jnp.asarray(a)
    try:
        t = torch.from_dlpack(a)
    except Exception:  # fall back to a host copy
        host = np.array(a)
        bits = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
                np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
                np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2)}
        if host.dtype in bits:
            via, tdt = bits[host.dtype]
            return torch.from_numpy(host.view(via)).view(tdt)
        return torch.from_numpy(host)
    return t.clone() if copy else t


# ------------------------------------------------------------------------------------------
# 4-bit

def _dtype_str(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def params4bit_to_weight(p, *, copy: bool = False, device=None) -> Weight4bit:
    """bitsandbytes Params4bit (quantized) -> Weight4bit, bit for bit."""
    qs = getattr(p, "quant_state", None)
    if qs is None or not getattr(p, "bnb_quantized", True):
        raise ValueError("Params4bit is not quantized yet (no quant_state); move it to a device first")
    return quant_state_to_weight(p, qs, copy=copy, device=device)


def quant_state_to_weight(packed, quant_state, *, copy: bool = False, device=None) -> Weight4bit:
    """(packed tensor, bitsandbytes QuantState) as returned by ``F.quantize_4bit`` -> Weight4bit."""
    torch = _torch()
    qs = quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError(
            "this Linear4bit weight is in bitsandbytes' CPU inference layout (it ran an eval-mode forward on an "
            "AVX512-BF16 CPU, which repacked the codes and rounded absmax to bfloat16); it cannot be converted "
            "exactly. Convert before running it in eval mode, or run it in train mode / with inputs that need grad.")
    data = packed.detach().as_subclass(torch.Tensor).contiguous()
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    stored = _dtype_str(qs.dtype)
    if stored not in STORED_DTYPES:
        raise ValueError(f"quant_state dtype {qs.dtype} is not one of {STORED_DTYPES}")
    conv = lambda t: tensor_to_jax(t, copy=copy, device=device)  # noqa: E731
    kw = {}
    if qs.nested:
        if qs.state2.blocksize != NESTED_BLOCKSIZE:
            raise ValueError(f"nested blocksize {qs.state2.blocksize}; only {NESTED_BLOCKSIZE} is supported")
        kw = dict(nested_absmax=conv(qs.state2.absmax), nested_code=conv(qs.state2.code),
                  offset=conv(qs.offset.reshape(()).to(torch.float32)))
    q = Weight4bit(
        packed=conv(data.reshape(-1)),
        absmax=conv(qs.absmax),
        code=conv(qs.code),
        shape=tuple(int(d) for d in qs.shape),
        quant_type=qs.quant_type,
        blocksize=int(qs.blocksize),
        stored_dtype=stored,
        **kw,
    )
    return q.validate("Params4bit")


def weight_to_params4bit(q: Weight4bit, *, copy: bool = False, device="cpu", module=None):
    """Weight4bit -> bnb.nn.Params4bit with a real QuantState (via Params4bit.from_prequantized)."""
    import json

    bnb = _bnb()
    q.validate("Weight4bit")
    conv = lambda a: jax_to_tensor(a, copy=copy)  # noqa: E731
    stats = {"absmax": conv(q.absmax), "quant_map": conv(q.code)}
    state = {"quant_type": q.quant_type, "blocksize": q.blocksize, "dtype": q.stored_dtype, "shape": list(q.shape)}
    if q.nested:
        stats["nested_absmax"] = conv(q.nested_absmax)
        stats["nested_quant_map"] = conv(q.nested_code)
        state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32",
                     nested_offset=float(np.asarray(q.offset, np.float32)))
    torch = _torch()
    stats[f"quant_state.bitsandbytes__{q.quant_type}"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    data = conv(q.packed).reshape(-1, 1)
    return bnb.nn.Params4bit.from_prequantized(data=data, quantized_stats=stats, requires_grad=False, device=device,
                                               module=module)


# ------------------------------------------------------------------------------------------
# 8-bit

def int8_parts(module_or_param):
    """(CB, SCB, threshold, has_fp16_weights) of a bitsandbytes Linear8bitLt or its Int8Params."""
    bnb = _bnb()
    if isinstance(module_or_param, bnb.nn.Linear8bitLt):
        mod = module_or_param
        p = mod.weight
        cb = p.CB if getattr(p, "CB", None) is not None else mod.state.CB
        scb = p.SCB if getattr(p, "SCB", None) is not None else mod.state.SCB
        if cb is None:
            cb = p.data
        return cb, scb, float(mod.state.threshold), getattr(p, "has_fp16_weights", False) or mod.state.has_fp16_weights
    p = module_or_param
    cb = p.CB if getattr(p, "CB", None) is not None else p.data
    return cb, getattr(p, "SCB", None), 0.0, getattr(p, "has_fp16_weights", False)


def int8_to_weight(module_or_param, *, copy: bool = False, device=None) -> Int8Weight:
    """bnb Int8Params / Linear8bitLt (quantized, has_fp16_weights=False) -> Int8Weight."""
    torch = _torch()
    cb, scb, threshold, fp16 = int8_parts(module_or_param)
    if fp16 or cb.dtype != torch.int8 or scb is None:
        raise ValueError("Int8Params is not quantized (has_fp16_weights=True, or no SCB / int8 CB yet); "
                         "move it to a device with has_fp16_weights=False first")
    conv = lambda t: tensor_to_jax(t, copy=copy, device=device)  # noqa: E731
    return Int8Weight(cb=conv(cb.detach().as_subclass(torch.Tensor)), scb=conv(scb.detach().float()),
                      threshold=threshold).validate("Int8Params")


def weight_to_int8params(q: Int8Weight, *, copy: bool = False):
    """Int8Weight -> bnb.nn.Int8Params with CB and SCB (has_fp16_weights=False)."""
    bnb = _bnb()
    q.validate("Int8Weight")
    cb = jax_to_tensor(q.cb, copy=copy)
    scb = jax_to_tensor(q.scb, copy=copy)
    return bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)


# ------------------------------------------------------------------------------------------
# public

def from_torch(obj, *, copy: bool = False, device=None):
    """Live torch / bitsandbytes object -> JAX type (see the module docstring for the mapping)."""
    torch = _torch()
    bnb = _bnb()
    if isinstance(obj, bnb.nn.Linear4bit):
        return params4bit_to_weight(obj.weight, copy=copy, device=device)
    if isinstance(obj, bnb.nn.Params4bit):
        return params4bit_to_weight(obj, copy=copy, device=device)
    if isinstance(obj, (bnb.nn.Linear8bitLt, bnb.nn.Int8Params)):
        return int8_to_weight(obj, copy=copy, device=device)
    if isinstance(obj, torch.nn.Linear):
        return tensor_to_jax(obj.weight, copy=copy, device=device)
    if isinstance(obj, torch.Tensor):
        return tensor_to_jax(obj, copy=copy, device=device)
    raise TypeError(f"from_torch: unsupported object of type {type(obj).__name__}")


def from_torch_module(module, *, copy: bool = False, device=None):
    """Linear4bit / Linear8bitLt / nn.Linear -> (weight, bias jax array or None)."""
    torch = _torch()
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"from_torch_module: expected a Linear4bit, Linear8bitLt or nn.Linear, got "
                        f"{type(module).__name__}")
    weight = from_torch(module, copy=copy, device=device)
    bias = None if module.bias is None else tensor_to_jax(module.bias, copy=copy, device=device)
    return weight, bias


def to_torch(x, *, copy: bool = False):
    """JAX type -> live torch object: Params4bit / Int8Params / torch.Tensor."""
    if isinstance(x, Weight4bit):
        return weight_to_params4bit(x, copy=copy)
    if isinstance(x, Int8Weight):
        return weight_to_int8params(x, copy=copy)
    if isinstance(x, (jax.Array, np.ndarray)):
        return jax_to_tensor(x, copy=copy)
    raise TypeError(f"to_torch: unsupported object of type {type(x).__name__}")


def to_torch_module(weight, bias=None, *, compute_dtype=None, copy: bool = False):
    """(weight, bias) -> bnb.nn.Linear4bit / bnb.nn.Linear8bitLt / torch.nn.Linear on CPU.

    compute_dtype: Linear4bit's compute dtype (None: bitsandbytes adopts the input's dtype).
    """
    torch = _torch()
    bnb = _bnb()
    if isinstance(weight, Weight4bit):
        if len(weight.shape) != 2:
            raise ValueError(f"a linear weight must be 2-D (out, in), got shape {weight.shape}")
        out_f, in_f = weight.shape
        mod = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=compute_dtype,
                                compress_statistics=weight.nested, quant_type=weight.quant_type, device="meta")
        mod.weight = weight_to_params4bit(weight, copy=copy, module=mod)
    elif isinstance(weight, Int8Weight):
        out_f, in_f = weight.shape
        mod = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False,
                                  threshold=weight.threshold, device="meta")
        mod.weight = weight_to_int8params(weight, copy=copy)
    else:
        w = jax_to_tensor(weight, copy=copy)
        mod = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta", dtype=w.dtype)
        mod.weight = torch.nn.Parameter(w, requires_grad=False)
    if bias is not None:
        mod.bias = torch.nn.Parameter(jax_to_tensor(bias, copy=copy), requires_grad=False)
    return mod
