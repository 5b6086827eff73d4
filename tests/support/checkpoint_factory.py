"""Build tiny Hugging Face Llama checkpoints with transformers + bitsandbytes, on CPU, in tests.

Not a test module: other tests import it (``import checkpoint_factory`` works under pytest, whose
tests/conftest.py puts ``tests/support/`` on sys.path). Nothing is downloaded: weights are random.

Main entry points
-----------------
``build_llama_checkpoint(directory, *, quant="nf4", ...) -> Path``
    The real transformers path: a random ``LlamaForCausalLM`` is saved unquantized, loaded back
    with ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...), device_map="cpu")``
    (bitsandbytes quantizes on CPU), then ``save_pretrained``. ``quant``: "nf4" | "fp4" | "int8"
    | None (plain checkpoint in `dtype`). transformers does not expose the 4-bit blocksize; for
    ``blocksize != 64`` every Linear4bit weight is re-quantized from the original dense weight
    with ``bnb.nn.Params4bit(..., blocksize=...)`` before saving (the module and config are still
    the ones transformers made). lm_head stays unquantized (transformers' default).
``cached_llama_checkpoint(tmp_path_factory, **kwargs) -> Path``
    Same, built once per (kwargs) per test session, in a tmp dir. Treat the result as read-only
    (copy it with ``copy_checkpoint`` before corrupting it).
``load_with_transformers(directory, **kwargs)``
    ``AutoModelForCausalLM.from_pretrained(directory, device_map="cpu")`` (eval mode).
``torch_tensors(directory)``: every tensor of the checkpoint as torch tensors (safetensors.torch).
``bnb_reference_weights(directory) -> {module: torch.Tensor}``
    What bitsandbytes/transformers dequantize each quantized linear to, computed from the raw
    checkpoint tensors: 4-bit via ``QuantState.from_dict`` + ``bitsandbytes.functional.
    dequantize_4bit``; int8 via ``int8_vectorwise_dequant(CB, SCB)`` (= CB * SCB / 127).
``bnb_dequantize_4bit_reference(packed, quant_state)``
    bitsandbytes' pure-torch 4-bit dequantization. Needed because bitsandbytes 0.50.2's native
    CPU dequantize_4bit is WRONG when in_features % blocksize != 0 (blocks spanning rows): keep
    in_features a multiple of the blocksize when comparing against F.dequantize_4bit or against
    a transformers forward on CPU (the default configs here do).
``tiny_llama_config(**overrides)``: the default tiny config (hidden 64, 2 layers, vocab 128).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

_CACHE: dict = {}


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**DEFAULT_CONFIG, **overrides})


def _quiet():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def build_llama_checkpoint(
    directory,
    *,
    quant: str | None = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
    dtype: torch.dtype = torch.float32,
    shard_size: int | str | None = None,
    config_overrides: dict | None = None,
    seed: int = 0,
    quant_storage: torch.dtype = torch.uint8,
    compute_dtype: torch.dtype = torch.float32,
    skip_modules: list[str] | None = None,
) -> Path:
    """Write a tiny random Llama checkpoint to `directory` (created) and return it.

    quant: "nf4" / "fp4" (4-bit; `double_quant`, `blocksize`, `quant_storage` apply), "int8"
    (LLM.int8, threshold 6.0), or None (plain checkpoint in `dtype`). dtype: the model dtype
    (becomes the 4-bit quant_state "dtype"). shard_size: passed to save_pretrained as
    max_shard_size (e.g. 20_000 bytes gives several shards); None = one file.
    skip_modules: bitsandbytes' ``llm_int8_skip_modules`` (module names or suffixes, matched as
    transformers does): those linears stay dense in `dtype` next to the quantized ones, as in
    unsloth's dynamic 4-bit checkpoints. It replaces transformers' default (``["lm_head"]``), so
    list "lm_head" to keep it dense.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

    _quiet()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_llama_config(**(config_overrides or {}))
    torch.manual_seed(seed)
    dense = LlamaForCausalLM(config).to(dtype).eval()
    save_kw = {} if shard_size is None else {"max_shard_size": shard_size}
    if quant is None:
        dense.save_pretrained(directory, **save_kw)
        return directory
    if quant in ("nf4", "fp4"):
        bnb_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=quant_storage,
            llm_int8_skip_modules=skip_modules,
        )
    elif quant == "int8":
        bnb_config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    else:
        raise ValueError(f"quant must be 'nf4', 'fp4', 'int8' or None, got {quant!r}")
    with tempfile.TemporaryDirectory() as plain:
        dense.save_pretrained(plain)
        model = AutoModelForCausalLM.from_pretrained(
            plain, quantization_config=bnb_config, device_map="cpu", dtype=dtype
        )
    if quant != "int8" and blocksize != 64:
        _requantize_4bit(model, dense, blocksize)
    model.save_pretrained(directory, **save_kw)
    return directory


