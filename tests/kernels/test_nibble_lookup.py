"""The in-register 16-entry code lookup (pallas_kernels.nibble_lookup), without a GPU.

Three layers are checked against the plain table lookup code[p >> 4], code[p & 15]:
- the jnp emulation of the instruction program, exhaustively over byte values and on random
  16-bit tables (hypothesis);
- the emitted PTX text, run through a small independent PTX interpreter written here from the
  PTX ISA's definitions of prmt, lop3, shr, shl, and, or, mov (so a wrong operand number, a
  swapped source or a missing instruction in the emitted text fails on CPU);
- an independent numpy model of `prmt` itself, on edge selectors (sign replication).
"""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import nibble_lookup as nl
from test_kernels_4bit import FP4, NF4

DTYPES16 = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def all_byte_words():
    """uint8 (256, 4): every byte value in every position of a word, with varied neighbours."""
    v = np.arange(256, dtype=np.int64)
    return np.stack([v, v[::-1], (v * 7) % 256, (v + 91) % 256], axis=1).astype(np.uint8)


def expected(p, table16):
    t = np.asarray(table16).view(np.uint16)
    return t[p >> 4], t[p & 15]


def as_bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("dt", sorted(DTYPES16))
@pytest.mark.parametrize("table", [NF4, FP4], ids=["nf4", "fp4"])
def test_emulation_matches_table_for_every_byte(dt, table):
    code16 = jnp.asarray(table).astype(DTYPES16[dt])
    words = nl.table_words(code16)
    p = np.concatenate([all_byte_words(), all_byte_words().T.reshape(-1, 4)])
    hi, lo = (nl.emulate_lookup(jnp.asarray(p), words, DTYPES16[dt], h) for h in ("hi", "lo"))
    want_hi, want_lo = expected(p, code16)
    np.testing.assert_array_equal(as_bits(hi), want_hi)
    np.testing.assert_array_equal(as_bits(lo), want_lo)


@settings(max_examples=25, deadline=None)
@given(bits=st.lists(st.integers(0, 2**16 - 1), min_size=16, max_size=16),
       shape=st.sampled_from([(3,), (5, 7), (2, 3, 8)]), seed=st.integers(0, 2**16))
def test_emulation_any_16_bit_table_any_shape(bits, shape, seed):
    """Any 16-bit patterns (NaNs, infinities, signed zeros included: the lookup moves bytes)
    and tile sizes that are not multiples of 4 (the emulation pads the last word)."""
    code16 = jnp.asarray(np.asarray(bits, np.uint16).view(np.float16))
    p = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    hi, lo = (nl.emulate_lookup(jnp.asarray(p), nl.table_words(code16), jnp.float16, h)
              for h in ("hi", "lo"))
    want_hi, want_lo = expected(p, code16)
    np.testing.assert_array_equal(as_bits(hi), want_hi)
    np.testing.assert_array_equal(as_bits(lo), want_lo)


def test_table_words_layout():
    """Word i of the low plane holds the low bytes of entries 4i..4i+3, entry 4i in byte 0."""
    vals = np.arange(16, dtype=np.uint16) * 0x0101 + 0x8000  # low byte i, high byte 0x80 + i
    words = np.asarray(nl.table_words(jnp.asarray(vals.view(np.float16))))
    assert words.dtype == np.uint32
    assert hex(words[0]) == "0x3020100" and hex(words[3]) == "0xf0e0d0c"
    assert hex(words[4]) == "0x83828180" and hex(words[7]) == "0x8f8e8d8c"
    with pytest.raises(ValueError, match="16-bit code table"):
        nl.table_words(jnp.zeros((16,), jnp.float32))
    with pytest.raises(ValueError, match="16-bit code table"):
        nl.table_words(jnp.zeros((8,), jnp.bfloat16))


def _np_prmt(a, b, c):
    """prmt.b32 default mode from the PTX ISA text, one word at a time in Python ints."""
    src = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def test_emulated_prmt_matches_the_isa_definition():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    for c in (0x3210, 0x7654, 0xB9A8, 0x6240, 0x7351, 0xFFFF, 0x8888, 0x1F2E):
        got = np.asarray(nl._prmt(jnp.asarray(a), jnp.asarray(b), c))
        want = [_np_prmt(int(x), int(y), c) for x, y in zip(a, b)]
        np.testing.assert_array_equal(got, np.asarray(want, np.uint32))


