"""Which implementation computes a quantized product: the jnp reference ("xla") or a Pallas kernel.

`backend="auto"` reads one table, `RULES`. A row names a weight kind ("4bit", "int8", or "llm_int8"
for an int8 weight with LLM.int8 numerics), a product ("fwd": y = x @ W.T, "bwd": dx = dy @ W), a
requirement (`REQUIREMENTS`), an inclusive range of rows M and a kernel variant from
`pallas_kernels.registry` (None: the jnp reference, run by XLA). For each product the first row
whose requirement holds, whose range contains M and whose variant's `supports(m, n, k, blocksize)`
accepts the shape wins: the kernels' `supports()` stay the veto. An explicit `backend="pallas"` or
`"interpret"` reads the same table (the "auto backend" requirement does not hold there).

To make `auto` run a variant, add one row above the rows it beats and one evidence line for it in
docs/kernels.md (the measurement that chose it) and paste `markdown_table()` there.
tests/ops/test_dispatch.py checks every row's variant and that every row is reachable.
`explain(...)` shows the decision for one shape, row by row; `choose_plan` returns its plan, so
the two cannot disagree. Grouped products (qgmm) read a table of their own:
`jqlora.ops.grouped_dispatch`.

A `Plan` is a small hashable record chosen once per call from the backend name, the weight's
format and the row count M. It is static (a nondiff argument of the custom_vjp), so a traced
function never decides anything at run time and no state is kept between calls.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jqlora.errors import Error
from jqlora.quant import Int8Weight, Weight4bit

log = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "interpret", "xla")
WEIGHTS = ("nf4", "fp4", "int8", "llm_int8")  # what `explain` takes
SIXTEEN_BIT = ("bfloat16", "float16")

# What a rule can require, beyond its M range and its variant's supports():
#   "any":               every device the kernel backend runs on (a GPU, or interpret mode)
#   "sm90 and 16-bit x": a Hopper GPU whose jax runs Mosaic GPU, and bfloat16/float16 operands
#   "gpu and 16-bit x":  any GPU (Triton kernels), and bfloat16/float16 operands
#   "auto backend":      the caller asked for "auto" (a measured preference, not a capability)
REQUIREMENTS = ("any", "sm90 and 16-bit x", "gpu and 16-bit x", "auto backend")
KINDS = ("4bit", "int8", "llm_int8")
PRODUCTS = ("fwd", "bwd")
# The registry op each (weight kind, product) row must implement.
OPS = (("4bit", "fwd", "matmul_4bit"), ("4bit", "bwd", "matmul_4bit_t"),
       ("int8", "fwd", "matmul_int8"), ("int8", "bwd", "matmul_int8_t"),
       ("llm_int8", "fwd", "llm_int8"), ("llm_int8", "bwd", "matmul_int8_t"))


class BackendError(Error, ValueError):
    """The requested backend cannot compute this product (shape, format or platform)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    backend: str  # "xla", "pallas" or "interpret"
    fwd: str | None = None  # kernel variant names (None for xla)
    bwd: str | None = None

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the dispatch table (see the module docstring)."""

    weight: str  # "4bit" | "int8" | "llm_int8"
    product: str  # "fwd" | "bwd"
    requires: str  # one of REQUIREMENTS
    m: tuple  # (lo, hi) inclusive; hi None: no upper bound
    variant: str | None  # registry name; None: the jnp reference ("xla")
    why: str  # one line; the measurement behind it is in docs/kernels.md

    def __post_init__(self):
        if self.weight not in KINDS or self.product not in PRODUCTS:
            raise ValueError(f"dispatch rule {self}: weight must be one of {KINDS}, product one of {PRODUCTS}")
        if self.requires not in REQUIREMENTS:
            raise ValueError(f"dispatch rule {self}: unknown requirement {self.requires!r}; "
                             f"expected one of {REQUIREMENTS}")
        lo, hi = self.m
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"dispatch rule {self}: M range {self.m} is empty or negative")

    @property
    def op(self) -> str:
        """The registry op this row's variant implements."""
        return next(op for w, p, op in OPS if (w, p) == (self.weight, self.product))

    @property
    def m_text(self) -> str:
        lo, hi = self.m
        return f"{lo}.." if hi is None else f"{lo}..{hi}"

    def covers(self, m: int) -> bool:
        lo, hi = self.m
        return lo <= m and (hi is None or m <= hi)


