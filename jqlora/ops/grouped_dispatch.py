"""Which implementation computes a grouped product (`jqlora.ops.qgmm`, mixture-of-experts layers).

A table of its own, `GROUPED_RULES`, read as `jqlora.ops.dispatch` reads `RULES` (both by
`dispatch.walk_rules`): a row names an expert-stack format ("4bit", "int8", "dense"), a product
("fwd": y = x @ W_e.T per group, "bwd": dx = dy @ W_e), a requirement (`dispatch.REQUIREMENTS`), an
M range (all rows of the sorted activation) and a grouped variant from
`pallas_kernels.registry.grouped_variants()` (None: the jnp reference, dequantize +
`jax.lax.ragged_dot_general`). Kernels of op "grouped_matmul[_t]" take the expert stack dequantized
to x's dtype by a transient jnp pass; those of op "grouped_matmul_4bit[_t]" decode the packed 4-bit
stack themselves. The plan, the device, the explanation and the backend error are dispatch's, so
both products read alike in `explain-kernel`.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jqlora.ops.dispatch import (BACKENDS, PRODUCTS, REQUIREMENTS, BackendError, Device, Explanation, Plan, Rule,
                                 check_runs_here, rules_markdown, walk_rules)

GROUPED_KINDS = ("4bit", "int8", "dense")


@dataclasses.dataclass(frozen=True)
class GroupedRule:
    """One row of the grouped dispatch table (see the module docstring)."""

    weight: str  # one of GROUPED_KINDS
    product: str  # "fwd" | "bwd"
    requires: str  # one of REQUIREMENTS
    m: tuple  # (lo, hi) inclusive; hi None: no upper bound
    variant: str | None  # grouped registry name; None: the jnp reference ("xla")
    why: str

    def __post_init__(self):
        if self.weight not in GROUPED_KINDS or self.product not in PRODUCTS:
            raise ValueError(f"grouped dispatch rule {self}: weight must be one of {GROUPED_KINDS}, "
                             f"product one of {PRODUCTS}")
        if self.requires not in REQUIREMENTS:
            raise ValueError(f"grouped dispatch rule {self}: unknown requirement {self.requires!r}")

    m_text = Rule.m_text
    covers = Rule.covers


GROUPED_RULES = (
    GroupedRule("4bit", "fwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot_4bit",
                "the wgmma grouped kernel decoding the experts itself, no dense stack: 0.27 / 0.33 ms "
                "(gate/up, down; H200) against 0.37 / 0.42 for a dequant_tiled pass + mgpu_grouped_dot"),
    GroupedRule("4bit", "fwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot",
                "shapes the decoding kernel declines (N or K not a multiple of 256, blocksize other than 64: there it "
                "runs one warpgroup, slower than this): dequant_tiled pass + the wgmma grouped kernel, 0.37-0.44 ms "
                "where the xla path takes 8.8-9.8 ms"),
    GroupedRule("4bit", "fwd", "gpu and 16-bit x", (1, None), "grouped_dot",
                "other GPUs: dequant_tiled pass + the Triton grouped kernel (H200: 0.30 ms + the pass, against "
                "9.8 ms for the xla path and 1.75-6.1 ms for grouped_dot_4bit's in-register decode)"),
    GroupedRule("4bit", "fwd", "auto backend", (0, None), None,
                "elsewhere (CPU, 32-bit x): dequantize, then XLA's ragged dot"),
    GroupedRule("4bit", "fwd", "any", (0, None), "grouped_dot_4bit",
                "an explicit kernel backend (interpret mode too) runs the Triton kernel, tiles decoded in registers"),
    GroupedRule("4bit", "bwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot_4bit_t",
                "the decoding kernel's backward: dx 0.35 / 0.32 ms against 0.41 / 0.36 for dequant_tiled again "
                "+ mgpu_grouped_dot_t"),
    GroupedRule("4bit", "bwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot_t",
                "shapes the decoding kernel declines: dequant_tiled again + the wgmma grouped kernel (forward + "
                "backward 0.79-0.80 ms, the xla path 18.6-18.7)"),
    GroupedRule("4bit", "bwd", "gpu and 16-bit x", (1, None), "grouped_dot_t",
                "other GPUs: dequant_tiled again + the Triton grouped kernel"),
    GroupedRule("4bit", "bwd", "auto backend", (0, None), None, "elsewhere: dequantize again, then XLA's ragged dot"),
    GroupedRule("4bit", "bwd", "any", (0, None), "grouped_dot_4bit_t",
                "an explicit kernel backend runs the Triton kernel, tiles decoded in registers"),
    GroupedRule("int8", "fwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot",
                "a jnp dequant pass (elementwise) + the wgmma grouped kernel, as for 4-bit"),
    GroupedRule("int8", "fwd", "gpu and 16-bit x", (1, None), "grouped_dot",
                "other GPUs: a jnp dequant pass + the Triton grouped kernel"),
    GroupedRule("int8", "fwd", "auto backend", (0, None), None, "elsewhere: dequantize, then XLA's ragged dot"),
    GroupedRule("int8", "fwd", "any", (0, None), "grouped_dot",
                "an explicit kernel backend runs a jnp dequant pass + the Triton grouped kernel"),
    GroupedRule("int8", "bwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot_t",
                "the stack dequantized again + the wgmma grouped kernel"),
    GroupedRule("int8", "bwd", "gpu and 16-bit x", (1, None), "grouped_dot_t",
                "other GPUs: the stack dequantized again + the Triton grouped kernel"),
    GroupedRule("int8", "bwd", "auto backend", (0, None), None, "elsewhere: dequantize again, then XLA's ragged dot"),
    GroupedRule("int8", "bwd", "any", (0, None), "grouped_dot_t",
                "an explicit kernel backend runs a jnp dequant pass + the Triton grouped kernel"),
    GroupedRule("dense", "fwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot",
                "the wgmma grouped kernel: 0.23-0.29 ms, level with JAX's example kernel; lax.ragged_dot 8.5-9.3 ms"),
    GroupedRule("dense", "fwd", "gpu and 16-bit x", (1, None), "grouped_dot",
                "other GPUs: the Triton grouped kernel (H200: 0.30 ms, lax.ragged_dot 9.3 ms)"),
    GroupedRule("dense", "fwd", "auto backend", (0, None), None, "elsewhere: XLA's ragged dot"),
    GroupedRule("dense", "fwd", "any", (0, None), "grouped_dot", "an explicit kernel backend runs the Triton kernel"),
    GroupedRule("dense", "bwd", "sm90 and 16-bit x", (1, None), "mgpu_grouped_dot_t",
                "the wgmma grouped kernel: forward + backward 0.50 ms, lax.ragged_dot's 25.4-26.6 ms"),
    GroupedRule("dense", "bwd", "gpu and 16-bit x", (1, None), "grouped_dot_t", "other GPUs: the Triton grouped kernel"),
    GroupedRule("dense", "bwd", "auto backend", (0, None), None, "elsewhere: XLA's ragged dot"),
    GroupedRule("dense", "bwd", "any", (0, None), "grouped_dot_t", "an explicit kernel backend runs the Triton kernel"),
)


@dataclasses.dataclass(frozen=True)
class _Experts:
    """What grouped dispatch needs of an expert stack."""

    kind: str  # one of GROUPED_KINDS
    shape: tuple  # (E, N, K)
    blocksize: int  # 0 for int8 and dense stacks


def _grouped_variants() -> dict:
    from pallas_kernels import registry

    return {v.name: v for v in registry.grouped_variants()}


def _resolve_grouped(w: _Experts, m: int, backend: str, *, variant: str | None, dtype: str | None,
                     device: Device | None, query: str = "") -> Explanation:
    """The one decision path behind `choose_grouped_plan` and `explain_grouped`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "xla":
        return Explanation(Plan("xla"), (), query, "requested")
    device = device if device is not None else Device.current()
    auto = backend == "auto"
    if auto:
        if device.platform != "gpu":
            return Explanation(Plan("xla"), (), query, "auto on a non-GPU device runs the jnp reference")
        backend = "pallas"
    if backend == "pallas" and device.platform != "gpu":
        raise BackendError("backend 'pallas' needs a GPU; use 'interpret' to run the kernels on CPU, or 'xla'")
    variants = _grouped_variants()
    _, n, k = w.shape
    plan = {}
    rows = []
    for product in PRODUCTS:
        if product == "fwd" and variant is not None:
            v = variants.get(variant)
            if v is None:
                raise BackendError(f"no grouped kernel variant named {variant!r}; known: {sorted(variants)}")
            if not v.op.startswith("grouped_matmul") or v.op.endswith("_t"):
                raise BackendError(f"grouped kernel variant {variant!r} implements {v.op!r}, not a forward product")
            if v.op == "grouped_matmul_4bit" and w.kind != "4bit":
                raise BackendError(f"grouped kernel variant {variant!r} takes a 4-bit stack, not {w.kind}")
            if not v.supports(m, n, k, w.blocksize):
                raise BackendError(f"grouped kernel variant {variant!r} does not support M={m}, N={n}, K={k}, "
                                   f"blocksize={w.blocksize}")
            plan[product] = variant
            rows.append(("fwd", variant, "chosen (variant=)"))
            continue
        rule, verdicts, _ = walk_rules(GROUPED_RULES, w.kind, product, m, n, k, w.blocksize, device, dtype, auto,
                                       variants, interpret=backend == "interpret")
        rows += verdicts
        if rule is None:
            raise BackendError(f"no grouped dispatch rule for a {w.kind} {product} product at M={m} "
                               "(jqlora/ops/grouped_dispatch.py GROUPED_RULES)")
        plan[product] = rule.variant
    if plan["fwd"] is None and plan["bwd"] is None:
        if not auto:
            raise BackendError(f"backend {backend!r}: no grouped kernel takes a {w.kind} stack of shape {w.shape} "
                               f"at M={m} here; use 'xla'")
        return Explanation(Plan("xla"), tuple(rows), query, "the table keeps both products on the jnp reference")
    for name in (plan["fwd"], plan["bwd"]):
        if name is not None:
            check_runs_here(name, backend, device, variants)
    return Explanation(Plan(backend, plan["fwd"], plan["bwd"]), tuple(rows), query)


