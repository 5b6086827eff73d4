"""The Hopper pair-table MMA kernel (`pallas_kernels.mosaic.mgpu_mma_pair_table`).

On CPU: the lookup program runs in the GEMV tests' PTX interpreter against the A fragments the
MMA needs; the permuted K order of the A and B fragments is one permutation of each group's
columns; `emulate` and the jnp reference agree, and both differ from the exact-code product by
the rounding of the codes only; configs and errors; the kernel lowers for CUDA (jax 0.10 and
0.11). On a Hopper GPU: the compiled kernel against `emulate` and the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora.quant import tables
from pallas_kernels import registry
from pallas_kernels.mosaic import mgpu_mma_pair_table as mm
from pallas_kernels.mosaic import mgpu_mma_layout as ml
from pallas_kernels.mosaic import mgpu_mma_pieces as mp_pieces
from pallas_kernels.mosaic import mgpu_pipeline as mp
from pallas_kernels.reference.fourbit import matmul_4bit_gemv_reference
from mosaic_lowering import lower_for_cuda
from test_kernels_4bit_mgpu_gemv import _problem, _run


def _table_bytes(code, dtype, base: int) -> np.ndarray:
    """Shared memory with build_table's words at `base`: entry b of lane l at 256 b + 4 l,
    (code[b >> 4] in the low half, code[b & 15] in the high half) in dtype."""
    c16 = np.asarray(jnp.asarray(code, jnp.float32).astype(dtype).view(jnp.uint16), np.uint32)
    words = np.zeros(mm.TABLE_BYTES // 4, np.uint32)
    b, lane = np.meshgrid(np.arange(256), np.arange(32), indexing="ij")
    words[(256 * b + 4 * lane) // 4] = c16[b >> 4] | (c16[b & 15] << 16)
    return np.concatenate([np.zeros(base, np.uint8), words.view(np.uint8)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lookup_program_builds_the_a_fragments(dtype):
    """lookup_ptx on random bytes of rows g and g + 8: register 4 s + i of step s holds the
    codes of byte 2 s (i = 0: row g, 1: row g + 8) or 2 s + 1 (i = 2, 3), high nibble (the even
    column) in the low half, each lane reading its own copy of the table."""
    code = tables.code_4bit("nf4")
    rng = np.random.default_rng(7)
    lanes, base = 64, 3072
    rows = rng.integers(0, 256, (lanes, 2, 8), dtype=np.uint8)  # (lane, row g / g + 8, byte)
    words = rows.view(np.uint32)  # (lane, 2, 2)
    ops_ = {16: words[:, 0, 0], 17: words[:, 0, 1], 18: words[:, 1, 0], 19: words[:, 1, 1],
            20: (base + 4 * (np.arange(lanes) % 32)).astype(np.uint32)}
    got = _run(mp_pieces.lookup_ptx(), ops_, list(range(16)), _table_bytes(code, dtype, base))
    c16 = np.asarray(jnp.asarray(code, jnp.float32).astype(dtype).view(jnp.uint16), np.uint32)
    for s in range(4):
        for i, (row, byte) in enumerate(((0, 2 * s), (1, 2 * s), (0, 2 * s + 1), (1, 2 * s + 1))):
            b = rows[:, row, byte].astype(np.uint32)
            np.testing.assert_array_equal(got[4 * s + i], c16[b >> 4] | (c16[b & 15] << 16))


def test_mma_order_is_a_permutation_of_each_group():
    """The A fragment's bytes and the B fragment's x columns name the same weight columns, and
    the four lanes' four k16 steps cover the 64 columns of a group once each."""
    cols = [c for s in range(4) for t in range(4) for c in mm.mma_columns(t, s)]
    assert sorted(cols) == list(range(mm.GROUP))
    for t in range(4):
        for s in range(4):
            a0, a2 = 8 * t + 2 * s, 8 * t + 2 * s + 1  # the lane's bytes of step s
            assert mm.mma_columns(t, s) == (2 * a0, 2 * a0 + 1, 2 * a2, 2 * a2 + 1)
            x_words = (2 * s, 2 * s + 1)  # of the 8 words at x columns 16 t .. 16 t + 15
            assert [16 * t + 2 * w + e for w in x_words for e in (0, 1)] == list(
                mm.mma_columns(t, s))


