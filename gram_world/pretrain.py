"""Contrastive pretraining of the tiny world CLIP on the pretraining corpus, on CPU.

The model is open_clip's own ``CLIP`` built from ``meta/model/model_configs/GRAM-World-ViT-T.json``
and trained with open_clip's ``ClipLoss`` (symmetric InfoNCE with a learnable
temperature, clamped at 100 as in open_clip's training script).  The weights
are saved as a plain safetensors state dict and reloaded through
``meta.model.backbone.load_clip(WORLD_MODEL, pretrained=<file>)``.

Hyperparameters are ours (no paper gives them for this world), picked by the
trials in ``docs/world_pretraining.md`` on a 2-core CPU machine (one core each):
AdamW, lr 1e-3 with linear warm-up over 5 % of the steps then cosine decay,
weight decay 0.1 (0 for gains, biases, embeddings and the temperature, as in
open_clip's training script), batch 128, 10 epochs over the default world's
40k pairs (3120 steps, 408 s on that machine) or, ``quick``, 6 epochs over the
quick world's 16k pairs (750 steps, 97-129 s); augmentation is a random
shift of up to 2 px (no flips: captions name positions).  The image tower is
a 4-layer, width-64 ViT with 8-px patches (16 tokens + CLS), five times
cheaper per image than 4-px patches (64 tokens): 56 vs 283 ms per
forward+backward of 128 images, 7200 vs 1400 images/s inference.  Every later
stage (CHC features, VPT meta-training through the tower, evaluation) pays
that price, and per second of pretraining 8-px patches learn shape faster.

The trials behind these values, and what was tried and dropped: ``docs/world_pretraining.md``.  The
times above are of the plain one-thread loop; :func:`pretrain_clip`'s default ``fast`` path (two towers
in two threads, AdamW on the used token rows) gives the same weights bit for bit in about 60 % of that
time on two cores (quick CLIP: 101 s against 165 s, same sha256, 2026-11-27).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
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

from meta.model.backbone import register_model_configs

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
    max_images: int = 0  # 0 = the whole corpus; >0 trains on the first N pairs (tests)
    text_frozen_fraction: float = 0.0  # first part of training with the text tower locked at init
    bow_weight: float = 0.0  # weight of the caption bag-of-words auxiliary loss (0 = pure CLIP)
    bow_min_count: int = 5  # words rarer than this in the corpus are not predicted

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
    rows = dy.view(b, 1) + torch.arange(s).view(1, s)  # [B, S]
    cols = dx.view(b, 1) + torch.arange(s).view(1, s)
    idx_b = torch.arange(b).view(b, 1, 1)
    return padded.permute(0, 2, 3, 1)[idx_b, rows.view(b, s, 1), cols.view(b, 1, s)].permute(0, 3, 1, 2)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        exclude = (
            p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name or "embedding" in name
        )
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


class _UsedTokenRows:
    """The rows of a token-embedding table ``[vocab, width]`` that ``tokens`` use, as one trainable
    tensor ``weight`` ``[V_used, width]`` (ids in increasing order); :meth:`write_back` copies them into
    the table."""

    def __init__(self, table: torch.nn.Embedding, tokens: torch.Tensor):
        self.table = table
        self.used = torch.unique(tokens)  # sorted ids [V_used]
        self.position = torch.full((table.num_embeddings,), -1, dtype=torch.long)
        self.position[self.used] = torch.arange(len(self.used))
        self.weight = torch.nn.Parameter(table.weight.detach()[self.used].clone())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, L, width]`` of token ids ``[B, L]`` (ids the corpus uses)."""
        return F.embedding(self.position[ids], self.weight)

    @torch.no_grad()
    def write_back(self) -> None:
        self.table.weight[self.used] = self.weight


def _backward_towers_in_parallel(
    loss: torch.Tensor,
    img_raw: torch.Tensor,
    txt_raw: torch.Tensor,
    heads: list,
    text_thread: ThreadPoolExecutor,
) -> None:
    """``loss.backward()`` split at the towers' outputs: the gradients of ``img_raw`` ``[B, D]``,
    ``txt_raw`` ``[B, D]`` (when it requires one) and of the ``heads`` (logit scale, BoW head) first, then
    the image tower's backward here and the text tower's in ``text_thread``; the heads' ``.grad`` are set."""
    towers = [t for t in (img_raw, txt_raw) if t.requires_grad]
    grads = torch.autograd.grad(loss, towers + heads, retain_graph=True)
    text_done = text_thread.submit(towers[1].backward, grads[1]) if len(towers) == 2 else None
    towers[0].backward(grads[0])
    if text_done is not None:
        text_done.result()
    for p, g in zip(heads, grads[len(towers) :]):
        p.grad = g


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


