"""16-entry code lookup in registers with byte permutes (PTX `prmt`), no memory gather.

The small-M 4-bit kernels decode each weight by gathering `code[q]` from a 16-entry table (in
device memory, L1-resident): most of their instructions per weight are address arithmetic,
the gather and nibble handling, and the warps stall on the gathers' latency. This module
replaces the gather with in-register arithmetic on packed bytes:

A 16-bit code table (x's dtype: bf16 or fp16) is split into byte planes, low bytes L[0..15] and
high bytes H[0..15], each held as four 32-bit words (`table_words`). `prmt.b32 d, a, b, s`
picks each byte of d from the 8 bytes of (a, b) by a 3-bit index in s's nibbles, so
prmt(L0, L1, s) looks up four codes < 8 and prmt(L2, L3, s) four codes >= 8; a `lop3` select
on each index's bit 3 merges the two. Two more prmt interleave the low and high planes into
two words of 16-bit pairs. One 32-bit word of packed weights (4 bytes, 8 nibbles) costs 26
instructions: 3.25 per weight, with no load.

It gives bitwise the same codes as the gather. It pays in the block-scaled tensor-core kernel,
not in the GEMV, whose fp32 multiply-add per weight needs the code widened to fp32 and which is
not bound by the gather alone (docs/kernels.md).

The program is written once (`_PROGRAMS`, one per nibble half) and turned into PTX (`_ptx`,
for `plgpu.elementwise_inline_asm` with pack = 4: four uint8 elements per 32-bit register) and
into a jnp emulation (`emulate_words`, the same instructions on uint32 arrays). CPU tests run the
emulation against the plain table lookup for every byte value; interpret mode runs the
emulation inside the kernels; only the PTX text itself needs the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import plgpu

# Table word names: low bytes of entries 4i..4i+3 in Li, high bytes in Hi (byte j of a word is
# entry 4i + j).
WORD_NAMES = ("L0", "L1", "L2", "L3", "H0", "H1", "H2", "H3")

# prmt selectors (result byte i <- source byte of nibble i; bit 3 of a nibble replicates that
# byte's sign bit instead of copying it).
_SIGN_OF_ORDER = 0xB9A8  # sign bytes of source bytes 0, 2, 1, 3: the index order below
_PAIRS_0_2 = 0x6240  # (L[e0], H[e0], L[e1], H[e1]) from L = (e0, e2, e1, e3), H likewise
_PAIRS_1_3 = 0x7351  # (L[e2], H[e2], L[e3], H[e3])
_SELECT = 0xD8  # lop3 truth table of (a & ~m) | (b & m): a = 0xF0, b = 0xCC, m = 0xAA


def _nibble_program(src: str, tag: str, shift: bool) -> tuple:
    """Instructions looking up the four nibbles at bits 0-3 (shift=False) or 4-7 (shift=True)
    of each byte of `src`; results `{tag}0` (bytes 0, 1) and `{tag}1` (bytes 2, 3)."""
    ops = []
    if shift:
        ops.append(("shr", "t", src, 4))
        nib = "t"
    else:
        nib = src
    ops += [
        ("and", "x", nib, 0x07070707),  # 3-bit indices in bits 0-2 of each byte
        ("shr", "s", "x", 12),  # bytes 2, 3 -> nibbles 1, 3 of the selector
        ("or", "s", "s", "x"),  # selector nibbles: indices of bytes 0, 2, 1, 3
    ]
    if shift:  # bit 3 of the high nibble is the byte's sign bit
        ops.append(("prmt", "m", src, src, _SIGN_OF_ORDER))
    else:
        ops += [("shl", "t", src, 4), ("prmt", "m", "t", "t", _SIGN_OF_ORDER)]
    ops += [
        ("prmt", "a", "L0", "L1", "s"), ("prmt", "b", "L2", "L3", "s"),
        ("lop3", "lb", "a", "b", "m", _SELECT),  # low bytes of entries e0, e2, e1, e3
        ("prmt", "a", "H0", "H1", "s"), ("prmt", "b", "H2", "H3", "s"),
        ("lop3", "hb", "a", "b", "m", _SELECT),
        ("prmt", f"{tag}0", "lb", "hb", _PAIRS_0_2),
        ("prmt", f"{tag}1", "lb", "hb", _PAIRS_1_3),
    ]
    return tuple(ops)


# One 32-bit word r of packed weights -> hi0, hi1 (codes of the high nibbles of bytes 0-3, as
# 16-bit pairs) and lo0, lo1 (low nibbles). Two programs: Pallas lowers an inline-asm call with
# one result only, so each half is its own call.
_PROGRAMS = {"hi": _nibble_program("r", "hi", shift=True),
             "lo": _nibble_program("r", "lo", shift=False)}
_OUTPUTS = {"hi": ("hi0", "hi1"), "lo": ("lo0", "lo1")}
_HALVES = ("hi", "lo")


def table_words(code16):
    """(8,) uint32 words [L0..L3, H0..H3] of a (16,) 16-bit code table (bf16 or fp16)."""
    if code16.shape != (16,) or jnp.dtype(code16.dtype).itemsize != 2:
        raise ValueError(f"table_words: need a (16,) 16-bit code table, got {code16.dtype} "
                         f"{code16.shape}")
    bits = lax.bitcast_convert_type(code16, jnp.uint16).astype(jnp.uint32)
    planes = jnp.stack([bits & 0xFF, bits >> 8]).reshape(2, 4, 4)  # (plane, word, byte)
    shifts = jnp.asarray([0, 8, 16, 24], jnp.uint32)
    return jnp.sum(planes << shifts, axis=-1, dtype=jnp.uint32).reshape(8)


# ----------------------------------------------------------------------------- jnp emulation
def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on uint32 arrays."""
    sel = jnp.asarray(sel, jnp.uint32)
    out = jnp.zeros(jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), sel.shape), jnp.uint32)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        idx = nib & 7
        src = jnp.where(idx < 4, a, b)
        byte = (src >> ((idx & 3) * 8)) & 0xFF
        byte = jnp.where((nib & 8) != 0, jnp.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out = out | (byte.astype(jnp.uint32) << (8 * i))
    return out


def _lop3(a, b, c, lut):
    """PTX lop3.b32: bit i of the result is bit (a_i b_i c_i) of the truth table lut."""
    out = jnp.zeros(jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c)), jnp.uint32)
    for bit in range(8):
        if lut >> bit & 1:
            ta = a if bit & 4 else ~a
            tb = b if bit & 2 else ~b
            tc = c if bit & 1 else ~c
            out = out | (ta & tb & tc)
    return out