def _wavefronts(addresses, width: int) -> int:
    """Shared-memory wavefronts of loads of `width` bytes at these lane addresses (one warp
    instruction): lanes go in groups of 128 / width (what one wavefront can serve), and a
    group takes as many wavefronts as the most distinct 4-byte words any bank must give."""
    total = 0
    for group in np.asarray(addresses).reshape(-1, 128 // width):
        words = {w for a in group for w in range(a // 4, (a + width) // 4)}
        per_bank = np.bincount([w % 32 for w in words], minlength=32)
        total += int(per_bank.max())
    return total


@pytest.mark.parametrize("cfg", [mm.MmaPairTableConfig(), mm.MmaPairTableConfig(swizzle=False),
                                 mm.MmaPairTableConfig(compute_wgs=4),
                                 mm.MmaPairTableConfig(tile_k=512, swizzle=False),
                                 mm.MmaPairTableConfig(tile_k=512, wg_reduce=True),
                                 mm.MmaPairTableConfig(tile_k=1024, swizzle=False)])
def test_weight_loads_find_their_bytes(cfg):
    """Each of a lane's 8-byte weight loads reads, byte for byte, where TMA put the tile
    bytes it needs (swizzled or not), for every warp of the warpgroup."""
    place = ml.swizzle_128 if cfg.swizzle else (lambda a: np.asarray(a))
    for warp in range(4):
        phys, logical = ml.weight_load_offsets(cfg, warp)
        for j in range(8):
            np.testing.assert_array_equal(place(logical + j), phys + j)


def test_swizzled_weight_loads_are_conflict_free():
    """With the swizzle and the row order rho(g), every 8-byte weight load of a warp takes the
    ideal 2 wavefronts; the plain layout takes 8 (4-way conflicts, as Nsight Compute counts
    them on the GPU)."""
    for swizzle, wgs, tile_k, want in ((True, 2, 256, 2), (False, 2, 256, 8), (True, 4, 256, 2),
                                       (False, 4, 256, 8), (True, 2, 512, 2),
                                       (False, 2, 512, 8)):
        cfg = mm.MmaPairTableConfig(swizzle=swizzle, compute_wgs=wgs, tile_k=tile_k)
        phys, _ = ml.weight_load_offsets(cfg, warp=1)
        counts = {_wavefronts(a, 8) for a in phys.reshape(-1, 32)}
        assert counts == {want}, (swizzle, wgs, tile_k, counts)
    assert sorted(ml.tile_row(g, True) for g in range(8)) == list(range(8))


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, mm.MAX_M), x_swap=st.booleans(), tile_k=st.sampled_from([256, 512]))
def test_x_loads(m, x_swap, tile_k):
    """The two 16-byte x loads of a lane read its 32 bytes (the selects take words 0..3 from
    the load at the piece's start), and with x_swap each load takes the ideal 4 wavefronts
    where the plain order takes up to 8 (2-way conflicts between a quarter-warp's two
    tokens)."""
    cfg = mm.MmaPairTableConfig(tile_k=tile_k, swizzle=tile_k == 256, x_swap=x_swap)
    first, second, lo, hi = ml.x_load_offsets(cfg, m)
    odd = (np.arange(32) // 4) % 2 == 1
    if not x_swap:
        odd = np.zeros(32, bool)
    np.testing.assert_array_equal(np.where(odd, second, first), lo)
    np.testing.assert_array_equal(np.where(odd, first, second), hi)
    counts = {_wavefronts(a, 16) for a in np.concatenate([first, second]).reshape(-1, 32)}
    if x_swap or m == 1:
        assert counts == {4}, counts
    elif m % 8 == 0:  # every quarter-warp of every n8 tile holds two tokens
        assert counts == {8}, counts
    else:  # the lanes past x's last row read it again (broadcasts)
        assert max(counts) > 4, counts


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, mm.MAX_M), n256=st.integers(1, 2), k256=st.integers(1, 7),
       log_bs=st.integers(6, 8), splits=st.sampled_from([1, 2, 3]), seed=st.integers(0, 99),
       f16=st.booleans())
