"""Which decoding steps ran the `decode_attention` kernel: a test wraps the door and reads the calls."""
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