RULES = (
    # 4-bit forward, Hopper (Mosaic GPU kernels)
    Rule("4bit", "fwd", "sm90 and 16-bit x", (1, 48), "mgpu_mma_pair_table",
         "pair-table mma.sync kernel: ahead of the wgmma kernel and both GEMVs up to M = 48"),
    Rule("4bit", "fwd", "sm90 and 16-bit x", (3, 1024), "mgpu_decoded_wgmma",
         "warp-specialized wgmma kernel: ahead of every Triton kernel from M = 3 to 1024"),
    Rule("4bit", "fwd", "sm90 and 16-bit x", (1, 2), "mgpu_gemv_pair_table",
         "pair-table GEMV: ahead of the Triton GEMV where the MMA kernel declines the shape"),
    # 4-bit forward, any GPU (Triton kernels)
    Rule("4bit", "fwd", "any", (0, 2), "gemv_block_scaled",
         "block-scaled GEMV: ahead of split-K at M <= 2"),
    Rule("4bit", "fwd", "any", (3, 32), "block_scaled_dot_prmt",
         "codes rounded to x's dtype, looked up in registers: ahead of split-K and table gathers"),
    Rule("4bit", "fwd", "any", (33, 64), "decoded_dot_prmt",
         "decoded-weight tensor-core kernel: ahead of block_scaled_dot_prmt and dequant_dot"),
    Rule("4bit", "fwd", "any", (65, None), "dequant_dot",
         "transient dequant + vendor GEMM: the fused kernels are decode-bound at large M"),
    # 4-bit backward
    Rule("4bit", "bwd", "sm90 and 16-bit x", (1, 128), "mgpu_decoded_wgmma_t",
         "Mosaic GPU backward (tiles decoded to shared memory): ahead of dequant_dot_t to M = 128"),
    Rule("4bit", "bwd", "any", (0, None), "dequant_dot_t",
         "transient dequant + vendor GEMM: the fused backward was slower at every measured M"),
    # INT8 weight-only
    Rule("int8", "fwd", "any", (0, 64), "int8_weight_only_splitk",
         "split-K streams CB once: below the bf16 GEMM's time at small M"),
    Rule("int8", "fwd", "any", (65, None), "int8_dequant_dot",
         "dequantize_int8 kernel + vendor GEMM: ahead of the tiled kernel at large M"),
    Rule("int8", "bwd", "any", (0, None), "int8_dequant_dot_t",
         "the backward recomputes W the same way at every M"),
    # LLM.int8 numerics: the kernel is bit-exact with bitsandbytes, XLA's int8 GEMM is faster
    Rule("llm_int8", "fwd", "auto backend", (0, None), None,
         "XLA's int8 GEMM measured faster than llm_int8_tiled in every protocol cell"),
    Rule("llm_int8", "fwd", "any", (0, None), "llm_int8_tiled",
         "an explicit kernel backend runs the bitsandbytes-exact kernel"),
    Rule("llm_int8", "bwd", "any", (0, None), "int8_dequant_dot_t",
         "the backward is weight-only (as in bitsandbytes)"),
)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def decoding_backend_problem(backend: str, xla_path: str) -> str | None:
    """Why a decoding step's kernel (attention, norm) does not run under `backend`, before any
    shape is looked at (None: the backend runs it). xla_path: what "xla" runs instead. Unlike the
    products' backends these fall back: the path they fall back to computes the same."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "xla":
        return f"backend 'xla' runs {xla_path}"
    if backend == "auto" and not on_gpu():
        return "not on a GPU"
    return None


def mgpu_available() -> bool:
    """A Hopper GPU and a jax whose Mosaic GPU runs the sm90 variants."""
    from pallas_kernels import registry

    return registry.platform_available("sm90")


@dataclasses.dataclass(frozen=True)
class Device:
    """What the rules ask of the machine: its platform and whether Mosaic GPU (sm90) runs."""

    platform: str  # "gpu" | "cpu"
    sm90: bool = False

    def __post_init__(self):
        if self.platform not in ("gpu", "cpu"):
            raise ValueError(f"Device platform must be 'gpu' or 'cpu', got {self.platform!r}")

    @classmethod
    def current(cls) -> "Device":
        """This process's default device (reads `on_gpu()` and `mgpu_available()` now)."""
        return cls("gpu" if on_gpu() else "cpu", bool(mgpu_available()))

    def __str__(self) -> str:
        return f"{self.platform} (sm90)" if self.sm90 else self.platform


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A dispatch decision: the plan, and every table row read with its verdict.

    rows: (product, variant, verdict), verdict "chosen" or why the row declined. Empty when no
    table was read (the xla backend, a dense weight, or `auto` falling back to xla; see `note`).
    `str()` prints each row with the file that holds its variant (`variant_file`).
    """

    plan: Plan
    rows: tuple = ()
    query: str = ""
    note: str = ""

    def __str__(self) -> str:
        p = self.plan
        head = f"backend {p.backend}" + (f": fwd {p.fwd}, bwd {p.bwd}" if p.backend != "xla" else "")
        lines = [head + (f" ({self.note})" if self.note else "")]
        if self.query:
            lines.append(f"  for {self.query}")
        files = [variant_file(var) for _, var, _ in self.rows]
        width = max((len(v) for _, v, _ in self.rows), default=0)
        fwidth = max(map(len, files), default=0)
        lines += [f"  {prod}  {var.ljust(width)}  {where.ljust(fwidth)}  {verdict}"
                  for (prod, var, verdict), where in zip(self.rows, files)]
        return "\n".join(lines)


def variant_file(name: str) -> str:
    """The source file of registry variant `name` (repository-relative), "jnp reference" for
    "xla" (the product XLA runs from the jnp reference)."""
    if name == "xla":
        return "jnp reference"
    from pallas_kernels import registry

    return registry.module_of(name).replace(".", "/") + ".py"


@dataclasses.dataclass(frozen=True)
class _Weight:
    """What dispatch needs of a quantized weight."""

    kind: str  # "4bit" | "int8"
    shape: tuple
    blocksize: int  # 0 for int8 (the kernels' supports() take it as such)


def requirement_holds(requires: str, device: Device, dtype: str | None, auto: bool) -> bool:
    """Whether a rule's requirement (one of REQUIREMENTS) holds for this device, dtype and backend."""
    if requires == "any":
        return True
    if requires == "sm90 and 16-bit x":
        return dtype in SIXTEEN_BIT and device.sm90
    if requires == "gpu and 16-bit x":
        return dtype in SIXTEEN_BIT and device.platform == "gpu"
    return auto  # "auto backend"


