"""Top-1 accuracy of classification logits: the one helper behind the evaluator, the Dassl-free
test-time scoring (:func:`meta.finetune.regulated.finetune_and_score`) and meta-training's logged accuracies."""

from __future__ import annotations

import torch


def accuracy_t(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Fraction (0-1) of rows of ``logits`` ``[n, C]`` whose argmax is ``labels`` ``[n]``, as a 0-d tensor
    (no host sync)."""
    return (logits.argmax(dim=-1) == labels).float().mean()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """:func:`accuracy_t` as a Python float (fraction, 0-1)."""
    return float(accuracy_t(logits, labels))


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Top-1 hits of ``logits`` ``[n, C]`` against ``labels`` ``[n]`` (moved to ``logits``' device)."""
    return int((logits.detach().argmax(dim=-1) == labels.to(logits.device)).sum())
