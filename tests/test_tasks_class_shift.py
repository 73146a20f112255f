"""Class-shift meta-tasks (``TASKS.QUERY_NEW_SHARE``): query classes the support does not hold.

Checked on a toy hierarchy against the definition in :mod:`meta.metatrain.tasks`: ``round(share * K)`` query classes are
topics outside the support (distinct names, items from their own topic dealt over all its domains), the rest are
support classes whose query items never repeat a support item; share 1 makes the topic sets disjoint; the
stream is deterministic under its seed and resumes exactly; the batcher gives the query its own class names.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_chc import toy_hierarchy

from meta.metatrain.tasks import TaskSampler, TaskStream, largest_k_way, new_query_classes

K, N_S, N_Q = 4, 3, 5


def check_class_shift_task(h, task, share: float) -> None:
    n_new = new_query_classes(K, share)
    support_names, query_names = task.classnames, task.query_names
    assert len(query_names) == K and len(set(query_names)) == K
    assert task.query_label.tolist() == np.repeat(np.arange(K), N_Q).tolist()
    new = [c for c in query_names if c not in support_names]
    assert len(new) == n_new, (support_names, query_names)
    assert len(np.intersect1d(task.support_index, task.query_index)) == 0
    for c, name in enumerate(query_names):
        topic = task.query_topics[c]
        assert h.topic_names[topic] == name
        items = task.query_index[task.query_label == c]
        assert (h.item_topic[items] == topic).all()
        domains = h.domain_members(topic)
        # dealt round-robin over every domain of the topic: each domain gives floor or ceil of its share
        # (no domain here is too small to give N_Q // n_domains items)
        got = np.bincount(h.item_domain[items], minlength=max(domains) + 1)
        assert got.max() - got[[u for u in domains]].min() <= 1
    for c, name in enumerate(support_names):  # the support side is the paper's: one domain per class
        items = task.support_index[task.support_label == c]
        assert (h.item_domain[items] == task.support_domain[c]).all()
        assert (h.item_topic[items] == task.topics[c]).all()


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_query_holds_round_share_k_new_classes(share):
    h = toy_hierarchy(n_topics=12)
    sampler = TaskSampler(h, K, N_S, N_Q, seed=3, query_new_share=share)
    for _ in range(100):
        check_class_shift_task(h, sampler.sample(), share)


def test_share_one_makes_the_topic_sets_disjoint_and_share_zero_keeps_the_paper_tasks():
    h = toy_hierarchy(n_topics=12)
    disjoint = TaskSampler(h, K, N_S, N_Q, seed=0, query_new_share=1.0)
    for _ in range(50):
        task = disjoint.sample()
        assert not set(task.topics.tolist()) & set(task.query_topics.tolist())
        assert not set(task.classnames) & set(task.query_names)
    paper = TaskSampler(h, K, N_S, N_Q, seed=0)
    task = paper.sample()
    assert task.query_classnames is None and task.query_topics is None and task.query_names == task.classnames


def test_mixed_tasks_vary_which_support_classes_stay_and_which_topics_are_new():
    h = toy_hierarchy(n_topics=12)
    sampler = TaskSampler(h, K, N_S, N_Q, seed=1, query_new_share=0.5)
    kept_positions, new_names = set(), set()
    for _ in range(60):
        task = sampler.sample()
        kept_positions |= {task.classnames.index(c) for c in task.query_names if c in task.classnames}
        new_names |= {c for c in task.query_names if c not in task.classnames}
    assert kept_positions == set(range(K))
    assert len(new_names) >= 8


def test_same_seed_same_tasks_and_the_stream_resumes_exactly():
    h = toy_hierarchy(n_topics=12)

    def make():
        return TaskSampler(h, K, N_S, N_Q, seed=5, query_new_share=0.5)

    def key(task):
        return (task.classnames, task.query_names, task.support_index.tolist(), task.query_index.tolist())

    a, b = TaskStream(make), TaskStream(make)
    assert [key(t) for t in a.next(5)] == [key(t) for t in b.next(5)]
    state = a.state()
    expected = [key(t) for t in a.next(4)]
    resumed = TaskStream(make)
    resumed.load_state(state)
    assert [key(t) for t in resumed.next(4)] == expected
    other = TaskSampler(h, K, N_S, N_Q, seed=6, query_new_share=0.5)
    assert [key(other.sample()) for _ in range(5)] != [key(t) for t in TaskStream(make).next(5)]


def test_too_few_topics_and_bad_shares_are_refused():
    h = toy_hierarchy(n_topics=9)  # topics 2, 5, 8 hold 6 < N_S + N_Q items: 6 eligible topics
    TaskSampler(h, 3, N_S, N_Q, query_new_share=1.0)  # 3 + 3 <= 6
    with pytest.raises(ValueError, match=r"only 6 topics .* K_WAY is 4 plus 4 new query classes \(TASKS.QUERY_NEW"):
        TaskSampler(h, 4, N_S, N_Q, query_new_share=1.0)
    with pytest.raises(ValueError, match=r"^TASKS.QUERY_NEW_SHARE: expected a share in \[0, 1\], got -0.1$"):
        TaskSampler(h, 3, N_S, N_Q, query_new_share=-0.1)


def test_largest_k_way_is_the_largest_k_that_fits():
    for n_topics in range(0, 12):
        for share in (0.0, 0.3, 0.5, 1.0):
            k = largest_k_way(n_topics, 5, share)
            fits = [j for j in range(1, 6) if j + new_query_classes(j, share) <= n_topics]
            assert k == (max(fits) if fits else 0)


def test_the_batcher_gives_the_query_its_own_class_names():
    from meta.metatrain.data import TaskBatcher

    h = toy_hierarchy(n_topics=12)
    task = TaskSampler(h, K, N_S, N_Q, seed=2, query_new_share=1.0).sample()
    batch = TaskBatcher(h, False, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))(task)
    assert batch.support["classnames"] == task.classnames
    assert batch.query["classnames"] == task.query_names != task.classnames
    assert batch.query["features"].shape == (K * N_Q, h.image_features.shape[1])
