"""Tokenizers and tokenization: load a tokenizer, resolve its BOS/EOS/PAD ids, and turn
:class:`~jqlora.train.examples.Example` objects into token ids and training-target masks; a data
source is tokenized as it streams (:func:`tokenize_source`), only the token arrays kept."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from .examples import DataError, Example, Schema, read_examples

__all__ = [
    "check_data",
    "tokenize_source",
    "SpecialTokens",
    "load_tokenizer",
    "check_tokenizer_fits",
    "special_tokens",
    "tokenize_example",
    "tokenize_examples",
]

# Names tried (in order) when the tokenizer has no tokenizer_config.json saying which is which.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>", "<|startoftext|>", "<BOS>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>", "<|endoftext|>", "<EOS>",
              "<|im_end|>", "<|eot_id|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>", "<PAD>")


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike, *, chat_template: str | os.PathLike | None = None):
    """Load the tokenizer of a Hugging Face folder or a lone tokenizer.json: a
    :class:`jqlora.tokenizer.HFTokenizer` (a ``tokenizers.Tokenizer`` with the folder's special
    tokens and chat template).

    Args:
      path: tokenizer.json or a directory holding it (and tokenizer_config.json,
        chat_template.jinja).
      chat_template: a Jinja file that replaces the folder's chat template.
    """
    from jqlora.tokenizer import TokenizerError, load_hf_tokenizer

    try:
        return load_hf_tokenizer(path, chat_template=chat_template)
    except TokenizerError as e:
        raise DataError(str(e)) from None


def _max_token_id(tokenizer) -> int:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) if vocab else -1


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Raise :class:`DataError` unless every token id of ``tokenizer`` is < ``vocab_size``.

    A model may have more rows than the tokenizer has tokens (padded embeddings); never fewer.
    """
    n = _max_token_id(tokenizer) + 1
    if n > int(vocab_size):
        raise DataError(
            f"tokenizer has token ids up to {n - 1} (needs vocab_size >= {n}) but the model's "
            f"vocab_size is {vocab_size}: wrong tokenizer for this model?")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Ids added around every example. ``None`` = not added. ``pad_id`` fills padding slots
    (they carry no loss, so any valid id works)."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int = 0


def _config_token(config: dict, key: str) -> str | None:
    v = config.get(key)
    if isinstance(v, dict):  # {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _resolve_one(tokenizer, spec, *, what: str, names: Sequence[str], config_name: str | None):
    if spec is None or spec is False:
        return None
    if isinstance(spec, bool) or spec == "auto":
        # True or "auto": from tokenizer_config.json if given, else well-known names.
        if config_name is not None:
            tid = tokenizer.token_to_id(config_name)
            if tid is not None:
                return int(tid)
        for name in names:
            tid = tokenizer.token_to_id(name)
            if tid is not None:
                return int(tid)
        if spec is True:
            raise DataError(f"tokenizer has no {what} token (tried {', '.join(names)}); "
                            f"pass {what}=<token or id> or {what}=None")
        return None
    if isinstance(spec, (int, np.integer)):
        if not 0 <= int(spec) <= _max_token_id(tokenizer):
            raise DataError(f"{what} id {spec} is outside the tokenizer's vocabulary")
        return int(spec)
    if isinstance(spec, str):
        tid = tokenizer.token_to_id(spec)
        if tid is None:
            raise DataError(f"{what} token {spec!r} is not in the tokenizer's vocabulary")
        return int(tid)
    raise TypeError(f"{what}: expected 'auto', True, None, a token string or an id; got {spec!r}")


def special_tokens(tokenizer, *, bos="auto", eos="auto", pad="auto",
                   tokenizer_path: str | os.PathLike | None = None) -> SpecialTokens:
    """Resolve BOS/EOS/PAD ids.

    Each of ``bos``/``eos``/``pad`` is ``"auto"`` (use the tokenizer's token if it has one, else
    don't add it), ``True`` (like auto, but an error if missing), ``None``/``False`` (don't add), a
    token string, or an id. "The tokenizer's token" comes from a ``tokenizer_config.json`` beside
    ``tokenizer_path`` when there is one (``bos_token``/``eos_token``/``pad_token``), else from
    the special tokens the tokenizer was loaded with (:func:`load_tokenizer`), else from
    well-known names (``<s>``, ``<|begin_of_text|>``, ``</s>``, ``<|endoftext|>``, ...).
    Padding falls back to EOS, then 0.
    """
    from jqlora.tokenizer import TokenizerError, read_tokenizer_config

    config: dict = dict(getattr(tokenizer, "special_tokens", None) or {})
    if tokenizer_path is not None:
        try:
            file_config = read_tokenizer_config(tokenizer_path)
        except TokenizerError as e:
            raise DataError(str(e)) from None
        if file_config is not None:
            config = file_config
    bos_id = _resolve_one(tokenizer, bos, what="bos", names=_BOS_NAMES,
                          config_name=_config_token(config, "bos_token"))
    eos_id = _resolve_one(tokenizer, eos, what="eos", names=_EOS_NAMES,
                          config_name=_config_token(config, "eos_token"))
    pad_id = _resolve_one(tokenizer, pad, what="pad", names=_PAD_NAMES,
                          config_name=_config_token(config, "pad_token"))
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else 0
    return SpecialTokens(bos_id, eos_id, pad_id)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids) if text else []


