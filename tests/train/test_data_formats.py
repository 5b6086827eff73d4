"""Training data formats (messages, ShareGPT, Alpaca, text, prompt/completion): detection, one-line
errors naming file and line, which tokens carry loss through the batch pipeline; every storage
(`test_sources.py`) giving the same tokens; ShareGPT through a role map; other column names; `jqlora
train` on Parquet and CSV data and its data flags; `jqlora train` checks
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


# --------------------------------------------------------------- storages, ShareGPT, column names
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": "What is the capital of France?"},
                              {"from": "gpt", "value": "Paris."},
                              {"from": "human", "value": "And of Italy?"},
                              {"from": "gpt", "value": "Rome."}]}
FIVE = {"messages": [CHAT, {"messages": CHAT["messages"][1:3]}],
        "sharegpt": [SHAREGPT, {"conversations": SHAREGPT["conversations"][1:3]}],
        "alpaca": [ALPACA, ALPACA_IN], "text": [TEXT, {"text": "a second line"}],
        "prompt_completion": [PC, {"prompt": "", "completion": "only a completion"}]}


def _tokens(tok, source, **kw):
    summary, tokenized = TK.tokenize_source(source, tok, T.special_tokens(tok), **kw)
    return summary, [(ids.tolist(), trained.tolist()) for ids, trained in tokenized]


@pytest.mark.parametrize("fmt", list(FIVE))
def test_every_storage_gives_the_same_tokens(fmt, tok, tmp_path, monkeypatch):
    """Each format's rows written in every storage tokenize to exactly what the rows do as Python
    dicts (conversations in CSV/TSV cells as JSON strings)."""
    from test_sources import STORAGES, write_rows

    rows = FIVE[fmt]
    sp = T.special_tokens(tok)
    want = [tuple(a.tolist() for a in TK.tokenize_example(tok, E.parse_example(r), sp)) for r in rows]
    for storage in STORAGES:
        src = write_rows(storage, rows, tmp_path / storage, monkeypatch)
        summary, got = _tokens(tok, src)
        assert got == want, storage
        assert summary["formats"] == {fmt: len(rows)} and summary["examples"] == len(rows), storage


def test_sharegpt_is_the_equivalent_messages_conversation(tok):
    sp = T.special_tokens(tok)
    ex = E.parse_example(SHAREGPT)
    assert ex.format == "sharegpt" and ex.messages == tuple(CHAT["messages"])
    mine = {"conversations": [{"from": {"human": "asker", "gpt": "bot"}.get(t["from"], t["from"]),
                               "value": t["value"]} for t in SHAREGPT["conversations"]]}
    schema = E.Schema.from_config(T.TrainConfig(role_map="asker=user, bot=assistant"))
    got = TK.tokenize_example(tok, E.parse_example(mine, schema=schema), sp)
    want = TK.tokenize_example(tok, E.parse_example(CHAT), sp)
    assert [a.tolist() for a in got] == [a.tolist() for a in want]
    with pytest.raises(T.DataError) as e:  # the same row without the map
        E.parse_example(mine, source="chat.jsonl", line=4)
    msg = str(e.value)
    assert msg.startswith("chat.jsonl, line 4: conversation turn 2 is from 'asker'") and \
        "--role-map 'asker=assistant'" in msg, msg
    with pytest.raises(ValueError, match="role_map: expected 'from=to' pairs"):
        E.Schema.from_config(T.TrainConfig(role_map="asker"))


@pytest.mark.parametrize("bad, needle", [
    ({"conversations": "hi"}, "'conversations' must be a list"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no turn maps to 'assistant'"),
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}, "conversation turn 1 has no 'value'"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
     "conversation turn 2 (gpt) has empty content"),
])
def test_sharegpt_errors_name_the_row(bad, needle):
    with pytest.raises(T.DataError) as e:
        E.parse_example(bad, where="d.csv, row 7 (line 9)")
    assert str(e.value).startswith("d.csv, row 7 (line 9): ") and needle in str(e.value), str(e.value)


def test_column_names_map_to_fields(tok, tmp_path):
    """prompt_field/completion_field, text_field and messages_field (role/content or ShareGPT
    turns) give the tokens of the usual names; a column with a usual name that the mapping moved
    elsewhere is not read."""
    from test_sources import write_rows

    sp = T.special_tokens(tok)
    cfg = T.TrainConfig(prompt_field="question", completion_field="answer")
    src = write_rows("csv", [{"question": PC["prompt"], "answer": PC["completion"], "prompt": "ignored"}], tmp_path)
    assert _tokens(tok, src, schema=E.Schema.from_config(cfg))[1] == \
        [tuple(a.tolist() for a in TK.tokenize_example(tok, E.parse_example(PC), sp))]
    cases = [(T.TrainConfig(text_field="body"), {"body": TEXT["text"]}, TEXT),
             (T.TrainConfig(messages_field="dialog"), {"dialog": json.dumps(CHAT["messages"])}, CHAT),
             (T.TrainConfig(messages_field="dialog"), {"dialog": SHAREGPT["conversations"]}, CHAT)]
    for cfg, row, same in cases:
        got = TK.tokenize_example(tok, E.parse_example(row, schema=E.Schema.from_config(cfg)), sp)
        assert [a.tolist() for a in got] == [a.tolist() for a in TK.tokenize_example(tok, E.parse_example(same), sp)]
    with pytest.raises(T.DataError, match="columns mapped: prompt=question, completion=answer"):
        E.parse_example({"q": "x", "a": "y"}, schema=E.Schema.from_config(T.TrainConfig(
            prompt_field="question", completion_field="answer")))


def test_train_reads_any_source_for_train_and_eval(tok, tok_dir, tmp_path):
    """What `train(data=<path>)` and the config's eval_data_path become: a Parquet file gives the
    batches its JSONL does; a datasets folder gives its eval_data_split's rows."""
    from jqlora.train.loop import _build_iterator
    from test_sources import write_rows

    rows = [CHAT, ALPACA, TEXT, PC, SHAREGPT]
    cfg = T.TrainConfig(tokenizer_path=str(tok_dir), seq_len=64, batch_size=2, shuffle=False,
                        eval_data_path=write_rows("folder", [TEXT, PC], tmp_path), eval_data_split="test")
    want = _build_iterator(cfg, write_rows("jsonl", rows, tmp_path), tok, None)
    got = _build_iterator(cfg, write_rows("parquet", rows, tmp_path), tok, None)
    for _ in range(3):
        a, b = next(want), next(got)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    ev = _build_iterator(cfg, None, tok, None, eval_=True)  # the folder's "test" split: TEXT only
    assert ev.fingerprint == T.BatchIterator(TK.tokenize_examples(tok, [E.parse_example(TEXT)], T.special_tokens(tok)),
                                             seq_len=64, batch_size=2, shuffle=False,
                                             pad_id=T.special_tokens(tok).pad_id).fingerprint


