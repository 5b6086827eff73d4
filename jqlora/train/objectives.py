"""The settings of the objectives besides SFT (DPO, GRPO): their choices and checks. Nothing heavy
is imported here: `TrainConfig.validate` (and so `jqlora train --help`) uses it without jax."""
from __future__ import annotations

import math

__all__ = ["DPO_LOSSES", "GRPO_LOSSES", "SCALE_REWARDS", "validate_objective", "reward_weight_list"]

DPO_LOSSES = ("sigmoid", "ipo", "hinge")
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


def reward_weight_list(config) -> list[float]:
    """The weight of each reward function: ``reward_weights`` ("1,0.5" or a list), default 1 each.

    Raises:
      ValueError: not numbers, a NaN/Inf, or not one per reward function.
    """
    rewards = list(config.reward or [])
    given = config.reward_weights
    if given is None:
        return [1.0] * len(rewards)
    parts = given.split(",") if isinstance(given, str) else list(given)
    try:
        weights = [float(w) for w in parts]
    except (TypeError, ValueError):
        raise ValueError(f"TrainConfig.reward_weights must be numbers separated by commas, got {given!r}") from None
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"TrainConfig.reward_weights must be finite, got {given!r}")
    if len(weights) != len(rewards):
        raise ValueError(f"TrainConfig.reward_weights has {len(weights)} weight(s) for {len(rewards)} "
                         f"reward function(s) ({', '.join(rewards) or 'none'})")
    return weights


def validate_objective(config) -> None:
    """Check the fields of ``config.objective`` ("dpo" or "grpo"). Raises ValueError naming the field."""
    def need(ok, message):
        if not ok:
            raise ValueError(f"TrainConfig.{message}")

    if config.objective == "dpo":
        need(config.dpo_loss in DPO_LOSSES, f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {config.dpo_loss!r}")
        need(config.dpo_beta > 0 and math.isfinite(config.dpo_beta), f"dpo_beta must be > 0, got {config.dpo_beta}")
        need(0 <= config.dpo_label_smoothing < 0.5,
             f"dpo_label_smoothing must be in [0, 0.5), got {config.dpo_label_smoothing}")
        need(config.dpo_label_smoothing == 0 or config.dpo_loss == "sigmoid",
             f"dpo_label_smoothing applies to dpo_loss 'sigmoid' only, not {config.dpo_loss!r}")
        return
    need(config.eval_data_path is None and config.eval_every is None,
         "eval_data_path / eval_every: GRPO has no held-out evaluation (its rewards are logged every step)")
    if isinstance(config.reward, str):  # one function given as a string (a config file, the API)
        config.reward = [config.reward]
    need(config.reward, "reward is empty: GRPO needs at least one reward function "
                        "(--reward module:function, or path/to/file.py:function)")
    for r in config.reward:
        need(isinstance(r, str) and ":" in r, f"reward {r!r} must be 'module:function' or 'file.py:function'")
    reward_weight_list(config)
    need(config.grpo_loss in GRPO_LOSSES, f"grpo_loss must be one of {', '.join(GRPO_LOSSES)}, got {config.grpo_loss!r}")
    need(config.scale_rewards in SCALE_REWARDS,
         f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {config.scale_rewards!r}")
    need(int(config.num_generations) >= 2, f"num_generations must be >= 2 (a group), got {config.num_generations}")
    need(int(config.max_completion_length) >= 1,
         f"max_completion_length must be >= 1, got {config.max_completion_length}")
    need(config.temperature > 0, f"temperature must be > 0 for sampling, got {config.temperature}")
    need(0 < config.top_p <= 1, f"top_p must be in (0, 1], got {config.top_p}")
    need(config.grpo_beta >= 0, f"grpo_beta must be >= 0, got {config.grpo_beta}")
    need(config.epsilon >= 0, f"epsilon must be >= 0, got {config.epsilon}")
    need(config.epsilon_high is None or config.epsilon_high >= 0,
         f"epsilon_high must be >= 0 or None, got {config.epsilon_high}")
