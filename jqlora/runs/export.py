"""A run's training checkpoint exported as a PEFT adapter directory (`jqlora export-peft`; merge
and GGUF export start from it)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from jqlora.runs.config_file import RunError
from jqlora.runs.locate import find_checkpoint, find_run_file
from jqlora.runs.settings import RunSettings
from jqlora.train.config import TrainConfig


def export_adapter(source, out, *, step: Optional[int] = None, model_path=None) -> dict[str, Any]:
    """Restore a run's training checkpoint into its model and write the LoRA weights as a PEFT
    adapter directory (what `jqlora export-peft` does).

    The base model and LoRA settings come from the run record; the checkpoint is validated
    (checksums, keys, shapes) while it is restored.

    Args:
      source: a run directory, its checkpoints/ directory, or one step directory.
      out: the adapter directory to write.
      step: the checkpoint's step (None: the newest).
      model_path: the base checkpoint (None: the `model` of the run record).

    Returns:
      {"checkpoint", "step", "adapter", "modules", "model", "rank", "alpha"}.

    Raises:
      RunError: no such source, no checkpoint, no run record, or no model recorded.
    """
    source = Path(source)
    if not source.exists():
        raise RunError(f"{source}: no such directory")
    ckpt = find_checkpoint(source, step)
    run_file = find_run_file(ckpt.parent if ckpt.parent.name == "checkpoints" else ckpt)
    if run_file is None:
        run_file = find_run_file(source)
    if run_file is None:
        raise RunError(f"no jqlora_run.json found near {ckpt}: it records the base model and LoRA settings "
                       "(written by `jqlora train`)")
    run = RunSettings.read(run_file)
    model_path = model_path or run.model.model
    if not model_path:
        raise RunError(f"{run_file}: no 'model' recorded; pass --model")
    from jqlora.train.checkpoint import CheckpointError, read_state

    try:
        state = read_state(ckpt)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    tc = (state.get("extra") or {}).get("train_config") or dataclasses.asdict(run.train)

    from jqlora._util import jnp_dtype, quiet_third_party

    quiet_third_party()
    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import lora_params_by_module
    from jqlora.train import make_optimizer, restore_checkpoint

    lora_cfg = run.lora.to_config()
    model = models.load_causal_lm(model_path, lora=lora_cfg,
                                  compute_dtype=jnp_dtype(run.model.compute_dtype or "float32"),
                                  quantize=run.model.quantize, quantize_experts=run.model.quantize_experts,
                                  rngs=nnx.Rngs(0))
    d = TrainConfig()
    g = lambda k: tc.get(k, getattr(d, k))  # noqa: E731
    tx = make_optimizer(g("lr"), g("warmup"), g("steps"), g("weight_decay"), g("b1"), g("b2"), g("grad_clip"),
                        final_lr_ratio=g("final_lr_ratio"), lr_schedule=g("lr_schedule"),
                        optimizer=g("optimizer"))  # a record without it: TrainConfig's "adamw"
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _, step_done = restore_checkpoint(ckpt, model, optimizer)
    adapters.save_adapter(out, model, lora_cfg, base_model=str(model_path))
    n = len(lora_params_by_module(model))
    return dict(checkpoint=str(ckpt), step=step_done, adapter=str(out), modules=n, model=str(model_path),
                rank=lora_cfg.rank, alpha=lora_cfg.alpha)