def _kernel_shape_problem(w: _Weight) -> str | None:
    if w.kind == "4bit":
        if len(w.shape) != 2:
            return f"the 4-bit kernels take a 2-D weight, this one has shape {w.shape}"
        k = w.shape[1]
        if k % 2 or k % w.blocksize:
            return (f"the 4-bit kernels need in_features ({k}) to be even and a multiple of the "
                    f"blocksize ({w.blocksize}) so that blocks do not span rows")
    return None


def walk_rules(rules, kind: str, product: str, m: int, n: int, k: int, blocksize: int, device: Device,
               dtype: str | None, auto: bool, variants: dict, *, interpret: bool = False) -> tuple:
    """One product's walk down a rule table (`RULES`, or `grouped_dispatch.GROUPED_RULES`): the
    first row for (kind, product) whose requirement holds, whose M range contains m and whose
    variant's supports(m, n, k, blocksize) accepts the shape; a (product, variant, verdict) for
    every row read; and the last row whose variant declined the shape (None if none).
    interpret: pass over variants that have no interpret mode (grouped dispatch does; `_resolve`
    chooses them and refuses them afterwards, `check_runs_here`)."""
    chosen, verdicts, declined = None, [], None
    for rule in rules:
        if (rule.weight, rule.product) != (kind, product):
            continue
        name = rule.variant or "xla"
        if chosen is not None:
            verdicts.append((product, name, "an earlier row matched"))
        elif not requirement_holds(rule.requires, device, dtype, auto):
            verdicts.append((product, name, f"needs {rule.requires}"))
        elif not rule.covers(m):
            verdicts.append((product, name, f"M={m} outside {rule.m_text}"))
        elif rule.variant is not None and not _variant(variants, rule.variant).supports(m, n, k, blocksize):
            verdicts.append((product, name, f"supports() declines M={m}, N={n}, K={k}, blocksize={blocksize}"))
            declined = rule
        elif rule.variant is not None and interpret and not _variant(variants, rule.variant).interpret:
            verdicts.append((product, name, "no interpret mode"))
        else:
            verdicts.append((product, name, "chosen"))
            chosen = rule
    return chosen, verdicts, declined


