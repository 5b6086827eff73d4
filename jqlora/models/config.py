"""`ModelConfig`: the architecture facts of a decoder-only checkpoint, parsed from HF config.json.

Llama (2/3), Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 share one module tree
(`jqlora.models.llama`); what differs between them is data here: the norm's form (Llama's
``w * x`` or Gemma's ``(1 + w) * x`` in float32), the embedding scale, the attention scale and
soft-caps, the sandwich norms around attention and MLP, per-layer sliding windows and the second
RoPE table of Gemma 3's sliding layers, Phi-3's fused projections, LongRoPE and partial rotary. A
multimodal Gemma 3 config (``model_type: gemma3``) is read through its nested ``text_config``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Optional

import numpy as np

from jqlora.errors import Error

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "qwen3_moe",
                         "mixtral", "phi3")
MOE_TYPES = ("qwen3_moe", "mixtral")
GEMMA_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")


class UnsupportedModelError(Error, ValueError):
    """The checkpoint's architecture (model_type, rope type, activation, ...) is not supported."""


def _get(d: Mapping, key: str, default=None):
    v = d.get(key, default)
    return default if v is None else v


_REQUIRED = object()


def _int(d: Mapping, key: str, default=_REQUIRED, *, minimum: int = 1) -> int:
    """`d[key]` as an int >= minimum; ValueError naming the key for a missing (when required),
    null, non-integer or out-of-range value."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{key!r} is {'null' if key in d else 'missing'}; expected an integer >= {minimum}")
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{key!r} is {v!r}; expected an integer >= {minimum}")
    if v < minimum:
        raise ValueError(f"{key!r} is {v}; expected an integer >= {minimum}")
    return int(v)


def _float(d: Mapping, key: str, default: float, *, positive: bool = True) -> float:
    """`d[key]` (or `default` when absent or null) as a finite float, > 0 when `positive`."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{key!r} is {v!r}; expected a finite {'positive ' if positive else ''}number")
    return float(v)