def run_program(program, regs: dict) -> dict:
    """Execute an instruction program (tuples (op, dst, *src) of and/or/shr/shl/prmt/lop3 on
    uint32 arrays) on `regs` (name -> array, updated and returned); the jnp twin of its PTX."""
    def val(v):
        return regs[v] if isinstance(v, str) else jnp.uint32(v)

    for op, dst, *src in program:
        a = val(src[0])
        if op == "and":
            regs[dst] = a & val(src[1])
        elif op == "or":
            regs[dst] = a | val(src[1])
        elif op == "shr":
            regs[dst] = a >> src[1]
        elif op == "shl":
            regs[dst] = a << src[1]
        elif op == "prmt":
            regs[dst] = _prmt(a, val(src[1]), val(src[2]))
        elif op == "lop3":
            regs[dst] = _lop3(a, val(src[1]), val(src[2]), src[3])
        else:
            raise ValueError(f"run_program: unknown instruction {op!r}")
    return regs


def emulate_words(r, words, half: str):
    """Run `_PROGRAMS[half]` on uint32 words r of packed weights with table `words` (8,) uint32:
    returns its two output words (16-bit pairs of elements 0, 1 and 2, 3), shaped like r."""
    regs = {"r": jnp.asarray(r, jnp.uint32)}
    regs.update({name: words[i] for i, name in enumerate(WORD_NAMES)})
    regs = run_program(_PROGRAMS[half], regs)
    return tuple(regs[o] for o in _OUTPUTS[half])


def _pairs_to_values(w0, w1, dtype):
    """Two uint32 words of 16-bit pairs (elements 0, 1 and 2, 3) -> (..., 4) values."""
    halves = [w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16]
    return lax.bitcast_convert_type(jnp.stack(halves, axis=-1).astype(jnp.uint16), dtype)


