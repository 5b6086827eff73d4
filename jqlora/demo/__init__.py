"""The end-to-end demo behind `jqlora demo` / `make demo` (see jqlora/demo/pipeline.py)."""
from jqlora.demo.pipeline import DemoSettings, run_demo

__all__ = ["DemoSettings", "run_demo"]
