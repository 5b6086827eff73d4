"""The cross-check's report: one tensor's difference (`Diff`, `diff`), the result of a run with its
verdict and the table `jqlora crosscheck` prints (`CrosscheckResult`), and the default tolerances."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .products import format_products
from .weights import format_weights

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
