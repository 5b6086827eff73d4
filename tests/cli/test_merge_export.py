"""Merged export (`jqlora.merge`, `jqlora export-merged`): a random nonzero LoRA adapter merged into a
tiny transformers + bitsandbytes NF4 checkpoint, checked against PEFT in torch (PeftModel over the
base, and PEFT's own merge_and_unload on the bitsandbytes-dequantized base), a float64 merge, and
bitsandbytes' reading of the re-quantized NF4 folder; then from a `jqlora train` run directory."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
checkpoint_factory = pytest.importorskip("checkpoint_factory")

from cli_runner import run_cli  # noqa: E402

pytestmark = pytest.mark.torch

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]
MODULE = "model.layers.1.mlp.down_proj"  # (64, 128), not square


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny NF4 Llama (blocksize 64, double quantization, float32) with tokenizer and generation
    config beside it."""
    from jqlora.demo import task

    src = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                     config_overrides={"initializer_range": 0.1})
    dst = tmp_path_factory.mktemp("merge") / "base"
    shutil.copytree(src, dst)
    task.save_tokenizer(dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 7}) + "\n")
    return dst


def write_adapter(path, base, *, rslora=False, seed=0, modules=None, targets=TARGETS, b_std=0.2):
    """A PEFT adapter with random nonzero A and B on the `targets` modules of `base` (or `modules`):
    A ~ N(0, 0.2), B ~ N(0, b_std). With the base's weights ~ N(0, 0.1), b_std 0.2 moves most NF4
    codes; b_std 0.001 (a delta of ~0.001 per weight, a few % of an NF4 step) moves none."""
    import interop

    config = json.loads((Path(base) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"q_proj": (hidden, hidden), "v_proj": (kv, hidden), "down_proj": (hidden, inter)}
    rng = np.random.default_rng(seed)
    if modules is None:
        modules = {f"model.layers.{i}.{'mlp' if t == 'down_proj' else 'self_attn'}.{t}": shapes[t]
                   for i in range(config["num_hidden_layers"]) for t in targets}
    params = {m: {"lora_A": rng.normal(0, 0.2, (RANK, i)).astype(np.float32),
                  "lora_B": rng.normal(0, b_std, (o, RANK)).astype(np.float32)} for m, (o, i) in modules.items()}
    interop.save_peft_adapter(path, params, rank=RANK, alpha=ALPHA, target_modules=targets, use_rslora=rslora,
                              base_model_name_or_path=str(base))
    return Path(path)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("adapter") / "a", base)


@pytest.fixture(scope="module")
def merged(base, adapter, tmp_path_factory):
    """{format: merged folder} for bf16, float32 and nf4."""
    from jqlora.merge import merge_adapter

    root = tmp_path_factory.mktemp("merged")
    return {fmt: Path(merge_adapter(base, adapter, root / fmt, format=fmt)["out"])
            for fmt in ("bf16", "float32", "nf4")}


def tokens():
    import torch

    return torch.from_numpy(np.random.default_rng(5).integers(0, 128, (2, 12))).long()


def logits(model):
    import torch

    with torch.no_grad():
        return model(tokens()).logits.double().numpy()


