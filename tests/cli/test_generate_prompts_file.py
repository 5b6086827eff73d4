"""`jqlora generate --prompts-file`: many prompts batched through `rollout.generate_batch`, one
JSON line per prompt, against the single-prompt paths (`--prompt`, `--chat`) of the same command;
bad files exit 2 with the line named."""
import json
import re
import shutil

import pytest

from cli_runner import run_cli

# a template in the demo tokenizer's alphabet (letters and "="): each turn's content, then "="
TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}a{% endif %}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny NF4 Llama checkpoint with the demo's char tokenizer and a chat template."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from jqlora.demo import task

    src = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                     config_overrides={"initializer_range": 0.1})
    dst = tmp_path_factory.mktemp("pf") / "nf4"
    shutil.copytree(src, dst)
    task.save_tokenizer(dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return dst


GEN = ("--max-new-tokens", "6", "--dtype", "float32")


def _lines(text):
    return [json.loads(ln) for ln in text.splitlines()]


def test_plain_prompts_file_equals_the_prompt_path(ckpt, tmp_path, capsys):
    prompts = ["abc=", "hello=", "zz", "qwertyuiop="]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts[:2]) + "\n\n" + "\n".join(prompts[2:]) + "\n")  # a blank line is skipped
    rc, out, err = run_cli(capsys, "generate", ckpt, "--prompts-file", f, "--batch-size", "2", "--timing", *GEN)
    assert rc == 0, err
    got = _lines(out)
    assert [g["prompt"] for g in got] == prompts
    timing = json.loads(next(ln for ln in err.splitlines() if ln.startswith("timing: "))[len("timing: "):])
    assert timing["prompts"] == 4 and timing["decode_attention"] in ("kernel", "einsum")
    # the reference: all four rows through `jqlora.models.generate` (--prompt, left-padded)
    rc, out, err = run_cli(capsys, "generate", ckpt, *sum((["--prompt", p] for p in prompts), []), "--json", *GEN)
    assert rc == 0, err
    ref = json.loads(out)
    for g, r in zip(got, ref):
        assert g["ids"] == r["ids"] and g["completion"] == r["text"] and g["stopped_at_eos"] == r["stopped_at_eos"]
    # --out writes the same lines to a file and nothing to stdout
    dst = tmp_path / "out.jsonl"
    rc, out, err = run_cli(capsys, "generate", ckpt, "--prompts-file", f, "--batch-size", "2", "--out", dst, *GEN)
    assert rc == 0 and out == "" and _lines(dst.read_text()) == got


def test_jsonl_with_chat_renders_prompts_and_messages(ckpt, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "abc", "id": 7}, {"messages": [{"role": "user", "content": "hello"}], "id": 8}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = run_cli(capsys, "generate", ckpt, "--prompts-file", f, "--chat", *GEN)
    assert rc == 0, err
    got = _lines(out)
    assert [g["id"] for g in got] == [7, 8] and got[1]["messages"] == rows[1]["messages"]
    rc, out, err = run_cli(capsys, "generate", ckpt, "--chat", "abc", "--chat", "hello", "--json", *GEN)
    assert rc == 0, err
    ref = json.loads(out)
    assert [g["ids"] for g in got] == [r["ids"] for r in ref]


@pytest.mark.parametrize("name, content, extra, match", [
    ("p.txt", "", (), "no prompts"),
    ("p.txt", "\n  \n", (), "no prompts"),
    ("p.jsonl", "", (), "no examples"),
    ("p.jsonl", '{"prompt": "ab"}\n{"prompt": "ab"\n', (), "line 2: invalid JSON"),
    ("p.txt", '{"prompt": "ab"}\n["ab"]\n', (), "line 2: expected a JSON object"),
    ("p.jsonl", '{"text": "ab"}\n', (), 'line 1: expected exactly one of "prompt" and "messages"'),
    ("p.jsonl", '{"prompt": 5}\n', (), 'line 1: "prompt" must be a string'),
    ("p.jsonl", '{"messages": [{"role": "user", "content": "ab"}]}\n', (), "line 1: .*pass --chat"),
    ("p.jsonl", '{"messages": [{"role": "user"}]}\n', ("--chat",), 'line 1: "messages" must be'),
    ("p.csv", 'prompt,id\nab,1\n,2\n', (), "row 2 \\(line 3\\): empty prompt"),
    ("p.txt", "ab\n", ("--batch-size", "0"), "--batch-size must be >= 1"),
    ("p.txt", "ab\n", ("--json",), "JSON lines already"),
    ("p.txt", "ab\n", ("--prompt", "x"), "not allowed with|cannot be combined"),
])
def test_bad_prompts_files_exit_2_naming_the_line(ckpt, tmp_path, capsys, name, content, extra, match):
    f = tmp_path / name
    f.write_text(content)
    rc, out, err = run_cli(capsys, "generate", ckpt, "--prompts-file", f, *extra, *GEN)
    assert rc == 2 and out == ""
    assert "Traceback" not in err
    assert re.search(match, err), err
    if re.match(r"(line|row) \d", match):
        assert str(f) in err


def test_bare_chat_needs_a_prompts_file_and_out_needs_one(ckpt, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "generate", ckpt, "--chat", *GEN)
    assert rc == 2 and "--chat needs a message" in err
    rc, _, err = run_cli(capsys, "generate", ckpt, "--prompt", "ab", "--out", tmp_path / "x.jsonl", *GEN)
    assert rc == 2 and "--prompts-file" in err and not (tmp_path / "x.jsonl").exists()
    rc, _, err = run_cli(capsys, "generate", ckpt, *GEN)
    assert rc == 2 and "is required" in err
    rc, _, err = run_cli(capsys, "generate", ckpt, "--prompts-file", tmp_path / "missing.txt", *GEN)
    assert rc == 2 and "no such prompts file" in err
