"""The code tables bitsandbytes uses, hard-coded to the bit (docs/bnb_format.md §1.1, §6).

Functions return fresh read-only numpy arrays: no shared mutable module state.
Regenerating these with numpy differs from torch in the last ulp, so they are bit patterns.
"""
from __future__ import annotations

import numpy as np

_NF4_BITS = (
    0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0, 0xBE91A24D, 0xBE3D353F, 0xBDBA7871, 0x00000000,
    0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A, 0x3EE1A4B8, 0x3F1007AB, 0x3F3913B3, 0x3F800000,
)
_FP4_POSITIVE_BITS = (0x00000000, 0x3BAAAAAB, 0x3F2AAAAB, 0x3F800000, 0x3EAAAAAB, 0x3F000000, 0x3E2AAAAB, 0x3E800000)

_DYNAMIC_POSITIVE_BITS = (  # dyn[128..255]
    0x3513A3B7, 0x365A1A94, 0x370205FF, 0x37B24206, 0x38378034, 0x388AEFB3, 0x38BA1F4B, 0x3923D70B,
    0x398CE705, 0x39C7E283, 0x3A016F01, 0x3A1EECC1, 0x3A3C6A80, 0x3A59E83E, 0x3A7765FF, 0x3AA7EF9D,
    0x3AF1A9FC, 0x3B1DB22D, 0x3B428F5C, 0x3B676C8A, 0x3B8624DD, 0x3B989374, 0x3BAB020D, 0x3BBD70A4,
    0x3BCFDF3B, 0x3BE24DD3, 0x3BF4BC6A, 0x3C039581, 0x3C0CCCCD, 0x3C160418, 0x3C1F3B64, 0x3C3AE148,
    0x3C68F5C3, 0x3C8B851F, 0x3CA28F5D, 0x3CB9999A, 0x3CD0A3D7, 0x3CE7AE15, 0x3CFEB852, 0x3D0AE148,
    0x3D166667, 0x3D21EB85, 0x3D2D70A3, 0x3D38F5C3, 0x3D447AE1, 0x3D500000, 0x3D5B851F, 0x3D670A3D,
    0x3D728F5D, 0x3D7E147B, 0x3D84CCCD, 0x3D8A8F5D, 0x3D9051EB, 0x3D96147B, 0x3D9BD70A, 0x3DA1999A,
    0x3DA75C2A, 0x3DAD1EB8, 0x3DB2E148, 0x3DB8A3D7, 0x3DBE6667, 0x3DC428F7, 0x3DC9EB85, 0x3DDB3334,
    0x3DF80000, 0x3E0A6666, 0x3E18CCCD, 0x3E273333, 0x3E35999A, 0x3E440000, 0x3E526666, 0x3E60CCCD,
    0x3E6F3333, 0x3E7D9999, 0x3E860000, 0x3E8D3334, 0x3E946666, 0x3E9B999A, 0x3EA2CCCC, 0x3EAA0000,
    0x3EB13333, 0x3EB86666, 0x3EBF999A, 0x3EC6CCCC, 0x3ECE0000, 0x3ED53333, 0x3EDC6666, 0x3EE3999A,
    0x3EEACCCC, 0x3EF20000, 0x3EF93332, 0x3F003333, 0x3F03CCCC, 0x3F076666, 0x3F0B0000, 0x3F0E999A,
    0x3F123334, 0x3F15CCCD, 0x3F196666, 0x3F1D0000, 0x3F20999A, 0x3F243334, 0x3F27CCCD, 0x3F2B6666,
    0x3F2F0000, 0x3F32999A, 0x3F363334, 0x3F39CCCD, 0x3F3D6666, 0x3F410000, 0x3F44999A, 0x3F483333,
    0x3F4BCCCD, 0x3F4F6666, 0x3F530000, 0x3F56999A, 0x3F5A3333, 0x3F5DCCCD, 0x3F616666, 0x3F650000,
    0x3F68999A, 0x3F6C3333, 0x3F6FCCCD, 0x3F736666, 0x3F770000, 0x3F7A999A, 0x3F7E3333, 0x3F800000,
)

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256


def _from_bits(bits) -> np.ndarray:
    out = np.array(bits, dtype=np.uint32).view(np.float32)
    out.setflags(write=False)
    return out


def nf4_code() -> np.ndarray:
    """The 16 NF4 values, float32, sorted ascending (code 7 is exactly 0)."""
    return _from_bits(_NF4_BITS)


def fp4_code() -> np.ndarray:
    """The 16 FP4 values, float32, in code order (bit 3 is the sign).

    Code 8 is +0.0, not -0.0: bitsandbytes' get_4bit_type("fp4") holds +0.0 there, and the
    sign of a dequantized zero must match it bit for bit.
    """
    return _from_bits(_FP4_POSITIVE_BITS + (0,) + tuple(b | 0x80000000 for b in _FP4_POSITIVE_BITS[1:]))


def code_4bit(quant_type: str) -> np.ndarray:
    if quant_type == "nf4":
        return nf4_code()
    if quant_type == "fp4":
        return fp4_code()
    raise ValueError(f"unknown 4-bit quant_type {quant_type!r}; expected one of {QUANT_TYPES}")


def dynamic_map() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (256 float32 values, sorted, 0 at index 127)."""
    pos = np.array(_DYNAMIC_POSITIVE_BITS, dtype=np.uint32)
    neg = pos[:127][::-1] | np.uint32(0x80000000)
    out = np.concatenate([neg, np.zeros(1, np.uint32), pos]).view(np.float32)
    out.setflags(write=False)
    return out