def _bool(d: Mapping, key: str, default: bool = False) -> bool:
    """`d[key]` as a bool; a string such as "false" is an error, not True."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key!r} is {v!r}; expected true or false")
    return v


def _token_ids(d: Mapping, key: str):
    """bos/eos token id: None, an int >= 0, or (eos) a list of them (returned as a tuple)."""
    v = d.get(key)
    if v is None:
        return None
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ValueError(f"{key!r} is {v!r}; expected a token id (an integer >= 0) or a list of them")
    return tuple(int(t) for t in items) if isinstance(v, list) else int(v)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (it is static module metadata). Build it with `ModelConfig.from_hf(config_dict)`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the rope parameters besides type/theta
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_windows: tuple = ()  # per layer: window size (int) or None
    norm_kind: str = "llama"     # "llama": w * x cast first; "gemma": (1 + w) * x in float32, then cast
    embed_scale: Optional[float] = None  # Gemma: sqrt(hidden), rounded to the compute dtype at use
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (None: head_dim)
    attn_softcap: Optional[float] = None   # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: Optional[float] = None  # Gemma 2: logits = cap * tanh(logits / cap)
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP (4 per layer)
    local_rope_theta: Optional[float] = None  # Gemma 3: RoPE base of the sliding layers (default rope)
    fused_projections: bool = False  # Phi-3: one qkv_proj (q, k, v rows) and one gate_up_proj (gate, up rows)
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE turns the first int(head_dim * this) features only
    # Mixture of experts (Qwen3-MoE, Mixtral; `jqlora.models.moe`): 0 experts = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalise the top-k probabilities (Mixtral: always)
    router_weights_f32: bool = False  # Mixtral: routing weights stay float32; Qwen3-MoE: compute dtype
    sparse_layers: tuple = ()         # per layer: True where the MLP is the sparse MoE block
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False  # add router_aux_loss_coef * the load-balancing loss in training
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None  # int or tuple of ints

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    def local(self) -> "ModelConfig":
        """The config whose RoPE is that of the sliding-window layers (itself unless Gemma 3)."""
        if self.local_rope_theta is None:
            return self
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_type="default", rope_scaling=())

    @property
    def rotary_dim(self) -> int:
        """The features of each head that RoPE turns (the rest pass through): head_dim unless partial."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_features(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_features(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Parse a transformers config dict (config.json; v4 `rope_theta`/`rope_scaling` or v5
        `rope_parameters`).

        Raises:
          UnsupportedModelError: an architecture this code does not implement (model_type, rope
            type, activation, partial rotary).
          ValueError: a malformed value: a missing, null, non-integer or non-positive size, head
            count or layer count, heads that do not divide the hidden size (without head_dim) or
            a KV head count that does not divide them, a non-boolean flag, and so on. The message
            names the key; `load_causal_lm` adds the file.
        """
        if isinstance(cfg, ModelConfig):
            return cfg
        if hasattr(cfg, "to_dict"):
            cfg = cfg.to_dict()
        if not isinstance(cfg, Mapping):
            raise ValueError(f"the config is a {type(cfg).__name__}, expected an object of config keys")
        mt = cfg.get("model_type")
        if not isinstance(mt, str) or mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt == "gemma3":
            cfg = text_config(cfg)
            mt = "gemma3_text"
        gemma = mt in GEMMA_TYPES
        if gemma and _bool(cfg, "use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention (an embedding model) is not supported")
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        layers = _int(cfg, "num_hidden_layers")
        vocab = _int(cfg, "vocab_size")
        inter = _int(cfg, "intermediate_size")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ValueError(f"'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' ({heads}) "
                             "and there is no 'head_dim'")
        head_dim = _int(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise ValueError(f"head dimension {head_dim} ('head_dim' or hidden_size / num_attention_heads) is odd; "
                             "rotary embeddings need an even one")
        partial = _partial_rotary(cfg, mt, head_dim)
        act = _get(cfg, "hidden_activation", "gelu_pytorch_tanh") if gemma else _get(cfg, "hidden_act", "silu")
        if not isinstance(act, str) or act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")

        # RoPE: transformers v5 writes rope_parameters = {rope_type, rope_theta, ...};
        # v4 wrote rope_theta at top level and rope_scaling = {rope_type|type, factor, ...} or null.
        rp = _get(cfg, "rope_parameters", {})
        rs = cfg.get("rope_scaling")
        local_theta = None
        if mt == "gemma3_text":  # one table per layer type: full layers get rope_scaling, sliding ones a base
            rp, local_theta = _gemma3_rope(cfg, rp)
            rs = None
        for key, v in (("rope_parameters", rp), ("rope_scaling", rs)):
            if v is not None and not isinstance(v, Mapping):
                raise ValueError(f"{key!r} is {v!r}; expected an object or null")
        rp = {**dict(rs or {}), **dict(rp)}
        theta = _float(rp, "rope_theta", _float(cfg, "rope_theta", 10000.0))
        if mt == "gemma3_text" and "rope_theta" not in rp:
            theta = 1_000_000.0
        rope_type = rp.get("rope_type", rp.get("type")) or "default"
        if mt == "phi3" and rope_type in ("su", "yarn"):  # transformers' Phi3Config renames both
            rope_type = "longrope"
        if rope_type == "longrope" and cfg.get("original_max_position_embeddings") is not None:
            rp["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]  # it wins (transformers)
        if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        extra = {k: v for k, v in rp.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
        if rope_type == "longrope":
            extra = _longrope(extra, cfg, int(head_dim * partial))
        needs = {"default": (), "linear": ("factor",), "longrope": ("original_max_position_embeddings",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        for k in needs[rope_type]:
            if k not in extra:
                raise ValueError(f"rope_type {rope_type!r} needs {k!r} in the rope parameters")
            _float(extra, k, 0.0)
        if rope_type == "llama3" and extra["low_freq_factor"] == extra["high_freq_factor"]:
            raise ValueError("rope_type 'llama3' needs 'low_freq_factor' != 'high_freq_factor'")
        rope_scaling = tuple(sorted((k, v) for k, v in extra.items()
                                    if isinstance(v, (int, float, str, bool, tuple)) or v is None))

        # Biases and per-architecture extras (as transformers' modeling files hard-code them).
        qkv_bias = o_bias = False
        qk_norm = False
        if mt in ("llama", "qwen3", "qwen3_moe") or gemma:
            qkv_bias = o_bias = _bool(cfg, "attention_bias")
        if mt == "qwen2":
            qkv_bias = True
        if mt in ("qwen3", "gemma3_text", "qwen3_moe"):
            qk_norm = True
        gemma_fields = {}
        if gemma:
            softcap = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}[mt]  # transformers' defaults
            gemma_fields = dict(
                norm_kind="gemma", embed_scale=float(hidden ** 0.5), sandwich_norms=True,
                query_pre_attn_scalar=_float(cfg, "query_pre_attn_scalar", 256.0),
                attn_softcap=_cap(cfg, "attn_logit_softcapping", softcap[0]),
                final_softcap=_cap(cfg, "final_logit_softcapping", softcap[1]),
                local_rope_theta=local_theta)
        mlp_bias = _bool(cfg, "mlp_bias") if mt == "llama" else False

        windows = _sliding_windows(cfg, mt, layers)
        return cls(
            model_type=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6), rope_theta=theta,
            rope_type=rope_type, rope_scaling=rope_scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
            fused_projections=mt == "phi3", partial_rotary_factor=partial,
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, hidden_act=act,
            sliding_windows=windows, bos_token_id=_token_ids(cfg, "bos_token_id"),
            eos_token_id=_token_ids(cfg, "eos_token_id"), **gemma_fields, **_moe_fields(cfg, mt, layers),
        )


def _moe_fields(cfg: Mapping, mt: str, layers: int) -> dict:
    """The mixture-of-experts fields as transformers reads them: Qwen3-MoE (``num_experts``,
    ``moe_intermediate_size``, sparse layers from ``mlp_only_layers`` / ``decoder_sparse_step``,
    ``norm_topk_prob``) and Mixtral (``num_local_experts``, every layer sparse, the expert size is
    ``intermediate_size``, always renormalised, float32 routing weights)."""
    if mt not in MOE_TYPES:
        return {}
    experts = _int(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts")
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"'num_experts_per_tok' ({top_k}) is larger than the number of experts ({experts})")
    if mt == "mixtral":
        if _float(cfg, "router_jitter_noise", 0.0, positive=False):
            raise UnsupportedModelError("router_jitter_noise != 0 is not supported")
        inter, norm, f32, sparse = _int(cfg, "intermediate_size"), True, True, (True,) * layers
    else:
        inter, norm, f32 = _int(cfg, "moe_intermediate_size"), _bool(cfg, "norm_topk_prob"), False
        step = _int(cfg, "decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"'mlp_only_layers' is {only!r}; expected a list of layer indices")
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=norm,
                router_weights_f32=f32, sparse_layers=sparse,
                router_aux_loss_coef=_float(cfg, "router_aux_loss_coef", 0.001, positive=False),
                output_router_logits=_bool(cfg, "output_router_logits"))


def _partial_rotary(cfg: Mapping, mt: str, head_dim: int) -> float:
    """``partial_rotary_factor`` (top level, or in v5's ``rope_parameters``): Phi-3 / Phi-4-mini
    only; another family with a factor below 1 is refused (its modeling files ignore or differ)."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    src = rp if rp.get("partial_rotary_factor") is not None else cfg
    f = _float(src, "partial_rotary_factor", 1.0)
    if f == 1.0:
        return 1.0
    if mt != "phi3":
        raise UnsupportedModelError(f"partial_rotary_factor != 1 is not supported for model_type {mt!r}")
    dim = int(head_dim * f)
    if f > 1.0 or dim < 2 or dim % 2:
        raise ValueError(f"'partial_rotary_factor' is {f!r}; int(head_dim * it) must be an even number "
                         f"in [2, {head_dim}], got {dim}")
    return f


def _longrope(extra: dict, cfg: Mapping, rotary_dim: int) -> dict:
    """LongRoPE's parameters (Phi-3 "longrope" / "su"), checked: ``short_factor`` and
    ``long_factor`` (lists of rotary_dim / 2 positive numbers, kept as tuples),
    ``original_max_position_embeddings`` (default: max_position_embeddings) and ``factor``
    (default: max_position_embeddings / original, as transformers computes it)."""
    out = dict(extra)
    out.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    for key in ("short_factor", "long_factor"):
        v = out.get(key)
        if (not isinstance(v, (list, tuple)) or len(v) != rotary_dim // 2
                or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                           for x in v)):
            raise ValueError(f"rope_type 'longrope' needs {key!r}: a list of {rotary_dim // 2} positive numbers "
                             f"(rotary dims / 2), got {v!r}")
        out[key] = tuple(float(x) for x in v)
    _int(out, "original_max_position_embeddings")
    if out.get("factor") is None:
        out["factor"] = _int(cfg, "max_position_embeddings", 2048) / out["original_max_position_embeddings"]
    _float(out, "factor", 1.0)
    if out.get("attention_factor") is not None:
        _float(out, "attention_factor", 1.0)
    return out


