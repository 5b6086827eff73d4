"""Rematerialization policies for the decoder layers, and `remat_plan`: which policy fits.

`remat="auto"` asks `remat_plan` for the fastest policy whose predicted peak memory fits the
device: no remat (nothing recomputed), then `dots_with_no_batch_dims_saveable` (the matmul
outputs kept, the elementwise work recomputed), then `nothing_saveable` (each layer's input kept,
the whole layer recomputed in the backward pass), then `offload_layer_inputs` (as
`nothing_saveable`, but each layer's input is kept in pinned host memory, not on the device: for
sequences whose layer inputs alone would fill the device).

Under the two full-recompute policies, sequences of at least 2 x `MLP_CHUNK_TOKENS` tokens run
the MLP in chunks of that many tokens, each checkpointed, so one layer's backward holds the MLP's
intermediates (4 x intermediate width per token) of one chunk, not of the whole sequence. No policy keeps a dense dequantized weight:
`jqlora.ops.qmatmul` saves the packed weight and dequantizes again (docs/design.md, invariant 2).

The prediction is analytic, per token and per layer, in units of the model's widths, plus the
weights, the LoRA optimizer state and one loss chunk; a mixture-of-experts layer counts its router
and its k experts' rows (`moe_layer_bytes`) where a dense layer counts its MLP. Its constants are fitted to the 8B step
measured on an H200 (`activation_bytes_per_token`; tests/models/test_scan.py checks the fit). On CPU,
against `train_step.lower(...).compile().memory_analysis()` of a 4-layer float32 model (hidden
256, einsum attention), it predicts 0.66-0.69 of the measured growth of temporary memory per
token for all three policies: CPU XLA keeps more float32 intermediates; the order of the
policies is the same.

The memory a plan fits (`available_memory`): on a GPU the device's `bytes_limit`; on CPU the
memory this process may use (`host_memory`: the smallest of the cgroup limit, RLIMIT_AS and
MemAvailable), where the step's arrays live. `JQLORA_MEMORY_GB` caps either.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
from pathlib import Path
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jqlora.errors import SettingError
from jqlora.models.config import ModelConfig

_log = logging.getLogger("jqlora.models")

# The name `DecoderStack` gives each decoder layer's input (`checkpoint_name`): what the offloading
# policy moves to host memory.
LAYER_INPUT = "decoder_layer_input"

REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}

# The candidates of "auto", fastest first. None = no remat.
AUTO_ORDER = (None, "dots_with_no_batch_dims_saveable", "nothing_saveable", "offload_layer_inputs")

# The policies that recompute whole layers, and under which long sequences chunk the MLP.
FULL_RECOMPUTE = ("nothing_saveable", "offload_layer_inputs")
# Tokens per MLP chunk (a row's sequence is split when it has at least twice this many tokens
# and is a multiple of it).
MLP_CHUNK_TOKENS = 16384


def _mlp_chunked(seq_len: int) -> bool:
    return seq_len >= 2 * MLP_CHUNK_TOKENS and seq_len % MLP_CHUNK_TOKENS == 0


def mlp_chunk_for(policy: Optional[Callable], seq_len: int) -> int:
    """Tokens per MLP chunk for a forward under `policy` over rows of `seq_len` tokens; 0 = the
    whole row at once (no chunking: a policy that keeps activations, or a short row)."""
    full_recompute = policy is not None and any(policy is REMAT_POLICIES[n] for n in FULL_RECOMPUTE)
    return MLP_CHUNK_TOKENS if full_recompute and _mlp_chunked(seq_len) else 0

# Of the device's memory, what a plan may use: XLA's temporaries, fragmentation and the compile
# step's own scratch need the rest.
HEADROOM = 0.90
# Of the host memory a process may use (CPU), what a plan may use: the machine's other processes
# grow after the plan reads MemAvailable, and an out-of-memory kill loses the run where recompute
# costs about a third more compute. At SmolLM2-135M x 8 x 512 (float32, einsum attention, LoRA on
# every linear layer) no remat is predicted 14.6 GiB (XLA's temporaries 12.1 GiB): a 24 GB
# machine gets recompute.
HOST_HEADROOM = 0.50
# The memory a plan fits, in GB (10^9 bytes), instead of what the platform reports: a machine
# shared with other work, or a limit the process cannot see.
MEMORY_ENV = "JQLORA_MEMORY_GB"
# cgroup limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page).
_NO_LIMIT = 1 << 60
# What the scanned train step really keeps without remat, over the count above (float32 norm and
# rope intermediates the count leaves out): 1.43 at 8B x 2,048 and 1.52 at 8B x 16,384 tokens on
# an H200 (benchmarks/results/JOURNAL.md, 2026-11-26). Applied to the two policies that keep
# activations, so "auto" errs towards remat rather than out of memory.
KEPT_MEASURED_OVER_COUNTED = 1.5


def resolve_remat(remat) -> Optional[Callable]:
    """The jax.checkpoint policy for a `remat` setting (None for False); "auto" is resolved by
    the model, which knows the shapes (`remat_plan`)."""
    if remat is False or remat is None:
        return None
    if remat is True:
        return jax.checkpoint_policies.nothing_saveable
    if isinstance(remat, str):
        if remat == "auto":
            return None
        if remat not in REMAT_POLICIES:
            raise SettingError(f"unknown remat policy {remat!r}; expected 'auto' or one of {sorted(REMAT_POLICIES)}")
        return REMAT_POLICIES[remat]
    if callable(remat):
        return remat
    raise TypeError(f"remat must be a bool, 'auto', a policy name or a jax.checkpoint policy, got {remat!r}")


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What `remat_plan` chose and why.

    policy: the chosen policy name, or None for no remat.
    predicted: {policy name or "none": predicted peak bytes of the train step}.
    device_bytes: the memory the plan had to fit (None: unknown).
    reason: one line for the log.
    memory_source: where device_bytes came from ("device memory", "MemAvailable", "cgroup
      memory.max", "RLIMIT_AS", "JQLORA_MEMORY_GB", "given")."""

    policy: Optional[str]
    predicted: dict
    device_bytes: Optional[int]
    reason: str
    memory_source: str = "device memory"

    def log(self) -> None:
        """One log line per trace that asks for the plan (one per compiled shape), no global cache."""
        _log.info(self.reason)


