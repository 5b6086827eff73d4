"""jqlora: QLoRA in JAX with bitsandbytes checkpoint interop."""
__version__ = "0.1.0"
