"""Test-session setup shared by all tests (owned by the lead; add fixtures in your own files)."""
import os

# Two host devices so sharding tests have a real mesh on a CPU machine. Must precede jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "jqlora", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("jqlora")

# float32 references mean float32: on a GPU, XLA would otherwise round f32 matmuls to TF32.
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
