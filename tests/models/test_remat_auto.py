"""`remat="auto"` on CPU: the plan fits the memory this process may use (the cgroup limit,
RLIMIT_AS, MemAvailable, or JQLORA_MEMORY_GB), so a step that would not fit gets recompute, and
the model's trace logs what it chose."""
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import lora, models
from jqlora.errors import SettingError
from jqlora.models import remat

GB = 10**9
# SmolLM2-135M(-Instruct)'s config.json, as the README's real-model section trains it
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)


def _fake_system(root, *, cgroup_lines, files, meminfo_kb):
    """A procfs (self/cgroup, meminfo) and a cgroup tree under `root`: {relative path: text}."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kb} kB\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text + "\n")
    return dict(proc=proc, cgroup=cg)


def test_host_memory_takes_the_smallest_limit_of_the_cgroup_tree_and_meminfo(tmp_path):
    big_kb = 64 * GB // 1024
    # cgroup v2: the process's cgroup says max, its parent 6 GB, the root nothing
    v2 = _fake_system(tmp_path / "v2", cgroup_lines=["0::/a/b"], meminfo_kb=big_kb,
                      files={"a/b/memory.max": "max", "a/memory.max": str(6 * GB)})
    assert remat.host_memory(**v2) == (6 * GB, "cgroup memory.max")
    # cgroup v1: the memory controller's limit; "unlimited" is 2^63 rounded to a page
    v1 = _fake_system(tmp_path / "v1", cgroup_lines=["9:pids:/", "4:memory:/job", "0::/"], meminfo_kb=big_kb,
                      files={"memory/job/memory.limit_in_bytes": str(3 * GB),
                             "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert remat.host_memory(**v1) == (3 * GB, "cgroup memory.limit_in_bytes")
    # no limit anywhere: what the other processes leave (MemAvailable)
    free = _fake_system(tmp_path / "free", cgroup_lines=["0::/"], meminfo_kb=5 * GB // 1024,
                        files={"memory.max": "max"})
    assert remat.host_memory(**free) == (5 * GB // 1024 * 1024, "MemAvailable")
    # a container whose /proc/self/cgroup names a host path the mount does not have: its root counts
    inside = _fake_system(tmp_path / "ct", cgroup_lines=["0::/kubepods/pod1"], meminfo_kb=big_kb,
                          files={"memory.max": str(2 * GB)})
    assert remat.host_memory(**inside) == (2 * GB, "cgroup memory.max")


def test_host_memory_sees_rlimit_as(tmp_path):
    fake = _fake_system(tmp_path, cgroup_lines=["0::/"], meminfo_kb=64 * GB // 1024, files={})
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]), resource.RLIM_INFINITY));"
            "from jqlora.models.remat import host_memory; print(host_memory(proc=sys.argv[1], cgroup=sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(fake["proc"]), str(fake["cgroup"]), str(40 * GB)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr((40 * GB, "RLIMIT_AS"))


def test_cpu_plan_fits_the_injected_memory(monkeypatch):
    """On CPU with no limit given, the plan reads the host's memory; JQLORA_MEMORY_GB sets it."""
    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(remat.MEMORY_ENV, raising=False)
    plan = models.remat_plan(SMOLLM2, 8, 512, compute_dtype=jnp.float32, attention="einsum")
    assert plan.device_bytes is not None and plan.memory_source != "device memory", plan
    # the README's train line (SmolLM2-135M, 8 x 512, float32, LoRA on every linear layer)
    kw = dict(compute_dtype=jnp.float32, attention="einsum", lora_rank=16)
    chosen = {}
    for gb in (64, 24, 12, 2):
        monkeypatch.setenv(remat.MEMORY_ENV, str(gb))
        plan = models.remat_plan(SMOLLM2, 8, 512, **kw)
        chosen[gb] = plan.policy
        assert plan.device_bytes == gb * GB and "JQLORA_MEMORY_GB" in plan.reason, plan.reason
    assert chosen[64] is None, chosen                # 14.6 GiB predicted: fits half of 64 GB
    assert chosen[24] is not None and chosen[12] is not None, chosen  # the 24 GB machine: recompute
    assert chosen[2] == "nothing_saveable", chosen  # nothing fits: the least memory, never offload
    assert "may not fit" in models.remat_plan(SMOLLM2, 8, 512, **kw).reason
    monkeypatch.setenv(remat.MEMORY_ENV, "lots")
    with pytest.raises(SettingError, match="JQLORA_MEMORY_GB"):
        models.remat_plan(SMOLLM2, 8, 512, **kw)


def test_model_traced_under_a_small_limit_recomputes_and_logs_it(monkeypatch, caplog):
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    m = models.from_params(models.init_params(cfg, seed=0, std=0.1), cfg, quantize="nf4", compute_dtype=jnp.float32,
                           remat="auto", lora=lora.LoraConfig(rank=4), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 64)), jnp.int32)
    graphdef, state = nnx.split(m)
    need = models.remat_plan(cfg, 2, 64, compute_dtype=jnp.float32, attention="einsum", lora_rank=4,
                             param_bytes=remat.state_bytes(m), device_bytes=10**12).predicted["none"]

    def chosen(gb):
        monkeypatch.setenv(remat.MEMORY_ENV, repr(gb))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jqlora.models"):
            jax.eval_shape(lambda st: nnx.merge(graphdef, st)(ids), state)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("remat: ")]
        assert len(lines) == 1, lines
        return lines[0]

    assert chosen(need / GB * 4).startswith("remat: none (")  # twice what half the memory needs
    small = chosen(need / GB * 1.5)  # half of it is less than no remat needs
    assert not small.startswith("remat: none") and "JQLORA_MEMORY_GB" in small, small


@pytest.mark.skipif(not os.path.isfile("/proc/meminfo"), reason="Linux only")
def test_readme_shape_plans_against_this_machine():
    """With nothing injected the plan names the limit it read, and that limit is at most the RAM."""
    limit, source = remat.host_memory()
    assert source in ("cgroup memory.max", "cgroup memory.limit_in_bytes", "RLIMIT_AS", "MemAvailable")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < limit <= ram
