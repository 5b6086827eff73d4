"""Adam with 8-bit moments, as bitsandbytes' blockwise 8-bit optimizers (``AdamW8bit``,
``paged_adamw_8bit``) keep them.

LoRA on every expert of a mixture of experts trains over half a billion parameters, and AdamW's
two float32 moments are then most of the training memory besides the frozen weights. Here each
moment is one byte per element (an index into a 256-entry dynamic map) plus one float32 absmax per
block of 256 elements: 2 bytes + 8 bytes per 256 elements for both moments, against 8 bytes.

Each step dequantizes both moments to float32, updates them and computes the Adam update in
float32, then quantizes them again: block by block, each value divided by its block's absmax and
stored as the nearest entry of the map. The maps are bitsandbytes' own: ``create_dynamic_map(
signed=True)`` for the first moment and ``signed=False`` for the second (``name2qmap["dynamic"]``
and ``["udynamic"]`` in ``bitsandbytes/optim/optimizer.py``), rebuilt here in numpy. Leaves with
fewer than 4096 elements (bitsandbytes' ``min_8bit_size``; a stacked leaf counts whole) or fewer
than two dimensions keep float32 moments and take :func:`optax.scale_by_adam`'s own step.

Layout, chosen so that the state follows its parameter through sharding and checkpoints: a leaf
of shape ``(..., a, b)`` is quantized per matrix, its last two axes flattened into blocks of 256
(the last block padded with zeros); its codes have the parameter's own shape (uint8) and its
absmax the shape ``(..., 1, n_blocks)``. The state's moment trees mirror the parameters, so each
state path ends with its parameter's path (:func:`jqlora.parallel.place_state` relies on it).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["BLOCK", "CHUNK", "MIN_8BIT_SIZE", "ScaleByAdam8bitState", "create_dynamic_map", "dequantize_blockwise",
           "quantize_blockwise", "quantized_leaf", "scale_by_adam_8bit"]

BLOCK = 256            # elements per absmax (bitsandbytes' blockwise optimizers use 256)
MIN_8BIT_SIZE = 4096   # smaller leaves keep float32 moments (bitsandbytes' min_8bit_size)
CHUNK = 1 << 22        # elements a step requantizes at once (a stacked leaf goes in slices of its first axis)


def _torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n, dtype=torch.float32)`` on CPU, bit for bit: a float32 step,
    the first half counted up from ``start`` and the rest down from ``end``, each value rounded
    once (a fused multiply-add), which is what the map below is built from."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64(np.float32((end32 - start32) / np.float32(n - 1)))
    i = np.arange(n)
    up = (np.float64(start32) + step * i).astype(np.float32)
    down = (np.float64(end32) - step * (n - 1 - i)).astype(np.float32)
    return np.where(i < n // 2, up, down)


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' ``functional.create_dynamic_map``: 256 sorted float32 values in [-1, 1]
    (signed) or [0, 1], dense near zero (a decimal exponent, then a fraction whose bits shrink as
    the exponent grows). Built in float32 as bitsandbytes builds it, so the values are equal."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    i = 0
    for i in range(max_exponent_bits):
        items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                 else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        bounds = _torch_linspace_f32(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        bounds = _torch_linspace_f32(0.1, 1.0, additional_items + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    if len(data) != 2 ** total_bits:
        raise ValueError(f"the dynamic map has {len(data)} values, not {2 ** total_bits}")
    data += [0.0] * (256 - len(data))
    return np.sort(np.asarray(data, np.float32))


SIGNED_MAP = create_dynamic_map(signed=True)     # first moment ("dynamic")
UNSIGNED_MAP = create_dynamic_map(signed=False)  # second moment ("udynamic")


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``(..., a, b)`` -> ``(..., n_blocks, block)``: the last two axes flattened, zero-padded."""
    lead, n = x.shape[:-2], x.shape[-2] * x.shape[-1]
    flat = x.reshape(*lead, n)
    pad = -n % block
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    return flat.reshape(*lead, (n + pad) // block, block)


def _unblocks(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of :func:`_blocks`: the padding dropped, ``shape`` restored."""
    n = shape[-2] * shape[-1]
    return x.reshape(*shape[:-2], -1)[..., :n].reshape(shape)


def _nearest(scaled: jax.Array, code: np.ndarray) -> jax.Array:
    """The index of the entry of ``code`` nearest each value: how many float32 midpoints of
    consecutive entries lie below it (a binary search, 8 halvings; the table padded with +inf)."""
    mid = np.float32(0.5) * (code[:-1] + code[1:])
    table = jnp.asarray(np.concatenate([mid, np.full(1, np.inf, np.float32)]))
    idx = jnp.zeros(scaled.shape, jnp.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        idx = jnp.where(table[idx + step - 1] < scaled, idx + step, idx)
    return idx


def quantize_blockwise(x: jax.Array, code, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """``x`` (..., a, b) -> (codes uint8 (..., a, b), absmax float32 (..., 1, n_blocks)).

    Per block: ``absmax = max |x|``, then each ``x * (1 / absmax)`` becomes the index of the
    nearest entry of ``code`` (a sorted map; a value exactly on the float32 midpoint of two
    entries takes the lower one). A block of zeros gets absmax 0 and codes 0, as bitsandbytes
    stores it. On one matrix whose size is a multiple of ``block`` these are the blocks of
    ``bitsandbytes.functional.quantize_blockwise(x, code=code, blocksize=block)``."""
    code = np.asarray(code, np.float32)
    if code.shape != (256,):
        raise ValueError(f"the code must hold 256 values, got shape {code.shape}")
    shape = x.shape
    xb = _blocks(x.astype(jnp.float32), block)
    absmax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scaled = xb * (1.0 / jnp.where(absmax > 0, absmax, 1.0))
    idx = jnp.where(absmax > 0, _nearest(scaled, code), 0)
    codes = _unblocks(idx.astype(jnp.uint8), shape)
    return codes, jnp.swapaxes(absmax, -1, -2)


def dequantize_blockwise(codes: jax.Array, absmax: jax.Array, code, block: int = BLOCK) -> jax.Array:
    """The float32 values of :func:`quantize_blockwise`'s ``(codes, absmax)``: ``code[c] * absmax``
    of the block (bitsandbytes' ``dequantize_blockwise``)."""
    values = jnp.asarray(np.asarray(code, np.float32))[codes.astype(jnp.int32)]
    return _unblocks(_blocks(values, block) * jnp.swapaxes(absmax, -1, -2), codes.shape)


def quantized_leaf(x) -> bool:
    """Whether a parameter leaf gets 8-bit moments: at least MIN_8BIT_SIZE elements and 2 dims."""
    return getattr(x, "ndim", 0) >= 2 and int(np.prod(x.shape)) >= MIN_8BIT_SIZE


class ScaleByAdam8bitState(NamedTuple):
    """``count`` as :func:`optax.scale_by_adam` counts; ``mu`` and ``nu`` mirror the parameters,
    each leaf the uint8 codes of a quantized leaf or the float32 moment of a small one; ``mu_absmax``
    and ``nu_absmax`` mirror them too, each leaf the block absmax (None for a float32 leaf)."""

    count: jax.Array
    mu: Any
    nu: Any
    mu_absmax: Any
    nu_absmax: Any


def _map_leaves(fn, n_out: int, tree, *rest):
    """``fn`` over the leaves of ``tree`` and the matching subtrees of ``rest`` (a None there is
    passed on as it is), ``n_out`` trees of ``tree``'s structure back."""
    treedef = jax.tree.structure(tree)
    leaves = [treedef.flatten_up_to(t) for t in (tree, *rest)]
    outs = [fn(*args) for args in zip(*leaves)]
    return tuple(treedef.unflatten([o[k] for o in outs]) for k in range(n_out))


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """:func:`optax.scale_by_adam` whose moments are kept in 8 bits between steps.

    Each step dequantizes ``m`` and ``v`` to float32 and runs ``optax.scale_by_adam``'s own step on
    them (``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, update ``m_hat / (sqrt(v_hat) +
    eps)`` from this step's float32 moments), then quantizes ``m`` with the signed map and ``v`` with
    the unsigned one. Chained with ``add_decayed_weights`` and ``scale_by_learning_rate`` it is
    bitsandbytes' ``AdamW8bit`` (blockwise, block 256)."""

    def init_fn(params):
        def one(p):  # four distinct arrays: a train step donates each state buffer once
            if quantized_leaf(p):
                blocks = (*p.shape[:-2], 1, -(-p.shape[-2] * p.shape[-1] // BLOCK))
                return (jnp.zeros(p.shape, jnp.uint8), jnp.zeros(p.shape, jnp.uint8),
                        jnp.zeros(blocks, jnp.float32), jnp.zeros(blocks, jnp.float32))
            return jnp.zeros_like(p), jnp.zeros_like(p), None, None

        mu, nu, mu_absmax, nu_absmax = _map_leaves(one, 4, params)
        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), mu, nu, mu_absmax, nu_absmax)

    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)  # the step itself, on float32 moments

    def update_fn(updates, state, params=None):
        del params

        def quantized(args):
            g, m_codes, m_absmax, v_codes, v_absmax = args
            m = dequantize_blockwise(m_codes, m_absmax, SIGNED_MAP)
            v = dequantize_blockwise(v_codes, v_absmax, UNSIGNED_MAP)
            update, new = adam.update(g, optax.ScaleByAdamState(state.count, m, v))
            m_codes, m_absmax = quantize_blockwise(new.mu, SIGNED_MAP)
            v_codes, v_absmax = quantize_blockwise(new.nu, UNSIGNED_MAP)
            return update, m_codes, v_codes, m_absmax, v_absmax

        def one(args):
            g = args[0]
            if g.ndim < 3 or g.size <= CHUNK:
                return quantized(args)
            # XLA keeps the search's intermediates (about 13 bytes an element) for a whole leaf:
            # a stacked leaf (layers, experts) larger than CHUNK goes in slices of its first axis
            return jax.lax.map(quantized, args, batch_size=max(1, CHUNK // (g.size // g.shape[0])))

        treedef = jax.tree.structure(updates)
        g, mu, nu, mu_absmax, nu_absmax = (treedef.flatten_up_to(t) for t in (
            updates, state.mu, state.nu, state.mu_absmax, state.nu_absmax))
        out = [None] * len(g)
        # the small leaves together: optax.scale_by_adam's own step over them, float32 moments
        small = [i for i, a in enumerate(mu_absmax) if a is None]
        if small:
            small_updates, new = adam.update([g[i] for i in small], optax.ScaleByAdamState(
                state.count, [mu[i] for i in small], [nu[i] for i in small]))
            for j, i in enumerate(small):
                out[i], mu[i], nu[i] = small_updates[j], new.mu[j], new.nu[j]
        for i, a in enumerate(mu_absmax):
            if a is not None:
                out[i], mu[i], nu[i], mu_absmax[i], nu_absmax[i] = one((g[i], mu[i], a, nu[i], nu_absmax[i]))
        mu, nu, mu_absmax, nu_absmax = (treedef.unflatten(x) for x in (mu, nu, mu_absmax, nu_absmax))
        return treedef.unflatten(out), ScaleByAdam8bitState(optax.safe_increment(state.count), mu, nu,
                                                            mu_absmax, nu_absmax)

    return optax.GradientTransformation(init_fn, update_fn)
