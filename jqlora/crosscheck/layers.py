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
import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .products import Int8ProductRecorder, format_products
from .weights import bnb_weight_rounding, check_weights, format_weights, patch_torch_weights

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}
BF16_RATIO = 2.0  # low-precision verdict: jqlora's error <= this x torch's own error


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
    layers: list  # list[Diff] (embed/layer.N/norm) of the run the verdict is about
    logits: Diff
    passed: bool
    notes: list
    verdict_numerics: str = "own"  # which run `layers` / `logits` are: "own", "stored" or "llm_int8"
    reference: str = "torch float32"  # what `layers` / `logits` are compared against
    runs: dict = dataclasses.field(default_factory=dict)  # RUN_TITLES keys -> list[Diff] incl. logits
    references: dict = dataclasses.field(default_factory=dict)  # run -> what it is compared against
    lowp_label: str = ""  # "bfloat16", "bfloat16 LLM.int8", ...: what torch_lowp ran
    torch_rounding: str = "compute"  # what the torch reference does with 4-bit weights (`bnb_weight_rounding`)
    weights: list = dataclasses.field(default_factory=list)  # list[WeightCheck]
    products: list = dataclasses.field(default_factory=list)  # list[ProductCheck] (LLM.int8)
    rule: str = ""  # the verdict rule, in words
    torch_lowp_rel: Optional[float] = None  # bf16/fp16: torch's own logits error vs torch float32
    bf16_ratio: Optional[float] = None

    @property
    def max_rel(self) -> float:
        return max([self.logits.rel] + [d.rel for d in self.layers])

    @property
    def bnb_problems(self) -> list:
        return [w for w in self.weights if not w.bnb_ok]

    @property
    def jqlora_weight_problems(self) -> list:
        return [w for w in self.weights if not w.jqlora_ok]

    @property
    def product_problems(self) -> list:
        return [p for p in self.products if not p.ok]

    def to_dict(self) -> dict:
        return dict(path=self.path, adapter=self.adapter, dtype=self.dtype, tokens_shape=list(self.tokens_shape),
                    tolerance=self.tolerance, passed=self.passed, notes=list(self.notes), rule=self.rule,
                    verdict_numerics=self.verdict_numerics, reference=self.reference,
                    references=dict(self.references), torch_rounding=self.torch_rounding,
                    layers=[d.to_dict() for d in self.layers], logits=self.logits.to_dict(),
                    runs={k: [d.to_dict() for d in v] for k, v in self.runs.items()},
                    torch_lowp_rel=self.torch_lowp_rel, bf16_ratio=self.bf16_ratio,
                    weights=dict(checked=len(self.weights),
                                 bnb_problems=[w.to_dict() for w in self.bnb_problems],
                                 jqlora_problems=[w.to_dict() for w in self.jqlora_weight_problems],
                                 worst_jqlora_rel=max((w.jqlora_rel for w in self.weights), default=0.0)),
                    products=dict(checked=len(self.products),
                                  problems=[p.to_dict() for p in self.product_problems],
                                  worst_rel=max((p.rel for p in self.products), default=0.0)))

    def format(self) -> str:
        lines = [f"crosscheck {self.path}" + (f" + adapter {self.adapter}" if self.adapter else "")
                 + f" | dtype {self.dtype} | tokens {tuple(self.tokens_shape)}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += format_weights(self.weights)
        lines += format_products(self.products, self.dtype)
        cols = [k for k in RUN_TITLES if k in self.runs]
        titles = {k: RUN_TITLES[k] + (" *" if k == self.verdict_numerics else "") for k in cols}
        titles["torch_lowp"] = f"torch {self.lowp_label or self.dtype}"
        lines.append("  layers (relative error = max|diff| / max|reference|; * = the run the verdict is about), "
                     "each against torch float32 with the same numerics:")
        lines += [f"    {titles[c].removesuffix(' *')}: {self._explain(c)}" for c in cols]
        names = [d.name for d in self.runs[cols[0]]]
        w = max(len(n) for n in names)
        lines.append("  " + "tensor".ljust(w) + "".join(f"  {titles[c]:>24}" for c in cols) + f"  {'max|ref|':>10}")
        lines.append("  " + "".ljust(w) + "".join(f"  {'max_abs_err':>12} {'rel_err':>11}" for _ in cols))
        for i, n in enumerate(names):
            row = "  " + n.ljust(w)
            for c in cols:
                d = self.runs[c][i]
                row += f"  {d.max_abs:12.4e} {d.rel:11.3e}".rjust(26)
            lines.append(row + f"  {self.runs[self.verdict_numerics][i].ref_max:10.3e}")
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: {self.rule}")
        return "\n".join(lines)

    def _explain(self, run: str) -> str:
        torch_does = {"compute": "dequantizes 4-bit weights straight into the compute dtype",
                      "stored": "rounds 4-bit weights to their stored dtype, then the compute dtype"}
        what = {"own": "jqlora's production numerics (4-bit weights dequantized into the compute dtype, 8-bit "
                       "weight-only)",
                "stored": "each 4-bit weight rounded to the checkpoint's stored dtype first (this bitsandbytes "
                          f"{torch_does[self.torch_rounding]})",
                "llm_int8": "bitsandbytes' LLM.int8 inference numerics reproduced (int8 activations, 16-bit "
                            "outlier columns)",
                "torch_lowp": "torch's own low-precision error",
                "fp8": "the 4-bit base products on FP8 (E4M3) operands scaled per row (--base-matmul fp8): "
                       "reported, not judged"}[run]
        return f"{what}; vs {self.references.get(run, self.reference)}"


RUN_TITLES = {"torch_lowp": "torch", "llm_int8": "jqlora LLM.int8", "own": "jqlora own",
              "stored": "jqlora stored-rounded", "fp8": "jqlora fp8"}


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
def load_torch_model(path, *, adapter=None, dtype: str = "float32", bnb_cpu_kernel: bool = False,
                     int8_numerics: str = "llm_int8"):
    """transformers (+ PEFT) on CPU in `dtype`, bnb layers set up as the module docstring says."""
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


# ---------------------------------------------------------------------------------------------- JAX
def jax_states(model, ids: np.ndarray) -> dict:
    """Same keys as `torch_states`, from a jqlora CausalLM (eval mode, no cache)."""
    import jax
    import jax.numpy as jnp
    from jqlora.train.frozen import frozen_jit

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


def torch_numerics_model(model, compute_dtype):
    """A copy of `model` whose 4-bit bases are dense: dequantized into each weight's stored dtype,
    then cast to `compute_dtype` (what bitsandbytes computes; see the module docstring). Works for
    layers stored one by one and stacked (a stacked Weight4bit has a leading layer axis). The
    original model is not modified.

    Args:
      model: a jqlora CausalLM.
      compute_dtype: the dtype of the dense weights (the model's compute dtype).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QuantizedBase

    copy = nnx.clone(model)
    for _, var in nnx.to_flat_state(nnx.state(copy, QuantizedBase)):
        q = var.get_value()
        if not isinstance(q, quant.Weight4bit):
            continue

        def dense(w):
            return quant.dequantize(w, jnp.dtype(w.stored_dtype)).astype(compute_dtype)

        for _ in range(np.ndim(q.packed) - 1):  # one vmap per leading (layer) axis
            dense = jax.vmap(dense)
        var.set_value(jax.jit(dense)(q))
    return copy


def perturb_model(model, amount: float) -> None:
    """Scale layer 0's input RMSNorm weight by (1 + amount): a deliberate error, to show the
    checker localizes it (layer.0 and everything after it diverge; embed stays exact)."""
    import jax.numpy as jnp

    w = model.model.layers[0].input_layernorm.weight
    w.set_value(w.get_value() * jnp.asarray(1.0 + amount, w.get_value().dtype))


def random_tokens(vocab_size: int, tokens: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, tokens), dtype=np.int64)


def _diffs(names, ours, ref) -> list:
    return [diff(n, ours[n], ref[n]) for n in names]


def with_fp8_base_products(model):
    """A copy of `model` whose 4-bit linear layers compute their base products in FP8
    (`numerics="fp8"`, what `load_causal_lm(base_matmul="fp8")` sets). The original is not modified."""
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QLoRALinear

    copy = nnx.clone(model)
    for _, layer in nnx.iter_graph(copy):
        if isinstance(layer, QLoRALinear) and isinstance(layer.base.get_value(), quant.Weight4bit):
            layer.numerics = "fp8"
    return copy


def with_int8_numerics(model, numerics: str):
    """`model` itself when its 8-bit layers (if any) already compute with `numerics`, else a copy
    whose 8-bit layers do ("weight_only" or "llm_int8": the attribute the loader sets from
    `int8_numerics`). The original model is not modified."""
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QLoRALinear

    def int8_layers(m):
        return [n for _, n in nnx.iter_graph(m)
                if isinstance(n, QLoRALinear) and isinstance(n.base.get_value(), quant.Int8Weight)]

    if all(layer.numerics == numerics for layer in int8_layers(model)):
        return model
    copy = nnx.clone(model)
    for layer in int8_layers(copy):
        layer.numerics = numerics
    return copy


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


__all__ = ["Diff", "CrosscheckResult", "crosscheck", "share_experts", "torch_states", "jax_states", "diff",
           "perturb_model", "random_tokens", "torch_numerics_model", "with_int8_numerics", "set_int8_inference",
           "load_torch_model", "torch_model_states", "DEFAULT_TOLERANCE", "BF16_RATIO", "RUN_TITLES"]