def _gib(n) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def activation_bytes_per_token(config: ModelConfig, policy: Optional[str], *, compute_dtype=jnp.bfloat16,
                               attention: str = "cudnn", seq_len: int = 2048, lora_rank: int = 16) -> dict:
    """Predicted activation bytes per token of the train step: {"kept": what the forward keeps on
    the device for the backward over all layers, "transient": one layer's recomputation/backward
    working set, "host": what the forward keeps in host memory}.

    Per layer and token, with s the compute dtype's size: without remat the backward keeps the
    norms' inputs and outputs (4 H s), q/k/v and the attention output ((2 Q + 2 KV) s), the MLP's
    gate, up, activation and product (4 I s) and the LoRA x A^T (7 r, float32); the einsum
    attention also keeps its (T, heads) float32 scores and probabilities, cuDNN only its
    logsumexp. dots_with_no_batch_dims_saveable keeps the matmul outputs as the matmuls produce
    them, in float32 ((Q + 2 KV + 2 H + 2 I) x 4), and the quantized products' inputs
    ((2 H + Q + I) s), not the attention scores (their einsums have batch dimensions). At the
    8B shape that is more than no remat keeps, so "auto" picks it only where the einsum
    attention's scores make no remat the larger one. nothing_saveable keeps each layer's input (H s) and rebuilds one layer at a
    time, with float32 gradients of the residual stream (4 H x 4) on top; from 2 x
    MLP_CHUNK_TOKENS tokens its MLP runs in chunks, so the MLP's part of that working set (4 I s)
    is one chunk's. offload_layer_inputs keeps the layer inputs in host memory instead.

    Against the 8B step measured on an H200 (batch 1, cuDNN attention, bf16; issue 31): no remat
    predicted 16.4 GiB / measured 16.4 at 2,048 tokens; the matmul outputs 20.0 / 20.8;
    nothing_saveable 7.1 / 7.09 at 2,048, 13.7 / 13.3 at 16,384, 36.4 / 35.6 at 65,536.

    A mixture-of-experts layer (`moe_layer_bytes`) counts its router and its k experts per token
    in place of the dense MLP's terms; it runs whole under every policy (no MLP chunks)."""
    c = config
    s = jnp.dtype(compute_dtype).itemsize
    h, i, q, kv, nh = c.hidden_size, c.intermediate_size, c.q_features, c.kv_features, c.num_attention_heads
    attn = nh * seq_len * (4 + s) if attention == "einsum" else nh * 4  # scores+probs, or the logsumexp
    # the attention einsums have batch dimensions: dots_with_no_batch_dims_saveable recomputes their scores
    attn_full = (4 * h + 2 * q + 2 * kv) * s + 4 * lora_rank * 4 + attn
    attn_dots = (q + 2 * kv + h) * 4 + (h + q) * s + 4 * lora_rank * 4 + (0 if attention == "einsum" else attn)
    dense = {"full": attn_full + 4 * i * s + 3 * lora_rank * 4,
             "dots": attn_dots + (2 * i + h) * 4 + (h + i) * s + 3 * lora_rank * 4}
    moe = {k: attn_full if k == "full" else attn_dots for k in ("full", "dots")}
    for k, v in moe_layer_bytes(c, compute_dtype=compute_dtype, lora_rank=lora_rank).items():
        moe[k] += v
    sparse = sum(bool(x) for x in c.sparse_layers)
    n = c.num_hidden_layers
    kinds = [(dense, n - sparse), (moe, sparse)]
    kinds = [(d, count) for d, count in kinds if count]
    if policy is None:
        return {"kept": int(sum(count * d["full"] for d, count in kinds) * KEPT_MEASURED_OVER_COUNTED),
                "transient": 0, "host": 0}
    if policy == "dots_with_no_batch_dims_saveable":
        return {"kept": int(sum(count * d["dots"] for d, count in kinds) * KEPT_MEASURED_OVER_COUNTED),
                "transient": max(max(d["full"] - d["dots"], 0) for d, _ in kinds) + 4 * h * 4, "host": 0}
    if policy in FULL_RECOMPUTE:
        mlp = 4 * i * s
        chunked = mlp * (1 - MLP_CHUNK_TOKENS / seq_len) if _mlp_chunked(seq_len) else 0
        transient = max(d["full"] - (chunked if d is dense else 0) for d, _ in kinds) + 4 * h * 4
        kept = 0 if policy == "offload_layer_inputs" else n * h * s
        return {"kept": kept, "transient": int(transient), "host": n * h * s - kept}
    raise ValueError(f"no memory model for policy {policy!r}; expected one of {AUTO_ORDER}")


