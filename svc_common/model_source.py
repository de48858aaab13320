"""``--model``: a checkpoint directory or a Hugging Face hub id, resolved once to a local directory.

Every entry point (``up``, each service, the router's ``--model-dir``) calls ``resolve_model`` on what
the user gave and passes the directory on, so every process reads the same files:

- nothing given -> the embedded default model (``svc_common/models/default``);
- an existing directory -> its absolute path;
- ``org/name`` (or ``name``) that is no directory here -> ``huggingface_hub.snapshot_download`` of the
  config, tokenizer and safetensors files only (``MODEL_FILE_PATTERNS``), into the hub cache
  (``HF_HOME`` / ``HF_HUB_CACHE``); with ``HF_HUB_OFFLINE=1`` the cached snapshot is used and nothing
  is downloaded.

Failures raise ``ModelSourceError`` (a ValueError) whose message is one line saying what to do.
"""

from __future__ import annotations

from pathlib import Path

# Files a served checkpoint needs: config.json, generation_config.json, tokenizer*.json, the safetensors
# index and shards, chat templates; not *.bin / *.pt / *.gguf / onnx copies of the weights.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")


class ModelSourceError(ValueError):
    """``--model`` names no usable directory or hub model; the message says what to do."""


def resolve_model(spec: str | None) -> str:
    """The local directory of ``spec`` (see the module docstring); the same directory for every caller."""
    if not spec:
        from svc_common.default_model import default_model_dir

        return default_model_dir()
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise ModelSourceError(f"--model {spec} is a file: pass the checkpoint's directory or a hub id (org/name)")
    if not _looks_like_repo_id(spec):
        raise ModelSourceError(f"--model {spec}: no such directory (pass a checkpoint directory with config.json "
                               f"and *.safetensors, or a Hugging Face hub id such as Qwen/Qwen3-0.6B)")
    return _snapshot(spec)


def hub_id_of(spec: str | None) -> str | None:
    """``spec`` when ``resolve_model`` takes it from the hub (no such path here), else None. The API then names
    the model by its hub id (``--served-model-name`` default), as vLLM and SGLang do, not by its snapshot hash."""
    if not spec or Path(spec).expanduser().exists() or not _looks_like_repo_id(spec):
        return None
    return spec


def _looks_like_repo_id(spec: str) -> bool:
    """``org/name`` or ``name`` as the hub spells ids; anything path-like (./x, /x, ~/x, a/b/c) is a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, allow_patterns=list(MODEL_FILE_PATTERNS))
    except GatedRepoError:
        raise ModelSourceError(f"--model {repo_id} is a gated model: accept its licence on the hub and log in "
                               f"(hf auth login or HF_TOKEN), or pass a downloaded directory") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"--model {repo_id}: no such directory here and no such model on the Hugging Face "
                               f"hub (check the spelling; a private model needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"--model {repo_id}: the hub model has no 'main' revision") from None
    except LocalEntryNotFoundError:
        if _offline():
            raise ModelSourceError(
                f"--model {repo_id} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: download it "
                f"on a connected machine (hf download {repo_id}) into that cache, or pass a directory") from None
        raise ModelSourceError(
            f"--model {repo_id}: the Hugging Face hub cannot be reached and the model is not in the cache {cache}: "
            f"check the network (or HF_ENDPOINT), or pass a downloaded directory") from None
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSourceError(f"--model {repo_id}: the Hugging Face hub answered {first}") from None
    except OSError as e:  # disk full, a read-only cache
        raise ModelSourceError(f"--model {repo_id}: cannot write the Hugging Face cache {cache} ({e}); set "
                               f"HF_HOME to a writable directory") from None

