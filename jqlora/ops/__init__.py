"""Quantized products with a custom_vjp (see qmatmul); which kernel runs them (see dispatch)."""
from jqlora.ops.dispatch import BACKENDS, BackendError, Device, Explanation, Plan, choose_plan, explain
from jqlora.ops.qmatmul import qmatmul

__all__ = ["qmatmul", "BACKENDS", "BackendError", "Device", "Explanation", "Plan", "choose_plan", "explain"]