def moe_layer_bytes(config: ModelConfig, *, compute_dtype=jnp.bfloat16, lora_rank: int = 16) -> dict:
    """Per token, what a mixture-of-experts block keeps for the backward pass in place of a dense
    MLP's 4 I s: {"full": without remat, "dots": the matmul outputs and the products' inputs}.

    Without remat: the router's logits (E s) and float32 probabilities (E x 4) and the k routing
    weights (k x 4); per (token, slot) row, k of them per token, the gathered input and the down
    product's output (2 H s: the grouped products' residual and the routing weight's gradient) and
    the expert MLP's gate, up, activation and product (4 I s, I = moe_intermediate_size), with the
    x A^T of LoRA on the two expert stacks (2 r, float32). With the matmul outputs kept: the
    grouped products are custom_vjp calls, which that policy does not save, so the experts are
    recomputed in the backward pass and only the block's input (H s), the router's logits and
    probabilities (E x 8) and the routing (k x 16: weights, expert ids, the sort order and its
    inverse) stay. (Against `saved_residuals` of a tiny Qwen3-MoE and Mixtral on CPU this counts
    0.55-0.61 of what the backward keeps without remat, 0.67 for a dense Llama: the CPU grouped
    product pads its row tiles; with the matmul outputs kept, 0.8 as for the dense model.)"""
    c = config
    s = jnp.dtype(compute_dtype).itemsize
    h, i, e, k = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok
    return {"full": e * (s + 4) + k * 4 + k * (2 * h + 4 * i) * s + 2 * k * lora_rank * 4,
            "dots": h * s + e * 8 + k * 16}


def _layer_counts(config: ModelConfig) -> tuple[int, int]:
    """(dense MLP layers, mixture-of-experts layers)."""
    sparse = sum(bool(x) for x in config.sparse_layers)
    return config.num_hidden_layers - sparse, sparse


