"""Which decoding steps ran the decoding kernels: a test wraps a door and reads its calls."""
from __future__ import annotations


def record_kernel_calls(monkeypatch) -> list[dict]:
    """Wrap `jqlora.ops.cached_attention.decode_attention` for the test; the returned list gets each
    call's keyword arguments (scale, cap, window, backend) as it is traced."""
    from jqlora.ops import cached_attention

    calls: list[dict] = []
    real = cached_attention.decode_attention

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(cached_attention, "decode_attention", recorded)
    return calls


def record_norm_calls(monkeypatch) -> list[dict]:
    """Wrap `jqlora.ops.decode_norm.add_rms_norm` for the test; the returned list gets each call's
    keyword arguments and the shape of its delta (None: a norm without a residual add)."""
    from jqlora.ops import decode_norm

    calls: list[dict] = []
    real = decode_norm.add_rms_norm

    def recorded(x, delta, weight, **kwargs):
        calls.append({**kwargs, "delta_shape": None if delta is None else tuple(delta.shape)})
        return real(x, delta, weight, **kwargs)

    monkeypatch.setattr(decode_norm, "add_rms_norm", recorded)
    return calls
