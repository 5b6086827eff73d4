"""Tiny random checkpoints of the other model families (Gemma 2, Gemma 3 text, Gemma 3 multimodal, Phi-3),
made with transformers (+ bitsandbytes) on CPU, as `checkpoint_factory` makes Llama ones, and the
comparisons those families' tests share: token ids, relative error, transformers' forward pass,
PEFT's LoRA and its gradients beside jqlora's.

Not a test module: tests import it by name (tests/conftest.py puts tests/support on sys.path).
Weights are random, drawn so that every part matters: norms N(0, 0.1) around Gemma's (1 + w),
linears N(0, 0.05). Nothing is downloaded.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

# in_features stay multiples of 64: bitsandbytes 0.50.2 dequantizes blocks that span rows wrongly on CPU
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=128)

# Windows shorter than the tests' sequences, an attention scale that is not head_dim ** -0.5, and
# soft-caps small enough to bite (Gemma 2).
GEMMA2 = dict(model_type="gemma2", sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, **TINY)
GEMMA3 = dict(model_type="gemma3_text", sliding_window=6, query_pre_attn_scalar=24, **TINY)

# Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, LongRoPE with an original length (8) shorter
# than the tests' sequences (so the long factors apply to them), partial rotary (0.75: 24 of 32
# features turn) and a window shorter than the sequence.
# Phi3Config checks the factors' length against hidden_size / heads (not head_dim): no head_dim here.
_ROT = int(32 * 0.75) // 2
PHI3 = dict({k: v for k, v in TINY.items() if k != "head_dim"}, hidden_size=128, num_hidden_layers=4,
            model_type="phi3", sliding_window=12, original_max_position_embeddings=8, pad_token_id=0,
            rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(_ROT)],
                              long_factor=[1.5 + 0.7 * i for i in range(_ROT)]),
            partial_rotary_factor=0.75)
FAMILIES = {"gemma2": GEMMA2, "gemma3": GEMMA3, "phi3": PHI3}

_CACHE: dict = {}


def _quiet():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def randomize(model, seed: int = 0):
    """Draw every parameter: norms N(0, 0.1), everything else N(0, 0.05)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.1 if "norm" in name else 0.05
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def text_model(config: dict, seed: int = 0, dtype=torch.float32):
    """A random transformers causal LM of `config` (a dict with model_type), eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet()
    cfg = AutoConfig.for_model(**config)
    cfg._attn_implementation = "eager"
    return randomize(AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager"), seed).eval()


def multimodal_gemma3(seed: int = 0):
    """A random `Gemma3ForConditionalGeneration`: a tiny SigLIP tower + projector + the GEMMA3 text model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    _quiet()
    text = {k: v for k, v in GEMMA3.items() if k != "model_type"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
                       boi_token_index=253, eoi_token_index=254)
    cfg.text_config._attn_implementation = "eager"
    return randomize(Gemma3ForConditionalGeneration(cfg).eval(), seed)


def save(model, directory, quant: str | None = None, dtype=torch.float32) -> Path:
    """Save `model` to `directory`, plain (quant None) or through bitsandbytes ("nf4", "int8"), as
    transformers saves a quantized model: the plain save is loaded back with a BitsAndBytesConfig."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, BitsAndBytesConfig

    directory = Path(directory)
    if quant is None:
        model.save_pretrained(directory)
        return directory
    qc = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=dtype) if quant == "nf4" else BitsAndBytesConfig(load_in_8bit=True))
    auto = AutoModelForImageTextToText if "ConditionalGeneration" in type(model).__name__ else AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as plain:
        model.save_pretrained(plain)
        q = auto.from_pretrained(plain, quantization_config=qc, device_map="cpu", dtype=dtype)
    q.save_pretrained(directory)
    return directory


def cached(tmp_path_factory, kind: str, quant: str | None = None) -> Path:
    """The checkpoint of `kind` ("gemma2", "gemma3", "gemma3_mm", "phi3") in format `quant` (None:
    float32, "bf16", "nf4", "int8"), built once per session. Read-only."""
    key = (kind, quant)
    path = _CACHE.get(key)
    if path is None or not path.exists():
        model = multimodal_gemma3() if kind == "gemma3_mm" else text_model(FAMILIES[kind])
        if quant == "bf16":  # a plain bfloat16 folder, as real checkpoints are stored
            model, quant = model.to(torch.bfloat16), None
        path = save(model, tmp_path_factory.mktemp(f"{kind}-{key[1]}"), quant)
        _CACHE[key] = path
    return path


def load_with_transformers(directory, train: bool = False):
    """The saved checkpoint as transformers loads it (eager attention; CPU). train=True picks
    bitsandbytes' training path (dequantize + linear), which float32 comparisons need."""
    from transformers import AutoModelForCausalLM

    _quiet()
    m = AutoModelForCausalLM.from_pretrained(str(directory), device_map="cpu", attn_implementation="eager")
    return m.train() if train else m.eval()


# ------------------------------------------------------------------------------------------
# comparisons against transformers and PEFT
# ------------------------------------------------------------------------------------------
def ids(b: int = 2, t: int = 20, seed: int = 0) -> np.ndarray:
    """(b, t) random token ids of TINY's vocabulary; t = 20 is past every tiny config's window and
    Phi-3's original length (8)."""
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], (b, t))


def rel_error(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def torch_forward(model, token_ids):
    """transformers' logits and every hidden state (float32 numpy) for `token_ids`."""
    with torch.no_grad():
        out = model(torch.tensor(token_ids), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def jax_params(model) -> dict:
    """A transformers model's state dict as JAX arrays, as `jqlora.models.from_params` takes it."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v.numpy()) for k, v in model.state_dict().items()}


def peft_model(config: dict, targets, seed: int = 1):
    """PEFT LoRA (r=4, alpha=8) on a fresh `text_model(config)` with random (nonzero) B;
    -> (peft model, {module: {"lora_A", "lora_B"}})."""
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(text_model(config), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                 lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_B") and "default" in getattr(mod, "lora_B", {}):
                mod.lora_B["default"].weight.copy_(0.1 * torch.randn(mod.lora_B["default"].weight.shape, generator=g))
                values[name.removeprefix("base_model.model.")] = {
                    "lora_A": mod.lora_A["default"].weight.numpy().copy(),
                    "lora_B": mod.lora_B["default"].weight.numpy().copy()}
    return pm, values


def peft_loss_and_grads(pm, token_ids):
    """PEFT's next-token cross-entropy on `token_ids` and its gradients, by transformers' names
    without the PEFT prefix ("model.layers.0.self_attn.q_proj.lora_A.weight")."""
    x, y = torch.tensor(token_ids[:, :-1]), torch.tensor(token_ids[:, 1:])
    logits = pm(x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad.numpy()
             for n, p in pm.named_parameters() if p.grad is not None}
    return float(loss), grads


def lora_loss_and_grads(model, token_ids):
    """The same loss for a jqlora model with LoRA, and its LoRA gradients per module
    ({module: {"lora_A", "lora_B"}})."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import lora

    def loss_fn(m):
        lg = m(jnp.asarray(token_ids[:, :-1])).astype(jnp.float32)
        lp = jax.nn.log_softmax(lg, -1)
        return -jnp.take_along_axis(lp, jnp.asarray(token_ids[:, 1:])[..., None], -1).mean()

    # compiled whole: run op by op, the model's value and gradient cost several times more on a CPU
    grad_fn = nnx.jit(nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam)))
    loss, grads = grad_fn(model)
    return float(loss), lora.lora_state_by_module(model, grads)
