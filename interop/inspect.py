"""What a (bitsandbytes-quantized or plain) Hugging Face checkpoint holds: per entry its format,
shape and bytes, and totals with the effective bits per parameter.

`jqlora inspect` prints this as a table; the demo reports the totals. Every tensor is read and
validated through `interop.load_bnb_checkpoint`, so a malformed checkpoint raises its
`CheckpointError` (naming the file and tensor) here too.
"""
from __future__ import annotations

import math
from pathlib import Path

from interop.errors import CheckpointError


def _entry(name: str, value) -> dict:
    """One row: a quantized linear layer (Weight4bit / Int8Weight) or a plain tensor."""
    from jqlora import quant

    if isinstance(value, quant.Weight4bit):
        return dict(name=name, kind=value.quant_type, blocksize=int(value.blocksize), nested=bool(value.nested),
                    dtype=value.stored_dtype, shape=[int(d) for d in value.shape], bytes=int(value.nbytes),
                    params=int(value.numel), quantized=True)
    if isinstance(value, quant.Int8Weight):
        return dict(name=name, kind="int8", blocksize=None, nested=False, dtype=value.stored_dtype,
                    shape=[int(d) for d in value.shape], bytes=int(value.nbytes),
                    params=int(math.prod(value.shape)), quantized=True, threshold=float(value.threshold))
    shape = [int(d) for d in getattr(value, "shape", ())]
    nbytes = int(getattr(value, "nbytes", 0))
    return dict(name=name, kind="plain", blocksize=None, nested=False, dtype=str(value.dtype), shape=shape,
                bytes=nbytes, params=int(math.prod(shape)), quantized=False)


def inspect_checkpoint(path) -> dict:
    """Read a checkpoint (on the CPU) and describe every entry.

    Args:
      path: a checkpoint directory (config.json + model.safetensors or a sharded index), or one
        .safetensors file with config.json beside it.

    Returns:
      {"path", "model_type", "files", "quantization", "tensors": [row, ...], "totals": {...}}. A row
      has name (module name of a quantized linear layer, else the tensor key), kind (nf4, fp4,
      int8 or plain), blocksize, nested, dtype, shape, bytes, params, quantized. The totals count
      entries by kind, bytes and parameters (quantized, plain, all), bits per parameter overall
      and over the quantized weights, and the bytes of the files on disk.

    Raises:
      CheckpointError: `path` does not exist, or the checkpoint is malformed (the message names
        the file and tensor).
    """
    import jax

    from interop.bnb_load import load_bnb_checkpoint

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    ckpt_dir = path.parent if path.is_file() else path
    params, config = load_bnb_checkpoint(ckpt_dir, device=jax.devices("cpu")[0])
    rows = [_entry(k, v) for k, v in sorted(params.items())]
    q = [r for r in rows if r["quantized"]]
    pl = [r for r in rows if not r["quantized"]]
    qb, pb = sum(r["bytes"] for r in q), sum(r["bytes"] for r in pl)
    qp, pp = sum(r["params"] for r in q), sum(r["params"] for r in pl)
    files = sorted(str(p) for p in ckpt_dir.glob("*.safetensors"))
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    totals = dict(
        entries=len(rows), by_kind=kinds,
        quantized_bytes=qb, plain_bytes=pb, total_bytes=qb + pb,
        quantized_params=qp, plain_params=pp, params=qp + pp,
        bits_per_param=(8.0 * (qb + pb) / (qp + pp)) if qp + pp else None,
        bits_per_quantized_param=(8.0 * qb / qp) if qp else None,
        file_bytes=sum(Path(f).stat().st_size for f in files),
    )
    qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else None
    return dict(path=str(ckpt_dir), model_type=config.get("model_type"), files=files,
                quantization=qc, tensors=rows, totals=totals)


__all__ = ["inspect_checkpoint"]