def text_config(cfg: Mapping) -> dict:
    """The text model's config of a multimodal checkpoint (Gemma 3's ``text_config``), with the
    top-level keys transformers reads from the outer config (tied embeddings, token ids) where the
    nested one lacks them; a flat config is returned as it is."""
    inner = cfg.get("text_config")
    if inner is None:
        return dict(cfg)
    if not isinstance(inner, Mapping):
        raise ValueError(f"'text_config' is {inner!r}; expected an object")
    out = dict(inner)
    out.setdefault("model_type", "gemma3_text")
    for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if k in cfg and out.get(k) is None:
            out[k] = cfg[k]
    return out


def _cap(cfg: Mapping, key: str, default: Optional[float]) -> Optional[float]:
    """A soft-cap: absent means transformers' default for the family, null means none."""
    if key not in cfg:
        return default
    return None if cfg[key] is None else _float(cfg, key, 1.0)


def _gemma3_rope(cfg: Mapping, rp: Mapping) -> tuple[dict, Optional[float]]:
    """Gemma 3's two RoPE tables -> (the full-attention layers' rope parameters, the sliding layers'
    base). transformers v5 writes ``rope_parameters = {"full_attention": {...}, "sliding_attention":
    {...}}``; v4 wrote ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (full layers)."""
    if "full_attention" in rp or "sliding_attention" in rp:
        full = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    else:
        full = {**dict(cfg.get("rope_scaling") or {}), **dict(rp)}
        if cfg.get("rope_theta") is not None:
            full.setdefault("rope_theta", cfg["rope_theta"])
        local = {"rope_type": "default"}
        if cfg.get("rope_local_base_freq") is not None:
            local["rope_theta"] = cfg["rope_local_base_freq"]
    for where, v in (("full_attention", full), ("sliding_attention", local)):
        if not isinstance(v, Mapping):
            raise ValueError(f"rope_parameters[{where!r}] is {v!r}; expected an object")
    local_type = local.get("rope_type", local.get("type")) or "default"
    if local_type != "default":
        raise UnsupportedModelError(f"rope_type {local_type!r} on sliding-window layers is not supported")
    return full, _float(local, "rope_theta", 10_000.0)


