"""Tokenizers from a Hugging Face folder and chat templates (jqlora.tokenizer) against
transformers' AutoTokenizer + apply_chat_template on the same folder; `jqlora generate --chat`
and its EOS ids against transformers' greedy generate."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jqlora.tokenizer import TokenizerError, generation_eos_ids, load_hf_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>"]

# SmolLM2-Instruct's template (ChatML with a default system prompt).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same rendering with the assistant text marked by generation blocks.
CHATML_MARKED = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                 "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
                 "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
                 "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama-3 style: bos_token, trimmed content, role alternation checked with raise_exception.
LLAMA3 = ("{{ bos_token }}{% set offset = 1 if messages[0]['role'] == 'system' else 0 %}"
          "{% for message in messages %}"
          "{% if message['role'] != 'system' and (message['role'] == 'user') != (loop.index0 % 2 == offset) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
          "{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy? {{ not a template }}"},
     {"role": "assistant", "content": "Rome, of course.", "name": None}],
    [{"role": "user", "content": "héllo wörld 👋 <|im_end|> is text here"}],
]


def build_tokenizer_folder(directory: Path, template: str | None = CHATML, *, in_config: bool = True) -> Path:
    """A byte-level BPE tokenizer (as SmolLM2/Llama 3 use) trained on a few sentences, with
    tokenizer_config.json and the chat template in it or in chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["What is the capital of France? The capital of France is Paris.",
            "system user assistant You are a helpful AI assistant. Rome Italy", "hello world"]
    tok.train_from_iterator(text * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template is not None and in_config:
        cfg["chat_template"] = template
    elif template is not None:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {"chatml": build_tokenizer_folder(root / "chatml"),
            "chatml_jinja": build_tokenizer_folder(root / "chatml_jinja", CHATML, in_config=False),
            "marked": build_tokenizer_folder(root / "marked", CHATML_MARKED),
            "llama3": build_tokenizer_folder(root / "llama3", LLAMA3),
            "none": build_tokenizer_folder(root / "none", None)}


@pytest.mark.torch
@pytest.mark.parametrize("name", ["chatml", "chatml_jinja", "marked", "llama3"])
def test_chat_template_matches_transformers(folders, name):
    from transformers import AutoTokenizer

    ours, theirs = load_hf_tokenizer(folders[name]), AutoTokenizer.from_pretrained(folders[name])
    for conv in CONVERSATIONS:
        for gen in (False, True):
            want_text = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(conv, add_generation_prompt=gen) == want_text
            want = theirs.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=True)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == list(want["input_ids"])
    assert ours.token_id("eos_token") == theirs.eos_token_id
    assert ours.token_id("bos_token") == theirs.bos_token_id


@pytest.mark.torch
def test_assistant_mask_matches_transformers_generation_blocks(folders):
    """Generation blocks: the same mask as transformers' return_assistant_tokens_mask. Without
    them (turn-by-turn rendering) the same mask again, on the template that renders identically."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(folders["marked"])
    marked, plain = load_hf_tokenizer(folders["marked"]), load_hf_tokenizer(folders["chatml"])
    for conv in CONVERSATIONS[:2]:
        out = theirs.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        want = np.asarray(out["assistant_masks"], bool)
        ids_m, mask_m = marked.chat_ids_and_mask(conv)
        ids_p, mask_p = plain.chat_ids_and_mask(conv)
        assert list(ids_m) == list(out["input_ids"]) == list(ids_p)
        np.testing.assert_array_equal(mask_m, want)
        np.testing.assert_array_equal(mask_p, want)
        answers = [m["content"] + "<|im_end|>\n" for m in conv if m["role"] == "assistant"]
        assert plain.decode([int(i) for i in ids_p[mask_p]], skip_special_tokens=False) == "".join(answers)


def test_template_errors_are_one_line(folders, tmp_path):
    tok = load_hf_tokenizer(folders["llama3"])
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "x"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        load_hf_tokenizer(folders["none"]).apply_chat_template(CONVERSATIONS[0])
    bad = build_tokenizer_folder(tmp_path / "bad", "{% for m in messages %}{{ m.content }")
    with pytest.raises(TokenizerError, match="does not parse"):
        load_hf_tokenizer(bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHATML, "eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in"):
        load_hf_tokenizer(bad)
    with pytest.raises(TokenizerError, match="chat template file not found"):
        load_hf_tokenizer(folders["chatml"], chat_template=tmp_path / "missing.jinja")


def test_generation_eos_ids(tmp_path):
    assert generation_eos_ids(tmp_path, None) == ()
    assert generation_eos_ids(tmp_path, (5, 7)) == (5, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 2]}))
    assert generation_eos_ids(tmp_path, 5) == (5, 7, 9, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert generation_eos_ids(tmp_path, None) == (11,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id must be"):
        generation_eos_ids(tmp_path, None)


# ------------------------------------------------------------------------------- generate --chat
@pytest.fixture(scope="module")
def chat_ckpt(folders, tmp_path_factory):
    """A tiny random plain Llama whose vocabulary is the chat tokenizer's, with its tokenizer."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folders["chatml"] / "tokenizer.json")).get_vocab_size()
    d = checkpoint_factory.build_llama_checkpoint(
        tmp_path_factory.mktemp("chat") / "ckpt", quant=None,
        config_overrides={"vocab_size": vocab, "initializer_range": 0.2, "eos_token_id": 0,
                          "bos_token_id": None, "pad_token_id": None})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["chatml"] / f, d / f)
    (d / "generation_config.json").unlink(missing_ok=True)
    return d