def _default_param_bytes(config: ModelConfig, compute_dtype) -> int:
    """Weights of an NF4 (double-quant) checkpoint: 4.127 bits per linear weight (experts
    included, as `quantize_experts="auto"` holds them); embeddings, the LM head, the norms and the
    routers in the compute dtype."""
    c = config
    s = jnp.dtype(compute_dtype).itemsize
    dense, sparse = _layer_counts(c)
    attn = c.hidden_size * (c.q_features + 2 * c.kv_features) + c.q_features * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    experts = 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size
    emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return int((c.num_hidden_layers * attn + dense * mlp + sparse * experts) * 4.127 / 8
               + (emb + sparse * c.num_experts * c.hidden_size) * s)


def _lora_train_bytes(config: ModelConfig, lora_rank: int) -> int:
    """LoRA gradients (summed in float32) and AdamW's two moments: 3 x the float32 LoRA params,
    LoRA on the four attention projections and the MLP's three, or every expert's (the params
    themselves are in param_bytes)."""
    c = config
    dense, sparse = _layer_counts(c)
    attn = 3 * c.hidden_size + c.q_features + 2 * c.kv_features + c.q_features
    mlp = 3 * (c.hidden_size + c.intermediate_size)
    experts = c.num_experts * (2 * c.hidden_size + 3 * c.moe_intermediate_size)  # (H + 2I) + (I + H) per expert
    return 3 * 4 * lora_rank * (c.num_hidden_layers * attn + dense * mlp + sparse * experts)


def state_bytes(module) -> int:
    """Bytes of every array of an NNX module (works on tracers: shapes and dtypes only; RNG keys
    left out)."""
    return int(sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(nnx.state(module)) if hasattr(a, "dtype")
                   and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)))


