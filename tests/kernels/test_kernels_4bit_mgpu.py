"""The Mosaic GPU 4-bit kernel (`pallas_kernels.mosaic.mgpu_decoded_wgmma`).

On CPU: its two PTX programs run in a small PTX interpreter (the instructions they use, per
lane, with the quad shuffles across 4 lanes) against the plain table lookup and against
bitsandbytes' dequantized weight; the tile configs are checked over random shapes; the kernel
lowers for CUDA (Pallas -> Mosaic GPU, layout inference included); `auto` picks it where it
should. On a Hopper GPU: the compiled kernel against the reference, and bit for bit against
bitsandbytes' weight through an identity product.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jqlora import ops, quant
from jqlora.quant import tables
from pallas_kernels import registry
from pallas_kernels.mosaic.mgpu_pipeline import split_windows
from pallas_kernels.mosaic import mgpu_decoded_wgmma as mm
from pallas_kernels.mosaic import mgpu_decode as md
from pallas_kernels.mosaic import mgpu_decoded_wgmma_t as mt
from pallas_kernels.reference.fourbit import matmul_4bit_reference, matmul_4bit_t_reference
from pallas_kernels.nibble_lookup import _lop3, _prmt
from mosaic_lowering import lower_for_cuda

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ----------------------------------------------------------------------------- PTX interpreter
def _run_ptx(ptx: str, operands: dict[int, np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute `ptx` (the instruction subset the kernel emits) for a group of lanes at once:
    every operand is an array over lanes (4 lanes = one quad). Returns $0..$(n_out - 1)."""
    regs: dict[str, np.ndarray] = {f"${i}": v for i, v in operands.items()}
    lanes = next(iter(operands.values())).shape[0]

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0x"):
            return np.full(lanes, int(tok, 16), np.uint32)
        if re.fullmatch(r"\d+", tok):
            return np.full(lanes, int(tok), np.uint32)
        raise AssertionError(f"read before write: {tok}")

    def f32(a):
        return np.asarray(a, np.uint32).view(np.float32)

    def u32(a):
        return np.asarray(a, np.float32).view(np.uint32)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mul.rn.f32":
            regs[dst] = u32(f32(val(src[0])) * f32(val(src[1])))
        elif op == "add.rn.f32":
            regs[dst] = u32(f32(val(src[0])) + f32(val(src[1])))
        elif op.startswith("cvt.rn.") and op.endswith("x2.f32"):
            dt = {"bf16x2": jnp.bfloat16, "f16x2": jnp.float16}[op.split(".")[2]]
            half = lambda a: np.asarray(jnp.asarray(f32(a)).astype(dt).view(jnp.uint16),
                                        np.uint32)
            regs[dst] = (half(val(src[0])) << 16) | half(val(src[1]))
        elif op == "prmt.b32":
            regs[dst] = np.asarray(_prmt(val(src[0]), val(src[1]), val(src[2])), np.uint32)
        elif op == "lop3.b32":
            regs[dst] = np.asarray(_lop3(val(src[0]), val(src[1]), val(src[2]),
                                         int(src[3], 16)), np.uint32)
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << int(src[1])).astype(np.uint32)
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> int(src[1])
        elif op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "shfl.sync.idx.b32":
            assert src[2] == "0x1c1f" and lanes % 4 == 0, "only quad shuffles are modelled"
            j = int(src[1])
            v = val(src[0]).reshape(-1, 4)
            regs[dst] = np.repeat(v[:, j], 4)
        else:
            raise AssertionError(f"instruction not modelled: {op}")
    return [regs[f"${i}"] for i in range(n_out)]


def _tables_by_ptx(absmax: np.ndarray, code: np.ndarray, dtype) -> np.ndarray:
    """(rows,) absmax -> (rows, 8) table words, each row's table built by a quad of 4 lanes
    running `table_ptx` (lane q gets codes 4q..4q+3), as the kernel does."""
    rows = absmax.shape[0]
    lanes = np.repeat(np.asarray(absmax, np.float32), 4).view(np.uint32)
    quad = np.tile(np.arange(4), rows)
    ops_ = {8: lanes}
    for i in range(4):
        ops_[9 + i] = np.asarray(code, np.float32)[4 * quad + i].view(np.uint32)
    out = _run_ptx(md.table_ptx(dtype), ops_, 8)
    words = np.stack(out, axis=-1).reshape(rows, 4, 8)
    assert (words == words[:, :1]).all(), "the quad's lanes disagree on the table"
    return words[:, 0]


