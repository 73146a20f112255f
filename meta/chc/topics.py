"""Semantic topic clustering (paper section 3.2): UMAP -> HDBSCAN -> cluster TF-IDF words.

Scale rule (meta/chc/README.md): UMAP + HDBSCAN are fitted on at most ``CHC.TOPICS.FIT_SAMPLE`` unique captions;
every other caption goes to the nearest centroid (cosine), or to noise below the ``ASSIGN_QUANTILE`` quantile of the
fitted members' similarity to their own centroid.

Topic words use the paper's cluster TF-IDF (eq. 1) over the tokens of :func:`topic_tokens`, stop words removed
(:func:`cluster_tfidf_words`; formula and presence threshold: meta/chc/README.md, "Topic words").  Clusters whose
top word is the same become ONE topic, so a K-way task can never hold two classes with one name.
"""

from __future__ import annotations

import contextlib
import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from meta.infra.numerics import torch_threads_kept

# Words that describe the medium, not the content, of web captions (CC3M-style alt-text).
CAPTION_STOP_WORDS = frozenset(
    """
photo photos photograph photographs photography image images picture pictures pic pics illustration
illustrations vector vectors stock background backgrounds royalty free isolated closeup footage shot shots
file clipart cartoon drawing render rendering artwork template mockup hd high quality resolution
""".split()
)


# ------------------------------------------------------------------------------ fitting
@functools.lru_cache(maxsize=None)
def _umap_with_jit_cache():
    """``umap``, its numba functions compiled once per machine instead of once per process.

    umap-learn declares its kernels without ``cache=True`` (a UMAP fit of 300 captions: 30 s from a cold process,
    0.8 s cached); numba's cache keeps the same machine code, so the same numbers.
    """
    import umap
    import umap.distances
    import umap.layouts
    import umap.sparse
    import umap.umap_
    import umap.utils
    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    for module in (umap.utils, umap.umap_, umap.layouts, umap.distances, umap.sparse):
        for fn in vars(module).values():
            if isinstance(fn, Dispatcher) and isinstance(fn._cache, NullCache):
                with contextlib.suppress(RuntimeError):  # no writable cache folder: compile per process as before
                    fn.enable_caching()
    return umap


