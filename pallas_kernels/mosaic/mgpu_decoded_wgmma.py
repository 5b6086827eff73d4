"""`mgpu_decoded_wgmma`: 4-bit matmul on Hopper through Pallas' Mosaic GPU lowering,
y = x @ dequant(W).T with the weight decoded in registers and fed to warpgroup MMAs (wgmma) as
their register operand. Oracle: `reference.matmul_4bit_reference` (bitsandbytes' weight).

Why: a dequant pass + cuBLAS (`dequant_dot`) pays the dense weight's bytes on top of the GEMM,
and the Triton lowering's fused kernels do not overlap their decode with the MMA. Mosaic GPU
gives the Hopper structure: a memory warpgroup streams tiles with TMA while two compute
warpgroups each decode their weight tile and issue wgmma, so one warpgroup's decode can run
under the other's MMA.

The product is computed transposed, y.T (N, M) = W (N, K) . x.T, because only the left wgmma
operand may come from registers. Per compute warpgroup and K step (64 or 128 columns):

1. the packed tile (64 rows) is loaded from shared memory as int4 in `WGMMA_LAYOUT_UPCAST_4X`
   and shuffled toward the WGMMA register layout (two warp shuffles and two byte permutes per 8
   codes: Mosaic's own relayout, stopped before it splits each 32-bit word);
2. for each of a thread's two weight rows and each scale block, a 16-entry table of
   round(code * absmax) in x's dtype (fp32 products, one rounding: bitsandbytes' dequantized
   weight bit for bit) as byte planes in 8 registers; the 4 lanes of a quad (same rows) each
   make 4 entries and gather the rest by quad shuffles (`mgpu_decode.table_ptx`, 16 instructions);
3. each word of 8 codes becomes the four 16-bit pairs of the A fragment by byte permutes
   (`mgpu_decode._LOOKUP_PROGRAM`, 22 instructions, no memory access).

The (rows, tokens) tile of y.T is stored transposed through shared memory, so y comes out in
its own layout (one K split, jax >= 0.11); K splits (and jax 0.10, whose layout inference
rejects that store) write fp32 / 16-bit tiles of y.T that XLA sums and transposes. The weight
reaches the kernel as an int4 view of the packed bytes (an XLA bitcast, `s4[...]{E(4)}`):
Mosaic keeps each byte whole through its relayout, and the lookup reads the high nibble as the
even column (bitsandbytes' order). Double-quantized scales are de-nested by XLA first
((K / blocksize, N) float32), or, where a thread has at most 8 of a tile's scales, by the kernel
itself once per tile into shared memory (`mgpu_decode.scale_denester`, `denests_in_kernel`).
Each warpgroup waits for its MMA before decoding the next tile: the decode reuses the A
registers the MMA reads. The code table rides in registers, loaded once per tile
(`mgpu_decode.code_loader`). K splits need not divide the steps: each split runs a window of
ceil(steps / splits) steps, the last moved back to end at K, skipping (`pl.when`) the steps the
split before it took (`mgpu_pipeline.split_windows`).

Hopper only (sm_90), no interpret mode. CPU checks: the two PTX programs run in a PTX
interpreter in the tests (`tests/kernels/test_kernels_4bit_mgpu.py`), `mgpu_decode.emulate_lookup_words`
/ `emulate_table_words` are their jnp twins, and the kernel lowers for CUDA on CPU; the compiled
suite checks it on the GPU, bit for bit through an identity product.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference.fourbit import (
    check_4bit_weight, check_x, denest_absmax_reference, matmul_4bit_reference, supports_4bit)
from pallas_kernels.mosaic.mgpu_decode import (
    code_loader, codes_layout, decode_fn, mosaic_modules, scale_denester)
from pallas_kernels.mosaic.mgpu_pipeline import (
    FOUR_WG_REGISTERS, SMEM_LIMIT, SMS, compute_registers_held, load_tile, sm_count,
    split_steps, traced_window, uneven_splits_problem, warp_specialized, window_blocks_problem)
from pallas_kernels.registry import Variant

reference = matmul_4bit_reference


@dataclasses.dataclass(frozen=True)
class DecodedWgmmaConfig:
    """Tile shape: each CTA computes (2 * wg_rows) weight rows x tile_m tokens of y.T."""

    tile_m: int = 128  # tokens per CTA (the wgmma N side), 8..256
    tile_k: int = 64  # K columns per pipeline step (a multiple of 64)
    k_splits: int = 1  # K ranges computed by separate CTAs; partials summed by XLA
    max_concurrent_steps: int = 4  # pipeline depth of the memory warpgroup
    wg_rows: int = 64  # weight rows per compute warpgroup (64 or 128)
    # compute warpgroups per row group, each taking tile_k / k_wgs columns of every step (1 or
    # 2). 2 runs four compute warpgroups with 96 registers each, doubling the warps that hide
    # the decode's latency; their fp32 partials are summed by XLA like K splits. Correct but
    # measured no faster (docs/kernels.md), so `default_config` never picks it
    k_wgs: int = 1


def mgpu_decoded_wgmma(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                       interpret: bool = False, nested=None,
                       config: DecodedWgmmaConfig | None = None):
    """y = x @ dequant(W).T on a Hopper GPU (Mosaic GPU). x (M, K) bf16/f16; packed (N, K//2)
    uint8; absmax (N, K//blocksize) f32 or, with `nested`, uint8 codes."""
    if interpret:
        raise NotImplementedError("mgpu_decoded_wgmma has no interpret mode (Mosaic GPU, inline "
                                  "PTX); run matmul_4bit_reference or another variant on CPU")
    what = "mgpu_decoded_wgmma"
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what=what)
    check_x(x, k, what=what)
    m = x.shape[0]
    cfg = config or default_config(max(m, 1), n, k, blocksize)
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: x must be bfloat16 or float16 (the wgmma operand), got {x.dtype}")
    if m == 0:
        return jnp.zeros((0, n), out_dtype or x.dtype)
    if smem_bytes(cfg, blocksize) > SMEM_LIMIT:
        raise ValueError(f"{what}: {cfg} needs {smem_bytes(cfg, blocksize)} bytes of shared "
                         f"memory, more than {SMEM_LIMIT}: lower max_concurrent_steps or tiles")
    problem = shape_problem(m, n, k, blocksize, cfg)
    if problem:
        raise ValueError(f"mgpu_decoded_wgmma: {problem}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    nest = None
    if nested is not None and denests_in_kernel(n, k, blocksize, cfg):
        nested_absmax, nested_code, offset = nested
        scales = absmax.reshape(n, k // blocksize)  # the uint8 codes as stored
        nest = (jnp.asarray(nested_code, jnp.float32), jnp.asarray(nested_absmax, jnp.float32),
                jnp.reshape(offset, (1,)).astype(jnp.float32))
    else:
        if nested is not None:
            absmax = denest_absmax_reference(absmax, *nested)
        scales = jnp.asarray(absmax, jnp.float32).T  # (K / blocksize, N)
    w4 = lax.bitcast_convert_type(packed, jnp.int4).reshape(n, k)
    mp = -(-m // cfg.tile_m) * cfg.tile_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    y = _call(xp, w4, scales, jnp.asarray(code, jnp.float32), blocksize=blocksize, cfg=cfg,
              nest=nest)
    if _stores_transposed(cfg):
        return y[:m].astype(out_dtype)
    return jnp.sum(y, axis=0)[:, :m].T.astype(out_dtype)  # (splits, N, M) partials of y.T


def denests_in_kernel(n: int, k: int, blocksize: int, cfg: DecodedWgmmaConfig) -> bool:
    """Whether double-quantized scales are de-nested by the kernel (`scale_denester`: each
    compute warpgroup, once per tile, into shared memory) rather than by XLA first. Needs one
    compute warpgroup per row group, a whole number of scales per thread, and room in shared
    memory for the two warpgroups' (split columns, 64) fp32 scales at this config."""
    split_cols = _window_cols(k, cfg) // blocksize
    per_thread = cfg.wg_rows * split_cols // 128
    return (cfg.k_wgs == 1 and per_thread * 128 == cfg.wg_rows * split_cols
            and per_thread <= _DENEST_MAX_PER_THREAD
            and smem_bytes(cfg, blocksize, denest_k=k) <= SMEM_LIMIT)


# scales a thread de-nests per tile, at most: with more, de-nesting in XLA first is faster (the
# kernel grows by more than the XLA fusion it replaces; why is not understood). Chosen by
# measurement: docs/kernels.md
_DENEST_MAX_PER_THREAD = 8


def _stores_transposed(cfg: DecodedWgmmaConfig) -> bool:
    """Whether the kernel writes y (M, N) itself: one K split (fp32 partials of several splits
    are stored as y.T, since the transposed store takes 16-bit tiles only) and jax >= 0.11
    (jax 0.10's layout inference rejects the transposed store; XLA then transposes y.T)."""
    return _partials(cfg) == 1 and _jax_at_least(0, 11)


def _partials(cfg: DecodedWgmmaConfig) -> int:
    """fp32 partial products of y.T per output element: one per K split and per warpgroup
    sharing a row group's K steps."""
    return cfg.k_splits * cfg.k_wgs


def _jax_at_least(major: int, minor: int) -> bool:
    parts = jax.__version__.split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def shape_problem(m, n, k, blocksize, cfg: DecodedWgmmaConfig) -> str | None:
    cta_n = 2 * cfg.wg_rows
    if cfg.wg_rows not in (64, 128):
        return f"wg_rows must be 64 or 128, got {cfg.wg_rows}"
    if cfg.tile_m % 8 or not 8 <= cfg.tile_m <= 256:
        return f"tile_m must be a multiple of 8 in 8..256 (the wgmma N side), got {cfg.tile_m}"
    if cfg.tile_k % 64 or cfg.tile_k < 64:
        return f"tile_k must be a positive multiple of 64, got {cfg.tile_k}"
    if blocksize < 64:
        return f"blocksize {blocksize} < 64 is not supported (one scale per row per 64 columns)"
    if n % cta_n:
        return f"N ({n}) must be a multiple of {cta_n}"
    if k % cfg.tile_k:
        return f"K ({k}) must be a multiple of tile_k ({cfg.tile_k})"
    problem = uneven_splits_problem(k // cfg.tile_k, cfg.k_splits)
    if problem:
        return problem
    if cfg.tile_k % blocksize and blocksize % cfg.tile_k:
        return f"tile_k ({cfg.tile_k}) and blocksize ({blocksize}) must divide one another"
    if cfg.k_wgs not in (1, 2):
        return f"k_wgs must be 1 or 2, got {cfg.k_wgs}"
    if cfg.k_wgs > 1 and (cfg.tile_k // cfg.k_wgs) % 64:
        return f"tile_k ({cfg.tile_k}) must hold k_wgs ({cfg.k_wgs}) groups of 64 columns"
    if cfg.k_wgs > 1 and (cfg.wg_rows != 64 or cfg.tile_m > 64):
        return ("k_wgs = 2 takes wg_rows = 64 and tile_m <= 64 (four compute warpgroups "
                f"have {FOUR_WG_REGISTERS} registers each)")
    return window_blocks_problem(k // cfg.tile_k, cfg.k_splits, cfg.tile_k, blocksize)


def _window_cols(k: int, cfg: DecodedWgmmaConfig) -> int:
    """K columns of each split's window of steps (`split_windows`)."""
    return split_steps(k // cfg.tile_k, cfg.k_splits) * cfg.tile_k



def default_config(m: int, n: int, k: int, blocksize: int) -> DecodedWgmmaConfig:
    """The tile config `qmatmul` uses (chosen by measurement: docs/kernels.md): the token tile
    is the smallest of 16/32/64/128 holding M, or 256 once that still leaves about 100 CTAs
    (above M = 128); K splits fill the SMs up to one wave, whether or not they divide the steps
    (`split_windows`: K = 11008 takes 4, where dividing splits leave 2); 128-column K steps
    where the tile is 128 tokens or fewer."""
    if m <= 64:
        tile_m = max(16, 1 << max(0, (m - 1).bit_length()))
    elif m <= 128 or -(-m // 256) * (n // 128) < 100:
        tile_m = 128
    else:
        tile_m = 256
    base = -(-m // tile_m) * max(1, n // 128)
    splits = 1
    while base * splits * 2 <= SMS and splits < 8:
        splits *= 2
    tile_k = 128 if tile_m <= 128 else 64
    while splits > 1 and shape_problem(m, n, k, blocksize,
                                       DecodedWgmmaConfig(tile_m, tile_k, splits)):
        splits //= 2
    if shape_problem(m, n, k, blocksize, DecodedWgmmaConfig(tile_m, tile_k, splits)):
        tile_k = 64
    cfg = DecodedWgmmaConfig(tile_m=tile_m, tile_k=tile_k, k_splits=splits)
    while cfg.max_concurrent_steps > 2 and smem_bytes(cfg, blocksize) > SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
    return cfg


def smem_bytes(cfg: DecodedWgmmaConfig, blocksize: int, *, denest_k: int = 0) -> int:
    """Shared memory the kernel allocates: each input's pipeline buffer (all stages of the
    int4 weight, x and scale tiles), the epilogue's two slots per compute warpgroup (fp32 when
    K is split), and with `denest_k` (the weight's K) the compute warpgroups' de-nested scales
    of a K split instead of scale tiles, each rounded up to Mosaic's 1024-byte alignment. Matches what
    Mosaic reported for tile_m = 128, tile_k = 128, 2 splits (232,512 bytes with barriers)."""
    up = lambda b: -(-b // 1024) * 1024
    cta_n = 2 * cfg.wg_rows
    scale_rows = max(1, cfg.tile_k // blocksize)
    tiles = (cta_n * cfg.tile_k // 2, cfg.tile_m * cfg.tile_k * 2)
    scales = (up(cta_n * (_window_cols(denest_k, cfg) // blocksize) * 4) if denest_k
              else up(cfg.max_concurrent_steps * scale_rows * cta_n * 4))
    out_bytes = 4 if _partials(cfg) > 1 else 2
    return (sum(up(cfg.max_concurrent_steps * t) for t in tiles) + scales
            + up(2 * cfg.k_wgs * _epilogue_slots(cfg) * cfg.wg_rows * min(64, cfg.tile_m)
                 * out_bytes))


def _epilogue_slots(cfg: DecodedWgmmaConfig) -> int:
    """Output staging buffers per compute warpgroup: two, so one tile's store overlaps the
    next's; one with four warpgroups, whose fp32 slots would otherwise take 128 KiB."""
    return 2 if cfg.k_wgs == 1 else 1


def _call(x, w4, scales, code, *, blocksize: int, cfg: DecodedWgmmaConfig, nest=None):
    """The kernel. `scales`: fp32 (K / blocksize, N), or with `nest` = (nested_code,
    nested_absmax, offset (1,)) the uint8 scale codes (N, K / blocksize), de-nested by the
    kernel once per tile."""
    _, pl, plgpu, *_ = mosaic_modules()
    m, k = x.shape
    n = w4.shape[0]
    dtype = x.dtype
    tile_m, tile_k, rows = cfg.tile_m, cfg.tile_k, cfg.wg_rows
    cta_n = 2 * rows
    wg_k = tile_k // cfg.k_wgs  # columns of a step one compute warpgroup decodes
    kb = wg_k // 64  # 64-column groups per warpgroup and step
    k_iters = split_steps(k // tile_k, cfg.k_splits)  # a K split's window of steps
    uneven = k_iters * cfg.k_splits * tile_k != k  # the last window moved back over steps
    k_per = k_iters * tile_k
    m_iters, n_iters = m // tile_m, n // cta_n
    # scale rows per step: one per 64-column group when blocksize = 64, else the one block
    scale_rows = max(1, tile_k // blocksize)
    acc_dtype = jnp.float32
    partials = _partials(cfg)
    out_dtype = jnp.float32 if partials > 1 else dtype

    x_swizzle = plgpu.find_swizzle(wg_k * 16, "rhs")
    x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    w_swizzle = plgpu.find_swizzle(wg_k * 4, "lhs")
    w_transforms = (plgpu.TilingTransform((8, w_swizzle * 2)), plgpu.SwizzleTransform(w_swizzle))
    epi_m = min(64, tile_m)
    slots = _epilogue_slots(cfg)
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    store_t = _stores_transposed(cfg)
    out_swizzle = plgpu.find_swizzle((rows if store_t else epi_m) * out_bits, "out")
    slot_tile = (epi_m, rows) if store_t else (rows, epi_m)  # one epilogue staging slot
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)),
                      plgpu.SwizzleTransform(out_swizzle))
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.RefType(), codes_layout(plgpu)),
        return_type=plgpu.ShapeDtypeStruct((rows, wg_k), dtype, layout=plgpu.Layout.WGMMA),
    )(decode_fn(dtype, kb, rows, blocksize))
    load_codes = code_loader(plgpu)

    split_cols = k_per // blocksize  # scale columns of a K split
    step_col = lambda kk: kk * tile_k // blocksize  # a step's first scale column in its split
    denest = scale_denester(plgpu, rows, k // blocksize, split_cols) if nest else None
    if blocksize <= tile_k:
        scale_spec = plgpu.BlockSpec((scale_rows, cta_n), lambda kk: (kk, 0))
    else:  # one scale block spans several steps
        per = blocksize // tile_k
        scale_spec = plgpu.BlockSpec((1, cta_n), lambda kk: (kk // per, 0))

    pipeline, allocate = warp_specialized(
        plgpu, pl, grid=(k_iters,), num_compute_wgs=2 * cfg.k_wgs, depth=cfg.max_concurrent_steps,
        in_specs=[
            plgpu.BlockSpec((cta_n, tile_k), lambda kk: (0, kk), transforms=w_transforms),
            plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk), transforms=x_transforms),
            *([] if nest else [scale_spec]),
        ])

    def matmul_4bit_mgpu_kernel(x_gmem, w_gmem, s_gmem, code_gmem, *rest, out_smem,
                                scale_smem=None):
        *nest_gmem, out_gmem = rest
        @functools.partial(pl.run_scoped,
                           allocs=allocate(w_gmem, x_gmem, *([] if nest else [s_gmem])),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters * cfg.k_splits,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                split = lin % cfg.k_splits
                mn = lin // cfg.k_splits
                mi, ni = mn % m_iters, mn // m_iters
                m_sl = pl.ds(mi * tile_m, tile_m)
                n_sl = pl.ds(ni * cta_n, cta_n)
                if uneven:  # the window's first step, and the steps to skip
                    first, skipped = traced_window(split, k // tile_k, cfg.k_splits)
                    k_sl = pl.ds(first * tile_k, k_per)
                    s_sl = pl.ds(first * tile_k // blocksize, max(1, k_per // blocksize))
                else:
                    k_sl = pl.ds(split * k_per, k_per)
                    s_sl = pl.ds(split * (k_per // blocksize), max(1, k_per // blocksize))
                if cfg.k_wgs > 1:  # warpgroups 0, 1 and 2, 3 share rows, not columns
                    wg_rows = pl.ds(lax.rem(wg, 2) * rows, rows)
                    part = split * cfg.k_wgs + wg // 2  # this warpgroup's partial of y.T
                else:
                    wg_rows, part = pl.ds(wg * rows, rows), split

                def ctx(run):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((rows, tile_m), acc_dtype))
                    def _acc(acc):
                        if nest:  # this warpgroup's scales of the tile, into scale_smem[wg]
                            first_row = ni * cta_n + wg * rows
                            denest(s_gmem.at[pl.ds(first_row, rows), s_sl], *nest_gmem,
                                   scale_smem.at[wg])
                        run((acc, load_codes(code_gmem)))  # the table rides in registers
                        res = acc[...].astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        if store_t:  # y itself: this warpgroup's rows are y's columns
                            dst = out_gmem.at[m_sl, n_sl].at[:, wg_rows]
                        else:  # fp32 partials of y.T, one slab per K split
                            dst = out_gmem.at[part].at[n_sl, m_sl].at[wg_rows]
                        for e in range(tile_m // epi_m):
                            e_sl = slice(e * epi_m, (e + 1) * epi_m)
                            slot = out_smem.at[wg, e % slots]
                            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                            if store_t:  # the (rows, epi_m) tile of y.T as y's (epi_m, rows)
                                slot.T[...] = res[:, e_sl]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(slot, dst.at[e_sl])
                            else:
                                slot[...] = res[:, e_sl]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(slot, dst.at[:, e_sl])

                def body(indices, w_smem, x_smem, *rest):
                    *s_smem, (acc, codes) = rest
                    (kk,) = indices
                    if nest:  # the step's columns of the de-nested scales (k_wgs = 1)
                        s_wg = scale_smem.at[wg, pl.ds(step_col(kk), scale_rows)]
                    else:
                        s_wg = s_smem[0]
                    if cfg.k_wgs > 1:  # this warpgroup's columns of the step
                        half = wg // 2
                        w_smem = w_smem.at[:, pl.ds(half * wg_k, wg_k)]
                        x_smem = x_smem.at[:, pl.ds(half * wg_k, wg_k)]
                        if blocksize <= wg_k:
                            s_wg = s_wg.at[pl.ds(half * (wg_k // blocksize), wg_k // blocksize)]
                    if not nest:
                        s_wg = s_wg.at[:, wg_rows]

                    def step():
                        w = load_tile(plgpu, w_smem, wg_rows, plgpu.Layout.WGMMA_UPCAST_4X)
                        a = decode(w, s_wg, codes)
                        plgpu.wgmma(acc, a, x_smem.T)
                        # wait(0): wait(1) with slots released a step late (decode of step
                        # k + 1 under this warpgroup's own MMA k) gives NaN and wrong values
                        # past 32 tokens: the A registers are reused while the MMA reads them
                        plgpu.wgmma_wait(0)

                    if uneven:  # the moved-back window's steps the split before took
                        pl.when(kk >= skipped)(step)
                    else:
                        step()
                    return acc, codes

                pipeline(body, ctx)(
                    w_gmem.at[n_sl, k_sl], x_gmem.at[m_sl, k_sl],
                    *([] if nest else [s_gmem.at[s_sl, n_sl]]), allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = sm_count()
    out_shape = (m, n) if store_t else (partials, n, m)
    f = plgpu.kernel(
        matmul_4bit_mgpu_kernel,  # the name Nsight Compute shows
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=2 * cfg.k_wgs + 1,  # the compute warpgroups and the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            out_smem=plgpu.SMEM((2 * cfg.k_wgs, slots, *slot_tile), out_dtype,
                                transforms=out_transforms),
            **({"scale_smem": plgpu.SMEM((2, split_cols, rows), jnp.float32)} if nest else {}),
        ),
    )
    with compute_registers_held(FOUR_WG_REGISTERS if cfg.k_wgs == 2 else None):
        return f(x, w4, scales, code, *(nest or ()))


def supports(m, n, k, blocksize):
    """Shapes the default config takes (N a multiple of 128, K of 64, blocksize >= 64)."""
    return (supports_4bit(m, n, k, blocksize) and m >= 1
            and shape_problem(m, n, k, blocksize, default_config(m, n, k, blocksize)) is None)


VARIANTS = (
    Variant(
        name="mgpu_decoded_wgmma", op="matmul_4bit", fn=mgpu_decoded_wgmma,
        platform="sm90", interpret=False,
        reference=matmul_4bit_reference, supports=supports, accepts_nested=True,
        description="Hopper Mosaic GPU: warp-specialized TMA pipeline, 4-bit tile decoded in "
                    "registers (per-row scaled byte-plane tables, byte permutes) as the wgmma "
                    "register operand; y.T = W . x.T",
        numerics="rounded_weight", status="default", config_type=DecodedWgmmaConfig,
        default_config=default_config),
)
