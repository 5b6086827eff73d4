"""Tokenizers from a Hugging Face folder: ``tokenizer.json`` + ``tokenizer_config.json`` + chat template.

:func:`load_hf_tokenizer` reads what ``transformers.AutoTokenizer`` reads for a fast tokenizer,
without importing transformers: the ``tokenizers`` model (``tokenizer.json``), the special tokens
named in ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) and
the chat template (``chat_template.jinja`` beside it, else ``chat_template`` inside
``tokenizer_config.json``, a string or a list of named templates whose ``default`` is used).

The chat template is rendered the way transformers renders it (``apply_chat_template``): a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, the
variables ``messages``, ``add_generation_prompt`` and the special tokens, message keys whose
value is None dropped; the rendered text is tokenized without adding special tokens (the template
writes them). ``{% generation %}...{% endgeneration %}`` blocks mark assistant text, as in
transformers' ``return_assistant_tokens_mask``.

:meth:`HFTokenizer.chat_ids_and_mask` gives a conversation's token ids and which of them are
assistant text (the training targets of a chat example): from the template's generation blocks
when it has them, else by rendering the conversation turn by turn (the text an assistant turn adds
after the prompt that asks for it).
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jqlora.errors import Error

__all__ = ["TokenizerError", "HFTokenizer", "load_hf_tokenizer", "read_tokenizer_config", "generation_eos_ids"]

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKENIZER_CONFIG = "tokenizer_config.json"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizerError(Error, ValueError):
    """A tokenizer folder, chat template or conversation that cannot be used; the message names
    the file (and the conversation's line when there is one)."""


def _token_content(v) -> str | None:
    if isinstance(v, dict):  # {"content": "<s>", "lstrip": false, ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path: Path) -> dict:
    from interop.json_io import read_json_object  # noqa: PLC0415

    return read_json_object(path, TokenizerError)


def read_tokenizer_config(path: str | os.PathLike) -> dict | None:
    """The ``tokenizer_config.json`` of a tokenizer folder, or None when it has none: the one
    reader of that file.

    Args:
      path: the folder, or a file in it (its ``tokenizer.json``).

    Raises:
      TokenizerError: the file cannot be read, is not JSON or not an object (naming it).
    """
    path = Path(path)
    cfg_file = (path if path.is_dir() else path.parent) / TOKENIZER_CONFIG
    return _read_json(cfg_file) if cfg_file.is_file() else None


def _template_from_config(config: dict, where: Path) -> str | None:
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerError(f"{where}: chat_template is a list without a 'default' template "
                             f"(names: {sorted(map(str, named))})")
    raise TokenizerError(f"{where}: chat_template must be a string or a list, got {type(t).__name__}")


def _compile_template(source: str, where: str):
    """A Jinja template compiled in the environment transformers uses for chat templates."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # a dependency of jqlora; only a broken install lands here
        raise TokenizerError(f"rendering a chat template needs jinja2: {e}") from None

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records where each block's text lands in
        the output (the assistant text of transformers' ``return_assistant_tokens_mask``)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(generation_tracker=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            tracker = self.environment.generation_tracker
            if tracker is not None:
                blocks, spans = tracker
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: chat template does not parse: {e.message} "
                             f"(template line {e.lineno})") from None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with what its Hugging Face folder adds: the special tokens and
    the chat template. Every other attribute (``encode``, ``decode``, ``token_to_id``,
    ``get_vocab``, ...) is the wrapped tokenizer's."""

    def __init__(self, tokenizer, *, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, source: str = "<tokenizer>"):
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.source = source
        self._compiled = None

    def __getattr__(self, name):
        if name == "tokenizer":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.source!r}, vocab={self.tokenizer.get_vocab_size()}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # -- special tokens --------------------------------------------------------------------------
    def token_id(self, key: str) -> int | None:
        """Id of the special token named by ``key`` ("bos_token", "eos_token", ...), or None."""
        tok = self.special_tokens.get(key)
        return None if tok is None else self.tokenizer.token_to_id(tok)

    # -- chat template ---------------------------------------------------------------------------
    def _template(self):
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template "
                                 "(no chat_template.jinja, no chat_template in tokenizer_config.json)")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template, self.source)
        return self._compiled

    def _render(self, messages, add_generation_prompt: bool, spans: list | None = None) -> str:
        import jinja2

        template = self._template()
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        kwargs = dict(self.special_tokens, messages=msgs, tools=None, documents=None,
                      add_generation_prompt=bool(add_generation_prompt))
        try:
            if spans is None:
                return template.render(**kwargs)
            blocks: list[str] = []
            template.environment.generation_tracker = (blocks, spans)
            try:
                for block in template.generate(**kwargs):
                    blocks.append(block)
            finally:
                template.environment.generation_tracker = None
            return "".join(blocks)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise TokenizerError(f"chat template failed on this conversation: "
                                 f"{type(e).__name__}: {e}") from None

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` gives it.

        Args:
          messages: ``[{"role": ..., "content": ...}, ...]``.
          add_generation_prompt: end with the header that opens an assistant turn.
        """
        return self._render(messages, add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True):
        """Token ids (or, with ``tokenize=False``, the text) of a conversation; the same ids as
        transformers' ``apply_chat_template`` on the same folder.

        Args:
          messages: ``[{"role": ..., "content": ...}, ...]``.
          add_generation_prompt: end with the header that opens an assistant turn.
          tokenize: False returns the rendered text.
        """
        text = self._render(messages, add_generation_prompt)
        if not tokenize:
            return text
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """-> (rendered conversation, character spans of its assistant text).

        With ``{% generation %}`` blocks in the template, the spans are those blocks. Otherwise
        each assistant turn's span is the text it adds to the conversation before it rendered with
        ``add_generation_prompt=True`` (its content and end-of-turn marker); a template that does
        not render the conversation as a sequence of such prefixes is refused (the turns could not
        be located).
        """
        if _GENERATION_TAG.search(self.chat_template or ""):
            spans: list[tuple[int, int]] = []
            text = self._render(messages, False, spans)
            return text, [s for s in spans if s[1] > s[0]]
        text = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self._render(messages[:i], True) if i else ""
            upto = self._render(messages[:i + 1], False)
            if not upto.startswith(before) or not text.startswith(upto):
                raise TokenizerError(
                    f"the chat template does not render message {i + 1} (assistant) as a "
                    "continuation of the conversation before it, so its tokens cannot be located; "
                    "use a template with {% generation %} blocks")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return text, spans

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token the chat template writes after an assistant's text (Gemma's
        ``<end_of_turn>``, ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``), as a tuple of at most
        one id; () without a template or such a token. Chat generation stops there too: a base
        model's generation_config.json often names only its end-of-text token."""
        if not self.chat_template:
            return ()
        probe = "\u2063ok\u2063"  # text no template writes itself
        try:
            text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}], False)
        except TokenizerError:
            return ()
        at = text.rfind(probe)
        if at < 0:
            return ()
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        for i in self.tokenizer.encode(text[at + len(probe):], add_special_tokens=False).ids:
            if i in special:
                return (int(i),)
        return ()

    def chat_ids_and_mask(self, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
        """-> ``(ids int32 (n,), assistant bool (n,))``: the conversation's token ids (those of
        :meth:`apply_chat_template`) and which tokens overlap assistant text."""
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        mask = np.zeros(len(ids), bool)
        for i, (s, e) in enumerate(enc.offsets):
            if e > s and any(s < se and e > ss for ss, se in spans):
                mask[i] = True
        return ids, mask


def load_hf_tokenizer(path: str | os.PathLike, *, chat_template: str | os.PathLike | None = None
                      ) -> HFTokenizer:
    """Load the tokenizer of a Hugging Face folder (or a lone ``tokenizer.json``).

    Args:
      path: a directory holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``,
        ``chat_template.jinja``), or the ``tokenizer.json`` file itself.
      chat_template: a Jinja file that replaces the folder's chat template.

    Raises:
      TokenizerError: a missing or unreadable file, or a chat template that does not parse.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"{file}: tokenizer file not found")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise TokenizerError(f"{file}: cannot load tokenizer: {e}") from None
    folder = file.parent
    cfg_file = folder / TOKENIZER_CONFIG
    config: dict[str, Any] = read_tokenizer_config(folder) or {}
    special = {}
    for key in SPECIAL_KEYS:
        content = _token_content(config.get(key))
        if content is not None:
            if tok.token_to_id(content) is None:
                raise TokenizerError(f"{cfg_file}: {key} {content!r} is not in {file}")
            special[key] = content
    template, where = None, str(folder)
    jinja_file = Path(chat_template) if chat_template is not None else folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            template, where = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file}: cannot read: {e}") from None
    elif chat_template is not None:
        raise TokenizerError(f"{jinja_file}: chat template file not found")
    else:
        template = _template_from_config(config, cfg_file)
        where = str(cfg_file)
    out = HFTokenizer(tok, special_tokens=special, chat_template=template, source=where)
    if template:
        out._template()  # a template that does not parse fails here, not at the first example
    return out


def generation_eos_ids(model_dir: str | os.PathLike, config_eos=None) -> tuple[int, ...]:
    """Every id generation stops at: ``config.json``'s ``eos_token_id`` (``config_eos``, int or
    list) and ``generation_config.json``'s (int or list), in that order, without repeats.

    Args:
      model_dir: the checkpoint folder (its ``generation_config.json`` is optional).
      config_eos: the model config's ``eos_token_id`` (None, an int or a sequence of ints).

    Raises:
      TokenizerError: an unreadable ``generation_config.json`` or a non-integer id in it.
    """
    ids: list[int] = []

    def add(v, where):
        if v is None:
            return
        vals = [v] if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
        if not isinstance(vals, (list, tuple)) or not all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in vals):
            raise TokenizerError(f"{where}: eos_token_id must be an integer or a list of integers, "
                                 f"got {v!r}")
        for x in vals:
            if int(x) not in ids:
                ids.append(int(x))

    add(config_eos, "config.json")
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        add(_read_json(gen).get("eos_token_id"), str(gen))
    return tuple(ids)