def device_memory() -> Optional[int]:
    """The first device's memory limit in bytes (`memory_stats()["bytes_limit"]`), or None where
    the platform does not report one (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (a backend without memory stats)
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _read_int(path: Path) -> Optional[int]:
    """An integer in a file (a cgroup limit, "max" = None), or None where unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limits(proc: Path, cgroup: Path) -> list[tuple[int, str]]:
    """The memory limits of this process's cgroup and its ancestors: v2 `memory.max` under
    `cgroup`, v1 `memory.limit_in_bytes` under `cgroup/memory` (each at the path /proc/self/cgroup
    names, and up to the mount's root, which is the process's own cgroup inside a container)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    dirs = []  # (mount, relative path, limit file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].strip().lstrip("/")
        if parts[0] == "0" and parts[1] == "":
            dirs += [(cgroup, rel, "memory.max"), (cgroup / "unified", rel, "memory.max")]
        elif "memory" in parts[1].split(","):
            dirs.append((cgroup / "memory", rel, "memory.limit_in_bytes"))
    out = []
    for mount, rel, name in dirs:
        here = mount / rel if rel else mount
        while True:
            value = _read_int(here / name)
            if value is not None and value < _NO_LIMIT:
                out.append((value, f"cgroup {name}"))
            if here == mount or mount not in here.parents:
                break
            here = here.parent
    return out


def host_memory(*, proc: str | os.PathLike = "/proc", cgroup: str | os.PathLike = "/sys/fs/cgroup"
                ) -> tuple[Optional[int], str]:
    """The memory this process may use, in bytes, and what set it: the smallest of its cgroup's
    memory limit (v2 or v1, the cgroup and its ancestors), RLIMIT_AS and `/proc/meminfo`'s
    MemAvailable (what other processes leave). (None, "unknown") where none is readable.

    Args:
      proc, cgroup: where procfs and the cgroup file system are mounted (tests point them at
        files of their own)."""
    found = _cgroup_limits(Path(proc), Path(cgroup))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        found.append((int(soft), "RLIMIT_AS"))
    try:
        for line in (Path(proc) / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                break
    except (OSError, ValueError, IndexError):
        pass
    return min(found) if found else (None, "unknown")


def available_memory(environ: Optional[Mapping[str, str]] = None, **host_kw) -> tuple[Optional[int], str, bool]:
    """The memory a train step may fill, in bytes, what set it, and whether it is host memory:
    `JQLORA_MEMORY_GB` when set; else the first device's `bytes_limit` where the platform reports
    one (GPU), else, on CPU, `host_memory()`. (None, "unknown", host) where nothing is known.

    Raises:
      SettingError: JQLORA_MEMORY_GB is not a positive number."""
    env = os.environ if environ is None else environ
    limit = device_memory()
    host = limit is None and jax.default_backend() == "cpu"
    text = env.get(MEMORY_ENV, "").strip()
    if text:
        try:
            given = float(text)
        except ValueError:
            given = 0.0
        if not given > 0:
            raise SettingError(f"{MEMORY_ENV}={text!r}: expected a positive number of GB")
        return int(given * 10**9), MEMORY_ENV, host
    if host:
        return (*host_memory(**host_kw), True)
    return limit, "device memory", False


def remat_plan(config, batch: int, seq_len: int, *, device_bytes: Optional[int] = None,
               param_bytes: Optional[int] = None, compute_dtype=jnp.bfloat16, attention: str = "cudnn",
               lora_rank: int = 16, loss_chunk: int = 256, host_bytes: Optional[int] = None) -> RematPlan:
    """The fastest remat policy whose predicted train-step peak fits the device.

    Args:
      config: a `ModelConfig` or an HF config dict.
      batch, seq_len: the micro-batch shape of the train step.
      device_bytes: the memory to fit; default: `available_memory()` (the device's `bytes_limit`
        on a GPU, the process's RAM limit on CPU). Where none is known the plan is no remat.
      param_bytes: bytes of the model's arrays (weights and LoRA params); default: an NF4
        double-quant checkpoint of this config.
      compute_dtype, attention, lora_rank: as the model runs (they change the activations).
      loss_chunk: tokens per chunk of the chunked LM head + loss.
      host_bytes: the pinned host memory offloaded activations may use; default: XLA's limit
        (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, else 64, read as 10^9 bytes to be safe). A policy
        that offloads more is skipped.

    Returns:
      A `RematPlan`: the policy (None = no remat), the predicted peak of each candidate, the
      device memory and a one-line reason ("remat: dots_with_no_batch_dims_saveable (predicted
      16.4 GiB of 79.1 GiB)").
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    source, on_host = "given", False
    if device_bytes is None:
        device_bytes, source, on_host = available_memory()
    if param_bytes is None:
        param_bytes = _default_param_bytes(cfg, compute_dtype)
    tokens = int(batch) * int(seq_len)
    fixed = int(param_bytes) + _lora_train_bytes(cfg, lora_rank) \
        + 3 * 4 * int(batch) * min(loss_chunk, seq_len) * cfg.vocab_size  # one chunk's logits, softmax, grad
    predicted, offloaded = {}, {}
    for policy in AUTO_ORDER:
        a = activation_bytes_per_token(cfg, policy, compute_dtype=compute_dtype, attention=attention,
                                       seq_len=seq_len, lora_rank=lora_rank)
        predicted[policy or "none"] = fixed + tokens * (a["kept"] + a["transient"])
        offloaded[policy or "none"] = tokens * a["host"]
    if device_bytes is None:
        return RematPlan(None, predicted, None, f"remat: none (memory limit unknown; predicted "
                                                f"{_gib(predicted['none'])})", source)
    of = _gib(device_bytes) + ("" if source in ("given", "device memory") else f" ({source})") \
        + (f", {HOST_HEADROOM:.0%} of it usable" if on_host else "")
    if host_bytes is None:
        from jqlora._util import host_offload_limit_gb  # noqa: PLC0415

        host_bytes = host_offload_limit_gb() * 10**9
    # on CPU the "device" is the host: nothing to offload to, and the machine is shared
    budget = (HOST_HEADROOM if on_host else HEADROOM) * device_bytes
    order = AUTO_ORDER[:-1] if on_host else AUTO_ORDER
    too_much_host = ""
    for policy in order:
        need, host = predicted[policy or "none"], offloaded[policy or "none"]
        if need <= budget and host > HEADROOM * host_bytes:
            too_much_host = (f"; {policy} would fit with {_gib(host)} of host memory, over XLA's limit of "
                             f"{_gib(host_bytes)} (set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
            continue
        if need <= budget:
            extra = f"; {_gib(host)} of layer inputs in host memory" if host else ""
            return RematPlan(policy, predicted, device_bytes,
                             f"remat: {policy or 'none'} (predicted {_gib(need)} of {of}{extra})", source)
    last = order[-1]
    return RematPlan(last, predicted, device_bytes,
                     f"remat: {last} (predicted {_gib(predicted[last])} of {of}: "
                     f"may not fit; lower the batch or sequence length{too_much_host})", source)
