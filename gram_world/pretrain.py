"""Contrastive pretraining of the tiny world CLIP on the pretraining corpus, on CPU.

The model is open_clip's own ``CLIP`` built from ``meta/model_configs/GRAM-World-ViT-T.json``
and trained with open_clip's ``ClipLoss`` (symmetric InfoNCE with a learnable
temperature, clamped at 100 as in open_clip's training script).  The weights
are saved as a plain safetensors state dict and reloaded through
``meta.backbone.load_clip(WORLD_MODEL, pretrained=<file>)``.

Hyperparameters are ours (no paper gives them for this world), picked by the
trials below on this 2-core machine (one core each, shared with other work):
AdamW, lr 1e-3 with linear warm-up over 5 % of the steps then cosine decay,
weight decay 0.1 (0 for gains, biases, embeddings and the temperature, as in
open_clip's training script), batch 128, 10 epochs over the default world's
40k pairs (3120 steps, 408 s measured here) or, ``quick``, 6 epochs over the
quick world's 16k pairs (750 steps, 97-129 s); augmentation is a random
shift of up to 2 px (no flips: captions name positions).  The image tower is
a 4-layer, width-64 ViT with 8-px patches (16 tokens + CLS), five times
cheaper per image than 4-px patches (64 tokens): 56 vs 283 ms per
forward+backward of 128 images, 7200 vs 1400 images/s inference.  Every later
stage (CHC features, VPT meta-training through the tower, evaluation) pays
that price, and per second of pretraining 8-px patches learn shape faster.

Trials (zero-shot top-1 %, prompt "a photo of a {}.", on the default world's
six test splits, n = 600/600/400/400/400/400; "16k" = its first 16k pairs,
like the quick world; p = patch, l = ViT layers, b = batch; seconds of
training (trial rows include ~1 s of zero-shot probing per 250 steps) on a
machine shared with another session; one seed each, so differences under
~2 points are noise)::

  setting                     steps     s  Mixed MixSk  Poly Curve  Symb  Icon  mean  x chance
  p4 l4 b128 2e-3  3 x 16k      375   117    7.5   6.7  11.2  14.0  10.5   8.8   9.8  1.10
  p8 l4 b128 2e-3  3 x 16k      375    46    7.3  10.0  13.0  10.5   8.0   9.8   9.8  1.10
  p8 l4 b64  2e-3  3 x 16k      750    54    7.2   7.3  10.5  14.8  12.2  12.8  10.8  1.21
  p8 l4 b32  1e-3  3 x 16k     1500    76    6.8   5.3  10.8  13.8  15.0  12.5  10.7  1.20
  p8 l4 w128 b64 2e-3 3 x 16k   750    98    8.2   9.5  11.0  13.0  11.0  12.0  10.8  1.21
  p8 l4 b128 2e-3  6 x 16k      750    85   13.7  12.2  12.0  20.0  15.8  15.8  14.9  1.67
  p8 l4 b128 4e-3  6 x 16k      750    96    8.3   6.2  12.8  17.5  13.2  14.0  12.0  1.35
  p8 l4 b128 1e-3  6 x 16k      750   101   14.8  15.2  15.0  25.5  17.0  18.5  17.7  1.99
  p8 l4 b128 5e-4  6 x 16k      750    85   13.0  21.8  15.8  20.0  19.8  16.2  17.8  2.00
  p8 l4 b64  2e-3  5 x 16k     1250    89   10.5   6.3  11.8  17.8  13.2  14.8  12.4  1.39
  p8 l4 b256 2e-3  6 x 16k      372    85   11.2   9.2  13.2  18.0  13.0  12.8  12.9  1.45
  p8 l6 b128 2e-3  6 x 16k      750   130   12.2   6.0  10.8  20.2  13.0  13.8  12.7  1.42
  p8 l4 b128 2e-3  6 x 40k     1872   224   17.5  20.0  14.0  31.8  23.8  24.0  21.8  2.46
  p8 l4 b128 1e-3  6 x 40k     1872   219   35.5  43.5  29.5  45.8  38.8  40.2  38.9  4.37
  p4 l4 b128 2e-3  6 x 40k     1872   517   23.8  28.8  17.2  32.8  29.5  31.2  27.2  3.06
  p8 l4 b128 5e-4 10 x 40k     3120   374   50.2  56.0  40.5  53.5  52.2  48.0  50.1  5.63
  p8 l4 b128 1e-3 10 x 40k     3120   408   54.7  55.0  42.2  56.8  54.0  54.5  52.9  5.95  <- default

(width 64 unless stated.  The p4 6 x 40k row is the previous default; its
517 s were measured by another session's run on the same world.)
What mattered: enough steps (the loss sits near log(128) for the first
~100-200 steps whatever the setting; accuracy still rises at 3120 steps) and
an lr of 1e-3 or lower (on 750 steps: 4e-3 12.0, 2e-3 14.9, 1e-3 17.7,
5e-4 17.8 % mean; on 1872 steps: 2e-3 21.8, 1e-3 38.9 %; on 3120 steps:
1e-3 52.9, 5e-4 50.1 %).  Smaller batches,
bigger batches, a wider or deeper tower did not help at equal time.
Quick schedule on the quick world (10e8520f76d4), pretraining seeds 0/1/2:
mean 19.1 / 14.5 / 17.8 % = 2.15 / 1.63 / 2.00 x mean chance (8.89 %) in
129 / 103 / 97 s; random weights 8.4 % (0.94 x).  The test asserts >= 1.4 x.

Whether the features leave room for prompt tuning (linear probes against zero-shot; a width-128
tower: higher zero-shot, same gap) is measured in ``docs/world_baseline.md``.

Also tried earlier and not adopted (no gain on the quick world): locking the
text tower at its random init for the first 30-100 % of steps
(``text_frozen_fraction``); an auxiliary caption bag-of-words loss on the
image embedding (``bow_weight``).

Style in the image features, for CHC: a logistic-regression probe on the
default CLIP's features of 2000 CHC images predicts the style of 1000 others
at 99 % (random weights 62 %), yet k-means with k = 4 on the same features
no longer finds the styles (``zeroshot.style_clustering``: ARI 0.00, against
0.21 for the previous p4 default and 0.10 for random weights) - its clusters
follow other factors.  Anything that clusters domains on these features
should not rely on plain k-means picking style.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss
from safetensors.torch import save_file
from tqdm import tqdm

from meta.backbone import register_model_configs

from .build import WorldPaths
from .clip_io import WORLD_MODEL, encode_text_trimmed, to_model_input


@dataclass(frozen=True)
class PretrainSettings:
    """Everything that changes the pretrained weights (besides the world itself)."""

    model_name: str = WORLD_MODEL
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    max_shift: int = 2
    seed: int = 0
    max_images: int = 0      # 0 = the whole corpus; >0 trains on the first N pairs (tests)
    text_frozen_fraction: float = 0.0   # first part of training with the text tower locked at init
    bow_weight: float = 0.0  # weight of the caption bag-of-words auxiliary loss (0 = pure CLIP)
    bow_min_count: int = 5   # words rarer than this in the corpus are not predicted

    def checksum(self, world_hash: str, model_config: dict | None = None) -> str:
        """12 hex digits naming the weights: these settings, the world and the model config.

        The config (open_clip's JSON for ``model_name``) is part of the name so that
        editing it (e.g. the patch size) never reloads weights of another shape.
        """
        blob = json.dumps({**asdict(self), "world": world_hash, "model_config": model_config}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pretrain_settings(quick: bool = False, seed: int = 0) -> PretrainSettings:
    """Default (about 7 min here: 370-408 s measured) or ``quick`` (about 1.5-2 min) schedule."""
    base = PretrainSettings(seed=seed)
    return replace(base, epochs=6) if quick else base


def _shift(images: torch.Tensor, max_shift: int, gen: torch.Generator) -> torch.Tensor:
    """Random translation by up to ``max_shift`` px with edge padding; ``[B, 3, S, S]`` float."""
    if max_shift <= 0:
        return images
    b, _, s, _ = images.shape
    padded = F.pad(images, (max_shift,) * 4, mode="replicate")
    dx, dy = (torch.randint(0, 2 * max_shift + 1, (b,), generator=gen) for _ in range(2))
    rows = (dy.view(b, 1) + torch.arange(s).view(1, s))                      # [B, S]
    cols = (dx.view(b, 1) + torch.arange(s).view(1, s))
    idx_b = torch.arange(b).view(b, 1, 1)
    return padded.permute(0, 2, 3, 1)[idx_b, rows.view(b, s, 1), cols.view(b, 1, s)].permute(0, 3, 1, 2)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name \
            or "embedding" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def caption_vocabulary(captions: list[str], min_count: int) -> list[str]:
    """Sorted words (lower case, punctuation stripped) that occur in at least ``min_count`` captions."""
    counts: dict[str, int] = {}
    for c in captions:
        for w in set(_words(c)):
            counts[w] = counts.get(w, 0) + 1
    return sorted(w for w, n in counts.items() if n >= min_count)


def _words(caption: str) -> list[str]:
    return [w.strip(".,:!?#-") for w in caption.lower().split() if w.strip(".,:!?#-")]


def bag_of_words(captions: list[str], vocab: list[str]) -> torch.Tensor:
    """Multi-hot targets ``[N, V]`` (float 0/1): which vocabulary words each caption contains."""
    index = {w: i for i, w in enumerate(vocab)}
    out = torch.zeros(len(captions), len(vocab))
    for n, c in enumerate(captions):
        for w in _words(c):
            if w in index:
                out[n, index[w]] = 1.0
    return out


def weights_path(world: WorldPaths, settings: PretrainSettings) -> Path:
    """Where the weights of ``settings`` trained on ``world`` live (``.safetensors``)."""
    register_model_configs()
    config = open_clip.get_model_config(settings.model_name)
    if config is None:
        raise ValueError(f"PretrainSettings.model_name={settings.model_name!r}: no open_clip model config by that name")
    checksum = settings.checksum(world.settings_hash, config)
    return world.clip_dir / f"{settings.model_name}-{checksum}.safetensors"


def load_pretrain_corpus(world: WorldPaths, max_images: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Images ``[N, S, S, 3]`` uint8 and their captions, in corpus order."""
    images = np.load(world.pretrain_images, mmap_mode="r")
    with open(world.pretrain_pairs) as f:
        captions = [json.loads(line)["caption"] for line in f]
    if len(captions) != len(images):
        raise ValueError(f"{world.pretrain_pairs}: {len(captions)} captions for {len(images)} images")
    n = len(images) if max_images <= 0 else min(max_images, len(images))
    return torch.from_numpy(np.array(images[:n])), captions[:n]


def pretrain_clip(world: WorldPaths, quick: bool = False, settings: PretrainSettings | None = None,
                  force: bool = False, on_step: Callable[[int, torch.nn.Module], None] | None = None) -> Path:
    """Train the tiny CLIP on ``world``'s pretraining corpus (cached) and return the weights file.

    A JSON sidecar (same stem) records the settings, loss curve and wall time.
    ``on_step(step, model)``, if given, is called after every optimiser step
    (step counts from 1; the model is in train mode and must be left so) -
    for learning curves in trials; its time counts in the recorded seconds.
    """
    s = settings if settings is not None else pretrain_settings(quick, seed=int(world.settings.get("seed", 0)))
    out = weights_path(world, s)
    if out.is_file() and not force:
        return out
    register_model_configs()
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    model = open_clip.create_model(s.model_name, pretrained=None)
    model.train()
    tokenizer = open_clip.get_tokenizer(s.model_name)
    images, captions = load_pretrain_corpus(world, s.max_images)
    tokens = tokenizer(captions)                                         # [N, 77]
    n = len(images)
    steps_per_epoch = max(1, n // s.batch_size)                          # drop the last partial batch
    total = steps_per_epoch * s.epochs
    warmup = max(1, int(s.warmup_fraction * total))
    # Auxiliary: predict the caption's words from the image embedding (a linear head that is
    # thrown away).  It uses captions only - no ground truth - and gives the image tower fixed,
    # distinct targets per word from step one, which a from-scratch CLIP lacks.
    groups = _param_groups(model, s.weight_decay)
    vocab: list[str] = []
    if s.bow_weight > 0:
        vocab = caption_vocabulary(captions, s.bow_min_count)
        bow = bag_of_words(captions, vocab)
        bow_head = torch.nn.Linear(model.text_projection.shape[1], max(1, len(vocab)))
        groups.append({"params": list(bow_head.parameters()), "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / warmup if k < warmup else 0.5 * (1 + math.cos(math.pi * (k - warmup) / max(1, total - warmup))))
    loss_fn = ClipLoss()
    losses: list[float] = []
    frozen_steps = int(s.text_frozen_fraction * total)
    step = 0
    t0 = time.time()
    bar = tqdm(total=total, desc=f"pretrain {s.model_name}", unit="step", leave=False)
    for _epoch in range(s.epochs):
        order = torch.randperm(n, generator=gen)
        for k in range(steps_per_epoch):
            idx = order[k * s.batch_size:(k + 1) * s.batch_size]
            x = _shift(to_model_input(images[idx]), s.max_shift, gen)
            img_raw = model.encode_image(x)
            img_f = F.normalize(img_raw, dim=-1)
            with torch.set_grad_enabled(step >= frozen_steps):
                txt_f = F.normalize(encode_text_trimmed(model, tokens[idx]), dim=-1)
            loss = clip_loss = loss_fn(img_f, txt_f, model.logit_scale.exp())
            if s.bow_weight > 0:
                loss = loss + s.bow_weight * F.binary_cross_entropy_with_logits(bow_head(img_raw), bow[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            losses.append(clip_loss.item())
            step += 1
            bar.update(1)
            if on_step is not None:
                on_step(step, model)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    bar.close()
    seconds = time.time() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.rename(out)
    log = {"settings": asdict(s), "world_hash": world.settings_hash, "images": n, "steps": total,
           "seconds": round(seconds, 1), "bow_vocabulary": len(vocab), "loss_first": losses[0], "loss_last_20": float(np.mean(losses[-20:])),
           "loss_curve": [round(v, 4) for v in losses[:: max(1, total // 200)]],
           "logit_scale": float(model.logit_scale.detach().exp())}
    out.with_suffix(".json").write_text(json.dumps(log, indent=1))
    return out
