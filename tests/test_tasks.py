"""Task sampling: class names, one-domain support, domain-spread query, determinism, splits."""

import numpy as np
import pytest
from helpers_chc import toy_hierarchy

from meta.chc.hierarchy import Hierarchy
from meta.metatrain.tasks import Task, TaskSampler, split_topics


def check_task(h: Hierarchy, task: Task, k, n_s, n_q, domain_shift=True):
    assert isinstance(task, Task) and task.k_way == k
    assert len(set(task.classnames)) == k
    assert task.support_index.shape == task.support_label.shape == (k * n_s,)
    assert task.query_index.shape == task.query_label.shape == (k * n_q,)
    assert len(np.intersect1d(task.support_index, task.query_index)) == 0
    assert len(np.unique(task.support_index)) == k * n_s and len(np.unique(task.query_index)) == k * n_q
    for c in range(k):
        topic = task.topics[c]
        assert h.topic_names[topic] == task.classnames[c]
        sup = task.support_index[task.support_label == c]
        qry = task.query_index[task.query_label == c]
        assert (h.item_topic[sup] == topic).all() and (h.item_topic[qry] == topic).all()
        if domain_shift:
            assert (h.item_domain[sup] == task.support_domain[c]).all()
        else:
            assert task.support_domain[c] == -1


def test_tasks_have_distinct_names_and_one_domain_support():
    h = toy_hierarchy()
    sampler = TaskSampler(h, k_way=5, n_support=4, n_query=6, seed=1)
    for _ in range(200):
        check_task(h, sampler.sample(), 5, 4, 6)


def test_query_spreads_over_all_domains():
    h = toy_hierarchy()
    sampler = TaskSampler(h, k_way=4, n_support=3, n_query=6, seed=2)
    spread = []
    for _ in range(100):
        task = sampler.sample()
        for c in range(4):
            doms = h.domain_members(task.topics[c])
            qd = h.item_domain[task.query_index[task.query_label == c]]
            counts = np.bincount(qd, minlength=len(doms))
            # round-robin over domains: counts differ by at most one unless a domain ran dry
            avail = [len(np.setdiff1d(doms[u], task.support_index)) for u in sorted(doms)]
            assert counts.max() - counts[np.array(avail) > counts].min(initial=counts.max()) <= 1
            spread.append(len(np.unique(qd)) == len(doms))
    assert all(spread)


def test_support_domain_choice_varies_and_ablation_mixes_domains():
    h = toy_hierarchy()
    chosen = set()
    sampler = TaskSampler(h, k_way=3, n_support=5, n_query=4, seed=0)
    for _ in range(100):
        t = sampler.sample()
        chosen.update((int(a), int(b)) for a, b in zip(t.topics, t.support_domain))
    # topic 0 has 3 domains (12, 7, 4 items): only domains 0 and 1 hold 5 support shots
    assert {(0, 0), (0, 1)} <= chosen and (0, 2) not in chosen
    mixed = TaskSampler(h, k_way=3, n_support=4, n_query=4, domain_shift=False, seed=0)
    n_multi = 0
    for _ in range(100):
        t = mixed.sample()
        check_task(h, t, 3, 4, 4, domain_shift=False)
        for c in range(3):
            n_multi += len(np.unique(h.item_domain[t.support_index[t.support_label == c]])) > 1
    assert n_multi > 50


def test_deterministic_under_seed_and_resumable():
    h = toy_hierarchy()
    a = [TaskSampler(h, 5, 2, 3, seed=7).sample() for _ in range(1)][0]
    s1, s2, s3 = TaskSampler(h, 5, 2, 3, seed=7), TaskSampler(h, 5, 2, 3, seed=7), TaskSampler(h, 5, 2, 3, seed=8)
    seq1 = [s1.sample() for _ in range(10)]
    seq2 = [s2.sample() for _ in range(10)]
    seq3 = [s3.sample() for _ in range(10)]
    assert a.classnames == seq1[0].classnames
    for x, y in zip(seq1, seq2):
        assert x.classnames == y.classnames
        np.testing.assert_array_equal(x.support_index, y.support_index)
        np.testing.assert_array_equal(x.query_index, y.query_index)
    assert any(not np.array_equal(x.query_index, z.query_index) for x, z in zip(seq1, seq3))
    # state_dict: continue the stream in a new sampler
    s4 = TaskSampler(h, 5, 2, 3, seed=7)
    [s4.sample() for _ in range(4)]
    state = s4.state_dict()
    s5 = TaskSampler(h, 5, 2, 3, seed=123)
    s5.load_state_dict(state)
    np.testing.assert_array_equal(s5.sample().support_index, seq1[4].support_index)


def test_topic_restriction_eligibility_and_errors():
    h = toy_hierarchy()
    sampler = TaskSampler(h, 2, 4, 4, topics=[0, 1, 2], seed=0)
    for _ in range(30):
        assert set(sampler.sample().topics) <= {0, 1, 2}
    # 5 + 2 images needed: topics 2 and 5 (one domain of 6 images) are ineligible
    s = TaskSampler(h, 2, 5, 2, seed=0)
    assert s.topics == [0, 1, 3, 4, 6, 7] and s.skipped_topics == 2
    with pytest.raises(ValueError, match="K_WAY"):
        TaskSampler(h, 9, 2, 2)
    with pytest.raises(ValueError, match="N_SUPPORT"):
        TaskSampler(h, 2, 0, 2)


def test_hierarchy_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        Hierarchy(["a", "a"], np.array([0, 1]), np.array([0, 0]), np.zeros((2, 3), np.float32), {}, lambda i: None)


def test_split_topics_disjoint_and_deterministic():
    h = toy_hierarchy(n_topics=20)
    train, val = split_topics(h, 0.2, seed=4)
    assert len(val) == 4 and len(train) == 16
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(20))
    assert split_topics(h, 0.2, seed=4) == (train, val)
    assert split_topics(h, 0.2, seed=5) != (train, val)
    assert split_topics(h, 0.0, seed=4) == (list(range(20)), [])
    sampler = TaskSampler(h, 3, 2, 2, topics=val, seed=0)
    assert set(sampler.sample().topics) <= set(val)