def run_ptx(text: str, operands: dict[int, int]) -> dict[int, int]:
    """Interpret the emitted PTX (the instruction forms it uses) on Python ints; `operands`
    maps $i to input values; returns the final values of all $i."""
    regs = {f"${i}": v for i, v in operands.items()}
    mask = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return regs[tok]  # KeyError: a register read before it is written

    body = [ln.strip() for ln in text.splitlines()]
    assert body[0] == "{" and body[-1] == "}", "the program is one scoped block"
    declared = set()
    for ln in body[1:-1]:
        m = re.fullmatch(r"\.reg \.b32 (.+);", ln)
        if m:
            declared |= {r.strip() for r in m.group(1).split(",")}
            continue
        m = re.fullmatch(r"(\w+)\.b32 ([^,]+), (.+);", ln)
        assert m, f"unexpected PTX line: {ln!r}"
        op, dst, src = m.group(1), m.group(2), [s.strip() for s in m.group(3).split(",")]
        assert dst.startswith("$") or dst in declared, f"undeclared register {dst}"
        args = [val(s) for s in src]
        if op == "mov":
            out = args[0]
        elif op == "and":
            out = args[0] & args[1]
        elif op == "or":
            out = args[0] | args[1]
        elif op == "shr":
            out = args[0] >> args[1]
        elif op == "shl":
            out = (args[0] << args[1]) & mask
        elif op == "prmt":
            out = _np_prmt(*args)
        elif op == "lop3":
            a, b, c, lut = args
            out = 0
            for bit in range(32):
                idx = ((a >> bit & 1) << 2) | ((b >> bit & 1) << 1) | (c >> bit & 1)
                out |= (lut >> idx & 1) << bit
        else:
            raise AssertionError(f"instruction {op} not modelled")
        regs[dst] = out & mask
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


@pytest.mark.parametrize("dt", sorted(DTYPES16))
def test_emitted_ptx_computes_the_lookup(dt):
    """Each half's PTX text, with operands laid out as elementwise_inline_asm passes them for
    pack = 4 ($0, $1 the 16-bit-pair output, $2 the packed word, then each 32-bit table word 4
    times), gives code[hi nibble] / code[lo nibble] for every byte value."""
    code16 = jnp.asarray(NF4).astype(DTYPES16[dt])
    words = [int(w) for w in np.asarray(nl.table_words(code16))]
    table = np.asarray(code16).view(np.uint16)
    for half, nibble in (("hi", lambda b: b >> 4), ("lo", lambda b: b & 15)):
        text = nl._ptx(half)
        assert max(int(i) for i in re.findall(r"\$(\d+)", text)) < nl.N_OPERANDS
        for word in all_byte_words():
            ops = {2: int(word.astype(np.uint8).view(np.uint32)[0])}
            for i, w in enumerate(words):
                for copy in range(4):
                    ops[3 + 4 * i + copy] = w
            out = run_ptx(text, ops)
            got = np.asarray([out[0], out[1]], np.uint32).view(np.uint16)
            np.testing.assert_array_equal(got, table[nibble(word)], err_msg=half)


@pytest.mark.parametrize("half", ["hi", "lo"])
def test_outputs_are_written_last(half):
    """No output register is written before the last input read: without early-clobber
    constraints LLVM may give an output the register of an input."""
    lines = [ln for ln in nl._ptx(half).splitlines() if ln.endswith(";")
             and not ln.startswith(".")]
    first_out = min(i for i, ln in enumerate(lines) if re.match(r"\w+\.b32 \$[01],", ln))
    last_in = max(i for i, ln in enumerate(lines)
                  if any(int(k) >= 2 for k in re.findall(r"\$(\d+)", ln.split(",", 1)[1])))
    assert last_in < first_out


def test_lookup_rejects_bad_arguments():
    with pytest.raises(ValueError, match="uint8"):
        nl.lookup(jnp.zeros((4, 4), jnp.int32), [jnp.uint32(0)] * 8, jnp.bfloat16, "hi",
                  interpret=True)
    with pytest.raises(ValueError, match="half must be"):
        nl.lookup(jnp.zeros((4, 4), jnp.uint8), [jnp.uint32(0)] * 8, jnp.bfloat16, "both",
                  interpret=True)
