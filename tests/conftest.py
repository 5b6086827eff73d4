"""Test-session setup shared by all tests (owned by the lead; add fixtures in your own files)."""
import os
import sys
from pathlib import Path

# Test helpers (checkpoint builders, the CLI runner, real-model fixtures) live in tests/support/ and are
# imported by bare name, as pytest's default import mode imports the test files themselves.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Two host devices so sharding tests have a real mesh on a CPU machine. Must precede jax import.
# The tests compile hundreds of small programs and run each a few times: LLVM's optimisation passes
# cost more there than they save (a third of the time of the training tests); numerics are
# unchanged (no fast-math either way). XLA's CPU fusion emitters (MLIR) take about twice as long
# to compile a fusion as its classic LLVM IR emitters: without them the tiny models' tests take a
# third less time, while a real model's step (SmolLM2-135M) runs slower (2.5 -> 4 s), a few seconds
# of the suite. Results agree to the last bits (a transcendental or a reduction can round
# differently): the child processes of the tests inherit XLA_FLAGS, so all compare like with like.
# CPU runs only: a GPU run keeps the host's default emitters (and any jax without the flag).
_XLA_FLAGS = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    _XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", _XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JQLORA_COMPILE_CACHE", "0")  # in-process CLI tests never write the per-user cache

from hypothesis import HealthCheck, settings  # noqa: E402

# 12 derandomized examples a property (hypothesis draws the edges first: one row, ragged tiles,
# empty groups); a property that needs more sets its own `@settings`.
settings.register_profile(
    "jqlora", deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("jqlora")

# float32 references mean float32: on a GPU, XLA would otherwise round f32 matmuls to TF32.
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

# ---- one compilation cache a test session --------------------------------------------------
# The test processes compile many identical programs (the same tiny models in many files, in both
# xdist workers, and again after the mapping guard below clears the jit caches). JAX's persistent
# cache, in a fresh directory per session, compiles each once. The controller creates the directory
# before xdist starts its workers, which inherit its name through the environment, and removes it
# at the end; a plain `pytest` without xdist is its own controller. The name is not JAX's own
# variable, so the CLI's child processes run as the tests configure them (uncached).
_CACHE_ENV = "JQLORA_TESTS_XLA_CACHE_DIR"
_CACHE_OWNER_ENV = "JQLORA_TESTS_XLA_CACHE_OWNER_PID"


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if not _is_worker(config) and os.environ.get(_CACHE_OWNER_ENV) is None:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jqlora-tests-xla-")
        os.environ[_CACHE_OWNER_ENV] = str(os.getpid())
    directory = os.environ.get(_CACHE_ENV)
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if not _is_worker(config) and os.environ.get(_CACHE_OWNER_ENV) == str(os.getpid()):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)
        del os.environ[_CACHE_OWNER_ENV]


# The library turns its lowered-program cache (jqlora.lowered_cache) on with JAX's persistent cache;
# the session's cache above is not the library's, so in-process tests keep the library's default
# path (no lowered-program cache) unless a test points the lowered cache at a directory itself
# (tests/models/test_lowered_cache.py does).
from jqlora import lowered_cache as _lowered_cache  # noqa: E402

_library_cache_dir = _lowered_cache.cache_dir


def _cache_dir_without_the_sessions():
    directory = _library_cache_dir()
    session = os.environ.get(_CACHE_ENV)
    if directory is not None and session and Path(directory).parent == Path(session):
        return None
    return directory


_lowered_cache.cache_dir = _cache_dir_without_the_sessions


@pytest.fixture
def lower_for_triton(monkeypatch):
    """`lower(label, fn, *arg_shapes)`: lower jitted fn for CUDA (Pallas -> Triton IR) without a
    GPU, so CI checks that kernels use only ops the Triton lowering accepts. Skips the test
    where this jax cannot lower for a GPU it does not have."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as pcr
    except Exception:  # pragma: no cover
        pytest.skip("no Pallas Triton backend in this jax")
    gi = getattr(pcr, "gpu_info_lib", None)  # jax >= 0.11 asks the device for its GPU kind
    if gi is not None and jax.default_backend() != "gpu":
        try:
            info = gi.get_gpu_info_from_version(gi.GpuVersion.H100)
        except Exception:  # pragma: no cover
            pytest.skip("cannot fake a GPU for the Triton lowering in this jax")
        monkeypatch.setattr(gi, "get_gpu_info", lambda: info)

    def lower(label, fn, *args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton is deprecated"
            try:
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            except RuntimeError as e:
                if "GPU" in str(e) and "device" in str(e):
                    pytest.skip(f"Triton lowering needs a GPU here: {e}")
                raise AssertionError(f"{label}: Triton lowering failed: {e}") from e

    return lower


# ---- mappings of compiled code --------------------------------------------------------------
# XLA's CPU backend maps each compiled kernel's code, constants and data into pages of their own
# (about three mappings a kernel) and keeps them while a jit cache holds the executable. A test
# worker compiles for the whole suite and passes Linux's limit on mappings a process
# (vm.max_map_count, 65,530 by default): LLVM then fails with "Cannot allocate memory" and the
# worker crashes with a segfault in whichever test compiles next. Past a share of the limit, the
# caches are cleared between tests: the executables and their mappings go with them.
_MAPS_CLEAR_SHARE = 0.4


def _mapping_limit() -> int | None:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None  # not Linux


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    limit = _mapping_limit()
    if limit is not None and _mappings() > _MAPS_CLEAR_SHARE * limit:
        import gc

        jax.clear_caches()
        gc.collect()
