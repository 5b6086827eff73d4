"""Training data formats (messages, Alpaca, text, prompt/completion): detection, one-line errors
naming file and line, which tokens carry loss through the batch pipeline; `jqlora train` checks
the data before the model loads and refuses an --init-adapter that conflicts with --rank /
--target-modules; target_modules="all-linear" against PEFT's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jqlora import train as T
from jqlora.train import examples as E
from jqlora.train import tokenization as TK
from test_chat import CHATML, build_tokenizer_folder

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": "And of Italy?"},
                     {"role": "assistant", "content": "Rome."}]}
ALPACA = {"instruction": "Name the capital of France.", "input": "", "output": "Paris."}
ALPACA_IN = {"instruction": "Name the capital.", "input": "France", "output": "Paris."}
TEXT = {"text": "hello world"}
PC = {"prompt": "Capital of France? ", "completion": "Paris."}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer_folder(tmp_path_factory.mktemp("tok") / "t")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return T.load_tokenizer(tok_dir)


def test_formats_detected_per_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [CHAT, ALPACA, ALPACA_IN, TEXT, PC])
    exs = E.load_jsonl(p)
    assert [e.format for e in exs] == ["messages", "alpaca", "alpaca", "text", "prompt_completion"]
    assert exs[0].messages == tuple(CHAT["messages"])
    assert exs[1].prompt == E.ALPACA_PROMPT[False].format(instruction=ALPACA["instruction"])
    assert exs[2].prompt.endswith("### Input:\nFrance\n\n### Response:\n") and exs[2].completion == "Paris."
    # a forced format reads only its own keys
    ex = E.parse_example({"text": "t", "instruction": "i", "output": "o"}, format="text")
    assert ex.format == "text" and ex.text == "t"


@pytest.mark.parametrize("bad, needle", [
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}', "message 1 has no 'content'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}',
     "message 2 'content' must be a string"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}',
     "message 2 (assistant) has empty content"),
    ('{"messages": [{"role": "user", "content": "q"}], "text": "x"}', "keys of both formats"),
    ('{"instruction": "i"}', "missing field 'output'"),
    ('{"instruction": "i", "output": ""}', "'output' is empty"),
    ('{"instruction": "i", "input": 3, "output": "o"}', "'input' must be a string"),
    ('{"foo": 1}', "no known format"),
    ('{"messages": [1]', "invalid JSON"),
])
def test_errors_name_file_and_line(tmp_path, bad, needle):
    p = write_jsonl(tmp_path / "bad.jsonl", [TEXT, bad, TEXT])
    with pytest.raises(T.DataError) as e:
        E.load_jsonl(p)
    msg = str(e.value)
    assert "bad.jsonl, line 2" in msg and needle in msg and "\n" not in msg, msg


def test_forced_format_errors(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [CHAT, TEXT])
    with pytest.raises(T.DataError, match="d.jsonl, line 2: missing field 'messages'"):
        E.load_jsonl(p, format="messages")
    with pytest.raises(ValueError, match="data format must be"):
        E.load_jsonl(p, format="chat")


def _trained_text(tok, ids, trained, special):
    """The text of the target tokens, through the real batch pipeline (targets under loss_mask)."""
    it = T.BatchIterator([(ids, trained)], seq_len=len(ids), batch_size=1, packing=False, shuffle=False,
                         pad_id=special.pad_id)
    b = next(it)
    m = b["loss_mask"][0].astype(bool)
    return tok.decode([int(t) for t in b["targets"][0][m]], skip_special_tokens=False), m


def test_loss_on_assistant_turns_only(tok):
    sp = T.special_tokens(tok)
    ids, trained = TK.tokenize_example(tok, E.parse_example(CHAT), sp)
    assert list(ids) == tok.apply_chat_template(CHAT["messages"])  # no BOS/EOS added around the template
    text, m = _trained_text(tok, ids, trained, sp)
    assert text == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    # every other target is prompt: the conversation's text minus the answers
    full = tok.decode([int(t) for t in ids], skip_special_tokens=False)
    assert full.count("Paris.<|im_end|>\n") == 1 and int(m.sum()) == int(trained[1:].sum())


def test_alpaca_text_and_prompt_completion_targets(tok):
    sp = T.special_tokens(tok)
    assert sp.eos_id == tok.token_to_id("<|im_end|>")  # from tokenizer_config.json
    ids, trained = TK.tokenize_example(tok, E.parse_example(ALPACA_IN), sp)
    text, _ = _trained_text(tok, ids, trained, sp)
    assert text == "Paris.<|im_end|>"
    assert tok.decode([int(i) for i in ids[~trained]], skip_special_tokens=False) == \
        "<|begin_of_text|>" + E.ALPACA_PROMPT[True].format(instruction="Name the capital.", input="France")
    ids, trained = TK.tokenize_example(tok, E.parse_example(TEXT), sp)
    assert list(trained) == [False] + [True] * (len(ids) - 1)
    ids, trained = TK.tokenize_example(tok, E.parse_example(PC), sp)
    assert _trained_text(tok, ids, trained, sp)[0] == "Paris.<|im_end|>"


def test_messages_need_a_chat_template(tmp_path):
    plain = build_tokenizer_folder(tmp_path / "plain", None)
    t = T.load_tokenizer(plain)
    p = write_jsonl(tmp_path / "d.jsonl", [TEXT, CHAT])
    with pytest.raises(T.DataError, match="d.jsonl, line 2: .*no chat template"):
        TK.check_data(p, t, T.special_tokens(t))
    # --chat-template FILE supplies one
    (tmp_path / "t.jinja").write_text(CHATML)
    t = T.load_tokenizer(plain, chat_template=tmp_path / "t.jinja")
    summary = TK.check_data(p, t, T.special_tokens(t))
    assert summary["examples"] == 2 and summary["formats"] == {"text": 1, "messages": 1}


# ------------------------------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def weightless_model(tok_dir, tmp_path_factory):
    """A model folder with config.json and the tokenizer but no weights: loading it fails, so a
    command that gets past its data checks fails on the weights."""
    d = tmp_path_factory.mktemp("m") / "model"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((tok_dir / f).read_bytes())
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6}))
    return d


def _train(capsys, *argv):
    from jqlora.cli import main

    capsys.readouterr()
    rc = main(["train", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_cli_reports_bad_data_before_loading_the_model(weightless_model, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [CHAT, CHAT, '{"messages": [{"role": "user", "content": "q"}]}'])
    rc, err = _train(capsys, "--model", weightless_model, "--data-path", bad, "--out-dir", tmp_path / "run")
    assert rc == 2 and "bad.jsonl, line 3: no assistant message" in err and "Traceback" not in err, err
    good = write_jsonl(tmp_path / "good.jsonl", [CHAT, ALPACA, TEXT])
    rc, err = _train(capsys, "--model", weightless_model, "--data-path", good, "--out-dir", tmp_path / "run")
    assert rc == 2 and "data: 3 examples (messages 1, alpaca 1, text 1)" in err, err
    assert "bad.jsonl" not in err and "safetensors" in err.lower(), err  # got as far as the weights
    rc, err = _train(capsys, "--model", weightless_model, "--data-path", good, "--data-format", "text",
                     "--out-dir", tmp_path / "run")
    assert rc == 2 and "good.jsonl, line 1: missing field 'text'" in err, err


def test_cli_refuses_init_adapter_with_conflicting_lora_settings(weightless_model, tmp_path, capsys):
    import interop

    r = 4
    params = {f"model.layers.{i}.self_attn.{m}": {"lora_A": np.zeros((r, 64), np.float32),
                                                   "lora_B": np.zeros((64 if m == "q_proj" else 32, r), np.float32)}
              for i in range(2) for m in ("q_proj", "v_proj")}
    adapter = interop.save_peft_adapter(tmp_path / "adapter", params, rank=r, alpha=8,
                                        target_modules=["q_proj", "v_proj"])
    data = write_jsonl(tmp_path / "d.jsonl", [CHAT])
    base = ["--model", weightless_model, "--data-path", data, "--out-dir", tmp_path / "run", "--init-adapter", adapter]
    rc, err = _train(capsys, *base, "--rank", 8)
    assert rc == 2 and "rank: asked 8, adapter has 4" in err, err
    rc, err = _train(capsys, *base, "--target-modules", "q_proj,k_proj")
    assert rc == 2 and "target_modules: asked q_proj,k_proj, adapter has q_proj,v_proj" in err, err
    rc, err = _train(capsys, *base, "--target-modules", "all-linear")
    assert rc == 2 and "asked all-linear" in err, err
    # the adapter's own values (any order) are no conflict: the run gets as far as the weights
    rc, err = _train(capsys, *base, "--rank", 4, "--target-modules", "v_proj,q_proj")
    assert rc == 2 and "conflicts" not in err and "safetensors" in err.lower(), err


@pytest.mark.torch
def test_all_linear_matches_peft(tmp_path_factory, tmp_path):
    """"all-linear" wraps exactly the modules PEFT's all-linear wraps (every linear but the LM
    head), and the exported adapter lists them so that PEFT loads every weight."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    import peft
    import torch

    from jqlora import adapters, models
    from jqlora.lora import LoraConfig, lora_params_by_module, named_linears

    ckpt = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant=None)
    hf = checkpoint_factory.load_with_transformers(ckpt)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear"))
    want = {n.removeprefix("base_model.model.") for n, mod in pm.named_modules() if hasattr(mod, "lora_A")
            and isinstance(getattr(mod, "base_layer", None), torch.nn.Linear)}
    cfg = LoraConfig(rank=2, alpha=4, target_modules="all-linear")
    model = models.load_causal_lm(ckpt, lora=cfg)
    got = set(lora_params_by_module(model))  # the HF module names the adapter is written with
    assert got == want and "lm_head" not in got
    assert any(n.endswith("lm_head") for n, _ in named_linears(model))  # a linear, left out
    out = adapters.save_adapter(tmp_path / "a", model, cfg)
    saved = json.loads((Path(out) / "adapter_config.json").read_text())["target_modules"]
    assert saved == sorted({n.rsplit(".", 1)[-1] for n in want})
    hf2 = checkpoint_factory.load_with_transformers(ckpt)
    loaded = peft.PeftModel.from_pretrained(hf2, out)
    assert {n.removeprefix("base_model.model.") for n, mod in loaded.named_modules()
            if hasattr(mod, "lora_A") and isinstance(getattr(mod, "base_layer", None), torch.nn.Linear)} == want
