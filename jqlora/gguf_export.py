"""A LoRA fine-tune as one GGUF file for llama.cpp: the adapter merged into its base model, or
(``lora_only``) the adapter alone in llama.cpp's LoRA adapter format.

Why: llama.cpp (and what is built on it) serves GGUF files, and its converter
(convert_hf_to_gguf.py) wants a dense Hugging Face folder and torch. This writes the file from a
bitsandbytes (or dense) base and a PEFT adapter with the `gguf` package alone, a tensor at a time.

The file follows convert_hf_to_gguf.py, whose conventions transformers' GGUF reader undoes:

* architecture ``llama`` (model_type llama or mistral), ``qwen2`` or ``qwen3``; tensors named by
  `gguf.get_tensor_name_map` (``token_embd.weight``, ``blk.N.attn_q.weight``, ...,
  ``output.weight`` only when the embeddings are not tied), in the sorted order of the
  checkpoint's names (the order of a safetensors file);
* for ``llama``, the rows of attn_q and attn_k (weights and biases) permuted within each head from
  transformers' rotate-half order to the interleaved pairs llama.cpp's rope rotates;
* hyperparameters under ``<arch>.*`` and ``general.file_type``; rope scaling ``linear`` as keys,
  ``llama3`` as the ``rope_freqs.weight`` tensor (one divisor per frequency);
* the tokenizer, byte-level BPE only (``tokenizer.ggml.model = "gpt2"``): tokens (ids the tokenizer
  lacks up to vocab_size as ``[PADi]``, unused), token types (added tokens control when special or
  special-looking, else user-defined), merges, the pre-tokenizer's llama.cpp name, bos/eos/unk/pad
  ids (tokenizer_config.json's tokens, else config.json's ids), add_bos/add_eos (what encoding
  adds) and the chat template;
* ``bf16``: BF16 tensors; ``q8_0``: Q8_0 (a row not a multiple of 32 long: F16, llama.cpp's
  fallback); either way 1-D tensors (norms, biases) and rope_freqs in F32.

Weights are merged in float32 by `jqlora.merge.merged_tensors` and rounded once to the file's
type: the 2-D tensors of the bf16 file are the numbers of `jqlora export-merged --format bf16`,
the 1-D ones the float32 merge's (the same where the base stores them in bf16). The file is
written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from jqlora.errors import Error

TYPES = ("bf16", "q8_0")
# model_type -> GGUF architecture (llama.cpp converts Mistral checkpoints as llama)
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Text on which a tokenizer's pre-tokenizer is compared with the ones llama.cpp names: digits
# runs, contractions in both cases, runs of spaces and newlines, punctuation, non-Latin letters.
_PROBE = ("Hello World! I'M here, it's 2024: 1234567 apples.\n\n\t  tabs   and...   spaces\r\n"
          " 'S 3.14 \u00c0\u00e9t\u00e9 \u4e2d\u6587 \U0001f999?!  end  ")
# The pre-tokenizer regexes of Llama 3 and Qwen2 tokenizer.json files (llama.cpp: llama-bpe, qwen2).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class GGUFExportError(Error, ValueError):
    """A model, tokenizer or setting the GGUF export cannot write; the message names it."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFExportError("the GGUF export needs the gguf package: pip install gguf") from None
    return gguf


# ------------------------------------------------------------------------------------- the model
def model_config(config: Mapping[str, Any], where: Path):
    """The `ModelConfig` of a base whose architecture llama.cpp's graph for it computes alike:
    model_type llama, mistral, qwen2 or qwen3, SiLU, no sliding window, rope default, linear or
    (llama only) llama3."""
    from jqlora.models.config import ModelConfig

    mt = config.get("model_type")
    if mt not in ARCHS:
        raise GGUFExportError(f"{where}/config.json: model_type {mt!r} has no GGUF export; "
                              f"supported: {', '.join(ARCHS)}")
    try:
        cfg = ModelConfig.from_hf(config)
    except ValueError as e:  # UnsupportedModelError and a malformed value alike
        raise GGUFExportError(f"{where}/config.json: {e}") from None
    refusal = None
    if cfg.hidden_act not in ("silu", "swish"):
        refusal = f"hidden_act {cfg.hidden_act!r} (llama.cpp's {ARCHS[mt]} graph uses SiLU)"
    elif any(w is not None for w in cfg.sliding_windows):
        refusal = "sliding-window attention (llama.cpp's graph attends to the whole context)"
    elif cfg.rope_type == "llama3" and ARCHS[mt] != "llama":
        refusal = f"rope_type 'llama3' on architecture {ARCHS[mt]!r}"
    if refusal:
        raise GGUFExportError(f"{where}/config.json: {refusal} has no GGUF export")
    return cfg


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's order of a Q or K projection's rows (or bias), convert_hf_to_gguf.py's
    ``LlamaModel.permute``: within each of the `n_head` heads, transformers' two rotate-half
    halves interleaved into the pairs llama.cpp's rope rotates."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor of a llama3-scaled rope, as convert_hf_to_gguf.py computes
    it: per frequency, what llama.cpp divides it by (1 for short wavelengths, `factor` for long
    ones, a smooth blend between)."""
    p = cfg.rope_params
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of the file: its GGUF name, (rows, cols) shape, ggml type, float32 values."""

    name: str
    shape: tuple
    qtype: Any  # gguf.GGMLQuantizationType
    values: Callable[[], np.ndarray]