def exact_bnb(model):
    """`model` with each bitsandbytes Linear4bit in training mode, its exact path (dequantize, then
    F.linear): in eval mode bitsandbytes 0.50's CPU path rounds the weights to bf16 on the first
    call (0.3% per layer). Nothing here has dropout."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.train()
    return model


def load_bnb(folder):
    return exact_bnb(checkpoint_factory.load_with_transformers(folder))


def peft_logits(base, adapter):
    """PeftModel (PEFT's LoRA layers over bitsandbytes Linear4bit) on the base, float32."""
    from peft import PeftModel

    return logits(exact_bnb(PeftModel.from_pretrained(checkpoint_factory.load_with_transformers(base), str(adapter))))


def rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def st(folder) -> dict:
    """Every tensor of a folder as numpy (safetensors, the reference reader)."""
    from safetensors.numpy import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


# ----------------------------------------------------------------------------- (1) dense vs PEFT
def test_dense_folders_load_in_plain_transformers_and_match_peft(base, adapter, merged):
    import bitsandbytes as bnb
    import torch

    ref = peft_logits(base, adapter)
    assert rel(ref, logits(load_bnb(base))) > 0.05  # the adapter matters
    for fmt, dtype, tol in (("float32", torch.float32, 2e-5), ("bf16", torch.bfloat16, 2e-2)):
        cfg = json.loads((merged[fmt] / "config.json").read_text())
        assert "quantization_config" not in cfg and cfg["dtype"] == {"bf16": "bfloat16"}.get(fmt, fmt)
        model = checkpoint_factory.load_with_transformers(merged[fmt])  # plain from_pretrained, dtype from config
        assert next(model.parameters()).dtype == dtype
        assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        assert rel(logits(model), ref) < tol, fmt
        if fmt == "bf16":  # computed in float32: only the weights' bf16 rounding (2^-9) remains
            model32 = checkpoint_factory.load_with_transformers(merged[fmt], dtype=torch.float32)
            assert rel(logits(model32), ref) < 2e-2
    # the bf16 folder is the float32 one rounded once to bf16, every tensor
    f32, b16 = st(merged["float32"]), st(merged["bf16"])
    assert set(f32) == set(b16) and all(b16[k].dtype.name == "bfloat16" for k in b16)
    for k in f32:
        assert checkpoint_factory.same_bits(f32[k].astype(b16[k].dtype), b16[k]), k
    # tokenizer and generation config come along; jqlora's tokenizer reads the copy
    from jqlora.tokenizer import generation_eos_ids, load_hf_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (merged["bf16"] / name).read_bytes() == (base / name).read_bytes()
    assert load_hf_tokenizer(merged["bf16"]).encode("ab").ids == load_hf_tokenizer(base).encode("ab").ids
    assert generation_eos_ids(merged["bf16"]) == (2,)


def test_float32_folder_equals_peft_merge_and_unload(base, adapter, merged):
    """PEFT's own merge (merge_and_unload) over the base as bitsandbytes dequantizes it, in float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(base)
    del cfg.quantization_config
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    raw = checkpoint_factory.torch_tensors(base)
    deq = checkpoint_factory.bnb_reference_weights(base)
    state = {k: v for k, v in raw.items() if k in dense.state_dict()}
    state.update({m + ".weight": w.float() for m, w in deq.items()})
    dense.load_state_dict(state, strict=True)
    peft_merged = PeftModel.from_pretrained(dense, str(adapter)).merge_and_unload().state_dict()
    ours = st(merged["float32"])
    assert set(ours) == set(peft_merged)
    for k, v in peft_merged.items():
        assert rel(ours[k], v.numpy()) < 1e-6, k
    assert rel(ours[MODULE + ".weight"], deq[MODULE].numpy()) > 0.05  # the merge changed it


# ------------------------------------------------------------------------- (2) float64 reference
@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weight_equals_float64_merge(base, merged, adapter, rslora, tmp_path):
    """W + scale * B @ A in float64 (scale alpha/r, or alpha/sqrt(r) with rsLoRA), W as bitsandbytes
    dequantizes it, against the float32 folder."""
    import interop
    from jqlora.merge import merge_adapter

    if rslora:
        adapter = write_adapter(tmp_path / "rs", base, rslora=True, seed=1)
        folder = Path(merge_adapter(base, adapter, tmp_path / "out", format="float32")["out"])
    else:
        folder = merged["float32"]
    scale = ALPHA / (math.sqrt(RANK) if rslora else RANK)
    lora, _ = interop.load_peft_adapter(adapter)
    deq = checkpoint_factory.bnb_reference_weights(base)
    ours = st(folder)
    for m in (MODULE, "model.layers.0.self_attn.v_proj"):
        a, b = lora[m]["lora_A"].astype(np.float64), lora[m]["lora_B"].astype(np.float64)
        want = deq[m].numpy().astype(np.float64) + scale * (b @ a)
        assert rel(ours[m + ".weight"], want) < 1e-6, m
    # modules without LoRA are the dequantized base, exactly
    k = "model.layers.0.self_attn.k_proj"
    np.testing.assert_array_equal(ours[k + ".weight"], deq[k].numpy())


# ----------------------------------------------------------------------------------- (3) NF4 folder
def test_nf4_folder_is_quantize_4bit_of_the_merge_and_loads_everywhere(base, adapter, merged):
    import bitsandbytes as bnb
    import jax.numpy as jnp

    import interop
    from jqlora import models
    from jqlora.quant import Weight4bit, dequantize, quantize_4bit

    out, raw_base, f32 = st(merged["nf4"]), st(base), st(merged["float32"])
    qc = json.loads((merged["nf4"] / "config.json").read_text())["quantization_config"]
    assert qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"]
    lora, _ = interop.load_peft_adapter(adapter)
    params, _ = interop.load_bnb_checkpoint(merged["nf4"])  # jqlora's loader reads it back
    base_params, _ = interop.load_bnb_checkpoint(base)
    deq = checkpoint_factory.bnb_reference_weights(merged["nf4"])
    for m, q in ((k, v) for k, v in params.items() if isinstance(v, Weight4bit)):
        b = base_params[m]
        assert (q.quant_type, q.blocksize, q.nested, q.stored_dtype) == ("nf4", b.blocksize, b.nested, b.stored_dtype)
        if m in lora:  # re-quantized from the merged float32 weight, bitwise
            want = quantize_4bit(jnp.asarray(f32[m + ".weight"]), "nf4", b.blocksize, b.nested)
            for part in ("packed", "absmax", "nested_absmax", "offset"):
                assert checkpoint_factory.same_bits(getattr(q, part), getattr(want, part)), (m, part)
        else:  # untouched: the base's bytes
            for suffix in ("", ".absmax", ".nested_absmax"):
                assert checkpoint_factory.same_bits(out[m + ".weight" + suffix], raw_base[m + ".weight" + suffix])
        # bitsandbytes dequantizes the file to what jqlora does
        np.testing.assert_array_equal(deq[m].numpy(), np.asarray(dequantize(q, jnp.float32)))
    assert {m for m in lora} <= {k for k, v in params.items() if isinstance(v, Weight4bit)}
    # transformers + bitsandbytes load it; logits agree with jqlora's model of the same folder
    model = load_bnb(merged["nf4"])
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14
    torch_logits = logits(model)
    jq = models.load_causal_lm(str(merged["nf4"]), compute_dtype=jnp.float32)
    assert rel(np.asarray(jq(jnp.asarray(tokens().numpy()))), torch_logits) < 1e-4
    # and it is the adapted model up to NF4 re-quantization: it moves the logits the way PEFT's
    # adapter does (cosine 0.97 here) and ends closer to PEFT than the base is
    ref, base_logits = peft_logits(base, adapter), logits(load_bnb(base))
    ours, theirs = (torch_logits - base_logits).ravel(), (ref - base_logits).ravel()
    assert ours @ theirs / (np.linalg.norm(ours) * np.linalg.norm(theirs)) > 0.9
    assert rel(torch_logits, ref) < 0.5 * rel(base_logits, ref)


# ------------------------------------------------------------- (3b) what NF4 re-quantization keeps
def unpacked_codes(packed) -> np.ndarray:
    """bitsandbytes' packed uint8 bytes -> 4-bit codes (element 2j in the high nibble)."""
    packed = np.asarray(packed).reshape(-1)
    return np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)