def test_emulation_matches_the_references(m, n256, k256, log_bs, splits, seed, f16):
    """`emulate` (float64 group sums) equals the jnp reference up to f32 rounding, and both are
    the exact-code product up to the rounding of the codes to x's dtype; with K splits that do
    or do not divide the steps."""
    n, k, bs = 256 * n256, 256 * k256, 2 ** log_bs
    if k % bs:
        return
    if mp.uneven_splits_problem(k256, splits):
        splits = 1
    dtype = jnp.float16 if f16 else jnp.bfloat16
    q, x, packed, absmax = _problem(m, n, k, bs, seed=seed, x_dtype=dtype)
    got = mm.emulate(x, packed, absmax, q.code, blocksize=bs, cfg=mm.MmaPairTableConfig(k_splits=splits))
    ref = np.asarray(mm.matmul_4bit_mma_reference(x, packed, absmax, q.code, blocksize=bs,
                                                  out_dtype=jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(np.abs(ref).max()))
    exact = np.asarray(matmul_4bit_gemv_reference(x, packed, absmax, q.code, blocksize=bs,
                                                  out_dtype=jnp.float32))
    rel = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert rel < (4e-3 if dtype == jnp.bfloat16 else 5e-4), rel
    assert rel > 0  # the codes are rounded: a mutation that used exact codes would not be seen


@given(m=st.integers(1, mm.MAX_M + 4), n32=st.integers(1, 640), k32=st.integers(1, 640),
       log_bs=st.integers(5, 12))
def test_supports_follows_its_rule(m, n32, k32, log_bs):
    """The shape rule, and of those shapes the ones whose default grid gives a quarter of the
    SMs a CTA or has fewer steps than SMs (`grid_fills`)."""
    n, k, bs = 32 * n32, 32 * k32, 2 ** log_bs
    shape_ok = m <= mm.MAX_M and n % 256 == 0 and k % 256 == 0 and bs >= 64 and k % bs == 0
    if not shape_ok:
        assert not mm.supports(m, n, k, bs)
        return
    cfg = mm.default_config(m, n, k, bs)
    tiles, steps = n // cfg.cta_rows, k // cfg.tile_k
    assert mm.supports(m, n, k, bs) == (tiles * cfg.k_splits >= mm.SMS / 4
                                        or tiles * steps < mm.SMS)


def test_prime_step_counts_get_uneven_splits_and_the_gemv_declines_them():
    """Llama-2-7B's down projection (K = 11008: 43 steps, prime) would run as 16 CTAs with one
    K split. The MMA kernel splits it unevenly (8 windows of 6 steps, 128 CTAs; the last window
    moved back over 5 steps the split before took); the GEMV, whose splits must divide the
    steps, declines it (`grid_fills`; `auto` then takes the Triton GEMV at M <= 2 where the
    MMA kernel cannot run). Both keep the transpose and the protocol shapes."""
    from pallas_kernels.mosaic import mgpu_gemv_pair_table as mg
    for m in (1, 2, 16):
        cfg = mm.default_config(m, 4096, 11008, 64)
        assert (cfg.tile_k, cfg.k_splits) == (256, 8)
        assert mp.split_windows(43, 8)[-2:] == [(36, 36, 42), (37, 42, 43)]
        assert mm.supports(m, 4096, 11008, 64) and mm.supports(m, 11008, 4096, 64)
    for m in (1, 2):
        assert not mg.supports(m, 4096, 11008, 64) and mg.supports(m, 11008, 4096, 64)
    qwen = mm.default_config(1, 3584, 18944, 64)  # Qwen2.5-7B's down projection: 74 steps
    assert (qwen.k_splits, (3584 // qwen.cta_rows) * qwen.k_splits) == (9, 126)
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (256, 512)):
        assert mm.supports(1, n, k, 64) and mg.supports(1, n, k, 64)


@given(k_iters=st.integers(1, 200), k_splits=st.integers(1, 200))
def test_split_windows_cover_each_step_once(k_iters, k_splits):
    """Every step is owned by exactly one split, each split owns at least one, and each window
    is `split_steps` long, inside K, and holds its split's own steps; only the last window
    can start before its own steps."""
    problem = mp.uneven_splits_problem(k_iters, k_splits)
    p = mp.split_steps(k_iters, k_splits)
    assert (problem is None) == (k_splits <= k_iters and -(-k_iters // p) == k_splits)
    if problem:
        return
    windows = mp.split_windows(k_iters, k_splits)
    owned = [s for _, own, end in windows for s in range(own, end)]
    assert owned == list(range(k_iters))
    for i, (first, own, end) in enumerate(windows):
        assert 0 <= first <= own < end <= first + p <= k_iters
        assert first == own or i == k_splits - 1


def test_uneven_split_problems_are_named():
    assert "without a step of its own" in mm.shape_problem(
        1, 256, 1536, 64, mm.MmaPairTableConfig(k_splits=4))  # 6 steps: windows of 2 cover them in 3
    assert "must be 1..6" in mm.shape_problem(1, 256, 1536, 64, mm.MmaPairTableConfig(k_splits=7))
    assert "whole scale blocks" in mm.shape_problem(  # 5 steps of 256, blocksize 512
        1, 256, 1280, 512, mm.MmaPairTableConfig(k_splits=2))
    assert mm.shape_problem(1, 256, 1280, 256, mm.MmaPairTableConfig(k_splits=2)) is None


@given(m=st.integers(1, mm.MAX_M), n256=st.integers(1, 200), k256=st.integers(1, 80),
       log_bs=st.integers(6, 12))
def test_default_config_keeps_splits_within_one_wave(m, n256, k256, log_bs):
    """On shapes the kernel can take (a random shape rarely is one; whether its grid fills the
    GPU aside): the default config keeps the K splits within one wave of SMs (that it passes
    its own checks: tests/kernels/test_variants.py, for every variant)."""
    n, k, bs = 256 * n256, 256 * k256, 2 ** log_bs
    if k % bs:
        bs = 64
    cfg = mm.default_config(m, n, k, bs)
    assert cfg.k_splits == 1 or (n // cfg.cta_rows) * cfg.k_splits <= mm.SMS


def test_unsupported_shapes_and_configs_get_clear_errors():
    """The kernel's own limits (operands, interpret mode and x's dtype: test_variants.py)."""
    q, x, packed, absmax = _problem(1, 256, 512, 64)
    with pytest.raises(ValueError, match=r"M \(65\)"):
        mm.mgpu_mma_pair_table(jnp.concatenate([x] * 65), packed, absmax, q.code, blocksize=64)
    q32, x32, p32, a32 = _problem(1, 256, 512, 32, nested=False)
    with pytest.raises(ValueError, match="multiple of 64"):
        mm.mgpu_mma_pair_table(x32, p32, a32, q32.code, blocksize=32)
    assert "tile_k" in mm.shape_problem(1, 256, 512, 64, mm.MmaPairTableConfig(tile_k=128))
    assert "multiple of 128" in mm.shape_problem(1, 192, 512, 64, mm.MmaPairTableConfig(tile_k=512))
    assert mm.shape_problem(1, 192, 1024, 64, mm.MmaPairTableConfig(tile_k=1024, swizzle=False)) is None
    assert "swizzle needs tile_k = 256" in mm.shape_problem(
        1, 192, 1024, 64, mm.MmaPairTableConfig(tile_k=1024))
    assert "compute_wgs must be 2 or 4" in mm.shape_problem(
        1, 256, 512, 64, mm.MmaPairTableConfig(compute_wgs=3))
    assert "compute_wgs = 4 needs tile_k = 256" in mm.shape_problem(
        1, 256, 1024, 64, mm.MmaPairTableConfig(compute_wgs=4, tile_k=512, swizzle=False))
    assert "wg_reduce needs tile_k > 256" in mm.shape_problem(
        1, 256, 1024, 64, mm.MmaPairTableConfig(wg_reduce=True))
    cfg = mm.default_config(16, 14336, 4096, 64, tile_k=512)  # y stored by the kernel
    assert (cfg.swizzle, cfg.wg_reduce, cfg.k_splits, cfg.partials) == (True, True, 1, 1)
    assert mm.MmaPairTableConfig(tile_k=512, k_splits=3).partials == 6


@pytest.mark.parametrize("k,n,tile_k,splits", [(4096, 14336, 512, 1), (4096, 11008, 256, 3),
                                               (4096, 4096, 256, 8), (14336, 4096, 256, 8),
                                               (8192, 28672, 256, 1), (4096, 1024, 256, 16)])
def test_default_takes_512_column_steps_where_they_need_no_k_split(k, n, tile_k, splits):
    """128-row tiles (512-column steps, the warpgroups' partials summed in the CTA) where they
    fill as many SMs in one wave without a K split as 256-row tiles with theirs; else 256
    (4096x11008: 43 tiles of 256 rows in 3 uneven splits, 129 CTAs, against 86 of 128 rows)."""
    for m in (1, 16):
        cfg = mm.default_config(m, n, k, 64)
        assert (cfg.tile_k, cfg.k_splits) == (tile_k, splits)
        assert cfg.wg_reduce == (tile_k == 512) and cfg.swizzle
        assert mm.shape_problem(m, n, k, 64, cfg) is None


@pytest.mark.parametrize("m,n,k,bs,cfg,dtype,nested", [
    (1, 512, 1024, 64, None, jnp.bfloat16, True),
    (5, 256, 512, 128, mm.MmaPairTableConfig(k_splits=2), jnp.float16, False),
    (16, 256, 2048, 64, mm.MmaPairTableConfig(k_splits=4, stages=3), jnp.bfloat16, True),
    (3, 128, 1024, 64, mm.MmaPairTableConfig(tile_k=512, swizzle=False), jnp.bfloat16, True),
    (12, 192, 2048, 256, mm.MmaPairTableConfig(k_splits=2, tile_k=1024, swizzle=False), jnp.float16,
     False),
    (1, 512, 1024, 64, mm.MmaPairTableConfig(compute_wgs=4), jnp.bfloat16, True),
    (16, 256, 2048, 128, mm.MmaPairTableConfig(compute_wgs=4, swizzle=False, k_splits=2), jnp.float16,
     False),
    (1, 512, 1024, 64, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True), jnp.bfloat16, True),
    (16, 256, 2048, 128, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True, k_splits=2), jnp.float16,
     False),
    (5, 512, 2048, 64, mm.MmaPairTableConfig(tile_k=512), jnp.bfloat16, True),
    # K splits that do not divide the steps (the last window moved back, steps skipped)
    (1, 256, 1280, 64, mm.MmaPairTableConfig(k_splits=2), jnp.bfloat16, True),
    (16, 256, 256 * 43, 64, None, jnp.bfloat16, True),
    (5, 256, 2560, 128, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True, k_splits=2), jnp.float16,
     False),
    (3, 256, 1792, 64, mm.MmaPairTableConfig(k_splits=3, swizzle=False), jnp.bfloat16, True),
    # 17..64 tokens: up to eight n8 tiles
    (32, 512, 2048, 64, None, jnp.bfloat16, True),
    (64, 512, 2048, 64, None, jnp.bfloat16, True),
    (24, 256, 2048, 128, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True, k_splits=2), jnp.float16,
     False),
])
def test_kernel_lowers_for_cuda(m, n, k, bs, cfg, dtype, nested):
    assert "mosaic_gpu" in lower_for_cuda(mm.mgpu_mma_pair_table, m, n, k, bs, dtype, nested,
                                          config=cfg)


gpu = pytest.mark.skipif(not registry.platform_available("sm90"), reason="needs a Hopper GPU and Mosaic GPU")


@gpu
@pytest.mark.parametrize("m,n,k,bs,quant_type,dtype,cfg", [
    (1, 256, 512, 64, "nf4", jnp.bfloat16, None),
    (2, 512, 1024, 64, "fp4", jnp.float16, None),
    (7, 256, 1024, 128, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=2)),
    (8, 512, 2048, 64, "nf4", jnp.bfloat16, None),
    (9, 256, 3584, 64, "nf4", jnp.float16, mm.MmaPairTableConfig(k_splits=7, stages=3)),
    (16, 768, 4096, 256, "fp4", jnp.bfloat16, None),
    (1, 384, 2048, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=2, tile_k=512, swizzle=False)),
    (11, 128, 1536, 128, "nf4", jnp.float16,
     mm.MmaPairTableConfig(k_splits=3, tile_k=512, swizzle=False, x_swap=False)),
    (4, 192, 2048, 64, "fp4", jnp.bfloat16, mm.MmaPairTableConfig(tile_k=1024, swizzle=False)),
    (16, 320, 4096, 512, "nf4", jnp.bfloat16,
     mm.MmaPairTableConfig(k_splits=2, tile_k=1024, swizzle=False)),
    (16, 512, 2048, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(swizzle=False, x_swap=False)),
    (13, 256, 1024, 64, "fp4", jnp.float16, mm.MmaPairTableConfig(swizzle=False)),
    (6, 768, 2048, 128, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=2, x_swap=False)),
    (4, 512, 1024, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(quad_scales=False)),
    (10, 256, 2048, 128, "nf4", jnp.float16, mm.MmaPairTableConfig(nested_code_smem=False, k_splits=2)),
    (16, 256, 1024, 64, "fp4", jnp.bfloat16, mm.MmaPairTableConfig(stages=3)),
    (3, 256, 2048, 64, "nf4", jnp.bfloat16,
     mm.MmaPairTableConfig(tile_k=512, swizzle=False)),  # 8 groups a step: lanes take t and t + 4
    # four compute warpgroups (one m16 tile a warp)
    (1, 256, 512, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(compute_wgs=4)),
    (16, 512, 2048, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(compute_wgs=4, k_splits=2)),
    (5, 768, 1024, 128, "fp4", jnp.float16,
     mm.MmaPairTableConfig(compute_wgs=4, swizzle=False, x_swap=False)),
    (9, 256, 3584, 64, "nf4", jnp.float16, mm.MmaPairTableConfig(compute_wgs=4, k_splits=7, stages=3)),
    # 512-column steps: each warpgroup's swizzled half in its own buffer; the warpgroups'
    # partials summed in the CTA (wg_reduce) with and without K splits, or by XLA
    (1, 256, 1024, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True)),
    (16, 384, 2048, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True)),
    (7, 256, 3072, 128, "fp4", jnp.float16,
     mm.MmaPairTableConfig(tile_k=512, wg_reduce=True, k_splits=3)),
    (12, 128, 2048, 256, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(tile_k=512)),
    (2, 128, 1024, 64, "nf4", jnp.bfloat16,
     mm.MmaPairTableConfig(tile_k=512, swizzle=False, wg_reduce=True, stages=3)),
    (16, 128 * 150, 1024, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True)),
    (9, 192, 2048, 64, "fp4", jnp.float16,
     mm.MmaPairTableConfig(tile_k=1024, swizzle=False, wg_reduce=True, k_splits=2)),
    # K splits that do not divide the steps: the last window moved back, its first steps
    # skipped (5 steps in 2 windows of 3; 43 in 8 of 6; 7 in 3 of 3, two skipped; 11 in 4)
    (1, 256, 1280, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=2)),
    (9, 256, 256 * 43, 64, "nf4", jnp.float16, mm.MmaPairTableConfig(k_splits=8)),
    (16, 512, 256 * 43, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=8)),
    (7, 256, 2560, 128, "fp4", jnp.bfloat16,
     mm.MmaPairTableConfig(tile_k=512, wg_reduce=True, k_splits=2)),
    (4, 256, 1792, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=3, swizzle=False)),
    (12, 512, 2816, 256, "nf4", jnp.float16, mm.MmaPairTableConfig(k_splits=4, stages=3)),
    (2, 256, 1792, 64, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=4, compute_wgs=4)),
    # 17..32 tokens: three and four n8 tiles of x, the last one partly past x's rows
    (32, 512, 2048, 64, "nf4", jnp.bfloat16, None),
    (17, 256, 256 * 43, 64, "nf4", jnp.bfloat16, None),
    (24, 384, 2048, 64, "fp4", jnp.float16, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True)),
    (29, 256, 1024, 128, "nf4", jnp.bfloat16, mm.MmaPairTableConfig(k_splits=2, swizzle=False,
                                                                    x_swap=False)),
    (32, 256, 2048, 64, "nf4", jnp.float16, mm.MmaPairTableConfig(compute_wgs=4, k_splits=2)),
    # 33..64 tokens: five to eight n8 tiles
    (40, 512, 2048, 64, "nf4", jnp.bfloat16, None),
    (36, 384, 2048, 128, "fp4", jnp.float16, mm.MmaPairTableConfig(tile_k=512, wg_reduce=True)),
    (64, 256, 256 * 43, 64, "nf4", jnp.bfloat16, None),
])
def test_matches_emulation_and_reference(m, n, k, bs, quant_type, dtype, cfg):
    q, x, packed, absmax = _problem(m, n, k, bs, quant_type, seed=m + n, x_dtype=dtype)
    nested = (q.nested_absmax, q.nested_code, q.offset)
    got = np.asarray(mm.mgpu_mma_pair_table(
        x, packed, q.absmax.reshape(n, k // bs), q.code, blocksize=bs, nested=nested,
        config=cfg, out_dtype=jnp.float32))
    emu = mm.emulate(x, packed, absmax, q.code, blocksize=bs,
                     cfg=cfg or mm.default_config(m, n, k, bs))
    np.testing.assert_allclose(got, emu, rtol=2e-5, atol=2e-5 * float(np.abs(emu).max()))
    y16 = mm.mgpu_mma_pair_table(x, packed, q.absmax.reshape(n, k // bs), q.code,
                                 blocksize=bs, nested=nested, config=cfg)
    assert y16.dtype == dtype and y16.shape == (m, n)
    np.testing.assert_allclose(np.asarray(y16.astype(jnp.float32)), emu, rtol=1e-2,
                               atol=1e-2 * float(np.abs(emu).max()))


@gpu
@pytest.mark.parametrize("m", [1, 16])
def test_auto_runs_it_on_llama2_down_projection(m):
    """K = 11008 (43 steps, prime): `auto` plans this kernel with 8 uneven K splits, and the
    product matches the XLA path's."""
    from jqlora import ops, quant
    from jqlora.ops import dispatch
    w = jax.random.normal(jax.random.key(3), (4096, 11008), jnp.float32) * 0.02
    q = quant.quantize_4bit(w, "nf4", 64, True)
    assert dispatch.choose_plan(q, m, "auto", dtype="bfloat16").fwd == "mgpu_mma_pair_table"
    x = jax.random.normal(jax.random.key(m), (m, 11008), jnp.bfloat16)
    y = ops.qmatmul(x, q).astype(jnp.float32)
    ref = ops.qmatmul(x, q, backend="xla").astype(jnp.float32)
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2, err


@gpu
def test_qmatmul_auto_runs_it_on_3d_x():
    from jqlora import ops
    from jqlora.ops import dispatch
    q, x, _, _ = _problem(9, 512, 1024, 64)
    assert dispatch.choose_plan(q, 9, "auto", dtype="bfloat16").fwd == "mgpu_mma_pair_table"
    y = ops.qmatmul(x.reshape(3, 3, 1024), q)
    ref = ops.qmatmul(x.reshape(3, 3, 1024), q, backend="xla")
    assert y.shape == ref.shape == (3, 3, 512) and y.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32))
                / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < 1e-2, err