def _lookup_by_ptx(r: np.ndarray, words: np.ndarray) -> np.ndarray:
    """(L,) packed words and (L, 8) table words -> (L, 4) output words of `LOOKUP_PTX`."""
    ops_ = {4: np.asarray(r, np.uint32)}
    for i in range(8):
        ops_[5 + i] = np.asarray(words[:, i], np.uint32)
    return np.stack(_run_ptx(md.LOOKUP_PTX, ops_, 4), axis=-1)


def _expected_pairs(r, absmax, code, dtype):
    """o_b = (round(code[hi(b)] * a) in bits 0-15, round(code[lo(b)] * a) in bits 16-31)."""
    vals = np.asarray(jnp.asarray(np.asarray(code, np.float32)[None] * absmax[:, None])
                      .astype(dtype).view(jnp.uint16), np.uint32)  # (L, 16)
    out = []
    for b in range(4):
        byte = (r >> (8 * b)) & 0xFF
        hi = np.take_along_axis(vals, (byte >> 4)[:, None].astype(np.int64), 1)[:, 0]
        lo = np.take_along_axis(vals, (byte & 15)[:, None].astype(np.int64), 1)[:, 0]
        out.append(hi | (lo << 16))
    return np.stack(out, axis=-1)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@given(seed=st.integers(0, 2**31 - 1))