def kept_float64(base, folder, adapter, modules) -> dict:
    """The kept share and code changes computed independently of jqlora: float64 numpy on the
    files (bitsandbytes dequantizes both NF4 weights), X = 256 rows of
    numpy.random.default_rng(0).standard_normal(dtype=float32) per layer."""
    import interop

    lora, _ = interop.load_peft_adapter(adapter)
    deq_base, deq_out = checkpoint_factory.bnb_reference_weights(base), checkpoint_factory.bnb_reference_weights(folder)
    raw_base, raw_out = st(base), st(folder)
    out = {}
    for m in modules:
        a, b = lora[m]["lora_A"].astype(np.float64), lora[m]["lora_B"].astype(np.float64)
        x = np.random.default_rng(0).standard_normal((256, a.shape[1]), dtype=np.float32).astype(np.float64)
        true = x @ (ALPHA / RANK * (b @ a)).T
        kept = x @ (deq_out[m].numpy().astype(np.float64) - deq_base[m].numpy().astype(np.float64)).T
        n = a.shape[1] * b.shape[0]
        changed = int(np.sum(unpacked_codes(raw_out[m + ".weight"])[:n] != unpacked_codes(raw_base[m + ".weight"])[:n]))
        out[m] = dict(err=np.linalg.norm(kept - true), true=np.linalg.norm(true), changed=changed, codes=n)
    return out