def _requantize_4bit(model, dense, blocksize: int):
    """Re-quantize every Linear4bit of `model` from `dense`'s weights with another blocksize."""
    import bitsandbytes as bnb

    dense_modules = dict(dense.named_modules())
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            w = dense_modules[name].weight.detach().clone()
            old = mod.weight
            mod.weight = bnb.nn.Params4bit(
                w,
                requires_grad=False,
                blocksize=blocksize,
                compress_statistics=old.compress_statistics,
                quant_type=old.quant_type,
                quant_storage=old.quant_storage,
                module=mod,
            ).to("cpu")


def cached_llama_checkpoint(tmp_path_factory, **kwargs) -> Path:
    """build_llama_checkpoint(**kwargs) once per session (per kwargs). Do not modify the result."""
    key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
    path = _CACHE.get(key)
    if path is None or not path.exists():
        path = build_llama_checkpoint(tmp_path_factory.mktemp("ckpt"), **kwargs)
        _CACHE[key] = path
    return path


def copy_checkpoint(src, dst) -> Path:
    """Copy a checkpoint directory (to corrupt the copy)."""
    shutil.copytree(src, dst)
    return Path(dst)


def load_with_transformers(directory, **kwargs):
    """AutoModelForCausalLM.from_pretrained(directory) on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    _quiet()
    kwargs.setdefault("device_map", "cpu")
    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


def torch_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) checkpoint, loaded with safetensors.torch."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(directory / f))
    return out


def bnb_dequantize_4bit_reference(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' own pure-torch 4-bit dequantization (its default backend op, run eagerly).

    Use it where ``bitsandbytes.functional.dequantize_4bit`` on CPU is not a reference: in
    bitsandbytes 0.50.2 the native CPU kernel (used when shape[-1] is even) gives wrong values
    when in_features is not a multiple of the blocksize (blocks spanning rows), e.g. a (96, 96)
    weight with blocksize 64 or a (128, 64) one with blocksize 128.
    """
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    qs = quant_state
    absmax = qs.absmax
    if qs.nested:
        absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    data = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    with torch.compiler.set_stance("force_eager"):
        return _dequantize_4bit_compute(data.reshape(-1), absmax.float(), _get_4bit_code(qs.quant_type, data.device),
                                        qs.blocksize, tuple(qs.shape), qs.dtype)


def bnb_reference_weights(directory, impl: str = "functional") -> dict[str, torch.Tensor]:
    """{module name: dequantized weight} for every quantized linear, computed by bitsandbytes
    from the checkpoint's raw tensors (the numbers transformers/bitsandbytes use).

    4-bit: ``QuantState.from_dict`` then ``bitsandbytes.functional.dequantize_4bit``
    (impl="functional", exact for the default configs here) or
    :func:`bnb_dequantize_4bit_reference` (impl="torch"). int8: ``int8_vectorwise_dequant(CB, SCB)``
    (= CB * SCB / 127, as transformers and PEFT dequantize).
    """
    import bitsandbytes.functional as F

    tensors = torch_tensors(directory)
    out = {}
    for key in tensors:
        if ".weight.quant_state.bitsandbytes__" in key:
            m = key.split(".weight.quant_state.")[0]
            prefix = m + ".weight."
            stats = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            qs = F.QuantState.from_dict(stats, device=torch.device("cpu"))
            if impl == "functional":
                out[m] = F.dequantize_4bit(tensors[m + ".weight"], qs)
            else:
                out[m] = bnb_dequantize_4bit_reference(tensors[m + ".weight"], qs)
        elif key.endswith(".SCB"):
            m = key[: -len(".SCB")]
            out[m] = F.int8_vectorwise_dequant(tensors[m + ".weight"], tensors[key])
    return out


def tensor_to_numpy(t: "torch.Tensor") -> np.ndarray:
    """A torch tensor as numpy, bf16 kept as ml_dtypes.bfloat16 (numpy has no bf16)."""
    import ml_dtypes

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
