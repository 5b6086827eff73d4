"""Quantized products with a custom_vjp (see qmatmul)."""
from jqlora.ops.backends import BACKENDS, BackendError, Plan, choose_plan
from jqlora.ops.qmatmul import qmatmul

__all__ = ["qmatmul", "BACKENDS", "BackendError", "Plan", "choose_plan"]
