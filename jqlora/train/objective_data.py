"""What DPO and GRPO share on the host: the order their rows are drawn in, and their tokenizer."""
from __future__ import annotations

import numpy as np

__all__ = ["EpochOrder", "resolve_tokenizer"]


class EpochOrder:
    """Indices ``0..n-1`` in shuffled passes: the permutation of epoch ``e`` is a pure function of
    ``(seed, e)``, and a draw crossing a pass boundary continues into the next pass. The position
    ``{"epoch", "index"}`` restores exactly."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = int(n), int(seed), bool(shuffle)
        self.epoch = self.index = 0

    def _perm(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(self.n)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            perm = self._perm(self.epoch)
            j = min(self.n, self.index + k - len(out))
            out.extend(int(i) for i in perm[self.index:j])
            self.index = j
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def resolve_tokenizer(config, tokenizer, model, *_):
    """``(tokenizer, special tokens, model vocab size or None)`` for a task: ``tokenizer`` or the
    one at ``config.tokenizer_path``, checked against the model's vocabulary."""
    from .tokenization import check_tokenizer_fits, load_tokenizer, special_tokens

    if tokenizer is None:
        if config.tokenizer_path is None:
            raise ValueError("no tokenizer: pass tokenizer=... or set TrainConfig.tokenizer_path")
        tokenizer = load_tokenizer(config.tokenizer_path, chat_template=config.chat_template)
    cfg = getattr(model, "config", None)
    vocab = cfg.get("vocab_size") if isinstance(cfg, dict) else getattr(cfg, "vocab_size", None)
    if vocab is not None:
        check_tokenizer_fits(tokenizer, vocab)
    special = special_tokens(tokenizer, bos=config.bos, eos=config.eos, tokenizer_path=config.tokenizer_path)
    return tokenizer, special, vocab
