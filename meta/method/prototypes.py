"""CHC prototypes and a test image's relation to them: the context that conditions R_φ (``META.TEST_TIME.PROTOTYPES``).

From the meta-training hierarchy (:class:`meta.chc.hierarchy.Hierarchy`: frozen-CLIP image features of every pair,
its topic and visual domain)::

    T   [K_t, E]   the L2-normalised mean image feature of each topic's pairs          (topic prototypes)
    D   [K_d, E]   the same of each (topic, visual domain) cluster                      (domain prototypes)
    r(z) [2]       (max_k z·T_k, max_j z·D_j) for an L2-normalised image feature z [E]  (nearest-prototype cosines)
    s(z) [2]       (r(z) − μ) / σ,  μ, σ [2]: r's mean and standard deviation over the meta-training pairs

s ≈ 0 for an image like those meta-training saw; it falls as the image leaves the seen topics and domains (the
shift that test-time tuning meets).  R_φ takes s as an extra input of its two maps
(:class:`meta.method.regulator.GradientRegulator` with ``spec.context`` 2), so the regulated step can depend on how far
the image lies from the meta-training structure.  The journal extension of GRAM (Li et al., "Structure-Induced
Gradient Regulation for Generalizable Vision-Language Models", IEEE TPAMI 2026; only its abstract is public) relates
test data to prototypes of the hierarchically clustered meta-training data; this form is this project's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

FORMS = ("none", "nearest")  # META.TEST_TIME.PROTOTYPES
CONTEXT_DIM = 2  # s(z): nearest topic, nearest domain
TENSORS = ("topics", "domains", "mean", "std")  # init-file tensors prototypes.<name>
_CHUNK = 65536  # pairs per block when μ and σ are computed


@dataclass(frozen=True)
class Prototypes:
    """``topics`` ``[K_t, E]``, ``domains`` ``[K_d, E]`` (rows L2-normalised), ``mean`` / ``std`` ``[2]`` (module
    docstring); float32 on the CPU."""

    topics: torch.Tensor
    domains: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    def relation(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, 2]`` r(z) of L2-normalised ``features`` ``[n, E]``, on their device (no host sync in a step)."""
        z = features.detach().float()
        topics, domains = self.topics.to(z.device), self.domains.to(z.device)
        return torch.stack([(z @ topics.T).amax(dim=1), (z @ domains.T).amax(dim=1)], dim=1)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, 2]`` s(z) = (r(z) − μ) / σ of ``features`` ``[n, E]``."""
        r = self.relation(features)
        return (r - self.mean.to(r.device)) / self.std.to(r.device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{"prototypes.<name>": tensor}`` as the init file stores them."""
        return {f"prototypes.{name}": getattr(self, name).contiguous() for name in TENSORS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "Prototypes":
        """The inverse of :meth:`tensors` (``{name: tensor}`` without the prefix)."""
        return cls(**{name: tensors[name].float() for name in TENSORS})


def _unit_means(features: np.ndarray, groups: np.ndarray) -> torch.Tensor:
    """``[G, E]`` L2-normalised mean of ``features`` ``[n, E]`` per group id (``groups`` ``[n]`` in 0 … G−1)."""
    count = int(groups.max()) + 1
    sums = np.zeros((count, features.shape[1]), dtype=np.float64)
    np.add.at(sums, groups, features)
    means = torch.from_numpy(sums[np.bincount(groups, minlength=count) > 0])
    return torch.nn.functional.normalize(means, dim=1).float()


def prototypes_of(hierarchy, topics: Optional[Sequence[int]] = None) -> Prototypes:
    """The prototypes of ``hierarchy``'s pairs that lie in a topic (``item_topic >= 0``; of ``topics`` only when
    given, e.g. meta-training's, so held-out topics stay unseen); a pair outside any visual domain
    (``item_domain < 0``) counts for its topic only.  ValueError when no pair lies in such a topic."""
    topic = np.asarray(hierarchy.item_topic, dtype=np.int64)
    domain = np.asarray(hierarchy.item_domain, dtype=np.int64)
    keep = np.flatnonzero((topic >= 0) & (np.isin(topic, list(topics)) if topics is not None else True))
    if len(keep) == 0:
        raise ValueError("META.TEST_TIME.PROTOTYPES: the task hierarchy has no pair in a topic to build prototypes of")
    features = np.asarray(hierarchy.image_features[keep], dtype=np.float64)
    topics = _unit_means(features, topic[keep])
    in_domain = domain[keep] >= 0
    cluster = np.unique(np.stack([topic[keep], domain[keep]], axis=1)[in_domain], axis=0, return_inverse=True)[1]
    domains = _unit_means(features[in_domain], cluster.reshape(-1)) if in_domain.any() else topics
    shell = Prototypes(topics, domains, torch.zeros(CONTEXT_DIM), torch.ones(CONTEXT_DIM))
    r = torch.cat(
        [shell.relation(torch.from_numpy(features[i : i + _CHUNK]).float()) for i in range(0, len(keep), _CHUNK)]
    )
    std = r.double().std(dim=0, correction=0).clamp_min(1e-6).float() if len(r) > 1 else torch.ones(CONTEXT_DIM)
    return Prototypes(topics, domains, r.double().mean(dim=0).float(), std)