def test_ptx_programs_decode_every_byte(quant_type, dtype, seed):
    """The table PTX (fp32 products, one rounding, quad-shared) and the lookup PTX turn every
    packed byte into (code[hi] * absmax, code[lo] * absmax) in x's dtype: all 256 byte values
    in each of the 4 byte positions, on random scales spanning 2^-20..2^4."""
    rng = np.random.default_rng(seed)
    code = tables.code_4bit(quant_type)
    n = 256
    absmax = (2.0 ** rng.uniform(-20, 4, n)).astype(np.float32)
    words = _tables_by_ptx(absmax, code, dtype)
    np.testing.assert_array_equal(
        words, np.asarray(md.emulate_table_words(absmax, jnp.asarray(code), DTYPES[dtype])))
    perm = [rng.permutation(256) for _ in range(4)]
    r = sum(perm[b].astype(np.uint32) << (8 * b) for b in range(4)).astype(np.uint32)
    got = _lookup_by_ptx(r, words)
    np.testing.assert_array_equal(got, _expected_pairs(r, absmax, code, DTYPES[dtype]))
    emulated = np.stack([np.asarray(o) for o in jax.vmap(md.emulate_lookup_words)(
        jnp.asarray(r), jnp.asarray(words))], axis=-1)
    np.testing.assert_array_equal(emulated, got)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_decode_reproduces_bitsandbytes_weight(dtype):
    """Rows of a real quantized weight (double-quantized scales, bitsandbytes' byte order)
    through the two PTX programs word by word: bit for bit `quant.dequantize(q, dtype)`."""
    n, k = 8, 256
    w = jax.random.normal(jax.random.key(3), (n, k), jnp.float32) * 0.1
    q = quant.quantize_4bit(w, "nf4", 64, True)
    absmax = np.asarray(quant.absmax_f32(q)).reshape(n, k // 64)
    packed = np.asarray(q.packed).reshape(n, k // 2)
    words4 = packed.reshape(n, k // 8, 4).astype(np.uint32)
    r = (words4 * (1 << (8 * np.arange(4, dtype=np.uint32)))).sum(-1).astype(np.uint32)
    blk = (np.arange(k // 8) * 8) // 64  # each word of 8 codes lies in one scale block
    tab = _tables_by_ptx(absmax.reshape(-1), np.asarray(q.code), dtype).reshape(n, k // 64, 8)
    got = _lookup_by_ptx(r.reshape(-1), tab[:, blk].reshape(-1, 8)).reshape(n, k // 8, 4)
    halves = np.stack([got & 0xFFFF, got >> 16], axis=-1).reshape(n, k).astype(np.uint16)
    want = np.asarray(quant.dequantize(q, DTYPES[dtype]).view(jnp.uint16))
    np.testing.assert_array_equal(halves, want)


@pytest.mark.parametrize("k,k_splits", [(3072, 1), (3072, 3), (14336, 4), (256, 2)])
def test_scale_denester_gives_bitsandbytes_scales(k, k_splits):
    """`scale_denester` as the kernel runs it: per warpgroup (64 rows) and K split, thread t
    takes elements t + 128 i of the (64, split columns) window, looks up nested_code[code] and
    the nested absmax of group (window offset + r * cols + c) // 256, and runs `DENEST_PTX`:
    bit for bit bitsandbytes' fp32 scales, laid out (split columns, rows); also where groups
    of 256 scales straddle rows (K / 64 = 48, 224) and splits (56 columns a split)."""
    n, bs, rows = 256, 64, 64
    w = jax.random.normal(jax.random.key(k + k_splits), (n, k), jnp.float32) * 0.05
    q = quant.quantize_4bit(w, "nf4", bs, True)
    cols = k // bs
    per = cols // k_splits
    codes = np.asarray(q.absmax).reshape(n, cols)
    nabs, ncode = np.asarray(q.nested_absmax), np.asarray(q.nested_code)
    offset = np.full(128, np.float32(q.offset)).view(np.uint32)
    got = np.zeros((n, cols), np.float32)
    tid = np.arange(128)
    for row0 in range(0, n, rows):
        for split in range(k_splits):
            first = row0 * cols + split * per  # the window's memref offset
            dst = np.zeros((per, rows), np.float32)
            for i in range(rows * per // 128):
                e = tid + 128 * i
                r, c = e // per, e % per
                code = codes[row0 + r, split * per + c]
                group = (first + r * cols + c) // 256
                ops_ = {1: ncode[code].view(np.uint32), 2: nabs[group].view(np.uint32), 3: offset}
                dst[c, r] = _run_ptx(md.DENEST_PTX, ops_, 1)[0].view(np.float32)
            got[row0:row0 + rows, split * per:(split + 1) * per] = dst.T
    want = np.asarray(quant.absmax_f32(q)).reshape(n, cols)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_scales_denested_in_kernel_where_it_paid():
    """The kernel de-nests where each thread gets whole scales, at most 8 of them (where it
    measured faster than XLA de-nesting first, s16), and the two warpgroups' fp32 scales of a K
    split fit in shared memory beside the pipeline; elsewhere XLA de-nests."""
    dc = mm.default_config
    for m in (1, 16, 128):  # the protocol's shapes at small M: 4096 x 4096 only (4 K splits)
        assert mm.denests_in_kernel(4096, 4096, 64, dc(m, 4096, 4096, 64)), m
        for n, k in ((14336, 4096), (4096, 14336)):  # 32 and 28 scales a thread: slower
            assert not mm.denests_in_kernel(n, k, 64, dc(m, n, k, 64)), (m, n, k)
    assert mm.denests_in_kernel(256, 1024, 64, mm.DecodedWgmmaConfig(tile_m=16, tile_k=128))
    assert not mm.denests_in_kernel(256, 64, 64, mm.DecodedWgmmaConfig(tile_m=16, tile_k=64))  # 1 col: 64
    assert not mm.denests_in_kernel(256, 1024, 64, mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_wgs=2))
    # the de-nested scales (2 warpgroups x split columns x 64 rows, fp32) replace the
    # pipeline's scale tiles in the shared-memory count
    cfg = mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_splits=4)
    assert (mm.smem_bytes(cfg, 64, denest_k=4096) - mm.smem_bytes(cfg, 64)
            == 2 * 16 * 64 * 4 - 4 * 2 * 128 * 4)


# ----------------------------------------------------------------------------- configs
@given(m=st.integers(1, 4096), n128=st.integers(1, 160), k64=st.integers(1, 400),
       log_bs=st.integers(6, 12))
def test_default_config_takes_every_aligned_shape(m, n128, k64, log_bs):
    """Every shape with N a multiple of 128, K of 64 and blocksize >= 64 is taken, with a token
    tile that holds small M and splits within one wave (that `shape_problem` accepts the
    default: tests/kernels/test_variants.py, for every variant)."""
    n, k, bs = 128 * n128, 64 * k64, 1 << log_bs
    if k % bs:
        return
    cfg = mm.default_config(m, n, k, bs)
    assert mm.supports(m, n, k, bs)
    assert cfg.tile_m in (16, 32, 64, 128, 256)
    assert mm.smem_bytes(cfg, bs) <= mm.SMEM_LIMIT
    assert cfg.tile_m >= m or m > 64  # small M: one token tile holds all rows
    tiles = -(-m // cfg.tile_m) * (n // 128)
    assert cfg.k_splits == 1 or tiles * cfg.k_splits <= mm.SMS
    assert cfg.k_wgs == 1  # four compute warpgroups have not run on a GPU yet


def test_default_config_follows_the_measured_choices():
    """The configs measured fastest (`default_config`; evidence: docs/kernels.md)."""
    c = mm.default_config
    assert c(16, 4096, 4096, 64) == mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_splits=4)
    assert c(64, 4096, 14336, 64) == mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=4)
    assert c(128, 14336, 4096, 64) == mm.DecodedWgmmaConfig(tile_m=128, tile_k=128, k_splits=1)
    assert c(256, 4096, 4096, 64) == mm.DecodedWgmmaConfig(tile_m=128, tile_k=128, k_splits=2,
                                                           max_concurrent_steps=3)  # fp32 epilogue slots
    assert c(256, 14336, 4096, 64) == mm.DecodedWgmmaConfig(tile_m=256, tile_k=64, k_splits=1)
    assert c(1024, 4096, 4096, 64) == mm.DecodedWgmmaConfig(tile_m=256, tile_k=64, k_splits=1)
    # K = 11008 (86 steps of 128): 4 splits need not divide them (22-step windows, 128 CTAs;
    # dividing splits would leave 2, and 64 CTAs)
    assert c(64, 4096, 11008, 64) == mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=4)
    assert split_windows(86, 4)[-1] == (64, 66, 86)
    assert "without a step of its own" in mm.shape_problem(16, 256, 768, 64,
                                                            mm.DecodedWgmmaConfig(tile_m=16, k_splits=5))
    assert "whole scale blocks" in mm.shape_problem(16, 256, 1280, 256,
                                                     mm.DecodedWgmmaConfig(tile_m=16, k_splits=2))


def test_unsupported_shapes_and_configs_get_clear_errors():
    """The kernel's own limits (operands, interpret mode and x's dtype: test_variants.py)."""
    assert not mm.supports(16, 100, 4096, 64)  # N not a multiple of 128
    assert not mm.supports(16, 128, 4096, 32)  # blocksize 32
    assert mm.shape_problem(16, 128, 4096, 64, mm.DecodedWgmmaConfig(tile_m=12)) is not None
    assert "k_wgs must be 1 or 2" in mm.shape_problem(16, 128, 4096, 64, mm.DecodedWgmmaConfig(k_wgs=3))
    assert "tile_m <= 64" in mm.shape_problem(128, 128, 4096, 64,
                                                mm.DecodedWgmmaConfig(tile_m=128, tile_k=128, k_wgs=2))
    assert "groups of 64 columns" in mm.shape_problem(16, 128, 4096, 64,
                                                       mm.DecodedWgmmaConfig(tile_m=16, tile_k=64, k_wgs=2))
    w = jax.random.normal(jax.random.key(0), (128, 256)) * 0.1
    q = quant.quantize_4bit(w, "nf4", 64, False)
    args = (q.packed.reshape(128, 128), q.absmax.reshape(128, 4), q.code)
    with pytest.raises(ValueError, match="N .100. must be a multiple of 128"):
        mm.mgpu_decoded_wgmma(jnp.ones((4, 256), jnp.bfloat16), args[0][:100], args[1][:100],
                              args[2], blocksize=64)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        mm.mgpu_decoded_wgmma(jnp.ones((4, 256), jnp.bfloat16), *args, blocksize=64,
                              config=mm.DecodedWgmmaConfig(tile_m=256, tile_k=128))


# ----------------------------------------------------------------------------- lowering, plan
def _lower(m, n, k, bs, cfg, dtype=jnp.bfloat16, nested=True):
    return lower_for_cuda(mm.mgpu_decoded_wgmma, m, n, k, bs, dtype, nested, config=cfg)


@pytest.mark.parametrize("m,n,k,bs,cfg,dtype,nested", [
    (16, 256, 1024, 64, mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_splits=4), jnp.bfloat16, True),
    (200, 256, 1024, 128, mm.DecodedWgmmaConfig(tile_m=128, tile_k=128, k_splits=2, max_concurrent_steps=3),
     jnp.float16, False),
    (256, 256, 512, 256, mm.DecodedWgmmaConfig(tile_m=256, tile_k=64), jnp.bfloat16, True),
    (64, 256, 512, 64, mm.DecodedWgmmaConfig(tile_m=64, wg_rows=128), jnp.bfloat16, True),
    (16, 256, 1024, 64, mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_splits=2, k_wgs=2), jnp.bfloat16,
     True),
    (32, 256, 1280, 64, mm.DecodedWgmmaConfig(tile_m=32, tile_k=128, k_splits=3), jnp.bfloat16, True),
    (64, 256, 1792, 256, mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=4), jnp.float16, False),
    (40, 256, 1024, 128, mm.DecodedWgmmaConfig(tile_m=64, tile_k=256, k_wgs=2, max_concurrent_steps=3),
     jnp.float16, False),
])
def test_kernel_lowers_for_cuda(m, n, k, bs, cfg, dtype, nested):
    """Pallas -> Mosaic GPU on a machine without a GPU: the pipeline, the layouts Mosaic infers
    around the decode, and the decode's register program are all built here."""
    text = _lower(m, n, k, bs, cfg, dtype, nested)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("k_wgs,compute", [(1, 232), (2, mm.FOUR_WG_REGISTERS)])
def test_compute_warpgroup_registers_fit_the_register_file(k_wgs, compute):
    """The `setmaxnreg` counts in the lowered kernel: memory warpgroup down to 40, compute
    warpgroups up to a count the launch allocation can grant (threads x launch registers,
    65536 / threads rounded down to 8): jax's own 112 for four compute warpgroups cannot be."""
    from ir_fingerprint import captured_mosaic_modules

    cfg = mm.DecodedWgmmaConfig(tile_m=16, tile_k=128, k_wgs=k_wgs)
    with captured_mosaic_modules() as texts:
        _lower(16, 256, 1024, 64, cfg)
    def counts(action):  # jax 0.10: an nvvm op; jax 0.11: inline PTX
        pattern = rf"nvvm\.setmaxregister {action} (\d+)|setmaxnreg\.{action[:3]}\.\S+ (\d+);"
        return sorted({int(a or b) for t in texts for a, b in re.findall(pattern, t)})

    assert (counts("increase"), counts("decrease")) == ([compute], [40])
    # the block launches every warpgroup the pipeline waits for (k_wgs = 2 with 3 warpgroups,
    # 384 threads, hangs the GPU: barriers count arrivals of 4 compute warpgroups)
    launched = {int(t) for text in texts
                for t in re.findall(r"threads\([^)]*\) in \(%\w+ = %c(\d+)", text)}
    threads = 128 * (1 + 2 * k_wgs)
    assert launched == {threads}
    launch = (65536 // threads) // 8 * 8
    assert 128 * 40 + 128 * 2 * k_wgs * compute <= threads * launch
    assert compute >= launch  # an increase (or none), never a decrease


def test_mosaic_module_fingerprints():
    """tests/support/ir_fingerprint covers the Mosaic kernels: one module per call, stable across
    lowerings, different for another config (how a refactor is shown not to change them)."""
    from ir_fingerprint import fingerprints, fingerprints_t

    one = fingerprints(mm.mgpu_decoded_wgmma, 128, dict(config=mm.DecodedWgmmaConfig(tile_m=128)))
    assert len(one) == 2 and one[0] != one[1]  # scales de-nested by the kernel / fp32 scales
    assert fingerprints(mm.mgpu_decoded_wgmma, 128, dict(config=mm.DecodedWgmmaConfig(tile_m=128))) == one
    other = fingerprints(mm.mgpu_decoded_wgmma, 128, dict(config=mm.DecodedWgmmaConfig(tile_m=64)))
    assert set(other).isdisjoint(one)
    assert len(fingerprints_t(mt.mgpu_decoded_wgmma_t, 128, {})) == 1


def test_auto_picks_the_mosaic_kernel_on_hopper(monkeypatch):
    from jqlora.ops import dispatch

    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "mgpu_available", lambda: True)
    w = jax.random.normal(jax.random.key(0), (256, 512)) * 0.1
    q = quant.quantize_4bit(w, "nf4", 64, True)
    plan = lambda m, dtype="bfloat16": dispatch.choose_plan(q, m, "auto", dtype=dtype)
    assert plan(1, "float32").fwd == "gemv_block_scaled"  # the Hopper kernels take 16-bit x
    for m in (1, 2, 3, 16, 17, 32, 48):  # the pair-table MMA kernel up to six n8 token tiles
        assert plan(m) == dispatch.Plan("pallas", "mgpu_mma_pair_table", "mgpu_decoded_wgmma_t")
    assert plan(2, "float32").fwd == "gemv_block_scaled"
    for m in (49, 64, 65, 128):
        assert plan(m) == dispatch.Plan("pallas", "mgpu_decoded_wgmma", "mgpu_decoded_wgmma_t")
        assert plan(m, "float16").fwd == "mgpu_decoded_wgmma"
    for m in (129, 1024):
        assert plan(m) == dispatch.Plan("pallas", "mgpu_decoded_wgmma", "dequant_dot_t")
    assert plan(1025) == dispatch.Plan("pallas", "dequant_dot", "dequant_dot_t")
    assert plan(16, "float32") == dispatch.Plan("pallas", "block_scaled_dot_prmt",
                                                "dequant_dot_t")  # 16-bit operands only
    assert plan(16, None).fwd == "block_scaled_dot_prmt"
    q100 = quant.quantize_4bit(w[:100], "nf4", 64, True)  # N not a multiple of 128
    assert dispatch.choose_plan(q100, 16, "auto", dtype="bfloat16").fwd == "block_scaled_dot_prmt"
    q128 = quant.quantize_4bit(w[:128], "nf4", 64, True)  # N a multiple of 128, not of 256
    assert dispatch.choose_plan(q128, 16, "auto", dtype="bfloat16").fwd == "mgpu_decoded_wgmma"
    assert dispatch.choose_plan(q128, 2, "auto", dtype="bfloat16").fwd == "gemv_block_scaled"
    monkeypatch.setattr(dispatch, "mgpu_available", lambda: False)
    assert plan(128) == dispatch.Plan("pallas", "dequant_dot", "dequant_dot_t")
    with pytest.raises(dispatch.BackendError, match="Hopper GPU only"):
        dispatch.choose_plan(q, 128, "pallas", variant="mgpu_decoded_wgmma", dtype="bfloat16")
    with pytest.raises(dispatch.BackendError, match="Hopper GPU only"):
        ops.qmatmul(jnp.ones((4, 512), jnp.bfloat16), q, backend="interpret",
                    variant="mgpu_decoded_wgmma")


# ----------------------------------------------------------------------------- on a Hopper GPU
gpu = pytest.mark.skipif(not registry.platform_available("sm90"), reason="needs a Hopper GPU and Mosaic GPU")


def _quantized(n, k, bs, quant_type="nf4", nested=True, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32) * 0.05
    q = quant.quantize_4bit(w, quant_type, bs, nested)
    nest = (q.nested_absmax, q.nested_code, q.offset) if nested else None
    return q, (q.packed.reshape(n, k // 2), q.absmax.reshape(n, k // bs), q.code), nest


@gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("cfg,k", [(None, 256), (mm.DecodedWgmmaConfig(tile_m=128, k_splits=2), 256),
                                   (mm.DecodedWgmmaConfig(tile_m=256, tile_k=128, max_concurrent_steps=2),
                                    256),
                                   (mm.DecodedWgmmaConfig(tile_m=128, tile_k=128, k_splits=3,
                                                          max_concurrent_steps=3), 1280)])
def test_identity_product_gives_bitsandbytes_weight(dtype, cfg, k):
    """x = I: each output is one product 1 * w, exact in fp32, so y.T must equal bitsandbytes'
    dequantized weight bit for bit (decode, scales, layouts and the transposed store). K =
    1280 in 3 splits: windows of 4 steps, the last moved back over 2 steps it must skip (a
    step summed twice would double those columns)."""
    n = 256
    q, args, nest = _quantized(n, k, 64)
    eye = jnp.eye(k, dtype=DTYPES[dtype])
    y = mm.mgpu_decoded_wgmma(eye, *args, blocksize=64, nested=nest, config=cfg)
    np.testing.assert_array_equal(np.asarray(y.T.view(jnp.uint16)),
                                  np.asarray(quant.dequantize(q, DTYPES[dtype]).view(jnp.uint16)))


@gpu
@pytest.mark.parametrize("n,k,cfg", [
    (256, 3072, mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=3)),
    (128, 14336, mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=14)),
    (256, 4096, mm.DecodedWgmmaConfig(tile_m=128, tile_k=64, k_splits=4)),
    (256, 1792, mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=4)),  # uneven: 14 steps, windows of 4
])
def test_identity_product_with_scales_denested_in_kernel(n, k, cfg):
    """As above on shapes where groups of 256 scales straddle rows (K / 64 = 48, 224), with K
    splits, and with one scale column a step: the kernel's own de-nesting, bit for bit."""
    assert mm.denests_in_kernel(n, k, 64, cfg)
    q, args, nest = _quantized(n, k, 64, seed=5)
    y = mm.mgpu_decoded_wgmma(jnp.eye(k, dtype=jnp.bfloat16), *args, blocksize=64, nested=nest,
                              config=cfg)
    np.testing.assert_array_equal(np.asarray(y.T.view(jnp.uint16)),
                                  np.asarray(quant.dequantize(q, jnp.bfloat16).view(jnp.uint16)))