def _walk(kind: str, product: str, w: _Weight, m: int, device: Device, dtype: str | None,
          auto: bool, variants: dict) -> tuple[Rule | None, list, BackendError | None]:
    """The first matching row of RULES for one product, a verdict for every row read, and the
    error to raise when no row matched."""
    n, k = w.shape[0], w.shape[-1]
    chosen, verdicts, declined = walk_rules(RULES, kind, product, m, n, k, w.blocksize, device, dtype, auto,
                                            variants)
    error = None
    if chosen is None and declined is not None:  # the kernel for this M does not take the shape
        error = BackendError(f"kernel variant {declined.variant!r} does not support M={m}, N={n}, "
                             f"K={k}, blocksize={w.blocksize}")
    elif chosen is None:
        error = BackendError(f"no dispatch rule for a {kind} {product} product at M={m} "
                             "(jqlora/ops/dispatch.py RULES)")
    return chosen, verdicts, error


def _variant(variants: dict, name: str):
    if name not in variants:
        from pallas_kernels import registry

        registry.get(name)  # raises KeyError naming the known variants
    return variants[name]


def _check_variant(name: str, w: _Weight, m: int, variants: dict) -> None:
    v = _variant(variants, name)
    n, k = w.shape[0], w.shape[-1]
    want = ("matmul_4bit",) if w.kind == "4bit" else ("matmul_int8", "llm_int8")
    if v.op not in want:
        raise BackendError(f"kernel variant {name!r} implements {v.op!r}, not a product with this weight")
    if not v.supports(m, n, k, w.blocksize):
        raise BackendError(f"kernel variant {name!r} does not support M={m}, N={n}, K={k}, "
                           f"blocksize={w.blocksize}")


