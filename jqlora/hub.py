"""`resolve_model`: the folder a model argument names, a local path or a Hugging Face model id.

People name models three ways: a folder (``ckpt/llama-nf4``), a Hugging Face id
(``HuggingFaceTB/SmolLM2-135M-Instruct``, with ``@revision`` for a branch, tag or commit), or a
repo folder of the Hugging Face cache (``~/.cache/huggingface/hub/models--org--name``, the folder
above ``snapshots/<commit>``). All three resolve here, in this order:

1. an existing folder that is not a cache repo folder: itself;
2. a cache repo folder: the snapshot its ``refs/main`` names, else its only snapshot;
3. ``org/name[@revision]``: the cached snapshot (``huggingface_hub.snapshot_download`` with
   ``local_files_only=True``; ``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` as
   huggingface_hub reads them), else a download (with huggingface_hub's progress bars) unless
   offline. When neither works the error is one line with the command that downloads it.

Imports `jqlora.errors` only; `huggingface_hub` is imported when an id is looked up.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from jqlora.errors import Error

# A Hugging Face repo id (org/name: letters, digits, '-', '_', '.') and an optional @revision.
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<rev>[\w./-]+))?$")
# The files a model folder needs (weights, configs, tokenizer, chat template); not other formats.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]


class ModelNotFoundError(Error, FileNotFoundError):
    """A model argument that is neither a folder nor a model id found in the cache or online;
    the message says how to get it."""


def parse_model_id(text: str) -> Optional[tuple[str, Optional[str]]]:
    """``(repo_id, revision)`` when ``text`` has the form of ``org/name[@revision]``, else None."""
    m = _ID.match(str(text))
    if m is None or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("rev")


def cache_snapshot(repo_dir: str | os.PathLike, revision: Optional[str] = None) -> Optional[Path]:
    """The snapshot folder of a Hugging Face cache repo folder (``models--org--name``): the one
    ``refs/<revision>`` (default ``main``) names, or ``snapshots/<revision>`` for a commit hash,
    else the only snapshot. None when ``repo_dir`` is not a cache repo folder.

    Raises:
      ModelNotFoundError: a cache repo folder whose snapshot cannot be chosen (none, or several
        and no ref naming one).
    """
    repo = Path(repo_dir)
    snapshots = repo / "snapshots"
    if not snapshots.is_dir() or (not (repo / "refs").is_dir() and not repo.name.startswith("models--")):
        return None
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (snapshots / commit).is_dir():
            return snapshots / commit
    if revision and (snapshots / revision).is_dir():
        return snapshots / revision
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if revision is None and len(found) == 1:
        return found[0]
    names = ", ".join(p.name for p in found) or "none"
    want = f"refs/{revision or 'main'}"
    raise ModelNotFoundError(f"{repo}: a Hugging Face cache folder whose {want} names no snapshot "
                             f"(snapshots: {names}); pass the snapshot folder itself "
                             f"({snapshots}/<commit>)")


def download_command(repo_id: str, revision: Optional[str] = None) -> str:
    """The shell command that puts ``repo_id`` into the Hugging Face cache."""
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{rev}"


def resolve_model(name: str | os.PathLike, *, what: str = "model") -> Path:
    """The model folder ``name`` names (module docstring: a folder, a cache repo folder, or
    ``org/name[@revision]`` through the Hugging Face cache, downloading when online).

    Args:
      name: the argument as given.
      what: how errors name the argument (``--model``).

    Raises:
      ModelNotFoundError: no such folder, and not a model id that is cached or can be downloaded
        (offline, no network, unknown repo or revision); the message gives the download command.
    """
    path = Path(os.fspath(name)).expanduser()
    if path.is_dir():
        snap = cache_snapshot(path)
        return snap if snap is not None else path
    parsed = parse_model_id(os.fspath(name))
    if parsed is None or path.exists():
        raise ModelNotFoundError(f"{what} {os.fspath(name)}: no such model folder"
                                 + ("" if path.exists() else " (nor a Hugging Face model id org/name[@revision])"))
    return _from_hub(*parsed, what=what, given=os.fspath(name))


def _from_hub(repo_id: str, revision: Optional[str], *, what: str, given: str) -> Path:
    """The cached snapshot of ``repo_id`` at ``revision``, else a download unless offline."""
    cmd = download_command(repo_id, revision)
    try:
        import huggingface_hub  # noqa: PLC0415
        from huggingface_hub import constants  # noqa: PLC0415
    except ImportError:
        raise ModelNotFoundError(f"{what} {given}: no such folder; reading it as a Hugging Face model id needs "
                                 "huggingface_hub (pip install huggingface_hub)") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True,
                                                      allow_patterns=MODEL_FILES))
    except Exception:  # noqa: BLE001  (not cached, or an unusable cache entry: try the network)
        pass
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{what} {given}: no such folder, and the Hugging Face model {repo_id}"
                                 f"{'@' + revision if revision else ''} is not in the cache ({cache}) and "
                                 f"HF_HUB_OFFLINE is set; download it with `{cmd}` (or "
                                 f"`huggingface-cli download {repo_id}`) where there is a network") from None
    import sys  # noqa: PLC0415

    import tqdm  # noqa: PLC0415  (a bar even where HF_HUB_DISABLE_PROGRESS_BARS quiets huggingface_hub's own)

    print(f"downloading {repo_id}{'@' + revision if revision else ''} from the Hugging Face Hub into {cache}",
          file=sys.stderr, flush=True)
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES,
                                                      tqdm_class=tqdm.tqdm))
    except Exception as e:  # noqa: BLE001  (no network, unknown repo or revision, gated, ...)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"{what} {given}: no such folder, and the Hugging Face model {repo_id}"
                                 f"{'@' + revision if revision else ''} is not in the cache ({cache}) and could "
                                 f"not be downloaded ({type(e).__name__}: {why}); download it with `{cmd}`") from None


__all__ = ["ModelNotFoundError", "resolve_model", "parse_model_id", "cache_snapshot", "download_command"]