@gpu
@pytest.mark.parametrize("m,n,k,bs,quant_type,nested,dtype", [
    (1, 256, 512, 64, "nf4", True, "bfloat16"),
    (16, 512, 1024, 64, "nf4", True, "bfloat16"),
    (200, 256, 1024, 128, "fp4", False, "float16"),
    (300, 384, 2048, 256, "nf4", True, "bfloat16"),
    (1024, 256, 512, 64, "nf4", True, "float16"),
    (64, 512, 1792, 256, "nf4", False, "bfloat16"),  # 4 uneven splits, blocks of 2 steps
    (128, 4096, 11008, 64, "nf4", True, "bfloat16"),  # Llama-2-7B down: 4 uneven splits
])
def test_matches_reference(m, n, k, bs, quant_type, nested, dtype):
    q, args, nest = _quantized(n, k, bs, quant_type, nested, seed=m)
    x = jax.random.normal(jax.random.key(m + 1), (m, k), jnp.float32).astype(DTYPES[dtype])
    cfg = mm.DecodedWgmmaConfig(tile_m=64, tile_k=128, k_splits=4) if (n, k) == (512, 1792) else None
    y = mm.mgpu_decoded_wgmma(x, *args, blocksize=bs, nested=nest, config=cfg)
    assert y.shape == (m, n) and y.dtype == DTYPES[dtype]
    absmax = quant.absmax_f32(q).reshape(n, k // bs)
    ref = matmul_4bit_reference(x.astype(jnp.float32), args[0], absmax, args[2], blocksize=bs)
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < (4e-3 if dtype == "bfloat16" else 1e-3), err


@gpu
def test_qmatmul_auto_runs_them_forward_and_backward():
    """M = 128 rows (3-D x): `auto` runs both Mosaic kernels; y and dx as the jnp path's."""
    q, _, _ = _quantized(512, 1024, 64)
    x = jax.random.normal(jax.random.key(9), (2, 64, 1024), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(10), (2, 64, 512), jnp.bfloat16)
    from jqlora.ops import dispatch
    assert dispatch.choose_plan(q, 128, "auto", dtype="bfloat16").bwd == "mgpu_decoded_wgmma_t"
    y, pull = jax.vjp(lambda x: ops.qmatmul(x, q), x)
    y_ref, pull_ref = jax.vjp(lambda x: ops.qmatmul(x, q, backend="xla"), x)
    for got, ref in ((y, y_ref), (pull(dy)[0], pull_ref(dy)[0])):
        assert got.shape == ref.shape
        err = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32)))
        assert err < 1e-2, err


