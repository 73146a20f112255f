"""K-way meta-training tasks from a CHC hierarchy (paper section 3.3, "Automatic
Meta-Training Task Generation").

A task samples K topics with distinct names; each holds ``n_support`` support images from ONE visual domain of the
topic and ``n_query`` query images dealt round-robin over ALL its domains (never a support item): the train/test
domain shift the regulator learns from.  ``domain_shift=False`` is Table 4 row 1 (support from all domains).
``query_new_share`` > 0 (not in the paper) makes ``round(share * K)`` query classes topics the support does not hold,
as base-to-new scores new classes; ``0`` keeps the paper's tasks, drawn by the same generator calls.

One ``numpy.random.Generator`` seeded with ``seed`` drives everything, resumable (:meth:`TaskSampler.state_dict`);
:class:`TaskStream` draws meta-batches, :class:`ClassBatchStream` the pre-training baseline's batches.  Everything
works on item indices (numpy only) of a :class:`meta.chc.hierarchy.Hierarchy` or anything with its accessors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # any object with the same topic / domain accessors serves
    from meta.chc.hierarchy import Hierarchy


@dataclass
class Task:
    """One K-way episode.  Indices are item indices into the hierarchy.

    Attributes:
        classnames: [K] topic names, label ``k`` = ``classnames[k]``.
        topics: [K] topic ids in the hierarchy.
        support_index / support_label: int64 [K * n_support], grouped by class.
        query_index / query_label: int64 [K * n_query], grouped by class.
        support_domain: int64 [K] the domain each class's support came from
            (-1 when ``domain_shift=False``: support spans all domains).
        query_classnames: [K] the names ``query_label`` indexes; ``None`` = ``classnames`` (the query holds
            the support's classes).
        query_topics: [K] topic ids of ``query_classnames``; ``None`` = ``topics``.
    """

    classnames: list
    topics: np.ndarray
    support_index: np.ndarray
    support_label: np.ndarray
    query_index: np.ndarray
    query_label: np.ndarray
    support_domain: np.ndarray
    query_classnames: Optional[list] = None
    query_topics: Optional[np.ndarray] = None

    @property
    def k_way(self) -> int:
        return len(self.classnames)

    @property
    def query_names(self) -> list:
        """The class names of the query labels (the support's unless the classes shift)."""
        return self.classnames if self.query_classnames is None else self.query_classnames


class TaskSampler:
    """Samples :class:`Task` s of ``k_way`` (K) classes with ``n_support`` / ``n_query`` images each from the topics
    ``topics`` (e.g. :func:`split_topics`; ``None`` = all) of ``hierarchy``; ``domain_shift`` and ``query_new_share``
    as in the module docstring."""

    def __init__(
        self,
        hierarchy: "Hierarchy",
        k_way: int,
        n_support: int,
        n_query: int,
        domain_shift: bool = True,
        topics: Optional[Sequence[int]] = None,
        seed: int = 0,
        query_new_share: float = 0.0,
    ):
        if k_way < 1 or n_support < 1 or n_query < 1:
            raise ValueError(f"TASKS: K_WAY, N_SUPPORT and N_QUERY must be >= 1, got {k_way}, {n_support}, {n_query}")
        if not 0.0 <= query_new_share <= 1.0:
            raise ValueError(f"TASKS.QUERY_NEW_SHARE: expected a share in [0, 1], got {query_new_share}")
        self.h = hierarchy
        self.k_way, self.n_support, self.n_query = int(k_way), int(n_support), int(n_query)
        self.n_new = new_query_classes(self.k_way, query_new_share)
        self.domain_shift = bool(domain_shift)
        self.rng = np.random.default_rng(seed)
        candidates = range(hierarchy.num_topics) if topics is None else [int(t) for t in topics]
        self.topics = [t for t in candidates if self._eligible(t)]
        self.skipped_topics = len(list(candidates)) - len(self.topics)
        names = {hierarchy.topic_names[t] for t in self.topics}
        if len(names) < self.k_way + self.n_new:
            new = f" plus {self.n_new} new query classes (TASKS.QUERY_NEW_SHARE)" if self.n_new else ""
            raise ValueError(
                f"TaskSampler: only {len(names)} topics have a domain with >= {self.n_support} images "
                f"and >= {self.n_support + self.n_query} images in all; K_WAY is {self.k_way}{new}"
            )
        # distinct names -> topic ids (a hierarchy's names are unique, but a topic list may not be)
        self._by_name: dict = {}
        for t in self.topics:
            self._by_name.setdefault(hierarchy.topic_names[t], []).append(t)
        self._names = sorted(self._by_name)

    def _eligible(self, topic: int) -> bool:
        doms = self.h.domain_members(topic)
        total = sum(len(v) for v in doms.values())
        if total < self.n_support + self.n_query:
            return False
        return not self.domain_shift or any(len(v) >= self.n_support for v in doms.values())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]

    # ------------------------------------------------------------------ sampling
    def _query(self, doms: dict, used: np.ndarray) -> np.ndarray:
        """``n_query`` items dealt round-robin over the domains (random domain order)."""
        pools = [list(self.rng.permutation(np.setdiff1d(doms[u], used, assume_unique=True))) for u in sorted(doms)]
        order = self.rng.permutation(len(pools))
        picked: list = []
        while len(picked) < self.n_query:
            progressed = False
            for j in order:
                if pools[j] and len(picked) < self.n_query:
                    picked.append(pools[j].pop())
                    progressed = True
            if not progressed:
                raise RuntimeError("TaskSampler: topic ran out of query images")  # excluded by _eligible
        return np.asarray(picked, dtype=np.int64)

    def _topic_of(self, name: str) -> int:
        options = self._by_name[name]
        return options[int(self.rng.integers(len(options)))]

    def sample(self) -> Task:
        """The next task of the stream."""
        k, n_new = self.k_way, self.n_new
        picks = self.rng.choice(len(self._names), size=k + n_new, replace=False)
        names = [self._names[i] for i in picks[:k]]
        new_names = [self._names[i] for i in picks[k:]]
        kept = set(range(k) if n_new == 0 else (int(c) for c in self.rng.choice(k, size=k - n_new, replace=False)))
        topics, s_idx, q_idx, s_dom, q_names, q_topics = [], [], [], [], [], []
        for c, name in enumerate(names):
            topic = self._topic_of(name)
            doms = self.h.domain_members(topic)
            if self.domain_shift:
                usable = [u for u in sorted(doms) if len(doms[u]) >= self.n_support]
                dom = usable[int(self.rng.integers(len(usable)))]
                support = self.rng.choice(doms[dom], size=self.n_support, replace=False)
            else:
                dom = -1
                support = self.rng.choice(self.h.topic_members(topic), size=self.n_support, replace=False)
            support = np.sort(support)
            topics.append(topic), s_dom.append(dom), s_idx.append(support)
            if c in kept:
                q_idx.append(self._query(doms, support)), q_names.append(name), q_topics.append(topic)
        for name in new_names:  # classes the support does not hold: query over all their domains
            topic = self._topic_of(name)
            q_idx.append(self._query(self.h.domain_members(topic), np.empty(0, dtype=np.int64)))
            q_names.append(name), q_topics.append(topic)
        return Task(
            classnames=names,
            topics=np.asarray(topics, dtype=np.int64),
            support_index=np.concatenate(s_idx),
            support_label=np.repeat(np.arange(k), self.n_support),
            query_index=np.concatenate(q_idx),
            query_label=np.repeat(np.arange(k), self.n_query),
            support_domain=np.asarray(s_dom, dtype=np.int64),
            query_classnames=None if n_new == 0 else q_names,
            query_topics=None if n_new == 0 else np.asarray(q_topics, dtype=np.int64),
        )


def new_query_classes(k_way: int, share: float) -> int:
    """How many of a task's K query classes are new to its support: ``round(share * K)`` (Python's rounding)."""
    return int(round(float(share) * int(k_way)))


def largest_k_way(n_topics: int, k_way: int, share: float) -> int:
    """The largest K <= ``k_way`` whose task (K support topics plus ``round(share * K)`` new query topics) fits
    in ``n_topics`` distinct topics; 0 when none does (e.g. a small held-out validation set)."""
    for k in range(min(int(k_way), int(n_topics)), 0, -1):
        if k + new_query_classes(k, share) <= n_topics:
            return k
    return 0


def split_topics(hierarchy: "Hierarchy", val_fraction: float, seed: int = 0) -> tuple[list, list]:
    """Hold out topics for meta-validation: ``(train_topics, val_topics)``, disjoint, sorted.

    Only topics with at least one clustered item take part; ``round(val_fraction * L)``
    of them (at least 1 when ``val_fraction > 0``) go to validation.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"TASKS.VAL_FRACTION: expected a fraction in [0, 1), got {val_fraction}")
    sizes = hierarchy.topic_sizes()
    usable = np.flatnonzero(sizes > 0)
    n_val = int(round(val_fraction * len(usable)))
    if val_fraction > 0:
        n_val = min(max(1, n_val), len(usable) - 1)
    perm = np.random.default_rng(seed).permutation(usable)
    return sorted(int(t) for t in perm[n_val:]), sorted(int(t) for t in perm[:n_val])


class TaskStream:
    """Meta-batches from a :class:`meta.metatrain.tasks.TaskSampler`, with an exact, resumable position.

    The position is the number of tasks drawn plus the sampler's own ``state_dict()`` (its numpy
    generator).  A sampler without one is restored by re-drawing the same number of tasks from a
    fresh sampler with the same seed (samplers are deterministic under their seed; this costs only
    index arithmetic).
    """

    def __init__(self, make_sampler):
        self._make = make_sampler
        self.sampler = make_sampler()
        self.drawn = 0

    def next(self, n: int) -> list:
        tasks = [self.sampler.sample() for _ in range(n)]
        self.drawn += n
        return tasks

    def state(self) -> dict:
        has_state = hasattr(self.sampler, "state_dict")
        return {"drawn": int(self.drawn), "sampler": self.sampler.state_dict() if has_state else None}

    def load_state(self, state: dict) -> None:
        self.sampler = self._make()
        if state.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        else:
            for _ in range(int(state["drawn"])):
                self.sampler.sample()
        self.drawn = int(state["drawn"])


@dataclass
class ClassBatch:
    """One plain classification batch over ``classnames``: items and labels (0..C-1)."""

    classnames: list
    index: np.ndarray
    label: np.ndarray


class ClassBatchStream:
    """Batches for prompt pre-training (Table 4 row 3): classify images among the training topics.

    Each step takes ``ways`` topics (all training topics when 0), then ``batch_size`` items, each
    from a uniformly drawn topic of the step and uniformly among that topic's items (all domains).
    """

    def __init__(self, hierarchy, topics: Sequence[int], ways: int, batch_size: int, seed: int):
        self.h = hierarchy
        self.topics = np.asarray(sorted(int(t) for t in topics), dtype=np.int64)
        self.members = {int(t): hierarchy.topic_members(int(t)) for t in self.topics}
        empty = [hierarchy.topic_names[t] for t, m in self.members.items() if len(m) == 0]
        if empty:
            raise ValueError(f"topics without items cannot be classified: {empty[:5]}")
        self.ways = len(self.topics) if ways <= 0 else min(int(ways), len(self.topics))
        self.batch_size = int(batch_size)
        self.rng = np.random.default_rng([int(seed), 0x9E37])

    def next(self) -> ClassBatch:
        if self.ways == len(self.topics):
            chosen = self.topics
        else:
            chosen = np.sort(self.rng.choice(self.topics, size=self.ways, replace=False))
        label = self.rng.integers(0, len(chosen), size=self.batch_size)
        index = np.array(
            [self.members[int(chosen[c])][self.rng.integers(0, len(self.members[int(chosen[c])]))] for c in label],
            dtype=np.int64,
        )
        return ClassBatch([self.h.topic_names[int(t)] for t in chosen], index, label)

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
