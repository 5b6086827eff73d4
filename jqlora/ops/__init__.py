"""Quantized products with a custom_vjp (see qmatmul); which kernel runs them (see dispatch)."""
from jqlora.ops.dispatch import (BACKENDS, BackendError, Device, Explanation, Plan, choose_grouped_plan, choose_plan,
                                 explain, explain_grouped)
from jqlora.ops.qgmm import qgmm
from jqlora.ops.qmatmul import qmatmul

__all__ = ["qmatmul", "qgmm", "BACKENDS", "BackendError", "Device", "Explanation", "Plan", "choose_plan", "explain",
           "choose_grouped_plan", "explain_grouped"]