# ----------------------------------------------------------------------------- backward kernel
@given(m=st.integers(1, 4096), n64=st.integers(1, 300), k64=st.integers(1, 300))
def test_backward_default_config_is_valid(m, n64, k64):
    n, k = 64 * n64, 64 * k64
    cfg = mt.default_config(m, n, k, 64)
    assert mt.shape_problem(m, n, k, 64, cfg) is None
    assert cfg.n_splits == 1 or -(-m // cfg.tile_m) * (k // 64) * cfg.n_splits <= 2 * mm.SMS
    assert (cfg.tile_n == 128) == ((n // cfg.n_splits) % 128 == 0)


@pytest.mark.parametrize("m,n,k,bs,cfg", [
    (16, 512, 256, 64, mt.DecodedWgmmaTConfig(tile_m=64, n_splits=2)),
    (200, 256, 512, 128, mt.DecodedWgmmaTConfig(tile_m=128, tile_n=128)),
    (256, 256, 512, 256, mt.DecodedWgmmaTConfig(tile_m=256)),
])
def test_backward_kernel_lowers_for_cuda(m, n, k, bs, cfg):
    w = jax.ShapeDtypeStruct((n, k), jnp.float32)
    q = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", bs, False), w)
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    f = lambda dy, q: mt.mgpu_decoded_wgmma_t(dy, q.packed.reshape(n, k // 2),
                                              q.absmax.reshape(n, k // bs), q.code, blocksize=bs,
                                              config=cfg)
    assert "mosaic_gpu" in jax.jit(f).trace(dy, q).lower(lowering_platforms=("cuda",)).as_text()


def test_backward_bad_configs_get_clear_errors():
    """The kernel's own limits (operands, dtypes and empty batches: test_variants.py)."""
    w = jax.random.normal(jax.random.key(0), (128, 256)) * 0.1
    q = quant.quantize_4bit(w, "nf4", 64, False)
    args = (q.packed.reshape(128, 128), q.absmax.reshape(128, 4), q.code)
    with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
        mt.mgpu_decoded_wgmma_t(jnp.ones((4, 128), jnp.bfloat16), *args, blocksize=64,
                                config=mt.DecodedWgmmaTConfig(tile_n=32))


@gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("cfg", [None, mt.DecodedWgmmaTConfig(tile_n=128), mt.DecodedWgmmaTConfig(n_splits=2)])
def test_backward_identity_gives_bitsandbytes_weight(dtype, cfg):
    """dy = I: dx = dequant(W), bit for bit bitsandbytes' weight (one product per output)."""
    n, k = 256, 512
    q, _, _ = _quantized(n, k, 64)
    absmax = quant.absmax_f32(q).reshape(n, k // 64)
    dx = mt.mgpu_decoded_wgmma_t(jnp.eye(n, dtype=DTYPES[dtype]), q.packed.reshape(n, k // 2),
                                 absmax, q.code, blocksize=64, config=cfg)
    np.testing.assert_array_equal(np.asarray(dx.view(jnp.uint16)),
                                  np.asarray(quant.dequantize(q, DTYPES[dtype]).view(jnp.uint16)))


@gpu
@pytest.mark.parametrize("m,n,k,bs", [(1, 256, 512, 64), (100, 512, 256, 128), (300, 256, 1024, 64)])
def test_backward_matches_reference(m, n, k, bs):
    q, _, _ = _quantized(n, k, bs, seed=m)
    absmax = quant.absmax_f32(q).reshape(n, k // bs)
    dy = jax.random.normal(jax.random.key(m), (m, n), jnp.float32).astype(jnp.bfloat16)
    dx = mt.mgpu_decoded_wgmma_t(dy, q.packed.reshape(n, k // 2), absmax, q.code, blocksize=bs)
    ref = matmul_4bit_t_reference(dy.astype(jnp.float32), q.packed.reshape(n, k // 2), absmax,
                                  q.code, blocksize=bs)
    assert dx.shape == (m, k)
    err = float(jnp.linalg.norm(dx.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < 4e-3, err
