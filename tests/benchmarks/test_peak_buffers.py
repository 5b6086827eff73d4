"""benchmarks/profile/peak_buffers on a CPU-compiled dump: a layer loop whose body sorts a large
product (a temporary XLA cannot fuse away) beside a loop-carried stack written layer by layer."""
import glob
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.profile import peak_buffers

PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def looped(x, ws):
        def body(carry, w):
            h, stack, i = carry
            big = jnp.sort(h @ w, axis=-1)                   # f32[128, 2048]: 1 MiB, one layer at a time
            stack = jax.lax.dynamic_update_index_in_dim(stack, big[:, :256], i, 0)  # the carried stack: 2 MiB
            return (jnp.tanh(big[:, :256]), stack, i + 1), None
        init = (x, jnp.zeros((16, 128, 256), jnp.float32), jnp.int32(0))
        (h, stack, _), _ = jax.lax.scan(body, init, ws)
        return h + jnp.sum(stack, axis=0)

    jax.jit(looped)(jnp.ones((128, 256)), jnp.ones((16, 256, 2048)) * 1e-3).block_until_ready()
""")


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_dump_to={out} --xla_dump_hlo_module_re=.*looped.* --xla_dump_hlo_as_text")
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=240)
    (txt,) = glob.glob(str(out / "*looped*after_optimizations.txt"))
    return txt[:-len(".txt")]


def test_the_sorted_product_and_the_carried_stack_are_alive_at_the_peak(dump, capsys):
    gib = peak_buffers.peak(dump, top=10)
    text = capsys.readouterr().out
    assert "f32[128,2048]" in text  # the layer's sorted product
    assert "f32[16,128,256]" in text  # the stack, carried through the loop's slots
    block = float(text.split("temporary block ")[1].split(" GiB")[0])
    assert 3 / 1024 <= gib <= block + 1e-3, text


def test_a_missing_dump_is_a_clear_error(tmp_path, capsys):
    assert peak_buffers.main([str(tmp_path / "nothing")]) == 2
    assert "nothing.txt" in capsys.readouterr().err
