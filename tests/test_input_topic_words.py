"""Topic words in any script (meta.chc.topics.topic_tokens / cluster_tfidf_words), called directly with
made-up cluster assignments (no CHC pipeline run)."""

import re

import numpy as np
import pytest

from gram_tools.synthetic import TOPICS, make_caption
from meta.chc.topics import CAPTION_STOP_WORDS, cluster_tfidf_words, merge_clusters_by_word, topic_tokens


# ---------------------------------------------------------------- the former (ASCII) behaviour, kept as the reference
def old_tokens(text, min_word_len):
    """The token rule before Unicode support: CountVectorizer's ``token_pattern`` on lower-cased text."""
    return re.findall(rf"(?u)\b[a-z]{{{int(min_word_len)},}}\b", text.lower())


def old_cluster_tfidf_words(captions, labels, n_clusters, weights=None, presence_min_fraction=0.01, min_word_len=3):
    """Copy of ``cluster_tfidf_words`` as it was with the ASCII token pattern (dense numpy, same formula)."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, CountVectorizer

    labels = np.asarray(labels)
    weights = np.ones(len(captions)) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = np.flatnonzero(labels >= 0)
    stop = sorted(set(ENGLISH_STOP_WORDS) | CAPTION_STOP_WORDS)
    vec = CountVectorizer(lowercase=True, token_pattern=rf"(?u)\b[a-z]{{{min_word_len},}}\b", stop_words=stop)
    counts = vec.fit_transform([captions[i] for i in keep]).toarray().astype(np.float64)
    vocab = vec.get_feature_names_out()
    member = np.zeros((n_clusters, len(keep)))
    member[labels[keep], np.arange(len(keep))] = weights[keep]
    n_wl = member @ counts
    docs_with_w = member @ (counts > 0)
    need = np.maximum(1.0, presence_min_fraction * member.sum(axis=1))
    l_w = (docs_with_w >= need[:, None]).sum(axis=0)  # need >= 1: only clusters holding w count
    idf = np.log(n_clusters / (l_w + 1.0))
    top_words = []
    for cluster in range(n_clusters):
        cols = np.flatnonzero(n_wl[cluster])
        score = n_wl[cluster, cols] / n_wl[cluster, cols].sum() * idf[cols]
        order = np.lexsort((vocab[cols], -score))[:5]
        top_words.append([str(vocab[cols[j]]) for j in order])
    return top_words, len(vocab)


def english_captions(n=600, seed=0):
    """Generated alt-text plus hand-written captions with the ASCII corner cases of the old pattern."""
    rng = np.random.default_rng(seed)
    names = list(TOPICS)
    caps, labels = [], []
    for i in range(n):
        t = i % len(names)
        caps.append(make_caption(names[t], rng, names, 0.2)), labels.append(t)
    tricky = [
        "Dog's BALL, 4K photo of dogs2 and snake_case_dog; e.g. T-shirt www.example.com/pizza.jpg",
        "mp3 x86 ab abc ABCD a1b2c3 _cat cat_ 'car' \"boat\" (cake) [bird]\tforest\nriver",
        "DOG-CAT dog/cat dog.cat dog:cat 12dogs dogs12 dogs!!! ...tree... I'm it's you're",
        "",
        "    ",
        "a an the of on in at to by",
    ]
    for j, cap in enumerate(tricky):
        caps.append(cap), labels.append(j % len(names))
    return caps, np.array(labels), len(names)


@pytest.mark.parametrize("min_word_len", [1, 2, 3, 4, 6])
def test_ascii_tokens_equal_the_old_pattern(min_word_len):
    caps, _, _ = english_captions(200)
    for cap in caps:
        assert topic_tokens(cap.lower(), min_word_len) == old_tokens(cap, min_word_len), cap


def test_english_topic_words_unchanged():
    caps, labels, n_clusters = english_captions()
    labels = labels.copy()
    labels[::7] = -1  # noise is ignored by both
    for frac in (0.0, 0.1):
        new = cluster_tfidf_words(caps, labels, n_clusters, None, frac)
        old_top, old_vocab = old_cluster_tfidf_words(caps, labels, n_clusters, None, frac)
        assert new.top_words == old_top and new.vocabulary_size == old_vocab
        assert new.top_word == [w[0] for w in old_top]


# ---------------------------------------------------------------- scripts other than Latin
def _corpus(topics, templates, per_topic=30, seed=0):
    """``per_topic`` captions per topic from ``templates`` ("{}" = the topic word); labels = topic index."""
    rng = np.random.default_rng(seed)
    caps, labels = [], []
    for t, word in enumerate(topics):
        for _ in range(per_topic):
            caps.append(str(rng.choice(templates)).format(word)), labels.append(t)
    return caps, np.array(labels)


def test_arabic_captions_name_their_topics():
    topics = ["قطة", "كلب", "سيارة"]  # cat, dog, car
    templates = [
        "{} سوداء على الأريكة",  # black ... on the sofa
        "صورة {} في الحديقة",  # picture of ... in the garden
        "{} صغيرة في الشارع",  # small ... in the street
        "{} بيضاء تحت الشمس",  # white ... under the sun
    ]
    caps, labels = _corpus(topics, templates)
    with pytest.raises(ValueError, match="empty vocabulary"):  # what the ASCII pattern did with this corpus
        old_cluster_tfidf_words(caps, labels, 3, None, 0.1)
    words = cluster_tfidf_words(caps, labels, 3, None, 0.1)
    assert words.top_word == topics
    names, mapping = merge_clusters_by_word(words.top_word, np.bincount(labels))
    assert sorted(names) == sorted(topics) and sorted(mapping.tolist()) == [0, 1, 2]
    # harakat (combining marks) stay inside their word; a 2-letter word is under MIN_WORD_LEN 3
    assert topic_tokens("قِطَّة في البيت") == ["قِطَّة", "البيت"]


def test_marks_of_indic_scripts_stay_inside_the_word():
    # Devanagari vowel signs and virama are combining marks, not letters: "kutta" is one word, not pieces
    assert topic_tokens("कुत्ता पार्क") == ["कुत्ता", "पार्क"]
    assert topic_tokens("e\u0301cole café naïve", 3) == ["e\u0301cole", "café", "naïve"]  # decomposed accent too


def test_chinese_captions_give_character_pairs_and_name_their_topics():
    assert topic_tokens("一只小狗在草地上") == ["一只", "只小", "小狗", "狗在", "在草", "草地", "地上"]
    assert topic_tokens("猫") == ["猫"] and topic_tokens("猫, 狗") == ["猫", "狗"]  # a lone character is itself
    assert topic_tokens("ラーメン") == ["ラー", "ーメ", "メン"]  # kana (and the prolonged sound mark) too
    assert topic_tokens("我的dog在家", 3) == ["我的", "dog", "在家"]  # a Latin word inside a Han run
    topics = ["小狗", "小猫", "汽车"]  # puppy, kitten, car
    templates = ["一只{}在草地上", "可爱的{}睡在沙发上", "{}和球", "我的{}在海边", "{}"]
    caps, labels = _corpus(topics, templates)
    words = cluster_tfidf_words(caps, labels, 3, None, 0.1)
    assert words.top_word == topics


def test_emoji_only_captions_stop_with_one_line_naming_the_key():
    caps = ["🐶🐶", "🐶 🦴", "🐱", "🐱❤️", "🚗💨", "🚗"]
    labels = np.array([0, 0, 1, 1, 2, 2])
    assert all(topic_tokens(c) == [] for c in caps)
    with pytest.raises(ValueError) as err:
        cluster_tfidf_words(caps, labels, 3, None, 0.1)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("CHC.TOPICS.MIN_WORD_LEN: no topic word in the 6 clustered captions")
    assert "emoji" in msg


def test_emoji_only_cluster_among_named_ones_is_dropped_and_emoji_do_not_glue_words():
    assert topic_tokens("❤️dog🐶 sofa🛋️") == ["dog", "sofa"]
    caps = ["🐶🐶", "🐶 🦴", "red car ❤️", "blue car", "green cake 🎂", "cake with candles"]
    labels = np.array([0, 0, 1, 1, 2, 2])
    words = cluster_tfidf_words(caps, labels, 3, None, 0.0)
    assert words.top_word == ["", "car", "cake"]
    names, mapping = merge_clusters_by_word(words.top_word, [2, 2, 2])
    assert names == ["cake", "car"] and mapping.tolist() == [-1, 1, 0]
