"""The torch side of the cross-check: transformers (+ PEFT) + bitsandbytes on CPU, loaded with the
numerics the layer check compares against (`jqlora.crosscheck.layers` explains them), and its
hidden states read with forward hooks."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

def load_torch_model(path, *, adapter=None, dtype: str = "float32", bnb_cpu_kernel: bool = False,
                     int8_numerics: str = "llm_int8"):
    """transformers (+ PEFT) on CPU in `dtype`, bnb layers set up as
    `jqlora.crosscheck.layers` describes."""
    import torch
    from transformers import AutoModelForCausalLM

    from jqlora._util import quiet_third_party

    quiet_third_party()
    import bitsandbytes as bnb

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers/PEFT deprecation chatter
        tm = AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu", dtype=tdtype)
        if adapter is not None:
            from peft import PeftModel

            tm = PeftModel.from_pretrained(tm, str(adapter))
    tm.eval()
    # transformers keeps a pre-quantized checkpoint's stored dtype (bf16 in real ones) for the
    # tensors it did not quantize (embeddings, norms, lm_head), whatever `dtype` says: cast them,
    # or the "float32" reference would run its activations in bf16
    for p in tm.parameters():
        if not isinstance(p, (bnb.nn.Params4bit, bnb.nn.Int8Params)) and p.is_floating_point() and p.dtype != tdtype:
            p.data = p.data.to(tdtype)
    for mod in tm.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.compute_dtype = tdtype  # compute in the requested dtype, not the checkpoint's
            mod.compute_type_is_set = True
            if not bnb_cpu_kernel:
                mod.train()  # bitsandbytes' reference path: exact dequantize + F.linear
        elif isinstance(mod, bnb.nn.Linear8bitLt) and int8_numerics == "weight_only":
            mod.train()  # MatMul8bitFp: x @ (CB * SCB / 127).T
    return tm


def torch_model_states(tm, ids: np.ndarray) -> dict:
    """{"embed", "layer.N", "norm", "logits": np.float32 arrays} of a loaded transformers model."""
    import torch

    base = tm.get_base_model() if hasattr(tm, "get_base_model") else tm
    decoder = base.model
    out: dict[str, Any] = {}
    hooks = []

    def keep(name):
        def hook(_mod, _inp, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            out[name] = t.detach().float().numpy().copy()
        return hook

    hooks.append(decoder.embed_tokens.register_forward_hook(keep("embed")))
    for i, layer in enumerate(decoder.layers):
        hooks.append(layer.register_forward_hook(keep(f"layer.{i}")))
    hooks.append(decoder.norm.register_forward_hook(keep("norm")))
    try:
        with torch.no_grad():
            res = tm(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out["logits"] = res.logits.detach().float().numpy().copy()
    return out


def torch_states(path, ids: np.ndarray, *, adapter=None, dtype: str = "float32", bnb_cpu_kernel: bool = False,
                 int8_numerics: str = "llm_int8") -> dict:
    """{"embed", "layer.N", "norm", "logits": np.float32 arrays} from transformers (+ PEFT) on CPU."""
    tm = load_torch_model(path, adapter=adapter, dtype=dtype, bnb_cpu_kernel=bnb_cpu_kernel,
                          int8_numerics=int8_numerics)
    return torch_model_states(tm, ids)


def set_int8_inference(tm) -> None:
    """Put a transformers model's LLM.int8 layers in eval mode: bitsandbytes' inference path
    (MatMul8bitLt: int8 activations, 16-bit outliers). Its training mode is the weight-only path;
    the mode is read at every forward, so one loaded model serves both."""
    import bitsandbytes as bnb

    for mod in tm.modules():
        if isinstance(mod, bnb.nn.Linear8bitLt):
            mod.eval()


def share_experts(tm, jax_model) -> int:
    """Give the torch model `jax_model`'s expert weights where jqlora holds them quantized (dense
    experts quantized at load, `quantize_experts`): each torch expert stack (transformers 5's
    `mlp.experts.gate_up_proj` / `down_proj`, under PEFT's wrappers too) becomes jqlora's
    dequantized stack, so that both sides multiply the same experts and the check is about
    jqlora's grouped product, not the quantization. Returns the number of stacks set."""
    import re

    import torch

    from jqlora import quant
    from jqlora.lora.experts import QLoRAExperts

    mine = {}
    for i, layer in enumerate(jax_model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            mod = getattr(getattr(layer.mlp, "experts", None), name, None)
            if isinstance(mod, QLoRAExperts):
                w = mod.base.get_value()
                if isinstance(w.stack, (quant.Weight4bit, quant.Int8Weight)):
                    mine[(i, name)] = np.asarray(quant.dequantize_experts(w, np.float32))
    pattern = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(?:base_layer\.)*(gate_up_proj|down_proj)$")
    count = 0
    with torch.no_grad():
        for name, p in tm.named_parameters():
            m = pattern.search(name)
            if m is not None and (int(m[1]), m[2]) in mine:
                w = torch.from_numpy(mine[(int(m[1]), m[2])])
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: torch holds {tuple(p.shape)}, jqlora {tuple(w.shape)}")
                p.copy_(w.to(p.dtype))
                count += 1
    if count != len(mine):
        raise RuntimeError(f"set {count} of jqlora's {len(mine)} quantized expert stacks in the torch model")
    return count