def tokenize_example(tokenizer, example: Example, special: SpecialTokens
                     ) -> tuple[np.ndarray, np.ndarray]:
    """-> ``(ids int32 (n,), trained bool (n,))``; ``trained[i]`` says whether token ``i`` is a
    training target. BOS (if any) is never a target; EOS (if any) is. A conversation gets the
    ids of its chat template (no BOS/EOS added), its assistant tokens the targets."""
    where = example.where
    if example.messages is not None:
        return _tokenize_chat(tokenizer, example.messages, where)
    bos = [special.bos_id] if special.bos_id is not None else []
    eos = [special.eos_id] if special.eos_id is not None else []
    if example.text is not None:
        body = _encode(tokenizer, example.text)
        ids = bos + body + eos
        trained = [False] * len(bos) + [True] * (len(body) + len(eos))
    else:
        p = _encode(tokenizer, example.prompt)
        c = _encode(tokenizer, example.completion)
        if not c:
            raise DataError(f"{where}: completion tokenizes to no tokens")
        ids = bos + p + c + eos
        trained = [False] * (len(bos) + len(p)) + [True] * (len(c) + len(eos))
    if len(ids) < 2:
        raise DataError(f"{where}: example tokenizes to {len(ids)} token(s); need at least 2 "
                        f"(one input, one target)")
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


def _tokenize_chat(tokenizer, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
    from jqlora.tokenizer import TokenizerError

    if not callable(getattr(tokenizer, "chat_ids_and_mask", None)):
        raise DataError(f"{where}: a 'messages' line needs a tokenizer with a chat template "
                        "(load it with jqlora.train.load_tokenizer from its Hugging Face folder)")
    try:
        ids, trained = tokenizer.chat_ids_and_mask(messages)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    if not trained.any():
        raise DataError(f"{where}: the chat template renders no assistant tokens")
    if len(ids) < 2:
        raise DataError(f"{where}: conversation tokenizes to {len(ids)} token(s)")
    return ids, trained


def tokenize_examples(tokenizer, examples: Sequence[Example], special: SpecialTokens
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [tokenize_example(tokenizer, ex, special) for ex in examples]


def check_data(data_path: str | os.PathLike, tokenizer, special: SpecialTokens, *,
               format: str = "auto", vocab_size: int | None = None, schema: Schema | None = None,
               split: str | None = None) -> dict:
    """Read, validate and tokenize a whole data source (what training does first), so that a bad
    row is reported before a model is loaded: :func:`tokenize_source`'s summary."""
    return tokenize_source(data_path, tokenizer, special, format=format, vocab_size=vocab_size,
                           schema=schema, split=split)[0]


def tokenize_source(data_path: str | os.PathLike, tokenizer, special: SpecialTokens, *,
                    format: str = "auto", vocab_size: int | None = None, schema: Schema | None = None,
                    split: str | None = None) -> tuple[dict, list[tuple[np.ndarray, np.ndarray]]]:
    """Read, validate and tokenize a data source a row at a time (any source
    :func:`jqlora.train.sources.read_rows` takes): ``(summary, tokenized)``, where ``tokenized``
    is what a :class:`~jqlora.train.data.BatchIterator` is built from. Only the token arrays are
    kept, never the rows or their text.

    Args:
      data_path: a data file, a ``datasets`` folder or a cached hub dataset id.
      tokenizer: from :func:`load_tokenizer`.
      special: the BOS/EOS/PAD ids (:func:`special_tokens`).
      format: "auto" or a key of :data:`~jqlora.train.examples.FORMATS`.
      vocab_size: when given, the tokenizer's ids must fit it.
      schema: other column names and the ShareGPT role map (:class:`~jqlora.train.examples.Schema`).
      split: the split of a folder or dataset id (default "train").

    Returns:
      ``({"examples", "formats" ({format: count}), "tokens", "trained_tokens"}, tokenized)``.

    Raises:
      DataError: naming the file and row of the first bad example.
    """
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    formats: dict[str, int] = {}
    tokenized, tokens, trained_tokens = [], 0, 0
    for ex in read_examples(data_path, format=format, schema=schema, split=split):
        ids, trained = tokenize_example(tokenizer, ex, special)
        tokenized.append((ids, trained))
        formats[ex.format] = formats.get(ex.format, 0) + 1
        tokens += len(ids)
        trained_tokens += int(trained.sum())
    return ({"examples": len(tokenized), "formats": formats, "tokens": tokens,
             "trained_tokens": trained_tokens}, tokenized)
