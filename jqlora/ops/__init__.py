"""Quantized products with a custom_vjp (see qmatmul, qgmm); which kernel runs them (see dispatch,
grouped_dispatch)."""
from jqlora.ops.dispatch import BACKENDS, BackendError, Device, Explanation, Plan, choose_plan, explain
from jqlora.ops.grouped_dispatch import choose_grouped_plan, explain_grouped
from jqlora.ops.qgmm import qgmm
from jqlora.ops.qmatmul import qmatmul

__all__ = ["qmatmul", "qgmm", "BACKENDS", "BackendError", "Device", "Explanation", "Plan", "choose_plan", "explain",
           "choose_grouped_plan", "explain_grouped"]
