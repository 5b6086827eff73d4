"""`ModelConfig`: the architecture facts of a Llama-family checkpoint, parsed from HF config.json."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (model_type, rope type, activation, ...) is not supported."""


def _get(d: Mapping, key: str, default=None):
    v = d.get(key, default)
    return default if v is None else v


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
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None  # int or tuple of ints

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def q_features(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_features(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Parse a transformers config dict (config.json; v4 `rope_theta`/`rope_scaling` or v5
        `rope_parameters`). Raises UnsupportedModelError for anything this code does not implement."""
        if isinstance(cfg, ModelConfig):
            return cfg
        if hasattr(cfg, "to_dict"):
            cfg = cfg.to_dict()
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r} (model_type {mt})") from None
        kv_heads = int(_get(cfg, "num_key_value_heads", heads))
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        head_dim = int(_get(cfg, "head_dim", hidden // heads))
        if cfg.get("partial_rotary_factor", 1.0) not in (None, 1.0):
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        act = _get(cfg, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")

        # RoPE: transformers v5 writes rope_parameters = {rope_type, rope_theta, ...};
        # v4 wrote rope_theta at top level and rope_scaling = {rope_type|type, factor, ...} or null.
        rp = dict(_get(cfg, "rope_parameters", {}) or {})
        rs = cfg.get("rope_scaling")
        if isinstance(rs, Mapping):
            rp = {**dict(rs), **rp}
        theta = float(_get(rp, "rope_theta", _get(cfg, "rope_theta", 10000.0)))
        rope_type = rp.get("rope_type", rp.get("type")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        extra = {k: v for k, v in rp.items() if k not in ("rope_type", "type", "rope_theta")}
        if rope_type == "linear" and "factor" not in extra:
            raise ValueError("rope_type 'linear' needs 'factor'")
        if rope_type == "llama3":
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k not in extra:
                    raise ValueError(f"rope_type 'llama3' needs {k!r} in rope parameters")
        rope_scaling = tuple(sorted((k, v) for k, v in extra.items()
                                    if isinstance(v, (int, float, str, bool)) or v is None))

        # Biases and per-architecture extras (as transformers' modeling files hard-code them).
        qkv_bias = o_bias = False
        qk_norm = False
        if mt in ("llama", "qwen3"):
            qkv_bias = o_bias = bool(_get(cfg, "attention_bias", False))
        if mt == "qwen2":
            qkv_bias = True
        if mt == "qwen3":
            qk_norm = True
        mlp_bias = bool(_get(cfg, "mlp_bias", False)) if mt == "llama" else False

        windows = _sliding_windows(cfg, mt, layers)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        return cls(
            model_type=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_type=rope_type, rope_scaling=rope_scaling,
            max_position_embeddings=int(_get(cfg, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, hidden_act=act,
            sliding_windows=windows, bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
        )


def _sliding_windows(cfg: Mapping, mt: str, layers: int) -> tuple:
    window = cfg.get("sliding_window")
    if mt == "llama" or window is None:
        return (None,) * layers
    if mt == "mistral":
        return (int(window),) * layers
    # qwen2 / qwen3: only with use_sliding_window; layer_types (v5) says which layers.
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:
        mwl = int(_get(cfg, "max_window_layers", layers))
        types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies (head_dim // 2,) in float32, computed as transformers does."""
    dim = config.head_dim
    base = np.float32(config.rope_theta)
    inv = (np.float32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    p = config.rope_params
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
    return 1.0  # default / linear / llama3 do not rescale cos and sin
