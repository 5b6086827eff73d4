"""Cross-check: the same tokens through transformers + bitsandbytes (+ PEFT) in torch and through
jqlora in JAX, compared layer by layer.

What is compared (names in the report):

  embed            the token embeddings (input of layer 0)
  layer.N          the output hidden state of decoder layer N (torch: a forward hook on
                   `model.layers[N]`; JAX: decoder layer N's output as `CausalLM.__call__(...,
                   return_states=True)` returns it, so the JAX side is the production forward)
  norm             the final RMSNorm output
  logits           the model output

For each: max |jax - torch| and relative error = max |jax - torch| / max |torch|. The check
passes when the logits' relative error is <= tolerance.

Which bitsandbytes path is the reference: on CPU, an eval-mode `Linear4bit` on a machine with
AVX512-BF16 repacks the weight and runs a fused kernel that rounds activations and scales to
bf16 (~1e-2 relative error by itself). By default the torch side runs bitsandbytes' reference
path instead (the bnb linear layers in training mode: dequantize exactly, then F.linear; nothing
else depends on the mode because dropout modules stay in eval mode), which is what jqlora
computes. `bnb_cpu_kernel=True` keeps the fused kernel. For LLM.int8 layers, eval mode (int8
activations + fp16 outliers) is compared against jqlora's `int8_numerics="llm_int8"` by default;
`int8_numerics="weight_only"` compares the weight-only path with bitsandbytes' training path.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}
INT8_LLM_TOLERANCE = 1e-2  # minimum tolerance when LLM.int8 activations are quantized on both sides


@dataclasses.dataclass
class Diff:
    name: str
    max_abs: float
    rel: float
    ref_max: float

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CrosscheckResult:
    path: str
    adapter: Optional[str]
    dtype: str
    tokens_shape: tuple
    tolerance: float
    layers: list  # list[Diff], embed/layer.N/norm
    logits: Diff
    passed: bool
    notes: list

    @property
    def max_rel(self) -> float:
        return max([self.logits.rel] + [d.rel for d in self.layers])

    def to_dict(self) -> dict:
        return dict(path=self.path, adapter=self.adapter, dtype=self.dtype, tokens_shape=list(self.tokens_shape),
                    tolerance=self.tolerance, passed=self.passed, notes=list(self.notes),
                    layers=[d.to_dict() for d in self.layers], logits=self.logits.to_dict())

    def format(self) -> str:
        lines = [f"crosscheck {self.path}" + (f" + adapter {self.adapter}" if self.adapter else "")
                 + f" | dtype {self.dtype} | tokens {tuple(self.tokens_shape)}"]
        lines += [f"  note: {n}" for n in self.notes]
        w = max(len(d.name) for d in self.layers + [self.logits])
        lines.append(f"  {'tensor'.ljust(w)}  {'max_abs_err':>12}  {'rel_err':>10}  {'max|torch|':>10}")
        for d in self.layers + [self.logits]:
            lines.append(f"  {d.name.ljust(w)}  {d.max_abs:12.4e}  {d.rel:10.3e}  {d.ref_max:10.3e}")
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: logits relative error {self.logits.rel:.3e} "
                     f"{'<=' if self.passed else '>'} tolerance {self.tolerance:.1e}")
        return "\n".join(lines)


def diff(name: str, ours, ref) -> Diff:
    a = np.asarray(ours, np.float64)
    b = np.asarray(ref, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{name}: JAX shape {a.shape} != torch shape {b.shape}")
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    if not np.all(np.isfinite(a)):
        max_abs = math.inf
    ref_max = float(np.max(np.abs(b))) if b.size else 0.0
    rel = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else math.inf)
    return Diff(name, max_abs, rel, ref_max)


# -------------------------------------------------------------------------------------------- torch
def torch_states(path, ids: np.ndarray, *, adapter=None, dtype: str = "float32", bnb_cpu_kernel: bool = False,
                 int8_numerics: str = "llm_int8") -> dict:
    """{"embed", "layer.N", "norm", "logits": np.float32 arrays} from transformers (+ PEFT) on CPU."""
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
    for mod in tm.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.compute_dtype = tdtype  # compute in the requested dtype, not the checkpoint's
            mod.compute_type_is_set = True
            if not bnb_cpu_kernel:
                mod.train()  # bitsandbytes' reference path: exact dequantize + F.linear
        elif isinstance(mod, bnb.nn.Linear8bitLt) and int8_numerics == "weight_only":
            mod.train()  # MatMul8bitFp: x @ (CB * SCB / 127).T
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


# ---------------------------------------------------------------------------------------------- JAX
def jax_states(model, ids: np.ndarray) -> dict:
    """Same keys as `torch_states`, from a jqlora CausalLM (eval mode, no cache)."""
    import jax
    import jax.numpy as jnp
    from jqlora.train.frozen_jit import frozen_jit

    def fwd(m, x):
        logits, states = m(x, return_states=True)
        return states["embed"], states["layers"], states["norm"], logits

    model.eval()  # no LoRA dropout (the caller's model stays in eval mode)
    embed, layers, normed, logits = frozen_jit(fwd)(model, jnp.asarray(ids, jnp.int32))
    n = len(model.model.layers)
    if len(layers) != n:
        raise RuntimeError(f"got {len(layers)} decoder-layer outputs, the model has {n} layers")
    to_np = lambda a: np.asarray(jax.device_get(a.astype(jnp.float32)))  # noqa: E731
    out = {"embed": to_np(embed)}
    for i, h in enumerate(layers):
        out[f"layer.{i}"] = to_np(h)
    out["norm"] = to_np(normed)
    out["logits"] = to_np(logits)
    return out


def perturb_model(model, amount: float) -> None:
    """Scale layer 0's input RMSNorm weight by (1 + amount): a deliberate error, to show the
    checker localizes it (layer.0 and everything after it diverge; embed stays exact)."""
    import jax.numpy as jnp

    w = model.model.layers[0].input_layernorm.weight
    w.set_value(w.get_value() * jnp.asarray(1.0 + amount, w.get_value().dtype))


def random_tokens(vocab_size: int, tokens: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, tokens), dtype=np.int64)


def crosscheck(path, *, adapter=None, ids: Optional[np.ndarray] = None, tokens: int = 16, batch: int = 2,
               seed: int = 0, dtype: str = "float32", tolerance: Optional[float] = None, jax_model=None,
               bnb_cpu_kernel: bool = False, int8_numerics: str = "llm_int8", perturb: float = 0.0,
               backend: str = "auto") -> CrosscheckResult:
    """Compare jqlora (JAX) with transformers + bitsandbytes (+ PEFT `adapter`) on `ids` (default:
    `batch` x `tokens` random token ids from `seed`). `jax_model`: use this model instead of
    loading `path` (+ adapter) with jqlora. tolerance: on the logits' relative error; default
    DEFAULT_TOLERANCE[dtype] (at least INT8_LLM_TOLERANCE for LLM.int8 checkpoints)."""
    import jax.numpy as jnp

    from jqlora import quant
    from jqlora.adapters import load_model_with_adapter
    from jqlora.lora import named_linears

    if dtype not in DEFAULT_TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(DEFAULT_TOLERANCE)}, got {dtype!r}")
    if int8_numerics not in ("llm_int8", "weight_only"):
        raise ValueError(f"int8_numerics must be 'llm_int8' or 'weight_only', got {int8_numerics!r}")
    path = Path(path)
    notes = []
    if jax_model is None:
        jax_model, report, _ = load_model_with_adapter(path, adapter, compute_dtype=jnp.dtype(dtype),
                                                       int8_numerics=int8_numerics, backend=backend)
        if report is not None:
            notes.append(f"adapter: {len(report['matched'])} LoRA modules applied on both sides")
    if perturb:
        perturb_model(jax_model, perturb)
        notes.append(f"JAX side deliberately perturbed: layer 0 input_layernorm weight x (1 + {perturb})")
    has_int8 = any(isinstance(l.base.get_value(), quant.Int8Weight) for _, l in named_linears(jax_model))
    if ids is None:
        ids = random_tokens(jax_model.config.vocab_size, tokens, batch, seed)
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (batch, tokens), got shape {ids.shape}")
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE[dtype]
        if has_int8 and int8_numerics == "llm_int8":
            tolerance = max(tolerance, INT8_LLM_TOLERANCE)
    ref = torch_states(path, ids, adapter=adapter, dtype=dtype, bnb_cpu_kernel=bnb_cpu_kernel,
                       int8_numerics=int8_numerics)
    ours = jax_states(jax_model, ids)
    if bnb_cpu_kernel:
        notes.append("torch side uses bitsandbytes' eval-mode CPU kernel (may round to bf16 internally)")
    names = ["embed"] + [f"layer.{i}" for i in range(len(jax_model.model.layers))] + ["norm"]
    missing = [n for n in names + ["logits"] if n not in ref]
    if missing:
        raise RuntimeError(f"torch side produced no {missing} (hooks did not fire)")
    layers = [diff(n, ours[n], ref[n]) for n in names]
    logits = diff("logits", ours["logits"], ref["logits"])
    passed = bool(np.isfinite(logits.rel) and logits.rel <= tolerance)
    return CrosscheckResult(path=str(path), adapter=None if adapter is None else str(adapter), dtype=dtype,
                            tokens_shape=tuple(ids.shape), tolerance=float(tolerance), layers=layers,
                            logits=logits, passed=passed, notes=notes)


__all__ = ["Diff", "CrosscheckResult", "crosscheck", "torch_states", "jax_states", "diff", "perturb_model",
           "random_tokens", "DEFAULT_TOLERANCE"]
