"""Cross-check stage 3, LLM.int8 products: each 8-bit linear of jqlora recomputed on the very
inputs bitsandbytes received in the torch run of the compute dtype, against bitsandbytes' outputs
(recorded by `jqlora.crosscheck.crosscheck` during the layer stage's torch forward). Every product
must equal bitsandbytes' output to one ulp.

Why a stage of its own: LLM.int8 rounds every activation to an int8 code, so two forwards that
differ by a float32 ulp somewhere upstream eventually land on different codes (a near-tie falls
the other way) and differ by a whole int8 step from there on. End to end, jqlora's LLM.int8 run
and torch's then differ by as much as torch's own bfloat16 run differs from its float32 run, and
a wrong int8 scale of 1% hides in that spread (SmolLM2-135M, 2 x 16 random tokens, float32:
jqlora and torch LLM.int8 logits 3e-2 apart; a 1% error of every int8 scale gives 2e-1 in float32
and nothing visible in bfloat16). One product on identical inputs has no such spread: jqlora
reproduces bitsandbytes' CPU arithmetic (`pallas_kernels.reference.int8.llm_int8_matmul_reference`, the oracle of the `llm_int8_tiled` kernel), so its output
equals bitsandbytes' up to one ulp of the output dtype, plus float32 summation order
(`PRODUCT_RTOL` of the largest output) in the 16-bit outlier part.

What this catches: any error of jqlora's LLM.int8 product (scales, dequantization constant,
outlier threshold or columns, activation rounding) above one ulp of the compute dtype: about
0.4-0.8% in bfloat16, 1e-5 in float32.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PRODUCT_RTOL = 1e-5  # float32 summation order of the outlier product, relative to max |output|


@dataclasses.dataclass
class ProductCheck:
    """One 8-bit linear: jqlora's output vs bitsandbytes' on the same input."""

    name: str
    shape: tuple  # the output's shape
    rel: float  # max |jqlora - bitsandbytes| / max |bitsandbytes|
    beyond: int  # output elements further apart than one ulp (+ PRODUCT_RTOL x max |output|)

    @property
    def ok(self) -> bool:
        return self.beyond == 0

    def to_dict(self):
        return dict(dataclasses.asdict(self), shape=list(self.shape), ok=self.ok)


def ulp(ref: np.ndarray, dtype) -> np.ndarray:
    """The spacing of `dtype` at |ref| (float64), normal numbers; tiny values get the spacing at
    the smallest normal."""
    import ml_dtypes

    info = ml_dtypes.finfo(dtype)
    mag = np.maximum(np.abs(np.asarray(ref, np.float64)), float(info.smallest_normal))
    _, exp = np.frexp(mag)  # mag = m * 2**exp, m in [0.5, 1)
    return np.ldexp(1.0, exp - 1 - int(info.nmant))


def compare_product(name: str, ours, ref, dtype) -> ProductCheck:
    """A ProductCheck of jqlora's output `ours` against bitsandbytes' `ref` (both in `dtype`)."""
    a = np.asarray(ours).astype(np.float64)
    b = np.asarray(ref).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{name}: jqlora product shape {a.shape} != bitsandbytes {b.shape}")
    err = np.abs(a - b)
    top = float(np.max(np.abs(b))) if b.size else 0.0
    allowed = ulp(b, dtype) + PRODUCT_RTOL * top
    bad = ~(err <= allowed)  # NaN counts as beyond
    max_err = float(np.max(err)) if err.size else 0.0
    if not np.all(np.isfinite(a)):
        max_err = float("inf")
    rel = max_err / top if top > 0 else (0.0 if max_err == 0 else float("inf"))
    return ProductCheck(name=name, shape=tuple(b.shape), rel=rel, beyond=int(np.sum(bad)))


class Int8ProductRecorder:
    """Forward hooks on a transformers model's LLM.int8 layers that recompute each product with
    jqlora (`jax_model`'s layer of the same name, its own numerics and backend) on the layer's
    input and compare with the layer's output, one layer at a time (nothing is kept but the
    `ProductCheck`s, so long inputs cost no memory).

    Use as a context manager around the torch forward; `checks` then holds one ProductCheck per
    8-bit linear call, in call order.
    """

    def __init__(self, tm, jax_model):
        from jqlora import quant
        from jqlora.lora import named_linears

        from .weights import torch_quantized_linears

        self._mods = {n: m for n, m in torch_quantized_linears(tm).items() if _is_int8_module(m)}
        self._layers = {n: l for n, l in named_linears(jax_model) if isinstance(l.base.get_value(), quant.Int8Weight)}
        missing = sorted(set(self._mods) - set(self._layers))
        if missing:
            raise RuntimeError(f"{missing[0]}: an LLM.int8 layer in transformers but not an 8-bit layer in jqlora")
        self._compiled = {}
        self._hooks = []
        self.checks: list[ProductCheck] = []

    def __enter__(self):
        for name, mod in self._mods.items():
            self._hooks.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return False

    def _hook(self, name):
        def hook(_mod, inputs, output):
            self.checks.append(self._check(name, inputs[0], output))
        return hook

    def _check(self, name, x, y) -> ProductCheck:
        import jax.numpy as jnp

        from interop.torch_bridge import torch_to_numpy

        x_np, y_np = torch_to_numpy(x), torch_to_numpy(y)
        layer = self._layers[name]
        bias = None if layer.bias is None else layer.bias[...]
        fn = self._product_fn(layer.backend, layer.numerics, str(x_np.dtype))
        ours = fn(jnp.asarray(x_np), layer.base.get_value(), bias)
        return compare_product(name, np.asarray(ours), y_np, y_np.dtype)

    def _product_fn(self, backend: str, numerics: str, dtype: str):
        """jit of what `QLoRALinear.__call__` computes without LoRA: the base product in x's
        dtype, then the bias added in that dtype."""
        key = (backend, numerics, dtype)
        if key not in self._compiled:
            import jax

            from jqlora.ops import qmatmul

            kw = {} if numerics == "weight_only" else {"numerics": numerics}

            def product(x, q, bias):
                y = qmatmul(x, q, compute_dtype=x.dtype, backend=backend, **kw)
                return y if bias is None else y + bias.astype(y.dtype)

            self._compiled[key] = jax.jit(product)
        return self._compiled[key]


def _is_int8_module(mod) -> bool:
    import bitsandbytes as bnb

    return isinstance(mod, bnb.nn.Linear8bitLt)


def format_products(checks: list, dtype: str) -> list:
    """Report lines for stage 3 (empty without checks)."""
    if not checks:
        return []
    bad = [c for c in checks if not c.ok]
    worst = max(c.rel for c in checks)
    out = [f"  products: {len(checks)} LLM.int8 products recomputed by jqlora on the inputs torch's {dtype} run "
           f"gave them; worst relative error {worst:.1e}"
           + ("" if bad else f", every element within one {dtype} ulp of bitsandbytes: all agree")]
    for c in bad[:8]:
        out.append(f"  jqlora problem: {c.name} product {tuple(c.shape)}: {c.beyond} elements further than one "
                   f"{dtype} ulp from bitsandbytes (relative error {c.rel:.2e})")
    if len(bad) > 8:
        out.append(f"  ... and {len(bad) - 8} more products")
    return out


__all__ = ["ProductCheck", "Int8ProductRecorder", "compare_product", "format_products", "ulp", "PRODUCT_RTOL"]