def _qtype(shape: tuple, type: str, gguf):  # noqa: A002 - the CLI's word
    q = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return q.F32
    if type == "bf16":
        return q.BF16
    return q.Q8_0 if shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0] == 0 else q.F16


def _nbytes(e: _Entry, gguf) -> int:
    block, size = gguf.GGML_QUANT_SIZES[e.qtype]
    return math.prod(e.shape) // block * size


def _encode(e: _Entry, gguf) -> np.ndarray:
    arr = np.ascontiguousarray(e.values(), dtype=np.float32)
    if arr.shape != e.shape:
        raise ValueError(f"{e.name}: computed {arr.shape}, planned {e.shape}")
    return arr if e.qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(arr, e.qtype)


def _qk_heads(arch: str, key: str, cfg) -> int:
    """Heads of the llama row permutation that `key` takes (0: none)."""
    if arch != "llama":
        return 0
    module = key.rsplit(".", 1)[0]
    if module.endswith("self_attn.q_proj"):
        return cfg.num_attention_heads
    if module.endswith("self_attn.k_proj"):
        return cfg.num_key_value_heads
    return 0


def _name_map(arch: str, cfg, gguf):
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(enum, cfg.num_hidden_layers)


def _values(arr, heads: int) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        w = np.asarray(arr, dtype=np.float32)
        return permute_rows(w, heads) if heads else w
    return read


def _model_plan(tensors: Mapping, cfg, arch: str, type: str, where: Path, gguf) -> list[_Entry]:  # noqa: A002
    names = _name_map(arch, cfg, gguf)
    entries = []
    for key, arr in sorted(tensors.items()):
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp and transformers tie the output to token_embd when output.weight is absent
        if key.endswith("rotary_emb.inv_freq"):
            continue  # computed from the hyperparameters (older checkpoints stored it); llama.cpp skips it too
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(f"{where}: tensor {key!r} has no GGUF name in architecture {arch!r}")
        shape = tuple(int(d) for d in arr.shape)
        entries.append(_Entry(name, shape, _qtype(shape, type, gguf), _values(arr, _qk_heads(arch, key, cfg))))
    if cfg.rope_type == "llama3":
        factors = llama3_rope_factors(cfg)
        entries.append(_Entry("rope_freqs.weight", factors.shape, gguf.GGMLQuantizationType.F32, lambda: factors))
    return entries


def _lora_plan(adapter, cfg, arch: str, type: str, gguf) -> list[_Entry]:  # noqa: A002
    """``<name>.weight.lora_a`` (r, in) and ``.lora_b`` (out, r) per module, B's rows permuted
    as its weight's are."""
    names = _name_map(arch, cfg, gguf)
    entries = []
    for module in sorted(adapter.params):
        name = names.get_name(module)
        if name is None:
            raise GGUFExportError(f"{adapter.path}: module {module!r} has no GGUF name in architecture {arch!r}")
        heads = _qk_heads(arch, module + ".weight", cfg)
        for which, suffix, h in (("lora_A", "lora_a", 0), ("lora_B", "lora_b", heads)):
            arr = adapter.params[module][which]
            shape = tuple(int(d) for d in arr.shape)
            entries.append(_Entry(f"{name}.weight.{suffix}", shape, _qtype(shape, type, gguf), _values(arr, h)))
    return entries


def _add_hparams(w, cfg, gguf) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_params["factor"]))