@pytest.mark.torch
def test_generate_chat_matches_transformers_and_stops_at_every_eos(chat_ckpt, capsys):
    """`--chat` feeds the templated prompt (with the generation header) and stops at an EOS id
    that only generation_config.json lists."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jqlora.cli import main

    question = "What is the capital of France?"
    hf_tok = AutoTokenizer.from_pretrained(chat_ckpt)
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(chat_ckpt, dtype=torch.float32).eval()
    eos_cfg, eos_tok = 0, hf_tok.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    free = [int(t) for t in out[0, len(prompt):]]
    # an id the free run emits at step k >= 1 and not before, and neither of the other EOS ids
    k = next(j for j in range(1, len(free)) if free[j] not in free[:j] and free[j] not in (eos_cfg, eos_tok))
    assert not {eos_cfg, eos_tok} & set(free[:k]), "pick another seed: the free run hits a listed EOS"

    def run():
        capsys.readouterr()
        rc = main(["generate", str(chat_ckpt), "--chat", question, "--max-new-tokens", "10", "--json",
                   "--dtype", "float32"])
        return rc, json.loads(capsys.readouterr().out)

    rc, res = run()
    assert rc == 0 and res["ids"] == free and not res["stopped_at_eos"]
    assert res["text"] == hf_tok.decode(free, skip_special_tokens=True)
    (chat_ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[k], 3]}))
    try:
        rc, res = run()
    finally:
        (chat_ckpt / "generation_config.json").unlink()
    assert rc == 0 and res["ids"] == free[:k] and res["stopped_at_eos"]


@pytest.mark.torch
def test_generate_chat_needs_a_template(chat_ckpt, folders, capsys, tmp_path):
    from jqlora.cli import main

    d = tmp_path / "ckpt"
    shutil.copytree(chat_ckpt, d)
    shutil.copy(folders["none"] / "tokenizer_config.json", d / "tokenizer_config.json")
    capsys.readouterr()
    rc = main(["generate", str(d), "--chat", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "no chat template" in err and "Traceback" not in err


# ------------------------------------------------------------------------- the real SmolLM2 tokenizer
@pytest.fixture(scope="module")
def smollm2_dir():
    from jqlora.demo.real_model import ModelUnavailable, build_smollm2

    try:
        return build_smollm2().nf4  # built once per machine, then cached
    except ModelUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.torch
def test_smollm2_chat_template_and_demo_data(smollm2_dir):
    """The real SmolLM2-135M-Instruct folder: the same ids as transformers, and the demo's chat data
    trains exactly on its answers."""
    from transformers import AutoTokenizer

    from jqlora import train as T
    from jqlora.demo.smollm2 import TRAIN_CAPITALS, answer, chat_rows
    from jqlora.train import examples as E
    from jqlora.train import tokenization as TK

    ours, theirs = load_hf_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    for conv in CONVERSATIONS:
        for gen in (False, True):
            want = theirs.apply_chat_template(conv, add_generation_prompt=gen, return_dict=True)["input_ids"]
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == list(want)
    rows = chat_rows(TRAIN_CAPITALS[:3])
    sp = T.special_tokens(ours)
    for row, (c, cap) in zip(rows[::3], TRAIN_CAPITALS[:3]):
        ids, trained = TK.tokenize_example(ours, E.parse_example(row), sp)
        assert ours.decode([int(i) for i in ids[trained]], skip_special_tokens=False) == answer(c, cap) + "<|im_end|>\n"


def test_end_of_turn_is_the_special_token_after_the_assistant_text(folders):
    for name, want in (("chatml", "<|im_end|>"), ("chatml_jinja", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        tok = load_hf_tokenizer(folders[name])
        assert tok.end_of_turn_ids() == (tok.tokenizer.token_to_id(want),), name
    assert load_hf_tokenizer(folders["none"]).end_of_turn_ids() == ()


from real_models import gemma3  # noqa: E402,F401  (the fixture)


def test_end_of_turn_of_the_gemma_fixture_is_end_of_turn(gemma3):  # noqa: F811
    """The Gemma 3 270M folder's generation_config.json names only <eos> (1), as the base model's
    does; chat turns end at <end_of_turn> (106), where `generate --chat` and the demo stop."""
    folder = gemma3.nf4
    tok = load_hf_tokenizer(folder)
    assert generation_eos_ids(folder) == (1,)
    assert [tok.tokenizer.id_to_token(i) for i in tok.end_of_turn_ids()] == ["<end_of_turn>"]
