"""`jqlora export-peft` and `jqlora import-peft`: training checkpoints <-> PEFT adapter directories."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from jqlora.cli._common import CLIError, load_config_file

# ============================================================================== export-peft
EXPORT_DESCRIPTION = """\
Turn a jqlora training checkpoint into a PEFT LoRA adapter directory (adapter_config.json +
adapter_model.safetensors, float32) that peft.PeftModel.from_pretrained, `jqlora generate
--adapter`, `jqlora crosscheck --adapter` and `jqlora train --init-adapter` load.

SOURCE is a training output directory (as written by `jqlora train`), its checkpoints/
directory, or one checkpoints/step_XXXXXXXX directory; without --step the newest checkpoint is
used. The base model and LoRA settings come from <out_dir>/jqlora_run.json (written by `jqlora
train`); --model overrides the base model path. The checkpoint is validated (checksums, keys,
shapes) while it is restored into the model."""


def _export_args(p):
    p.add_argument("source", help="training out_dir, its checkpoints/ dir, or a step_XXXXXXXX dir")
    p.add_argument("out", help="adapter directory to write")
    p.add_argument("--step", type=int, default=None, help="export this step's checkpoint (default: newest)")
    p.add_argument("--model", default=None, help="base checkpoint (default: the one in jqlora_run.json)")


def _find_run_file(source: Path):
    from jqlora.cli.train_cmd import RUN_FILE

    for d in (source, source.parent, source.parent.parent):
        if (d / RUN_FILE).is_file():
            return d / RUN_FILE
    return None


def _find_checkpoint(source: Path, step):
    from jqlora.train import list_checkpoints

    if (source / "state.json").is_file():
        if step is not None and not source.name.endswith(f"{step:08d}"):
            raise CLIError(f"{source} is a single checkpoint; --step {step} does not name it")
        return source
    for root in (source / "checkpoints", source):
        cks = list_checkpoints(root)
        if cks:
            if step is None:
                return cks[-1][1]
            for s, p in cks:
                if s == step:
                    return p
            raise CLIError(f"{root}: no checkpoint for step {step} (have {[s for s, _ in cks]})")
    raise CLIError(f"{source}: no training checkpoint found (expected checkpoints/step_XXXXXXXX)")


def export_adapter(source, out, *, step=None, model_path=None) -> dict:
    """Library form of `jqlora export-peft`; returns a summary dict."""
    source = Path(source)
    if not source.exists():
        raise CLIError(f"{source}: no such directory")
    ckpt = _find_checkpoint(source, step)
    run_file = _find_run_file(ckpt.parent if ckpt.parent.name == "checkpoints" else ckpt)
    if run_file is None:
        run_file = _find_run_file(source)
    if run_file is None:
        raise CLIError(f"no jqlora_run.json found near {ckpt}: it records the base model and LoRA settings "
                       "(written by `jqlora train`)")
    run = load_config_file(run_file)
    model_path = model_path or run.get("model")
    if not model_path:
        raise CLIError(f"{run_file}: no 'model' recorded; pass --model")
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"{ckpt / 'state.json'}: cannot read: {e}") from None
    tc = (state.get("extra") or {}).get("train_config") or run.get("train") or {}

    from jqlora.cli._common import jnp_dtype, quiet_third_party

    quiet_third_party()
    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import LoraConfig
    from jqlora.train import TrainConfig, make_optimizer, restore_checkpoint

    lcfg = run.get("lora") or {}
    targets = lcfg.get("target_modules")
    lora_cfg = LoraConfig(rank=int(lcfg["rank"]), alpha=float(lcfg["alpha"]), dropout=float(lcfg.get("dropout", 0.0)),
                          target_modules=targets if isinstance(targets, str) else tuple(targets),
                          use_rslora=bool(lcfg.get("use_rslora", False)))
    model = models.load_causal_lm(model_path, lora=lora_cfg, compute_dtype=jnp_dtype(run.get("compute_dtype", "float32")),
                                  quantize=run.get("quantize"), rngs=nnx.Rngs(0))
    d = TrainConfig()
    g = lambda k: tc.get(k, getattr(d, k))  # noqa: E731
    tx = make_optimizer(g("lr"), g("warmup"), g("steps"), g("weight_decay"), g("b1"), g("b2"), g("grad_clip"),
                        final_lr_ratio=g("final_lr_ratio"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _, step_done = restore_checkpoint(ckpt, model, optimizer)
    adapters.save_adapter(out, model, lora_cfg, base_model=str(model_path))
    from jqlora.lora import lora_params_by_module

    n = len(lora_params_by_module(model))
    return dict(checkpoint=str(ckpt), step=step_done, adapter=str(out), modules=n, model=str(model_path),
                rank=lora_cfg.rank, alpha=lora_cfg.alpha)


def _export_run(args) -> int:
    r = export_adapter(args.source, args.out, step=args.step, model_path=args.model)
    print(f"exported step {r['step']} ({r['checkpoint']}): {r['modules']} LoRA modules, r={r['rank']}, "
          f"alpha={r['alpha']:g} -> {r['adapter']}")
    return 0


export = types.SimpleNamespace(
    HELP="a training checkpoint -> a PEFT adapter directory", DESCRIPTION=EXPORT_DESCRIPTION,
    add_arguments=_export_args, run=_export_run)


# ============================================================================== import-peft
IMPORT_DESCRIPTION = """\
Check that a PEFT LoRA adapter (from PEFT, or from export-peft) applies to a model in jqlora,
and show what it does. Loads the adapter (interop.load_peft_adapter: format, ranks), maps its
adapter_config.json onto a jqlora LoraConfig (rank, alpha, rsLoRA, target_modules), loads the
model with jqlora.models.load_causal_lm and sets every adapter module's weights (strict: an
adapter module that is not a linear layer of the model, a shape mismatch or an unsupported
option such as DoRA or rank_pattern is an error, exit 2). Then reports the modules matched,
the model's linear layers the adapter leaves alone, the LoRA parameter count, and how much the
adapter changes the logits on random tokens (0 means a no-op adapter, e.g. untrained B = 0).