@pytest.mark.parametrize("b_std", [0.2, 0.02])
def test_kept_share_equals_float64_reference(base, tmp_path, b_std):
    """merge_adapter's per-module and total kept share and code changes against `kept_float64`, for
    an adapter well above NF4's resolution and one near it (about half the effect kept)."""
    from jqlora.merge import merge_adapter

    adapter = write_adapter(tmp_path / "a", base, b_std=b_std, seed=2)
    r = merge_adapter(base, adapter, tmp_path / "out", format="nf4", force=True)["requantization"]
    ref = kept_float64(base, tmp_path / "out", adapter, r["modules"])
    assert set(r["modules"]) == {m for m in ref} and len(ref) == 6
    for m, want in ref.items():
        got = r["modules"][m]
        assert got["kept"] == pytest.approx(max(0.0, 1 - want["err"] / want["true"]), abs=1e-5), m
        assert got["effect_norm"] == pytest.approx(want["true"], rel=1e-5), m
        assert (got["codes_changed"], got["codes"]) == (want["changed"], want["codes"]), m
    err, true = sum(v["err"] for v in ref.values()), sum(v["true"] for v in ref.values())
    assert r["kept"] == pytest.approx(max(0.0, 1 - err / true), abs=1e-5)
    changed, codes = sum(v["changed"] for v in ref.values()), sum(v["codes"] for v in ref.values())
    assert r["changed_share"] == pytest.approx(changed / codes, rel=1e-12)
    assert (0.8 < r["kept"] < 0.95) if b_std == 0.2 else (0.3 < r["kept"] < 0.6), r["kept"]
    assert r["min_kept"] == 0.5 and r["below_min"] == (r["kept"] < 0.5)


def test_nf4_export_refuses_to_lose_the_fine_tune(base, adapter, merged, tmp_path, capsys, cli):
    """An adapter whose delta is below NF4's resolution: refused (exit 2, one line, nothing written);
    with --force written, with a warning, and it answers like the base model, as the measure says.
    The large adapter passes with a high kept share; --min-kept raises the bar."""
    import re

    from jqlora.merge import RequantizationError, merge_adapter

    small = write_adapter(tmp_path / "small", base, b_std=0.001)

    def kept_of(text) -> tuple[float, float]:
        found = re.search(r"nf4 re-quantization (?:would keep|kept) ([0-9.]+)% of the adapter's effect "
                          r"\(\d+ of the merged weights' \d+ 4-bit codes changed, ([0-9.e-]+)%", text)
        assert found, text
        return float(found[1]), float(found[2])

    out = tmp_path / "out"
    rc, text, err = run_cli(capsys, "export-merged", base, out, "--adapter", small, "--format", "nf4")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "below --min-kept 50%" in err and "--force" in err and "--format bf16" in err, err
    assert kept_of(err) == (0.0, 0.0)  # not one code moves
    assert list(tmp_path.iterdir()) == [small]  # nothing written, not even a temporary folder
    with pytest.raises(RequantizationError) as e:
        merge_adapter(base, small, out, format="nf4")
    assert e.value.report["kept"] == 0.0 and e.value.report["codes_changed"] == 0 and not out.exists()

    rc, text, err = run_cli(capsys, "export-merged", base, out, "--adapter", small, "--format", "nf4", "--force")
    assert rc == 0, err
    assert kept_of(text) == (0.0, 0.0) and "warning" in err and "--format bf16" in err, err
    # the model-level view of the same loss: the forced NF4 folder is no closer to PEFT's model than
    # the base is, and what moved its logits is not the adapter's direction (with no code changed,
    # only the re-computed blocks' absmax scales moved it: re-quantization noise)
    base_logits, nf4_logits, ref = logits(load_bnb(base)), logits(load_bnb(out)), peft_logits(base, small)
    assert rel(ref, base_logits) > 1e-3  # the adapter matters
    assert rel(nf4_logits, ref) > rel(base_logits, ref)
    moved, wanted = (nf4_logits - base_logits).ravel(), (ref - base_logits).ravel()
    assert abs(moved @ wanted) / (np.linalg.norm(moved) * np.linalg.norm(wanted)) < 0.5

    rc, text, err = run_cli(capsys, "export-merged", base, tmp_path / "big", "--adapter", adapter, "--format", "nf4")
    assert rc == 0 and "warning" not in err, err
    kept, changed = kept_of(text)
    assert kept > 80 and changed > 50, text  # and test (3) shows this folder moves logits as PEFT does
    rc, _, err = run_cli(capsys, "export-merged", base, tmp_path / "strict", "--adapter", adapter, "--format", "nf4",
                         "--min-kept", "0.95")
    assert rc == 2 and "below --min-kept 95%" in err and not (tmp_path / "strict").exists(), err
    rc, _, err = run_cli(capsys, "export-merged", base, tmp_path / "pct", "--adapter", adapter, "--min-kept", "50")
    assert rc == 2 and "--min-kept" in err
    # the dense formats are not measured and never refused
    rc, text, err = run_cli(capsys, "export-merged", base, tmp_path / "dense", "--adapter", small, "--format", "bf16")
    assert rc == 0 and "re-quantization" not in text + err, err


