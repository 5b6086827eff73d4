"""`load_causal_lm`: the one place in jqlora.models that reads a checkpoint (through interop)."""
from __future__ import annotations

import os
from typing import Optional

import jax.numpy as jnp
from flax import nnx

from jqlora import parallel
from jqlora.lora.config import LoraConfig
from jqlora.models.config import ModelConfig, UnsupportedModelError
from jqlora.models.build import from_params
from jqlora.models.llama import CausalLM


def _check_config(path: str) -> dict:
    """Parse ``config.json`` and its architecture before any tensor is read, so that a bad
    value fails fast with the file and the key named (not as an error deep in model building).
    Returns the parsed config (`interop.bnb_common.read_config`: a nested text_config unwrapped)."""
    from interop.bnb_common import read_config  # noqa: PLC0415
    from interop.errors import CheckpointError  # noqa: PLC0415

    cfg_file = os.path.join(path, "config.json")
    config = read_config(path)  # CheckpointError naming the file: missing, invalid JSON, not an object
    try:
        ModelConfig.from_hf(config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{cfg_file}: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    return config


def load_causal_lm(path: str, lora: Optional[LoraConfig] = None, compute_dtype=jnp.bfloat16,
                   quantize: Optional[str] = None, rngs: Optional[nnx.Rngs] = None, remat=False, *,
                   backend: str = "auto", param_dtype=None, int8_numerics: str = "weight_only",
                   attention: str = "einsum", mesh=None, quantize_experts: Optional[str] = "auto",
                   base_matmul: str = "compute") -> CausalLM:
    """Load a Hugging Face checkpoint folder (bitsandbytes 4-bit, bitsandbytes 8-bit, or plain
    safetensors) as a `CausalLM`.

    Example::

      >>> import tempfile, jax.numpy as jnp, interop
      >>> from jqlora.lora import LoraConfig
      >>> from jqlora.models import init_params, load_causal_lm
      >>> config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      ...           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
      >>> with tempfile.TemporaryDirectory() as d:              # a tiny plain checkpoint
      ...     _ = interop.save_bnb_checkpoint(f"{d}/tiny", init_params(config), config)
      ...     model = load_causal_lm(f"{d}/tiny", lora=LoraConfig(rank=8), quantize="nf4",
      ...                            compute_dtype=jnp.float32)
      >>> model(jnp.zeros((1, 5), jnp.int32)).shape
      (1, 5, 128)

    Args:
      path: the checkpoint folder (``config.json`` + ``model.safetensors`` or shards), a Hugging
        Face model id ``org/name[@revision]`` or a cache repo folder (`jqlora.hub.resolve_model`).
        The model keeps the folder's absolute path as ``model.checkpoint_path``.
      lora: a `LoraConfig` to add LoRA branches to its target modules; None for none.
      compute_dtype: the dtype of activations and matmuls: the caller's choice, never the
        checkpoint's dtype.
      quantize: "nf4" | "fp4" | "int8" quantizes dense linear weights at load; an
        already-quantized checkpoint keeps its own format.
      rngs: `nnx.Rngs` for the LoRA init and dropout (default ``nnx.Rngs(0)``).
      remat: per-layer rematerialization: False, True or a name in `REMAT_POLICIES`.
      backend: the `jqlora.ops.qmatmul` backend of every linear layer.
      param_dtype: cast the checkpoint's dense (non-quantized) tensors to this dtype; None
        keeps the stored dtype.
      int8_numerics: "weight_only" or "llm_int8" for 8-bit weights (see `QLoRALinear`).
      base_matmul: "compute" or "fp8": the frozen 4-bit linear weights' products in the compute
        dtype, or on float8_e4m3fn operands scaled per row (`from_params`, docs/numerics.md).
      attention: "einsum", "xla" or "cudnn".
      quantize_experts: the format of mixture-of-experts weights stored dense ("auto": NF4 in a
        quantized checkpoint, else as `quantize`; "nf4", "fp4", "int8", or "none" to keep them).
      mesh: a `jax.sharding.Mesh` or spec ("data=2,fsdp=2", see `jqlora.parallel`): each tensor
        goes onto its shards as it is read (frozen weights cut over fsdp, the rest replicated),
        never whole onto one device. None: JAX's default device.

    Raises:
      UnsupportedModelError: a model type other than llama/mistral/qwen2/qwen3 (or another
        architecture feature this code lacks); the message names config.json.
      KeyError: a tensor the architecture needs is missing (the message names it).
      interop.CheckpointError: the files are malformed: config.json missing, not JSON, not an
        object or with a bad value (the message names the file and the key), or a tensor that
        is malformed or holds NaN/Inf where it must not (the message names file and tensor).
    """
    import interop  # noqa: PLC0415  (the only jqlora.models module that touches files)

    from jqlora.hub import resolve_model  # noqa: PLC0415

    path = os.fspath(path)
    if os.path.isdir(path) or not os.path.exists(path):  # a Hugging Face id or cache repo folder too
        path = os.fspath(resolve_model(path, what="load_causal_lm path"))
    # fail on config.json before reading any tensor; the checkpoint reader takes the parsed config
    config = _check_config(path) if os.path.isdir(path) else None
    mesh = None if mesh is None else parallel.resolve_mesh(mesh)
    # one device: stage the quantized parts and small tensors on the host, stacked per layer kind
    # and moved in one transfer by from_params; a mesh places each tensor onto its shards as read
    params, config = interop.load_bnb_checkpoint(path, device="stage" if mesh is None else parallel.placement(mesh),
                                                 config=config)
    model = from_params(params, config, lora=lora, compute_dtype=compute_dtype, quantize=quantize, rngs=rngs,
                       remat=remat, backend=backend, param_dtype=param_dtype, int8_numerics=int8_numerics,
                       attention=attention, donate_params=True,  # the dict is ours: stack without a second copy
                       quantize_experts=quantize_experts, base_matmul=base_matmul)
    model.checkpoint_path = os.path.abspath(path)  # what a run record names as the base (jqlora.train.train)
    model.checkpoint_quantize = quantize
    model.checkpoint_quantize_experts = "none" if quantize_experts is None else quantize_experts
    return parallel.place_model(model, mesh)
