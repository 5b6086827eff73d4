"""The Hopper pair-table GEMV (`pallas_kernels.mosaic.mgpu_gemv_pair_table`).

On CPU: its PTX programs run in a small interpreter (the instructions they use, with a
shared-memory table) against the arithmetic `emulate` describes; `emulate` (the kernel's thread
mapping, table layout and summation order in numpy) against the float32 reference on random
shapes; configs over random shapes; the kernel lowers for CUDA (jax 0.10 and 0.11); `auto` picks
it where it should. On a Hopper GPU: the compiled kernel against the reference and `emulate`.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora import ops, quant
from jqlora.quant import tables
from pallas_kernels import registry
from pallas_kernels.mosaic import mgpu_gemv_pair_table as mg
from pallas_kernels.reference.fourbit import matmul_4bit_gemv_reference
from pallas_kernels.nibble_lookup import _prmt
from mosaic_lowering import lower_for_cuda


# ----------------------------------------------------------------------------- PTX interpreter
def _run(ptx: str, operands: dict[int, np.ndarray], outs: list[int], smem: np.ndarray | None):
    """Run `ptx` for a batch of lanes. operands: $i -> uint32 array over lanes (tied outputs
    start from their operand's value); smem: bytes of shared memory at address 0."""
    regs = {f"${i}": np.asarray(v, np.uint32) for i, v in operands.items()}
    f32 = lambda a: np.asarray(a, np.uint32).view(np.float32)
    u32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)
    lanes = next(iter(regs.values())).shape[0]

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-f]+|\d+", tok):
            return np.full(lanes, int(tok, 0), np.uint32)
        raise AssertionError(f"read before write: {tok}")

    def words_at(addr, count):
        a = np.asarray(addr, np.int64)
        assert (a % (4 * count) == 0).all(), "misaligned vector access"
        w = smem.view(np.uint32)
        return [w[a // 4 + i] for i in range(count)]

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        vec = re.match(r"\{([^}]*)\}, \[(\S+)\]", args)
        if op.startswith("ld.shared"):
            dsts = [d.strip() for d in vec.group(1).split(",")] if vec else [args.split(",")[0]]
            addr = vec.group(2) if vec else args.split("[")[1].rstrip("]")
            for d, w in zip(dsts, words_at(val(addr), len(dsts))):
                regs[d] = w
            continue
        if op == "mov.b32" and args.startswith("{"):  # unpack two 16-bit halves
            halves, src = args.rsplit(",", 1)
            lo, hi = [h.strip() for h in halves.strip("{} ").split(",")]
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            regs[dst] = np.asarray(_prmt(val(src[0]), val(src[1]), val(src[2])), np.uint32)
        elif op == "add.u32":
            regs[dst] = (val(src[0]) + val(src[1])).astype(np.uint32)
        elif op == "fma.rn.f32":
            regs[dst] = u32(mg.fma_f32(f32(val(src[0])), f32(val(src[1])), f32(val(src[2]))))
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << int(src[1])).astype(np.uint32)
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "cvt.f32.f16":
            regs[dst] = u32(val(src[0]).astype(np.uint16).view(np.float16).astype(np.float32))
        else:
            raise AssertionError(f"instruction not modelled: {op}")
    return [regs[f"${i}"] for i in outs]


def _table_bytes(code, base: int = 0) -> np.ndarray:
    """Shared memory holding the kernel's table at byte `base` (build_table's stores:
    (code[hi], code[lo]) at `table_offset(byte, lane)`), zeros around it."""
    table = np.zeros(mg.TABLE_FLOATS, np.float32)
    b, lane = np.meshgrid(np.arange(256), np.arange(mg.LANES), indexing="ij")
    off = mg.table_offset(b, lane) // 4
    table[off], table[off + 1] = np.asarray(code, np.float32)[b >> 4], np.asarray(code)[b & 15]
    return np.concatenate([np.zeros(base, np.uint8), table.view(np.uint8),
                           np.zeros(4096, np.uint8)])


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("base", [0, 3072])
def test_word_program_is_two_fma_chains_over_table_pairs(m, quant_type, base):
    """word_ptx on random words, lanes, x and running sums: byte i of the word adds
    x_even[i] * code[hi] to the even sum and x_odd[i] * code[lo] to the odd one, in byte order,
    one rounding each; each lane reads its own copy of the table, which starts at `base` (3072:
    where Mosaic's shared memory starts on an H100)."""
    code = tables.code_4bit(quant_type)
    rng = np.random.default_rng(m)
    lanes = 64
    lane = np.arange(lanes) % mg.LANES
    word = rng.integers(0, 2**32, lanes, dtype=np.uint64).astype(np.uint32)
    x = rng.standard_normal((lanes, m, 8)).astype(np.float32)
    sums = rng.standard_normal((lanes, 2 * m)).astype(np.float32)
    ops_ = {2 * m: word, 2 * m + 1: (base + mg.table_offset(0, lane)).astype(np.uint32)}
    for r in range(m):
        for i in range(8):
            ops_[2 * m + 2 + 8 * r + i] = x[:, r, i].view(np.uint32)
    for i in range(2 * m):  # tied: the outputs start as these
        ops_[i] = sums[:, i].view(np.uint32)
    got = _run(mg.word_ptx(m), ops_, list(range(2 * m)), _table_bytes(code, base))
    want = sums.copy()
    for i in range(4):
        byte = (word >> (8 * i)) & 0xFF
        hi, lo = np.asarray(code, np.float32)[byte >> 4], np.asarray(code, np.float32)[byte & 15]
        for r in range(m):
            want[:, 2 * r] = mg.fma_f32(x[:, r, i], hi, want[:, 2 * r])
            want[:, 2 * r + 1] = mg.fma_f32(x[:, r, 4 + i], lo, want[:, 2 * r + 1])
    np.testing.assert_array_equal(np.stack([g.view(np.float32) for g in got], axis=1), want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_x_program_widens_eight_values_in_order(dtype):
    rng = np.random.default_rng(3)
    vals = rng.standard_normal((16, 8)).astype(np.float32)
    raw = np.asarray(jnp.asarray(vals).astype(dtype).view(jnp.uint16))  # (16 lanes, 8)
    smem = raw.reshape(-1).view(np.uint8).copy()
    addr = (np.arange(16) * 16).astype(np.uint32)
    got = _run(mg.x_ptx(dtype), {8: addr}, list(range(8)), smem)
    want = np.asarray(jnp.asarray(vals).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.stack([g.view(np.float32) for g in got], axis=1), want)


# ----------------------------------------------------------------------------- emulation
def _problem(m, n, k, bs, quant_type="nf4", seed=0, x_dtype=jnp.bfloat16, nested=True):
    """(weight, x, packed (N, K / 2), f32 absmax (N, K / bs)) of a random problem (also the
    MMA kernel's tests')."""
    kw, kx = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
    q = quant.quantize_4bit(w, quant_type, bs, nested)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(x_dtype)
    absmax = quant.absmax_f32(q).reshape(n, k // bs)
    return q, x, q.packed.reshape(n, k // 2), absmax


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 2), n256=st.integers(1, 2), k256=st.integers(1, 4),
       log_bs=st.integers(5, 8), splits=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_emulation_matches_the_reference(m, n256, k256, log_bs, splits, seed):
    """The kernel's order of operations (what `emulate` runs) is the block-scaled product of
    the fp32 reference up to float32 summation error."""
    n, k, bs = 256 * n256, 256 * k256, 2 ** log_bs
    if k % (splits * 256) or (k // splits) % bs:
        splits = 1
    if k % bs:
        return
    q, x, packed, absmax = _problem(m, n, k, bs, seed=seed)
    got = mg.emulate(np.asarray(x.astype(jnp.float32)), packed, absmax, q.code, blocksize=bs,
                     cfg=mg.GemvPairTableConfig(k_splits=splits))
    want = np.asarray(matmul_4bit_gemv_reference(x, packed, absmax, q.code, blocksize=bs,
                                                 out_dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


# ----------------------------------------------------------------------------- configs, errors
@given(m=st.integers(1, 4), n32=st.integers(1, 640), k32=st.integers(1, 640),
       log_bs=st.integers(5, 12))
def test_supports_exactly_its_shapes_and_defaults_fit(m, n32, k32, log_bs):
    """Exactly the shapes with M <= 2, N and K multiples of 256 and whole scale blocks are
    taken, and their default config fits shared memory and one wave of SMs (that
    `shape_problem` accepts it: tests/kernels/test_variants.py, for every variant)."""
    n, k, bs = 32 * n32, 32 * k32, 2 ** log_bs
    want = m <= 2 and n % 256 == 0 and k % 256 == 0 and k % bs == 0
    assert mg.supports(m, n, k, bs) == want
    if want:
        cfg = mg.default_config(m, n, k, bs)
        assert mg.smem_bytes(m, k, bs, cfg) <= mg.SMEM_LIMIT
        assert (n // mg.CTA_ROWS) * cfg.k_splits <= mg.SMS


def test_default_config_follows_the_measured_choices():
    assert mg.default_config(1, 4096, 4096, 64) == mg.GemvPairTableConfig(k_splits=8, stages=2)
    assert mg.default_config(1, 14336, 4096, 64) == mg.GemvPairTableConfig(k_splits=2, stages=2)
    assert mg.default_config(1, 4096, 14336, 64) == mg.GemvPairTableConfig(k_splits=8, stages=2)


def test_scale_rows_are_read_without_bank_conflicts():
    """The 16 scales a warp reads in a step (4 consecutive rows x 4 blocks of 64 columns) lie
    in 16 distinct banks for every split width."""
    for split_cols in range(1, 80):
        stride = mg.scale_stride(split_cols)
        assert stride >= split_cols
        banks = {(r * stride + b) % 32 for r in range(4) for b in range(min(4, split_cols))}
        assert len(banks) == 4 * min(4, split_cols)


def test_unsupported_shapes_and_configs_get_clear_errors():
    """The kernel's own limits (operands, interpret mode and x's dtype: test_variants.py)."""
    q, x, packed, absmax = _problem(1, 256, 512, 64)
    with pytest.raises(ValueError, match=r"M \(3\)"):
        mg.mgpu_gemv_pair_table(jnp.concatenate([x] * 3), packed, absmax, q.code, blocksize=64)
    with pytest.raises(ValueError, match="multiple of 256"):
        mg.mgpu_gemv_pair_table(x, packed[:128], absmax[:128], q.code, blocksize=64)
    with pytest.raises(ValueError, match="k_splits"):
        mg.mgpu_gemv_pair_table(x, packed, absmax, q.code, blocksize=64,
                                config=mg.GemvPairTableConfig(k_splits=3))
    assert "shared memory" in mg.shape_problem(
        1, 256, 65536, 64, mg.GemvPairTableConfig(k_splits=1, stages=4, staged_scales=True))
    assert not mg.supports(4, 256, 512, 64) and not mg.supports(1, 384, 512, 64)


# ----------------------------------------------------------------------------- lowering, plan
def _lower(m, n, k, bs, cfg, dtype=jnp.bfloat16, nested=True):
    return lower_for_cuda(mg.mgpu_gemv_pair_table, m, n, k, bs, dtype, nested, config=cfg)


@pytest.mark.parametrize("m,n,k,bs,cfg,dtype,nested", [
    (1, 512, 1024, 64, None, jnp.bfloat16, True),
    (2, 256, 512, 128, mg.GemvPairTableConfig(k_splits=2), jnp.float16, False),
    (1, 512, 4096, 64, mg.GemvPairTableConfig(k_splits=2, wgs=4, stages=3), jnp.bfloat16, True),
    (2, 256, 2048, 512, mg.GemvPairTableConfig(k_splits=4, wgs=4), jnp.bfloat16, True),
    (1, 256, 1024, 64, mg.GemvPairTableConfig(k_splits=2, staged_scales=True), jnp.bfloat16, True),
    (2, 256, 1024, 128, mg.GemvPairTableConfig(staged_scales=True), jnp.float16, False),
    (1, 512, 1024, 64, mg.GemvPairTableConfig(k_splits=2, interleave=True), jnp.bfloat16, True),
    (2, 256, 1024, 64, mg.GemvPairTableConfig(interleave=True, staged_scales=True), jnp.float16, True),
])
def test_kernel_lowers_for_cuda(m, n, k, bs, cfg, dtype, nested):
    """Pallas -> Mosaic GPU on a machine without a GPU: the pipeline, the inline functions and
    their PTX operands are all built here."""
    assert "mosaic_gpu" in _lower(m, n, k, bs, cfg, dtype, nested)


def test_auto_picks_it_on_hopper_at_small_m(monkeypatch):
    from jqlora.ops import dispatch

    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "mgpu_available", lambda: True)
    q = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", 64, True),
                       jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    assert dispatch.choose_plan(q, 1, "auto", dtype="float32").fwd == "gemv_block_scaled"
    for m in (1, 2, 3):  # the pair-table MMA kernel (test_kernels_4bit_mgpu_mma), since s19 at M = 1
        assert dispatch.choose_plan(q, m, "auto", dtype="bfloat16").fwd == "mgpu_mma_pair_table"
    q32 = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", 32, True),
                         jax.ShapeDtypeStruct((4096, 4096), jnp.float32))  # blocksize 32
    for m in (1, 2):  # shapes the MMA kernel excludes
        assert dispatch.choose_plan(q32, m, "auto", dtype="bfloat16").fwd == "mgpu_gemv_pair_table"
    odd = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", 64, True),
                         jax.ShapeDtypeStruct((384, 4096), jnp.float32))  # N % 256 != 0
    for m in (1, 2):
        assert dispatch.choose_plan(odd, m, "auto", dtype="bfloat16").fwd == "gemv_block_scaled"
    with pytest.raises(dispatch.BackendError, match="Hopper"):
        dispatch.choose_plan(q, 1, "interpret", variant="mgpu_gemv_pair_table")


# ----------------------------------------------------------------------------- on the GPU
gpu = pytest.mark.skipif(not registry.platform_available("sm90"), reason="needs a Hopper GPU and Mosaic GPU")


@gpu
@pytest.mark.parametrize("m,n,k,bs,quant_type,dtype,cfg", [
    (1, 256, 512, 64, "nf4", jnp.bfloat16, None),
    (2, 512, 1024, 64, "fp4", jnp.float16, None),
    (1, 256, 1024, 128, "nf4", jnp.bfloat16, mg.GemvPairTableConfig(k_splits=2)),
    (2, 256, 2048, 512, "nf4", jnp.bfloat16, mg.GemvPairTableConfig(k_splits=4, wgs=4)),
    (1, 512, 3584, 64, "nf4", jnp.bfloat16, mg.GemvPairTableConfig(k_splits=7, stages=3)),
    (2, 256, 3584, 64, "nf4", jnp.bfloat16, mg.GemvPairTableConfig(k_splits=2, staged_scales=True)),
    (1, 256, 1024, 512, "fp4", jnp.float16, mg.GemvPairTableConfig(staged_scales=True)),
    (1, 512, 2048, 64, "nf4", jnp.bfloat16, mg.GemvPairTableConfig(k_splits=2, interleave=True)),
    (2, 256, 1024, 64, "fp4", jnp.float16, mg.GemvPairTableConfig(interleave=True, staged_scales=True)),
    (2, 512, 3584, 64, "fp4", jnp.bfloat16,
     mg.GemvPairTableConfig(k_splits=2, interleave=True, staged_scales=True)),
])
def test_matches_emulation_and_reference(m, n, k, bs, quant_type, dtype, cfg):
    """fp32 outputs: the emulation of the kernel's order (tight) and the reference."""
    q, x, packed, absmax = _problem(m, n, k, bs, quant_type, seed=m + n, x_dtype=dtype)
    nested = (q.nested_absmax, q.nested_code, q.offset)
    got = np.asarray(mg.mgpu_gemv_pair_table(
        x, packed, q.absmax.reshape(n, k // bs), q.code, blocksize=bs, nested=nested,
        config=cfg, out_dtype=jnp.float32))
    emu = mg.emulate(np.asarray(x.astype(jnp.float32)), packed, absmax, q.code, blocksize=bs,
                     cfg=cfg or mg.default_config(m, n, k, bs))
    np.testing.assert_allclose(got, emu, rtol=1e-6, atol=1e-6 * float(np.abs(emu).max()))
    ref = np.asarray(matmul_4bit_gemv_reference(x, packed, absmax, q.code, blocksize=bs,
                                                out_dtype=jnp.float32))
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-5


@gpu
def test_qmatmul_auto_runs_it_and_writes_x_dtype():
    q, x, packed, absmax = _problem(1, 512, 1024, 32)  # blocksize 32: the MMA kernel declines
    from jqlora.ops import dispatch
    assert dispatch.choose_plan(q, 1, "auto", dtype="bfloat16").fwd == "mgpu_gemv_pair_table"
    y = ops.qmatmul(x[None], q)  # (1, 1, K): 3-D x
    ref = ops.qmatmul(x[None], q, backend="xla")
    assert y.shape == ref.shape == (1, 1, 512) and y.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm((y - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < 1e-2, err