@pytest.mark.parametrize("kind", ["int8", "dense", "nf4-skip"])
def test_other_bases(kind, tmp_path_factory):
    """An LLM.int8 base, a dense float32 base, and an NF4 base whose o_proj stays dense
    (llm_int8_skip_modules): the float32 merge against float64, and the NF4 folder quantizes what
    it should (int8 and dense: every decoder linear, blocksize 64, double quantization; the skipped
    o_proj stays dense) and loads in transformers + bitsandbytes as jqlora reads it."""
    import jax.numpy as jnp

    import interop
    from jqlora import models
    from jqlora.merge import merge_adapter
    from jqlora.quant import Weight4bit, quantize_4bit

    quant, kw = {"int8": ("int8", {}), "dense": (None, {}),
                 "nf4-skip": ("nf4", {"skip_modules": ["o_proj", "lm_head"]})}[kind]
    base = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant=quant,
                                                      config_overrides={"initializer_range": 0.1}, **kw)
    root = tmp_path_factory.mktemp(f"other-{kind}")
    targets = ["q_proj", "o_proj", "down_proj"]
    adapter = write_adapter(root / "adapter", base, targets=targets, modules={
        f"model.layers.{i}.{p}": s for i in (0, 1) for p, s in
        (("self_attn.q_proj", (64, 64)), ("self_attn.o_proj", (64, 64)), ("mlp.down_proj", (64, 128)))})
    f32 = st(merge_adapter(base, adapter, root / "f32", format="float32")["out"])
    nf4_dir = Path(merge_adapter(base, adapter, root / "nf4", format="nf4")["out"])
    raw = checkpoint_factory.torch_tensors(base)
    ref = {m: w.double().numpy() for m, w in checkpoint_factory.bnb_reference_weights(base).items()}
    lora, _ = interop.load_peft_adapter(adapter)
    for m, p in lora.items():
        w = ref[m] if m in ref else raw[m + ".weight"].double().numpy()
        want = w + ALPHA / RANK * (p["lora_B"].astype(np.float64) @ p["lora_A"].astype(np.float64))
        assert rel(f32[m + ".weight"], want) < 1e-6, m
    params, _ = interop.load_bnb_checkpoint(nf4_dir)
    fourbit = {k for k, v in params.items() if isinstance(v, Weight4bit)}
    skipped = {f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)} if kind == "nf4-skip" else set()
    assert len(fourbit) == 14 - len(skipped) and not fourbit & skipped
    for m in skipped:  # merged, and kept dense in its dtype
        assert checkpoint_factory.same_bits(params[m + ".weight"], f32[m + ".weight"])
    if kind != "nf4-skip":
        for m in fourbit:
            q = params[m]
            want = quantize_4bit(jnp.asarray(f32[m + ".weight"]), "nf4", 64, True)
            assert (q.blocksize, q.nested, q.stored_dtype) == (64, True, "float32")
            assert checkpoint_factory.same_bits(q.packed, want.packed), m
    model = load_bnb(nf4_dir)
    jq = models.load_causal_lm(str(nf4_dir), compute_dtype=jnp.float32)
    assert rel(np.asarray(jq(jnp.asarray(tokens().numpy()))), logits(model)) < 1e-4


# ------------------------------------------------------------------------------ errors, atomicity
@pytest.fixture
def cli(monkeypatch):
    """The command registered as the CLI will register it."""
    from jqlora import cli

    monkeypatch.setitem(cli.COMMANDS, "export-merged", "merge_cmd")