# ------------------------------------------------------------------------------------ tokenizer
@dataclasses.dataclass(frozen=True)
class Vocab:
    """A byte-level BPE tokenizer as GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""

    tokens: list
    token_types: list
    merges: list
    pre: str  # llama.cpp's name of the pre-tokenizer
    special: dict  # "bos" / "eos" / "unk" / "pad" -> id
    add_bos: bool
    add_eos: bool
    chat_template: Optional[str]

    def add_to(self, w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.token_types)
        w.add_token_merges(self.merges)
        for kind, i in self.special.items():
            getattr(w, f"add_{kind}_token_id")(i)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def _known_pre_tokenizers() -> dict:
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    def split(regex):
        return pt.Sequence([pt.Split(Regex(regex), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])

    gpt2 = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    return {"gpt-2": gpt2, "smollm": pt.Sequence([pt.Digits(individual_digits=True), gpt2]),
            "llama-bpe": split(_LLAMA3_SPLIT), "qwen2": split(_QWEN2_SPLIT)}


def _pre_tokenizer_name(tok, where: str) -> str:
    """llama.cpp's name of the pre-tokenizer that splits the probe text as `tok`'s does."""
    pre = tok.pre_tokenizer
    if pre is None or type(tok.model).__name__ != "BPE":
        raise GGUFExportError(f"{where}: a {type(tok.model).__name__} tokenizer with pre-tokenizer {pre}; "
                              "the GGUF export embeds byte-level BPE tokenizers only")
    got = [s for s, _ in pre.pre_tokenize_str(_PROBE)]
    for name, known in _known_pre_tokenizers().items():
        if [s for s, _ in known.pre_tokenize_str(_PROBE)] == got:
            return name
    raise GGUFExportError(f"{where}: the pre-tokenizer {pre} splits text as none of llama.cpp's "
                          f"{', '.join(_known_pre_tokenizers())} does; the GGUF export cannot name it")


def _merges(tok) -> list[str]:
    """The BPE merges as ``"a b"`` lines (the model's merges.txt)."""
    with tempfile.TemporaryDirectory(prefix="jqlora-merges-") as d:
        files = tok.model.save(d)
        text = Path(next(f for f in files if f.endswith("merges.txt"))).read_text(encoding="utf-8")
    return [line for line in text.split("\n") if line and not line.startswith("#version")]


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's added tokens that are control tokens though not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def gguf_vocab(folder, vocab_size: int, config: Mapping[str, Any]) -> Vocab:
    """The tokenizer of `folder` (tokenizer.json, tokenizer_config.json, chat template, read by
    `jqlora.tokenizer.load_hf_tokenizer`) as GGUF metadata for a model of `vocab_size` rows.

    Raises:
      GGUFExportError: not a byte-level BPE tokenizer, a pre-tokenizer llama.cpp has no name for,
        or token ids past `vocab_size`.
      TokenizerError: a missing or unreadable tokenizer file.
    """
    gguf = _gguf()
    from jqlora.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(folder)
    where = f"{Path(folder) / 'tokenizer.json'}"
    pre = _pre_tokenizer_name(tok, where)
    ids = tok.get_vocab(with_added_tokens=True)
    top = max(ids.values(), default=-1)
    if top >= vocab_size:
        raise GGUFExportError(f"{where}: token id {top} is past the model's vocab_size {vocab_size}")
    t = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(t.UNUSED)] * vocab_size
    for token, i in ids.items():
        tokens[i], types[i] = token, int(t.NORMAL)
    for i, added in tok.get_added_tokens_decoder().items():
        special = added.special or _looks_special(added.content)
        tokens[i], types[i] = added.content, int(t.CONTROL if special else t.USER_DEFINED)
    special = {}
    for kind in ("bos", "eos", "unk", "pad"):
        i = tok.token_id(f"{kind}_token")
        if i is None:
            v = config.get(f"{kind}_token_id")
            i = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size else None
        if i is not None:
            special[kind] = int(i)
    bare, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
    adds = len(full) > len(bare)  # what the post-processor adds around a plain token
    add_bos = adds and full[0] == special.get("bos")
    add_eos = adds and full[-1] == special.get("eos")
    return Vocab(tokens, types, _merges(tok), pre, special, add_bos, add_eos, tok.chat_template)