def _resolve(w: _Weight | None, m: int, backend: str, *, variant: str | None, numerics: str,
             dtype: str | None, device: Device | None, query: str = "") -> Explanation:
    """The one decision path behind `choose_plan` and `explain`."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if w is None:
        if backend in ("pallas", "interpret"):
            raise BackendError(f"backend {backend!r} has kernels only for quantized weights; a dense weight uses 'xla'")
        return Explanation(Plan("xla"), (), query, "a dense weight runs the jnp product")
    if backend == "xla":
        return Explanation(Plan("xla"), (), query, "requested")
    if numerics == "llm_int8" and w.kind != "int8":
        raise ValueError("numerics='llm_int8' applies to Int8Weight only")
    device = device if device is not None else Device.current()
    problem = _kernel_shape_problem(w)
    auto = backend == "auto"
    if auto:
        if device.platform != "gpu":
            return Explanation(Plan("xla"), (), query, "auto on a non-GPU device runs the jnp reference")
        if problem:
            log.debug("qmatmul auto backend: falling back to xla: %s", problem)
            return Explanation(Plan("xla"), (), query, f"auto falls back: {problem}")
        backend = "pallas"
    elif problem:
        raise BackendError(f"backend {backend!r}: {problem}")
    if backend == "pallas" and device.platform != "gpu":
        raise BackendError("backend 'pallas' needs a GPU; use 'interpret' to run the kernels on CPU, or 'xla'")
    kind = "llm_int8" if numerics == "llm_int8" else w.kind
    from pallas_kernels import registry

    variants = {v.name: v for v in registry.all_variants()}
    fwd_rule, rows, error = _walk(kind, "fwd", w, m, device, dtype, auto, variants)
    if fwd_rule is not None and fwd_rule.variant is None:
        # a row that keeps the product on the jnp reference; it outranks variant= too
        log.debug("qmatmul auto backend: %s uses xla: %s", kind, fwd_rule.why)
        return Explanation(Plan("xla"), tuple(rows), query, fwd_rule.why)
    if variant is not None:  # the table's forward choice is replaced, never checked
        fwd, rows = variant, [("fwd", variant, "chosen (variant=)")]
        _check_variant(fwd, w, m, variants)
    elif error is not None:
        raise error
    else:
        fwd = fwd_rule.variant
    check_runs_here(fwd, backend, device, variants)
    bwd_rule, bwd_rows, error = _walk(kind, "bwd", w, m, device, dtype, auto, variants)
    if error is not None:
        raise error
    return Explanation(Plan(backend, fwd, bwd_rule.variant), tuple(rows + bwd_rows), query)


def check_runs_here(name: str, backend: str, device: Device, variants: dict) -> None:
    """Refuse a variant the backend or device cannot run (interpret mode, a Hopper-only kernel)."""
    v = _variant(variants, name)
    if (backend == "interpret" and not v.interpret) or (v.platform == "sm90" and not device.sm90):
        raise BackendError(f"kernel variant {name!r} runs on a Hopper GPU only (Mosaic GPU, "
                           "inline PTX; no interpret mode)")


def _weight_of(q) -> _Weight | None:
    if isinstance(q, Weight4bit):
        return _Weight("4bit", tuple(q.shape), q.blocksize)
    if isinstance(q, Int8Weight):
        return _Weight("int8", tuple(q.shape), 0)
    return None


def choose_plan(q, m: int, backend: str, *, variant: str | None = None, numerics: str = "weight_only",
                dtype: str | None = None, device: Device | None = None) -> Plan:
    """Resolve `backend` for weight `q` and M rows. Explicit backends never fall back silently.

    Args:
      q: a `Weight4bit`, an `Int8Weight` or a dense array (always "xla").
      m: rows of the flattened activation.
      backend: one of `BACKENDS`.
      variant: a registry variant forced for the forward product (kernel backends only).
      numerics: "weight_only" or "llm_int8" (an `Int8Weight` only).
      dtype: compute dtype name; None (unknown) rules out the kernels that take 16-bit operands only.
      device: the device the rules read; None: `Device.current()`.
    """
    return _resolve(_weight_of(q), m, backend, variant=variant, numerics=numerics, dtype=dtype,
                    device=device).plan


def explain(weight: str, m: int, n: int, k: int, *, blocksize: int = 64, dtype="bfloat16",
            device: Device | None = None, backend: str = "auto") -> Explanation:
    """Which kernels run y = x @ W.T and dx = dy @ W for x of M rows and W (N, K), and why.

    Args:
      weight: "nf4" or "fp4" (4-bit), "int8" (weight-only) or "llm_int8" (int8, LLM.int8 numerics).
      m, n, k: rows of x, out_features, in_features.
      blocksize: the 4-bit quantization blocksize (ignored for int8).
      dtype: compute dtype (name or dtype).
      device: the device to decide for; None: this process's (`Device.current()`).
      backend: one of `BACKENDS`.

    Returns:
      An `Explanation`: `.plan` is what `choose_plan` returns for such a weight; `str()` of it is
      a table of the rows read, the chosen ones and why the others declined.
    """
    if weight not in WEIGHTS:
        raise ValueError(f"explain: unknown weight {weight!r}; expected one of {WEIGHTS}")
    if min(m, n, k) < 0 or n == 0 or k == 0:
        raise ValueError(f"explain: need M >= 0 and N, K >= 1, got M={m}, N={n}, K={k}")
    four_bit = weight in ("nf4", "fp4")
    w = _Weight("4bit" if four_bit else "int8", (n, k), blocksize if four_bit else 0)
    dtype = None if dtype is None else jnp.dtype(dtype).name
    device = device if device is not None else Device.current()
    bs = f" blocksize={blocksize}" if four_bit else ""
    query = f"{weight} M={m} N={n} K={k}{bs} {dtype}, device {device}, backend {backend}"
    return _resolve(w, m, backend, variant=None, numerics="llm_int8" if weight == "llm_int8" else "weight_only",
                    dtype=dtype, device=device, query=query)


def rules_markdown(rules, kind_header: str) -> str:
    """A rule table (`RULES` or `grouped_dispatch.GROUPED_RULES`) as markdown, its weight column
    headed `kind_header`."""
    lines = [f"| # | {kind_header} | product | requires | M | variant | why |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rules, 1):
        variant = f"`{r.variant}`" if r.variant else "xla (jnp reference)"
        lines.append(f"| {i} | {r.weight} | {r.product} | {r.requires} | {r.m_text} | {variant} | {r.why} |")
    return "\n".join(lines)


def markdown_table() -> str:
    """RULES as the markdown table docs/kernels.md embeds."""
    return rules_markdown(RULES, "weight")