def pretrain_clip(
    world: WorldPaths,
    quick: bool = False,
    settings: PretrainSettings | None = None,
    force: bool = False,
    on_step: Callable[[int, torch.nn.Module], None] | None = None,
    fast: bool = True,
) -> Path:
    """Train the tiny CLIP on ``world``'s pretraining corpus (cached) and return the weights file.

    A JSON sidecar (same stem) records the settings, loss curve and wall time.
    ``on_step(step, model)``, if given, is called after every optimiser step
    (step counts from 1; the model is in train mode and must be left so) -
    for learning curves in trials; its time counts in the recorded seconds.

    ``fast`` (default) gives the same weights bit for bit in about 60 % of the time on two cores (a test
    compares it with ``fast=False``, the plain loop): the text tower runs in a second thread beside the
    image tower, forward and backward (one intra-op thread each, so every kernel runs as in the plain
    loop), and AdamW steps only the rows of the token-embedding table that the corpus uses (a
    ``[V_used, width]`` tensor; the other rows never get a gradient, so AdamW would leave them unchanged).
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
    tokens = tokenizer(captions)  # [N, 77]
    n = len(images)
    steps_per_epoch = max(1, n // s.batch_size)  # drop the last partial batch
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
    rows = _UsedTokenRows(model.token_embedding, tokens) if fast else None
    if rows is not None:  # AdamW steps the corpus's rows only (the others get zero gradients: no update)
        for group in groups:
            group["params"] = [rows.weight if p is model.token_embedding.weight else p for p in group["params"]]
    opt = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda k: (
            (k + 1) / warmup if k < warmup else 0.5 * (1 + math.cos(math.pi * (k - warmup) / max(1, total - warmup)))
        ),
    )
    loss_fn = ClipLoss()
    losses: list[float] = []
    frozen_steps = int(s.text_frozen_fraction * total)
    heads = [model.logit_scale] + (list(bow_head.parameters()) if s.bow_weight > 0 else [])
    step = 0
    t0 = time.time()
    bar = tqdm(total=total, desc=f"pretrain {s.model_name}", unit="step", leave=False)
    with ThreadPoolExecutor(1, thread_name_prefix="text-tower") as text_thread:

        def text_tower(ids: torch.Tensor, grad: bool) -> torch.Tensor:
            with torch.set_grad_enabled(grad):  # grad mode is per thread
                return encode_text_trimmed(model, ids, embed=rows)

        for _epoch in range(s.epochs):
            order = torch.randperm(n, generator=gen)
            for k in range(steps_per_epoch):
                idx = order[k * s.batch_size : (k + 1) * s.batch_size]
                x = _shift(to_model_input(images[idx]), s.max_shift, gen)
                text_grad = step >= frozen_steps
                if fast:
                    txt_future = text_thread.submit(text_tower, tokens[idx], text_grad)
                    img_raw = model.encode_image(x)
                    txt_raw = txt_future.result()
                else:
                    img_raw = model.encode_image(x)
                    txt_raw = text_tower(tokens[idx], text_grad)
                img_f, txt_f = F.normalize(img_raw, dim=-1), F.normalize(txt_raw, dim=-1)
                loss = clip_loss = loss_fn(img_f, txt_f, model.logit_scale.exp())
                if s.bow_weight > 0:
                    loss = loss + s.bow_weight * F.binary_cross_entropy_with_logits(bow_head(img_raw), bow[idx])
                opt.zero_grad(set_to_none=True)
                if fast:
                    _backward_towers_in_parallel(loss, img_raw, txt_raw, heads, text_thread)
                else:
                    loss.backward()
                opt.step()
                sched.step()
                with torch.no_grad():
                    model.logit_scale.clamp_(0, math.log(100))
                losses.append(clip_loss.item())
                step += 1
                bar.update(1)
                if on_step is not None:
                    if rows is not None:
                        rows.write_back()
                    on_step(step, model)
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    if rows is not None:
        rows.write_back()
    bar.close()
    seconds = time.time() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.rename(out)
    log = {
        "settings": asdict(s),
        "world_hash": world.settings_hash,
        "images": n,
        "steps": total,
        "seconds": round(seconds, 1),
        "bow_vocabulary": len(vocab),
        "loss_first": losses[0],
        "loss_last_20": float(np.mean(losses[-20:])),
        "loss_curve": [round(v, 4) for v in losses[:: max(1, total // 200)]],
        "logit_scale": float(model.logit_scale.detach().exp()),
    }
    out.with_suffix(".json").write_text(json.dumps(log, indent=1))
    return out