# ------------------------------------------------------------------------------------- writing
def _write(out: Path, arch: str, metadata: Callable, entries: list[_Entry], gguf,
           progress: Optional[Callable[[int, int, str], None]]) -> None:
    """Write the file: metadata, the tensor table, then each tensor computed and encoded in turn,
    under a temporary name renamed onto `out` once complete."""
    from interop.atomic_io import atomic_path

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            metadata(w)
            for e in entries:
                w.add_tensor_info(e.name, e.shape, np.dtype(np.float32), _nbytes(e, gguf), raw_dtype=e.qtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for i, e in enumerate(entries):
                w.write_tensor_data(_encode(e, gguf))
                if progress is not None:
                    progress(i + 1, len(entries), e.name)
        finally:
            w.close()


def _check_args(out: Path, type: str, force: bool) -> None:  # noqa: A002
    if type not in TYPES:
        raise GGUFExportError(f"type must be one of {', '.join(TYPES)}, got {type!r}")
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory; name the .gguf file to write")
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; choose a new file name or pass force (--force) to replace it")


def _export(base: Path, adapter_dir: Path, out: Path, type: str, lora_only: bool,  # noqa: A002
            progress, gguf) -> dict[str, Any]:
    from interop.bnb_common import read_config
    from jqlora.merge import merged_tensors

    config = read_config(base)
    cfg = model_config(config, base)  # before anything heavy: an unsupported model fails at once
    arch = ARCHS[cfg.model_type]
    vocab = None if lora_only else gguf_vocab(base, cfg.vocab_size, config)
    _, tensors, adapter = merged_tensors(base, adapter_dir)
    if lora_only:
        entries = _lora_plan(adapter, cfg, arch, type, gguf)
    else:
        entries = _model_plan(tensors, cfg, arch, type, base, gguf)
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type]

    def metadata(w) -> None:
        w.add_name(base.name)
        if lora_only:  # llama.cpp scales by alpha / r: this alpha gives jqlora's scale (rsLoRA too)
            w.add_type(gguf.GGUFType.ADAPTER)
            w.add_string(gguf.Keys.Adapter.TYPE, "lora")
            w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.scale * adapter.rank))
            return
        w.add_type(gguf.GGUFType.MODEL)
        _add_hparams(w, cfg, gguf)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.add_to(w)

    _write(out, arch, metadata, entries, gguf, progress)
    return dict(out=str(out), type=type, arch=arch, base=str(base), lora_only=lora_only, merged=len(adapter.params),
                rank=adapter.rank, alpha=adapter.alpha, use_rslora=adapter.use_rslora, scale=adapter.scale,
                tensors=len(entries), bytes=out.stat().st_size, pre_tokenizer=None if vocab is None else vocab.pre)


def export_gguf(source, out, *, type: str = "bf16", adapter=None, step: Optional[int] = None,  # noqa: A002
                model_path=None, lora_only: bool = False, force: bool = False,
                progress: Optional[Callable[[int, int, str], None]] = None) -> dict[str, Any]:
    """Write a fine-tune as one GGUF file (the module docstring says what it holds).

    Args:
      source: a training run (its directory, checkpoints/ or one step directory, as
        `jqlora.merge.merge_run` takes it), or with `adapter` the base model folder.
      out: the .gguf file to write.
      type: "bf16" or "q8_0", the type of the 2-D tensors.
      adapter: a PEFT LoRA adapter folder for the base `source`.
      step, model_path: a run's checkpoint (None: the newest) and base (None: the run record's).
      lora_only: write the adapter alone, in llama.cpp's LoRA adapter format, instead of the merge.
      force: replace an existing `out`.
      progress: called with (tensors written, tensor count, GGUF name) after each tensor.

    Returns:
      {"out", "type", "arch", "base", "lora_only", "merged" (LoRA modules), "rank", "alpha",
      "use_rslora", "scale", "tensors" (in the file), "bytes", "pre_tokenizer"}, plus "adapter",
      or "source", "step" and "checkpoint" for a run.

    Raises:
      GGUFExportError: an unsupported architecture or tokenizer, a bad type, gguf not installed.
      MergeError, interop.CheckpointError, RunError, adapter and tokenizer errors: as the merge,
        naming the file.
      FileExistsError: `out` exists and not `force`.
    """
    out = Path(out)
    _check_args(out, type, force)
    gguf = _gguf()
    if adapter is not None:
        if step is not None or model_path is not None:
            raise GGUFExportError("step and model_path choose a run's checkpoint and base; with an adapter, "
                                  "source is the base model")
        return dict(_export(Path(source), Path(adapter), out, type, lora_only, progress, gguf), adapter=str(adapter))
    from jqlora.runs import export_adapter

    with tempfile.TemporaryDirectory(prefix="jqlora-gguf-") as tmp:
        exported = export_adapter(source, Path(tmp) / "adapter", step=step, model_path=model_path)
        report = _export(Path(exported["model"]), Path(exported["adapter"]), out, type, lora_only, progress, gguf)
    return dict(report, source=str(source), step=exported["step"], checkpoint=exported["checkpoint"])


__all__ = ["ARCHS", "TYPES", "GGUFExportError", "Vocab", "export_gguf", "gguf_vocab", "llama3_rope_factors",
           "model_config", "permute_rows"]
