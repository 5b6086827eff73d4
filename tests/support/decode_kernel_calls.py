"""Which decoding steps ran the decoding kernels: a test wraps a door and reads its calls."""
from __future__ import annotations


def record_kernel_calls(monkeypatch) -> list[dict]:
    """Wrap the attention kernels' doors, `jqlora.ops.cached_attention.decode_attention` and
    `decode_attention_step`, for the test; the returned list gets each call's keyword arguments
    (scale, cap, window, backend) and "kernel" (the door's name) as it is traced."""
    from jqlora.ops import cached_attention

    calls: list[dict] = []
    for name in ("decode_attention", "decode_attention_step"):
        real = getattr(cached_attention, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append({**kwargs, "kernel": _name})
            return _real(*args, **kwargs)

        monkeypatch.setattr(cached_attention, name, recorded)
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
