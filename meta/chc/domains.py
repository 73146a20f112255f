"""Visual domain clustering (paper section 3.2): k-means on CLIP image features per topic.

Each topic is split into ``U = CHC.DOMAINS.NUM`` domains.  A topic with fewer than
``U * MIN_PER_DOMAIN`` images, or whose k-means leaves a domain smaller than
``MIN_PER_DOMAIN``, gets fewer domains (down to 1); a topic with fewer than
``MIN_PER_DOMAIN`` images is excluded.  Topics larger than ``MINIBATCH_ABOVE`` use
``MiniBatchKMeans``.  Features are unit-norm, so Euclidean k-means ranks like cosine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DomainSplit:
    """Domains of one topic: ``labels`` int64 ``[n]`` in ``[0, num_domains)``, or empty if excluded."""

    labels: np.ndarray
    num_domains: int

    @property
    def excluded(self) -> bool:
        return self.num_domains == 0


def _kmeans(features: np.ndarray, k: int, n_init: int, minibatch: bool, seed: int) -> np.ndarray:
    from sklearn.cluster import KMeans, MiniBatchKMeans

    if minibatch:
        model = MiniBatchKMeans(n_clusters=k, n_init=n_init, random_state=seed, batch_size=4096)
    else:
        model = KMeans(n_clusters=k, n_init=n_init, random_state=seed)
    return model.fit_predict(features).astype(np.int64)


def split_domains(
    features: np.ndarray,
    num_domains: int = 3,
    min_per_domain: int = 8,
    minibatch_above: int = 20000,
    n_init: int = 10,
    seed: int = 0,
) -> DomainSplit:
    """Partition one topic's image features ``[n, D]`` into at most ``num_domains`` domains.

    Domain ids are ordered by size (0 = largest), so the result does not depend on
    k-means' arbitrary label order.
    """
    n = len(features)
    if n_init < 1 or num_domains < 1 or min_per_domain < 1:
        raise ValueError("CHC.DOMAINS: NUM, MIN_PER_DOMAIN and N_INIT must be >= 1")
    k = min(num_domains, n // min_per_domain)
    if k < 1:
        return DomainSplit(np.zeros(0, dtype=np.int64), 0)
    x = np.asarray(features, dtype=np.float32)
    while k > 1:
        labels = _kmeans(x, k, n_init, n > minibatch_above, seed)
        sizes = np.bincount(labels, minlength=k)
        if sizes.min() >= min_per_domain:
            order = np.lexsort((np.arange(k), -sizes))  # largest first
            relabel = np.empty(k, dtype=np.int64)
            relabel[order] = np.arange(k)
            return DomainSplit(relabel[labels], k)
        k -= 1
    return DomainSplit(np.zeros(n, dtype=np.int64), 1)
