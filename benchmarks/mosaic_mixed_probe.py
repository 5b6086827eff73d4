"""JAX's shipped Mosaic GPU matmuls against `jnp.dot` bf16 at the protocol's shapes: can a
Hopper wgmma kernel that converts an int8 weight in registers beat the dequant pass + cuBLAS
that `qmatmul` runs at large M?

    python -m benchmarks.mosaic_mixed_probe 128,2048,8192    # $OUT/mixed_probe.json

Contenders per (K, N, M): `jnp.dot` bf16 (x @ W.T), the INT8 `qmatmul` (auto), JAX's
`hopper_matmul_mgpu` (bf16 x bf16, W.T materialised outside the timed call) and
`hopper_mixed_type_matmul_mgpu.mixed_matmul_kernel` as W_int8 (N, K) @ x.T (K, M) -> y.T: the
int8 operand must be the wgmma's register (left) operand, so x.T and y.T transposes, which a
real kernel would also have to pay or avoid, are outside the timed call. Untuned configs from
the JAX examples; configs that exceed shared memory are recorded as errors.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm

from benchmarks.timing import jax_device_ms
from jqlora import ops, quant


def main():
    out = []

    def rec(**r):
        print(json.dumps(r), flush=True)
        out.append(r)

    def t_us(f, *a):
        try:
            return jax_device_ms(f, *a, iterations=10) * 1e3
        except Exception as e:  # a config that does not fit is a result too
            return f"{type(e).__name__}: {str(e)[:300]}"

    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048, 8192]
    for (k, n) in ((4096, 4096), (4096, 14336), (14336, 4096)):
        w = jax.random.normal(jax.random.key(0), (n, k), jnp.bfloat16) * 0.02
        q8 = quant.quantize_int8(w)
        wt = jnp.array(w.T)
        for m in ms:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            xt = jnp.array(x.T)
            rec(k=k, n=n, m=m, what="bf16 jnp.dot", us=t_us(lambda x, w: x @ w.T, x, w))
            rec(k=k, n=n, m=m, what="int8 qmatmul pallas",
                us=t_us(lambda x, q: ops.qmatmul(x, q, backend="pallas"), x, q8))
            for tm, tn, tk, wg in ((128, 128, 64, hm.MatmulDimension.N),
                                   (128, 256, 64, hm.MatmulDimension.N),
                                   (128, 128, 128, hm.MatmulDimension.M)):
                cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=4,
                                      grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                                      wg_dimension=wg)
                rec(k=k, n=n, m=m, what=f"mgpu bf16 {tm}x{tn}x{tk} wg{wg}",
                    us=t_us(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg), x, wt))
            for tm, tn, tk, wg in ((128, 128, 64, mm.MatmulDimension.N),
                                   (128, 128, 128, mm.MatmulDimension.N),
                                   (64, 128, 128, mm.MatmulDimension.N),
                                   (128, 128, 64, mm.MatmulDimension.M)):
                cfg = mm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=4,
                                      grid_minor_dim=mm.MatmulDimension.N, grid_tile_width=8,
                                      wg_dimension=wg)
                rec(k=k, n=n, m=m, what=f"mixed W@xT {tm}x{tn}x{tk} wg{wg}",
                    us=t_us(lambda a, b, cfg=cfg: mm.mixed_matmul_kernel(
                        a, b, out_dtype=jnp.bfloat16, config=cfg), q8.cb, xt))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "mixed_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
