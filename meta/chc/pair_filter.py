"""Optional filter of mismatched image-text pairs by CLIP image-text cosine.

The paper filters CC3M's mismatched pairs ("we adopt a filtering model to filter out mismatched noisy image-text
pairs", section 4) without naming the model; here it is the same frozen CLIP.  Modes:

* ``threshold`` - drop pairs whose cosine is below ``CHC.FILTER.THRESHOLD``;
* ``quantile``  - drop the ``CHC.FILTER.QUANTILE`` fraction with the lowest cosine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from meta.chc.stages import ChunkedArray, dedupe


@torch.no_grad()
def clip_text_features(
    clip, tokenizer, captions: Sequence[str], template: str = "{}", batch_size: int = 256, device="cpu"
) -> np.ndarray:
    """L2-normalised CLIP text features float32 ``[n, D]`` of ``captions``."""
    out = []
    for start in range(0, len(captions), batch_size):
        tokens = tokenizer([template.format(c) for c in captions[start : start + batch_size]]).to(device)
        f = clip.encode_text(tokens).float()
        out.append(torch.nn.functional.normalize(f, dim=-1).cpu().numpy())
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0, int(clip.visual.output_dim)), np.float32)


def pair_cosines(
    clip,
    tokenizer,
    captions: Sequence[str],
    image_features: np.ndarray,
    ok: np.ndarray,
    stage_dir: Path,
    fp: str,
    template: str = "{}",
    batch_size: int = 256,
    chunk_size: int = 4096,
    device="cpu",
    show_progress: bool = True,
) -> np.ndarray:
    """Cosine ``[N]`` between each pair's image and caption (NaN where the image is unreadable).

    Captions are deduplicated and encoded in cached, resumable chunks.
    """
    uniq, inverse = dedupe(captions)
    store = ChunkedArray(
        Path(stage_dir) / "clip_text_features.npy", len(uniq), (image_features.shape[1],), np.float32, fp
    )
    text = store.fill(
        lambda s, e: clip_text_features(clip, tokenizer, uniq[s:e], template, batch_size, device),
        chunk_size,
        desc="CLIP caption features",
        disable_progress=not show_progress,
    )
    cos = np.full(len(captions), np.nan, dtype=np.float32)
    for start in range(0, len(captions), 65536):
        sl = slice(start, start + 65536)
        cos[sl] = np.einsum("nd,nd->n", np.asarray(image_features[sl]), np.asarray(text[inverse[sl]]))
    cos[~np.asarray(ok, dtype=bool)] = np.nan
    return cos


def keep_mask(cosine: np.ndarray, mode: str, threshold: float = 0.2, quantile: float = 0.1) -> np.ndarray:
    """bool ``[N]``: pairs that survive the filter (NaN cosines never survive)."""
    valid = ~np.isnan(cosine)
    if mode == "none":
        return valid
    if mode == "threshold":
        cut = float(threshold)
    elif mode == "quantile":
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"CHC.FILTER.QUANTILE: expected a fraction in [0, 1), got {quantile}")
        if not valid.any():
            return valid
        cut = float(np.quantile(cosine[valid], quantile))
    else:
        raise ValueError(f"CHC.FILTER.MODE: expected none|threshold|quantile, got {mode!r}")
    with np.errstate(invalid="ignore"):
        return valid & (cosine >= cut)
