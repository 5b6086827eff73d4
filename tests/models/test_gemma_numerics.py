"""What Gemma asks of the attention path and the compute dtype: soft-capped attention (Gemma 2) runs
the einsum path whatever `--attention auto` would pick on a GPU, `--attention cudnn` / `xla` on it
is a one-line error (exit 2), and float16 compute is refused at load because Gemma's residual
stream outgrows float16 (measured on the real Gemma 3 270M below)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import family_checkpoints as fc  # noqa: E402
from cli_runner import run_cli  # noqa: E402
from jqlora import models  # noqa: E402
from jqlora._util import resolve_attention  # noqa: E402
from jqlora.errors import SettingError  # noqa: E402
from interop.bnb_common import read_config  # noqa: E402
from jqlora.models.config import attn_softcap_of  # noqa: E402

pytestmark = pytest.mark.torch


def test_auto_attention_on_a_gpu_runs_soft_capped_models_on_einsum():
    gpu = dict(backend="gpu", cudnn=True)
    assert resolve_attention("auto", "bfloat16", **gpu)[0] == "cudnn"  # an uncapped model (Gemma 3, Llama)
    impl, why = resolve_attention("auto", "bfloat16", soft_capped=True, **gpu)
    assert impl == "einsum" and "soft-caps" in why
    assert resolve_attention("auto", "float32", soft_capped=True, backend="cpu")[0] == "einsum"
    for name in ("cudnn", "xla"):
        with pytest.raises(SettingError, match=f"--attention {name} cannot soft-cap"):
            resolve_attention(name, "bfloat16", soft_capped=True, **gpu)
    assert resolve_attention("einsum", "bfloat16", soft_capped=True, **gpu) == ("einsum", "requested")


def test_cli_reads_the_soft_cap_and_refuses_cudnn(tmp_path_factory, capsys):
    g2 = fc.cached(tmp_path_factory, "gemma2", "bf16")
    assert attn_softcap_of(read_config(g2)) == 5.0
    assert attn_softcap_of(read_config(fc.cached(tmp_path_factory, "gemma3", "bf16"))) is None
    rc, out, err = run_cli(capsys, "generate", g2, "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                           "--attention", "cudnn")
    assert rc == 2 and "cannot soft-cap" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc, out, err = run_cli(capsys, "generate", g2, "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert rc == 0, err


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_float16_compute_is_refused_with_the_reason(kind):
    tm = fc.text_model(fc.FAMILIES[kind])
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    with pytest.raises(SettingError, match="float16 compute is refused.*outgrows float16.*bfloat16 or float32"):
        models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float16)
    models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.bfloat16)  # bf16 has the range


def test_real_gemma3_residual_stream_outgrows_float16(gemma3):
    """The measurement behind the refusal: the real Gemma 3 270M's hidden states pass float16's
    maximum on an ordinary sentence (float32 compute, same as transformers' float32), so a float16
    forward overflows in transformers as it would in jqlora."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(gemma3.bf16))("The capital of France is Paris.").input_ids
    m = models.load_causal_lm(gemma3.bf16, compute_dtype=jnp.float32)
    _, states = m(jnp.asarray([ids]), return_states=True)
    peak = max(float(jnp.abs(h).max()) for h in states["layers"])
    assert peak > float(np.finfo(np.float16).max), peak


from real_models import gemma3  # noqa: E402,F401  (the fixture)