def fit_sample_clusters(
    embeddings: np.ndarray,
    umap_dim: int = 5,
    n_neighbors: int = 15,
    min_dist: float = 0.0,
    metric: str = "cosine",
    init: str = "random",
    min_cluster_size: int = 20,
    min_samples: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """UMAP to ``umap_dim`` dims, then HDBSCAN.  Returns int64 labels ``[n]`` (-1 = noise)."""
    import hdbscan

    umap = _umap_with_jit_cache()
    n = len(embeddings)
    if n < max(min_cluster_size, n_neighbors + 2):
        raise ValueError(
            f"CHC.TOPICS: only {n} unique captions to fit on; need at least "
            f"max(MIN_CLUSTER_SIZE={min_cluster_size}, UMAP_NEIGHBORS+2={n_neighbors + 2})"
        )
    reducer = umap.UMAP(
        n_components=umap_dim,
        n_neighbors=n_neighbors,
        min_dist=min_dist,
        metric=metric,
        init=init,
        random_state=seed,
        low_memory=True,
        n_jobs=1,
    )
    with torch_threads_kept():
        reduced = reducer.fit_transform(np.asarray(embeddings, dtype=np.float32))
    clusterer = hdbscan.HDBSCAN(
        min_cluster_size=int(min_cluster_size),
        min_samples=int(min_samples) if min_samples else None,
        core_dist_n_jobs=1,
    )
    return clusterer.fit_predict(reduced).astype(np.int64)


def project_2d(embeddings: np.ndarray, n_neighbors: int = 15, metric: str = "cosine", seed: int = 0) -> np.ndarray:
    """2-D UMAP of ``[n, d]`` embeddings for the report picture, float32 ``[n, 2]``."""
    umap = _umap_with_jit_cache()
    reducer = umap.UMAP(
        n_components=2,
        n_neighbors=min(n_neighbors, max(2, len(embeddings) - 1)),
        min_dist=0.1,
        metric=metric,
        init="random",
        random_state=seed,
        n_jobs=1,
    )
    with torch_threads_kept():
        return reducer.fit_transform(np.asarray(embeddings, dtype=np.float32)).astype(np.float32)


def centroids(embeddings: np.ndarray, labels: np.ndarray, n_clusters: int) -> np.ndarray:
    """Unit-norm mean embedding of each cluster, float32 ``[n_clusters, d]``."""
    d = embeddings.shape[1]
    sums = np.zeros((n_clusters, d), dtype=np.float64)
    mask = labels >= 0
    np.add.at(sums, labels[mask], embeddings[mask])
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return (sums / np.maximum(norms, 1e-12)).astype(np.float32)


def member_similarity_cut(embeddings: np.ndarray, labels: np.ndarray, cents: np.ndarray, quantile: float) -> float:
    """The ``quantile`` of fitted members' cosine to their own centroid (noise cut for new points)."""
    mask = labels >= 0
    sims = np.einsum("nd,nd->n", embeddings[mask], cents[labels[mask]])
    return float(np.quantile(sims, quantile)) if quantile > 0 and len(sims) else -1.0


def assign_nearest(embeddings: np.ndarray, cents: np.ndarray, min_similarity: float, block: int = 65536) -> np.ndarray:
    """Nearest centroid by cosine for unit-norm ``[n, d]`` rows; -1 below ``min_similarity``."""
    out = np.empty(len(embeddings), dtype=np.int64)
    for start in range(0, len(embeddings), block):
        sims = np.asarray(embeddings[start : start + block], dtype=np.float32) @ cents.T
        best = sims.argmax(axis=1)
        best[sims[np.arange(len(best)), best] < min_similarity] = -1
        out[start : start + block] = best
    return out


# ------------------------------------------------------------------------------ topic words
# Han ideographs and kana: scripts written without spaces between words (Unicode Standard, chapter 18
# "East Asia"; block ranges from the Unicode Character Database, Blocks.txt).
_CJK_RANGES = (
    (0x3005, 0x3006),  # ideographic iteration mark, closing mark
    (0x3040, 0x30FF),  # Hiragana, Katakana (with the prolonged sound mark U+30FC)
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK unified ideographs extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # halfwidth Katakana
    (0x20000, 0x323AF),  # CJK unified ideographs extensions B-H (supplementary planes 2 and 3)
)


def _char_class(codes: list) -> str:
    """A regex character class body for the sorted code points ``codes`` (merged into ranges)."""
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        lo, hi = re.escape(chr(codes[i])), re.escape(chr(codes[j]))
        parts.append(lo if i == j else f"{lo}-{hi}")
        i = j + 1
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _patterns() -> tuple:
    """(word run, CJK segment, CJK unit) patterns, built once from the running Python's Unicode database."""
    letters, marks, cjk = [], [], []
    in_cjk = bytearray(0x110000)
    for lo, hi in _CJK_RANGES:
        in_cjk[lo : hi + 1] = b"\x01" * (hi - lo + 1)
    for code in range(0x110000):
        cat = unicodedata.category(chr(code))
        if cat[0] == "L":
            letters.append(code)
            if in_cjk[code]:
                cjk.append(code)
        elif cat[0] == "M":
            marks.append(code)
    letter, mark, han = _char_class(letters), _char_class(marks), _char_class(cjk)
    # A run of letters (with their combining marks) not touching a digit, "_" or another word character:
    # for ASCII text exactly the runs the former pattern ``\b[a-z]{3,}\b`` matched (before the length rule).
    word = re.compile(rf"(?<!\w)[{letter}][{letter}{mark}]*(?!\w)")
    segment = re.compile(rf"(?:[{han}][{mark}]*)+")
    unit = re.compile(rf"[{han}][{mark}]*")
    return word, segment, unit, re.compile(rf"[{mark}]")


def topic_tokens(text: str, min_word_len: int = 3) -> list:
    """The tokens a caption gives for topic words (``text`` is lower-cased by the caller): words of letters of any
    script (combining marks inside, not touching a digit or ``_``) of at least ``min_word_len`` letters, overlapping
    character pairs of Han / kana runs, nothing for emoji, digits and punctuation.  The rule and its sources:
    meta/chc/README.md, "Topic words"."""
    word, segment, unit, mark = _patterns()
    out: list = []

    def add_word(run: str) -> None:
        n_letters = len(run) if run.isascii() else len(run) - len(mark.findall(run))
        if n_letters >= min_word_len:
            out.append(run)

    for run in word.findall(text):
        if run.isascii():  # the common case: no Han / kana segment to look for
            add_word(run)
            continue
        pos = 0
        for seg in segment.finditer(run):
            add_word(run[pos : seg.start()])
            chars = unit.findall(seg.group())
            out.extend(chars if len(chars) == 1 else [a + b for a, b in zip(chars, chars[1:])])
            pos = seg.end()
        add_word(run[pos:])
    return out


@dataclass
class ClusterWords:
    """Cluster TF-IDF result for ``L`` clusters.

    Attributes:
        top_word: [L] highest-scoring word per cluster.
        top_words: [L] the 5 best words per cluster (for the report).
        vocabulary_size: number of distinct words scored.
    """

    top_word: list
    top_words: list
    vocabulary_size: int


def cluster_tfidf_words(
    captions: Sequence[str],
    labels: np.ndarray,
    n_clusters: int,
    weights: Optional[np.ndarray] = None,
    presence_min_fraction: float = 0.01,
    min_word_len: int = 3,
    extra_stop_words: Sequence[str] = (),
) -> ClusterWords:
    """Top word of each cluster by the paper's cluster TF-IDF (eq. 1), ``N_wl / N_l * log(L / (L_w + 1))``.

    Args:
        captions: [n] caption strings (unique captions, see ``weights``).
        labels: [n] cluster id in ``[0, n_clusters)`` or -1 (ignored).
        weights: [n] how many pairs carry each caption (default 1): a cluster's
            document is the concatenation of all its pairs' captions.
        presence_min_fraction: cluster ``l`` counts towards ``L_w`` only if ``w`` is in
            at least this fraction of its captions (and at least once).
    """
    from scipy import sparse
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, CountVectorizer

    labels = np.asarray(labels)
    weights = np.ones(len(captions)) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = np.flatnonzero(labels >= 0)
    stop = sorted(set(ENGLISH_STOP_WORDS) | CAPTION_STOP_WORDS | {w.lower() for w in extra_stop_words})
    vectorizer = CountVectorizer(
        lowercase=True,
        tokenizer=functools.partial(topic_tokens, min_word_len=int(min_word_len)),
        token_pattern=None,
        stop_words=stop,
        dtype=np.float64,
    )
    try:
        counts = vectorizer.fit_transform([captions[i] for i in keep])  # [n_kept, V]
    except ValueError as err:
        if "empty vocabulary" not in str(err):
            raise
        raise ValueError(
            f"CHC.TOPICS.MIN_WORD_LEN: no topic word in the {len(keep)} clustered captions; a topic word is "
            f"a word of at least MIN_WORD_LEN={int(min_word_len)} letters (any script; Chinese/Japanese by "
            "character pairs) not in the stop-lists (CHC.TOPICS.EXTRA_STOP_WORDS), and captions of only "
            "emoji, digits or punctuation give none: check the captions CHC.INPUT names"
        ) from None
    vocab = vectorizer.get_feature_names_out()
    member = sparse.csr_matrix(
        (weights[keep], (labels[keep], np.arange(len(keep)))), shape=(n_clusters, len(keep))
    )  # [L, n_kept]
    # Everything stays sparse: at CC3M scale L x V is thousands x 10^5.
    n_wl = (member @ counts).tocsr()  # N_{w,l}  [L, V]
    n_wl.sum_duplicates()
    docs_with_w = (member @ (counts > 0).astype(np.float64)).tocsr()  # captions holding w [L, V]
    n_docs = np.asarray(member.sum(axis=1)).ravel()  # captions per cluster [L]
    need = np.maximum(1.0, presence_min_fraction * n_docs)  # presence threshold per cluster
    rows = np.repeat(np.arange(n_clusters), np.diff(docs_with_w.indptr))
    present_cols = docs_with_w.indices[docs_with_w.data >= need[rows]]
    l_w = np.bincount(present_cols, minlength=len(vocab))  # L_w  [V]
    idf = np.log(n_clusters / (l_w + 1.0))
    top_word, top_words = [], []
    for cluster in range(n_clusters):
        lo, hi = n_wl.indptr[cluster], n_wl.indptr[cluster + 1]
        cols, vals = n_wl.indices[lo:hi], n_wl.data[lo:hi]
        if len(cols) == 0:
            top_word.append(""), top_words.append([])
            continue
        score = vals / vals.sum() * idf[cols]  # N_wl / N_l * log(L / (L_w + 1))
        order = np.lexsort((vocab[cols], -score))[:5]  # ties broken alphabetically
        words = [str(vocab[cols[j]]) for j in order]
        top_words.append(words)
        top_word.append(words[0])
    return ClusterWords(top_word=top_word, top_words=top_words, vocabulary_size=len(vocab))


def merge_clusters_by_word(top_word: Sequence[str], cluster_sizes: Sequence[int]) -> tuple[list, np.ndarray]:
    """Merge clusters that share a top word (same name = same class); clusters without a word map to -1.  Returns
    ``(topic_names, cluster_to_topic)``: names by total size (descending, ties by name), int64 ``[L]`` cluster -> topic.
    """
    totals: dict = {}
    for word, size in zip(top_word, cluster_sizes):
        if word:
            totals[word] = totals.get(word, 0) + int(size)
    names = sorted(totals, key=lambda w: (-totals[w], w))
    index = {w: i for i, w in enumerate(names)}
    mapping = np.array([index.get(w, -1) if w else -1 for w in top_word], dtype=np.int64)
    return names, mapping