def emulate_lookup(p, words, dtype, half: str):
    """Interpret-mode twin of `lookup`: uint8 p (any shape) -> code[p >> 4] (half "hi") or
    code[p & 15] ("lo") in dtype, computed by the emulated instructions on 32-bit words of 4
    bytes of p. The lookup is elementwise, so which 4 bytes share a word does not matter (the
    GPU packs a thread's consecutive registers); the tail is zero-padded."""
    flat = p.reshape(-1).astype(jnp.uint32)
    flat = jnp.pad(flat, (0, -flat.size % 4))
    b = flat.reshape(-1, 4)
    r = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    w0, w1 = emulate_words(r, words, half)
    return _pairs_to_values(w0, w1, dtype).reshape(-1)[:p.size].reshape(p.shape)


# ----------------------------------------------------------------------------- PTX
def program_ptx(program, operands: dict[str, str], outputs, prefix: str = "jq_") -> str:
    """PTX text of an instruction program: names in `operands` are bound to asm operands ($i),
    every other register is a local `{prefix}name`; the outputs are moved to $0, $1, ... last
    (an output without early clobber may share an input's register)."""
    temps = sorted({dst for _, dst, *_ in program})
    local = {t: f"{prefix}{t}" for t in temps}

    def reg(v):
        if isinstance(v, int):
            return f"{v:#x}"
        return operands.get(v) or local[v]

    lines = ["{", f".reg .b32 {', '.join(local.values())};"]
    for op, dst, *src in program:
        if op == "lop3":
            lines.append(f"lop3.b32 {reg(dst)}, {reg(src[0])}, {reg(src[1])}, {reg(src[2])}, "
                         f"{src[3]:#x};")
        elif op in ("shr", "shl"):
            lines.append(f"{op}.b32 {reg(dst)}, {reg(src[0])}, {src[1]};")
        else:
            lines.append(f"{op}.b32 {reg(dst)}, {', '.join(reg(s) for s in src)};")
    lines += [f"mov.b32 ${i}, {local[name]};" for i, name in enumerate(outputs)]
    lines.append("}")
    return "\n".join(lines)


def _ptx(half: str) -> str:
    """One half's program as PTX for elementwise_inline_asm with pack = 4: $0, $1 the output
    (16-bit pairs of elements 0, 1 and 2, 3), $2 the packed word, then the 8 table words, each
    passed 4 times (a 32-bit argument fills one register per packed element; the first copy is
    used)."""
    operand = {"r": "$2"}
    operand.update({name: f"${3 + 4 * i}" for i, name in enumerate(WORD_NAMES)})
    return program_ptx(_PROGRAMS[half], operand, _OUTPUTS[half])


N_OPERANDS = 2 + 1 + 4 * len(WORD_NAMES)  # per call: output pairs, packed word, table copies


def lookup(p, words, dtype, half: str, *, interpret: bool):
    """code[p >> 4] (half "hi") or code[p & 15] ("lo") in dtype for a uint8 tile p, with `words`
    the 8 uint32 scalars of `table_words` (read from a ref inside the kernel). GPU: inline PTX;
    interpret mode: `emulate_lookup`. One half per call, so a kernel can use each tile before
    making the next (a tensor-core operand tile lives in shared memory).

    Known limit: ptxas keeps 4 of the 8 table words in uniform registers and copies each back
    with an IMAD.U32 before every prmt that reads it as its first source (prmt takes that one
    only from a regular register): about 1 instruction per weight. Making the words look
    per-thread (or'ing in `%laneid >> 5`) does not help: ptxas folds it."""
    if p.dtype != jnp.uint8:
        raise ValueError(f"nibble_lookup.lookup: packed tile must be uint8, got {p.dtype}")
    if half not in _HALVES:
        raise ValueError(f"nibble_lookup.lookup: half must be 'hi' or 'lo', got {half!r}")
    if interpret:
        return emulate_lookup(p, jnp.stack(words), dtype, half)
    tiles = [jnp.broadcast_to(w, p.shape) for w in words]
    constraints = ",".join(["=r"] * 2 + ["r"] * (N_OPERANDS - 2))
    (out,) = plgpu.elementwise_inline_asm(
        _ptx(half), args=[p, *tiles], constraints=constraints, pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, dtype)])
    return out