def _sliding_windows(cfg: Mapping, mt: str, layers: int) -> tuple:
    if mt == "llama" or cfg.get("sliding_window") is None:
        return (None,) * layers
    window = _int(cfg, "sliding_window")
    if mt in ("mistral", "mixtral", "phi3"):
        return (window,) * layers
    if mt == "qwen3_moe":  # transformers: every layer slides when use_sliding_window
        return ((window,) if _bool(cfg, "use_sliding_window") else (None,)) * layers
    types = cfg.get("layer_types")
    if mt in GEMMA_TYPES:  # transformers' rule when layer_types is absent: Gemma 2 alternates, Gemma 3 5:1
        if types is None:
            period = 2 if mt == "gemma2" else _int(cfg, "sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    # qwen2 / qwen3: only with use_sliding_window; layer_types (v5) says which layers.
    elif not _bool(cfg, "use_sliding_window"):
        return (None,) * layers
    if types is None:
        mwl = _int(cfg, "max_window_layers", layers, minimum=0)
        types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"'layer_types' is {types!r}; expected a list of {layers} entries (one per layer)")
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise ValueError(f"'layer_types' has {bad[0]!r}; expected 'sliding_attention' or 'full_attention'")
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_inv_freq(config: ModelConfig, long: bool = False) -> np.ndarray:
    """Inverse frequencies (rotary_dim // 2,) in float32, computed as transformers does. long:
    LongRoPE's table for sequences past original_max_position_embeddings (`long_factor`; the
    default is `short_factor`); other rope types have one table."""
    dim = config.rotary_dim
    base = np.float32(config.rope_theta)
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    p = config.rope_params
    if config.rope_type == "longrope":
        ext = np.asarray(p["long_factor" if long else "short_factor"], np.float32)
        return (np.float32(1.0) / (ext * (base ** shape).astype(np.float32))).astype(np.float32)
    inv = (np.float32(1.0) / (base ** shape)).astype(np.float32)
    if config.rope_type == "linear":
        inv = (inv / np.float32(p["factor"])).astype(np.float32)
    elif config.rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
        inv_l = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * inv_l / np.float32(factor) + smooth * inv_l).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    return inv


def rope_attention_scaling(config: ModelConfig) -> float:
    """The factor on cos and sin: LongRoPE's `attention_factor`, by default
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) when factor > 1 (transformers'
    `_compute_longrope_parameters`); 1.0 for default / linear / llama3."""
    if config.rope_type != "longrope":
        return 1.0
    p = config.rope_params
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"]))


def longrope_switch(config: ModelConfig) -> Optional[int]:
    """LongRoPE: the original_max_position_embeddings past which (max position + 1 of a forward
    call, as transformers decides per call) the long table replaces the short one; None otherwise."""
    return int(config.rope_params["original_max_position_embeddings"]) if config.rope_type == "longrope" else None


def attn_softcap_of(cfg: Mapping) -> Optional[float]:
    """The attention soft-cap (Gemma 2's attn_logit_softcapping) of a parsed config.json, read
    before loading so the CLI can choose an attention path; None when the model has none or the
    config does not parse (loading then reports that with its own message)."""
    try:
        return ModelConfig.from_hf(cfg).attn_softcap
    except (Error, ValueError):
        return None
