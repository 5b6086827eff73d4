"""Packed rows under cuDNN: the (T, T) segment mask against cuDNN's packed layout (per-segment
lengths and offsets, `jqlora.models.packed_attention`), forward + backward, one attention layer.

    python -m benchmarks.packed_attention_probe        # $OUT/packed_attention_probe.jsonl

Shapes: B = 1, T = 2048, 32 query heads, 8 kv heads, head_dim 128 (Llama-3-8B) and 64 (3.2-1B);
one row of four documents (700, 500, 600, 200 tokens) and 48 padding tokens. Rows: device time of
value_and_grad of sum(out * g) over q, k, v; accuracy of out and dq/dk/dv on real tokens against
the float32 XLA attention with the mask (max abs error / max abs reference).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import jax_device_ms
from jqlora.models import packed_attention as pa
from jqlora.models.llama import attention_mask


def main():
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(int(os.environ.get("PROBE_DUMP_S", "170")), exit=True, file=sys.stderr)
    out_path = os.path.join(os.environ.get("OUT", "."), "packed_attention_probe.jsonl")

    def rec(**r):
        print(json.dumps(r), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(r) + "\n")

    from jax._src.cudnn import fused_attention_stablehlo as fa
    rec(device=jax.devices()[0].device_kind, jax=jax.__version__, cudnn=fa.check_cudnn_version(),
        available=pa.available())
    t = 2048
    docs = (700, 500, 600, 200)
    seg = np.zeros((1, t), np.int32)
    at = 0
    for i, n in enumerate(docs):
        seg[0, at:at + n] = i + 1
        at += n
    seg = jnp.asarray(seg)
    real = np.asarray(seg != 0)
    slots = jnp.arange(t, dtype=jnp.int32)[None]
    mask = attention_mask(slots, slots, seg, seg, None)[:, None]
    for d in (128, 64):
        ks = jax.random.split(jax.random.key(d), 4)
        q = jax.random.normal(ks[0], (1, t, 32, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, t, 8, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, t, 8, d), jnp.bfloat16)
        g = jax.random.normal(ks[3], (1, t, 32, d), jnp.bfloat16) * jnp.asarray(real)[:, :, None, None]
        scale = d ** -0.5

        forms = {
            "cudnn plain causal (no segments; not the same result)": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, scale=scale, implementation="cudnn"),
            "cudnn segment mask (before)": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, scale=scale, implementation="cudnn"),
        }
        for m in (64, 16, 4):
            forms[f"cudnn packed M={m}"] = lambda q, k, v, m=m: pa.packed_causal_attention(
                q, k, v, seg, pa.segment_runs(seg, m), scale=scale)

        def loss_grad(f):
            def lg(q, k, v):
                out, vjp = jax.vjp(f, q, k, v)
                return (out,) + vjp(g.astype(out.dtype))
            return lg

        ref32 = loss_grad(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, implementation="xla"))
        refs = [np.asarray(a, np.float32) for a in jax.jit(ref32)(
            *(a.astype(jnp.float32) for a in (q, k, v)))]
        for name, f in forms.items():
            row = {"head_dim": d, "what": name}
            print("...", name, flush=True)
            try:
                lg = jax.jit(loss_grad(f))
                outs = [np.asarray(a, np.float32) for a in lg(q, k, v)]
                for label, a, r in zip(("out", "dq", "dk", "dv"), outs, refs):
                    sel = real[0] if label in ("out", "dq") else real[0]
                    err = np.abs(a[0, sel] - r[0, sel]).max() / max(np.abs(r[0, sel]).max(), 1e-30)
                    row[f"{label}_rel_err"] = float(err)
                row["finite"] = bool(all(np.isfinite(a).all() for a in outs))
                row["pad_out_max"] = float(np.abs(outs[0][0, ~real[0]]).max()) if (~real).any() else 0.0
                row["fwd_bwd_us"] = jax_device_ms(lg, q, k, v, iterations=20) * 1e3
                row["fwd_us"] = jax_device_ms(jax.jit(f), q, k, v, iterations=20) * 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            rec(**row)


if __name__ == "__main__":
    main()