@pytest.fixture(scope="module")
def tiny_nf4(tmp_path_factory):
    """A tiny NF4 Llama checkpoint with the demo's char tokenizer (as tests/cli/test_reads_once.py
    builds it), and its prompt/completion data as Parquet (train) and CSV (eval)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from interop.bnb_save import save_bnb_checkpoint
    from jqlora import models, quant
    from jqlora.demo import task

    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    root = tmp_path_factory.mktemp("tiny")
    params = models.init_params(config, seed=0, std=0.1)
    for k in [k for k in params if k.endswith("_proj.weight")]:
        params[k[: -len(".weight")]] = quant.quantize_4bit(params.pop(k), "nf4", 64, True)
    save_bnb_checkpoint(root / "model", params, config)
    task.save_tokenizer(root / "model")
    split = task.make_split(16, 8, seed=5)
    pq.write_table(pa.Table.from_pylist([task.reverse_example(s) for s in split.train]), root / "train.parquet")
    from test_sources import write_rows

    write_rows("csv", [task.reverse_example(s) for s in split.heldout], root, name="eval")
    return root / "model"


def test_cli_trains_on_parquet_and_csv_and_names_a_bad_csv_row(tiny_nf4, tmp_path, capsys):
    from cli_runner import run_cli

    root = tiny_nf4.parent
    base = ["train", "--model", tiny_nf4, "--compute-dtype", "float32", "--rank", "2", "--target-modules",
            "q_proj", "--seq-len", "32", "--batch-size", "4", "--attention", "einsum", "--remat", "false",
            "--out-dir", tmp_path / "run"]
    rc, out, err = run_cli(capsys, *base, "--data-path", root / "train.parquet", "--eval-data-path",
                           root / "eval.csv", "--eval-every", "1", "--steps", "1")
    assert rc == 0 and "data: 16 examples (prompt_completion 16)" in err and "eval loss:" in out, err
    bad = tmp_path / "bad.csv"
    bad.write_text((root / "eval.csv").read_text() + "abc\n")
    rc, _, err = run_cli(capsys, *base, "--data-path", bad, "--steps", "1")
    assert rc == 2 and f"{bad}, row 9 (line 10): 1 fields, the header has 2" in err and "Traceback" not in err, err


def test_cli_flags_of_the_data_settings(tiny_nf4, capsys, tmp_path):
    """The data settings are flags of `jqlora train` (from TrainConfig's fields), parsed into the
    run's settings and used by the data check: columns q/a read as prompt/completion."""
    from cli_runner import run_cli

    rc, out, _ = run_cli(capsys, "train", "--help")
    assert rc == 0 and all(f in out for f in ("--data-split", "--eval-data-split", "--prompt-field",
                                               "--completion-field", "--text-field", "--messages-field",
                                               "--role-map")), out
    from test_sources import write_rows

    src = write_rows("csv", [{"q": "abc=", "a": "cba"}, {"q": "xy=", "a": "yx"}], tmp_path, name="qa")
    argv = ["train", "--model", tiny_nf4, "--data-path", src, "--data-split", "dev", "--prompt-field", "q",
            "--role-map", "bot=assistant", "--out-dir", tmp_path / "r", "--dry-run"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and "qa.csv, row 1 (line 2): missing field 'completion'" in err, err
    rc, out, err = run_cli(capsys, *argv, "--completion-field", "a")
    assert rc == 0 and "data: 2 examples (prompt_completion 2)" in err, err
    train = json.loads(out)["train"]
    assert (train["data_split"], train["prompt_field"], train["completion_field"], train["role_map"]) == \
        ("dev", "q", "a", "bot=assistant"), train