def test_adapters_that_do_not_fit_are_named_errors(base, tmp_path, capsys, cli):
    cfg = json.loads((base / "config.json").read_text())
    h = cfg["hidden_size"]
    cases = {
        # target_modules selects q_proj of layer 1 too, but the adapter has no weights for it
        "missing": (dict(modules={"model.layers.0.self_attn.q_proj": (h, h)}, targets=["q_proj"]),
                    "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight is missing"),
        # the base has two layers
        "absent": (dict(modules={"model.layers.7.self_attn.q_proj": (h, h)}, targets=["layers.7.self_attn.q_proj"]),
                   "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight: the base checkpoint"),
        # lora_A's in_features is wrong
        "shape": (dict(modules={f"model.layers.{i}.self_attn.q_proj": (h, h + 8) for i in (0, 1)}, targets=["q_proj"]),
                  "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: shape [4, 72]"),
    }
    for name, (kw, expect) in cases.items():
        bad = write_adapter(tmp_path / name, base, **kw)
        out = tmp_path / f"out_{name}"
        rc, _, err = run_cli(capsys, "export-merged", base, out, "--adapter", bad)
        assert rc == 2, (name, err)
        assert expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    from jqlora import merge
    from jqlora.cli import merge_cmd

    assert merge_cmd.FORMATS == merge.FORMATS  # repeated there so that --help imports no jax
    assert merge_cmd.DEFAULT_MIN_KEPT == merge.DEFAULT_MIN_KEPT
    rc, _, err = run_cli(capsys, "export-merged", base, tmp_path / "x", "--adapter", tmp_path / "shape", "--step", "3")
    assert rc == 2 and "--adapter" in err
    (tmp_path / "taken").mkdir()
    rc, _, err = run_cli(capsys, "export-merged", base, tmp_path / "taken", "--adapter", tmp_path / "shape")
    assert rc == 2 and "already exists" in err


def test_failed_write_leaves_nothing(base, adapter, tmp_path, monkeypatch):
    from jqlora import merge

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge, "_copy_side_files", fail)  # after the weights are written
    with pytest.raises(OSError):
        merge.merge_adapter(base, adapter, tmp_path / "out", format="bf16")
    assert list(tmp_path.iterdir()) == []


def test_sharded_output_loads_in_transformers(base, adapter, merged, tmp_path):
    from jqlora.merge import merge_adapter

    out = Path(merge_adapter(base, adapter, tmp_path / "sharded", format="float32", max_shard_bytes=60_000)["out"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ref = logits(checkpoint_factory.load_with_transformers(merged["float32"]))
    np.testing.assert_array_equal(logits(checkpoint_factory.load_with_transformers(out)), ref)


# ---------------------------------------------------------------------------- (4) from a run dir
def test_export_merged_from_a_training_run(base, tmp_path, capsys, cli):
    """`jqlora train` for 2 steps, then one `jqlora export-merged RUN OUT` command."""
    import interop
    from jqlora.demo import task
    from jqlora.merge import merge_adapter

    data = task.write_jsonl(tmp_path / "train.jsonl", task.make_split(32, 0, seed=3).train)
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--model", base, "--compute-dtype", "float32", "--rank", "4", "--alpha", "8",
                         "--target-modules", "q_proj,v_proj", "--data-path", data, "--seq-len", "32",
                         "--batch-size", "4", "--lr", "0.01", "--steps", "2", "--save-every", "2",
                         "--out-dir", run, "--attention", "einsum", "--remat", "false")
    assert rc == 0, err
    trained, _ = interop.load_peft_adapter(run / "adapter")
    assert all(np.any(p["lora_B"] != 0) for p in trained.values())
    rc, text, err = run_cli(capsys, "export-merged", run, tmp_path / "merged", "--format", "float32")
    assert rc == 0, err
    assert "step 2" in text and "4 LoRA modules" in text
    # the same as merging the adapter the run wrote at its end
    want = st(merge_adapter(base, run / "adapter", tmp_path / "direct", format="float32")["out"])
    got = st(tmp_path / "merged")
    assert set(got) == set(want)
    for k in want:
        assert checkpoint_factory.same_bits(got[k], want[k]), k
    assert "re-quantization" not in text
    # two steps from B = 0 move few NF4 codes: --force writes the folder whatever is kept
    rc, text, err = run_cli(capsys, "export-merged", run, tmp_path / "merged_nf4", "--format", "nf4", "--force")
    assert rc == 0 and "weights quantized to NF4" in text and "nf4 re-quantization kept" in text, err