def _experts_of(experts) -> _Experts:
    fmt = experts.format
    kind = "4bit" if fmt in ("nf4", "fp4") else fmt
    return _Experts(kind, tuple(experts.shape), experts.blocksize)


def choose_grouped_plan(experts, m: int, backend: str, *, variant: str | None = None,
                        dtype: str | None = None, device: Device | None = None) -> Plan:
    """Resolve `backend` for a grouped product (qgmm) over `experts` (an ExpertWeights) and M
    rows. A plan's fwd or bwd None means that product runs the jnp reference."""
    return _resolve_grouped(_experts_of(experts), m, backend, variant=variant, dtype=dtype, device=device).plan


def explain_grouped(weight: str, m: int, n: int, k: int, experts: int, *, blocksize: int = 64,
                    dtype="bfloat16", device: Device | None = None, backend: str = "auto") -> Explanation:
    """Which kernels run a grouped product (qgmm) of M sorted rows against `experts` stacked
    (N, K) weights of format `weight` ("nf4", "fp4", "int8" or "dense"), and why."""
    if weight not in ("nf4", "fp4", "int8", "dense"):
        raise ValueError(f"explain_grouped: unknown weight {weight!r}; expected nf4, fp4, int8 or dense")
    if min(m, n, k) < 0 or n == 0 or k == 0 or experts < 1:
        raise ValueError(f"explain_grouped: need M >= 0, N, K, experts >= 1, got M={m}, N={n}, K={k}, "
                         f"experts={experts}")
    four_bit = weight in ("nf4", "fp4")
    w = _Experts("4bit" if four_bit else weight, (experts, n, k), blocksize if four_bit else 0)
    dtype = None if dtype is None else jnp.dtype(dtype).name
    device = device if device is not None else Device.current()
    bs = f" blocksize={blocksize}" if four_bit else ""
    query = f"{experts} x {weight} experts M={m} N={n} K={k}{bs} {dtype}, device {device}, backend {backend}"
    return _resolve_grouped(w, m, backend, variant=None, dtype=dtype, device=device, query=query)


def grouped_markdown_table() -> str:
    """GROUPED_RULES as the markdown table docs/kernels.md embeds."""
    return rules_markdown(GROUPED_RULES, "experts")