The model defaults to the adapter's base_model_name_or_path when that is a local directory.
Once it checks out, use the adapter with `jqlora generate MODEL --adapter DIR`,
`jqlora crosscheck MODEL --adapter DIR` (against PEFT in torch) or continue training it with
`jqlora train --init-adapter DIR`."""


def _import_args(p):
    p.add_argument("adapter", help="PEFT adapter directory")
    p.add_argument("--model", default=None, help="base checkpoint (default: adapter_config's base_model_name_or_path)")
    p.add_argument("--tokens", type=int, default=16, help="random tokens per row for the logits-change check")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def import_adapter(adapter, model_path=None, *, tokens: int = 16, dtype: str = "float32") -> dict:
    """Library form of `jqlora import-peft`; returns the report dict."""
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise CLIError(f"{adapter}: no such adapter directory")
    from jqlora.cli._common import jnp_dtype, quiet_third_party

    quiet_third_party()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jqlora import adapters, models
    from jqlora.lora import lora_scale
    from jqlora.train.frozen_jit import frozen_jit

    lora_cfg, params, raw = adapters.load_adapter(adapter)
    if model_path is None:
        base = raw.get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise CLIError(f"{adapter}: pass --model (adapter_config's base_model_name_or_path {base!r} is not a "
                           "local directory)")
        model_path = base
    cdt = jnp_dtype(dtype)
    model, report, _ = adapters.load_model_with_adapter(model_path, adapter, compute_dtype=cdt)
    base_model = models.load_causal_lm(model_path, compute_dtype=cdt)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, max(1, tokens)))
    fwd = frozen_jit(lambda m, x: m(x))  # the weights stay inputs only (no output copy)
    model.eval()
    y1 = np.asarray(jax.device_get(fwd(model, jnp.asarray(ids)).astype(jnp.float32)))
    y0 = np.asarray(jax.device_get(fwd(base_model, jnp.asarray(ids)).astype(jnp.float32)))
    delta = float(np.max(np.abs(y1 - y0)))
    b_zero = sorted(m for m, p in params.items() if not np.any(np.asarray(p["lora_B"], np.float32)))
    targets = lora_cfg.target_modules
    return dict(
        adapter=str(adapter), model=str(model_path), rank=lora_cfg.rank, alpha=lora_cfg.alpha,
        use_rslora=lora_cfg.use_rslora, scale=lora_scale(lora_cfg.rank, lora_cfg.alpha, lora_cfg.use_rslora),
        dropout=lora_cfg.dropout, target_modules=targets if isinstance(targets, str) else list(targets),
        matched=report["matched"], untouched=report["untouched"], lora_params=report["lora_params"],
        zero_B_modules=b_zero, logits_max_abs_change=delta, logits_max_abs=float(np.max(np.abs(y0))),
        tokens_shape=list(ids.shape))


def _import_run(args) -> int:
    r = import_adapter(args.adapter, args.model, tokens=args.tokens, dtype=args.dtype)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"adapter {r['adapter']} -> model {r['model']}")
    print(f"  r={r['rank']} alpha={r['alpha']:g} scale={r['scale']:g} rslora={r['use_rslora']} "
          f"dropout={r['dropout']:g} targets={r['target_modules']}")
    print(f"  matched {len(r['matched'])} modules ({r['lora_params']} LoRA parameters); "
          f"{len(r['untouched'])} linear layers without LoRA" + (f" (e.g. {r['untouched'][0]})" if r["untouched"] else ""))
    if r["zero_B_modules"]:
        print(f"  note: {len(r['zero_B_modules'])} modules have lora_B == 0 (no effect), e.g. {r['zero_B_modules'][0]}")
    print(f"  logits change vs the base model on {tuple(r['tokens_shape'])} random tokens: max |delta| = "
          f"{r['logits_max_abs_change']:.4e} (max |logit| {r['logits_max_abs']:.3e})")
    print("OK: the adapter applies to this model", file=sys.stderr)
    return 0


import_ = types.SimpleNamespace(
    HELP="check a PEFT adapter against a model: modules matched, shapes, effect on logits",
    DESCRIPTION=IMPORT_DESCRIPTION, add_arguments=_import_args, run=_import_run)
