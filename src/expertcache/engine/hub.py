"""Where a model's files are: the embedded model, a local folder, or a Hugging Face id in the local cache.

A Hugging Face id (``org/name``) is looked up in the local Hugging Face cache through huggingface_hub's
own cache lookup (``snapshot_download(..., local_files_only=True)``, so ``HF_HOME`` and ``HF_HUB_CACHE``
are honoured). Nothing is downloaded unless asked (``download=True``, ``--download``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from expertcache.errors import ExpertcacheError, first_line

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "data" / "default"
EMBEDDED = "embedded"  # what traces and reports call the embedded model (never a machine path)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what a checkpoint needs: config, weights, tokenizer, chat template, generation defaults
_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def resolve_model(model: str | Path | None, download: bool = False) -> Path:
    """The folder of ``model``: None is the embedded model; an existing path is itself; ``org/name`` is
    found in the local Hugging Face cache (or downloaded, with ``download``)."""
    if model is None:
        if download:
            raise ExpertcacheError(
                "a download needs a Hugging Face id (--model org/name); the embedded model is installed"
            )
        return DEFAULT_MODEL
    if not isinstance(model, str | os.PathLike):  # model_info(42): pathlib's TypeError named nothing
        raise ExpertcacheError(f"a model is a checkpoint's folder or a Hugging Face id, got {model!r}")
    path = Path(model).expanduser()
    if path.exists() or not _HUB_ID.fullmatch(str(model)):
        if download:
            raise ExpertcacheError(f"{model}: a download needs a Hugging Face id (org/name), not a path")
        return path
    return _from_hub(str(model), download)


def model_label(path: Path) -> str:
    """How a model is named in traces and reports: ``embedded``, or its path."""
    return EMBEDDED if path.resolve() == DEFAULT_MODEL else str(path)


def _from_hub(repo_id: str, download: bool) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        if download:  # its config first: a family the engine cannot run is refused before the weights come
            from expertcache.engine.loader import read_config

            read_config(Path(snapshot_download(repo_id, allow_patterns=["config.json"])))
        return Path(snapshot_download(repo_id, local_files_only=not download, allow_patterns=_FILES))
    except ExpertcacheError:
        raise
    except LocalEntryNotFoundError as exc:
        if download:  # asked to download, and it could not be reached
            raise ExpertcacheError(
                f"{repo_id}: could not download it (offline, HF_HUB_OFFLINE set, or the hub unreachable: "
                f"{first_line(exc)})"
            ) from None
        raise ExpertcacheError(
            f"{repo_id}: no such folder, and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"download it with `hf download {repo_id}`, or pass --download (Python: download=True)"
        ) from None
    except Exception as exc:  # network, authentication, a repository that does not exist
        raise ExpertcacheError(f"{repo_id}: cannot get it from the hub ({first_line(exc)})") from None
