"""Benchmark + study on a generated corpus: throughput per CHC stage and topic-word recovery.

``python -m gram_tools.chc_measure --pairs 10000 --min-cluster-size 20 --out .cache/chc_measure``

Prints (1) items per second of every stage on this machine and (2) for several
``PRESENCE_MIN_FRACTION`` values, how often the cluster TF-IDF top word equals the
true topic of the cluster's majority (cluster accuracy) and how many true topics get
at least one cluster named by their true word (topic recovery).  The default of
``CHC.TOPICS.PRESENCE_MIN_FRACTION`` was chosen from this study (see README / report).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from meta.infra.cli_errors import int_flag_problem


def word_recovery(captions, true_topic, labels, fractions, weights=None) -> list:
    """Per presence fraction: cluster accuracy and topic recovery of the TF-IDF top word."""
    from meta.chc.topics import cluster_tfidf_words

    labels = np.asarray(labels)
    n_clusters = int(labels.max()) + 1
    true_topic = np.asarray(true_topic)
    majority = []
    for c in range(n_clusters):
        names, counts = np.unique(true_topic[labels == c], return_counts=True)
        majority.append(str(names[counts.argmax()]))
    rows = []
    for frac in fractions:
        words = cluster_tfidf_words(list(captions), labels, n_clusters, weights, frac).top_word
        acc = float(np.mean([w == m for w, m in zip(words, majority)]))
        truths = sorted(set(true_topic.tolist()))
        recovered = float(np.mean([any(w == t for w in words) for t in truths]))
        rows.append(
            {
                "presence_min_fraction": frac,
                "cluster_accuracy": round(acc, 3),
                "topic_recovery": round(recovered, 3),
                "clusters": n_clusters,
            }
        )
    return rows


def model_throughput(n_captions: int = 2000, n_images: int = 48, backbone: str = "ViT-B-16") -> dict:
    """Items per second of the heavy models at their real size (random CLIP weights, same cost).

    Sentence embeddings fp32 vs bf16 (+ their cosine agreement), CLIP image tower on
    decoded 224 px images (JPEG decode + resize included), CLIP text tower (pair filter).
    """
    import io
    import warnings

    import open_clip
    import torch
    from PIL import Image

    from gram_tools.synthetic import TOPICS, make_caption
    from meta.chc.imaging import clip_norm_stats, decode_batch, encode_images
    from meta.chc.pair_filter import clip_text_features
    from meta.chc.text_embed import embed_texts, load_sentence_model
    from meta.model.backbone import load_clip

    rng = np.random.default_rng(0)
    caps = [make_caption(str(rng.choice(list(TOPICS))), rng, list(TOPICS), 0.1) + f" {i}" for i in range(n_captions)]
    res = {}
    embs = {}
    for dtype in ("fp32", "bf16"):
        model = load_sentence_model("", dtype, "cpu")
        embed_texts(model, caps[:64])  # warm-up
        t0 = time.time()
        embs[dtype] = embed_texts(model, caps, 128)
        res[f"sentence_embeddings_{dtype}"] = n_captions / (time.time() - t0)
    agreement = (embs["fp32"] * embs["bf16"]).sum(1)  # both unit-norm
    res["bf16_vs_fp32_min_cosine"] = float(agreement.min())
    res["bf16_vs_fp32_mean_cosine"] = float(agreement.mean())
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(backbone, None)
    mean, std = clip_norm_stats(clip)
    blobs = []
    for _ in range(n_images):  # CC3M-like 500 x 375 JPEGs
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    t0 = time.time()
    pixels, _ = decode_batch(blobs, dims.image_size)
    res["jpeg_decode_resize"] = n_images / (time.time() - t0)
    encode_images(clip, pixels[:4], mean, std)  # warm-up
    t0 = time.time()
    encode_images(clip, pixels, mean, std, batch_size=16)
    res[f"clip_image_tower_{backbone}"] = n_images / (time.time() - t0)
    tok = open_clip.get_tokenizer(backbone)
    t0 = time.time()
    clip_text_features(clip, tok, caps[:256], batch_size=64)
    res[f"clip_text_tower_{backbone}"] = 256 / (time.time() - t0)
    return {k: round(v, 5 if "cosine" in k else 1) for k, v in res.items()}


def umap_fit_scaling(sizes, n_clusters: int = 50, dim: int = 384, seed: int = 0) -> list:
    """Seconds to fit UMAP (5-d) + HDBSCAN on ``n`` unit vectors from ``n_clusters`` Gaussian blobs."""
    from meta.chc.topics import fit_sample_clusters

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_clusters, dim)).astype(np.float32)
    rows = []
    for n in sizes:
        x = centres[rng.integers(n_clusters, size=n)] + rng.normal(scale=0.9, size=(n, dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        t0 = time.time()
        labels = fit_sample_clusters(x, 5, 15, 0.0, "cosine", "random", 50, 0, seed)
        rows.append({"n": int(n), "seconds": round(time.time() - t0, 1), "clusters": int(labels.max()) + 1})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", action="store_true", help="only measure model throughput at real size")
    p.add_argument(
        "--umap-scale",
        type=int,
        nargs="*",
        default=None,
        help="only time UMAP+HDBSCAN fits on these sample sizes (first size pays numba compilation)",
    )
    p.add_argument("--pairs", type=int, default=10000)
    p.add_argument("--min-cluster-size", type=int, default=20)
    p.add_argument("--mention-rate", type=float, default=0.1)
    p.add_argument("--backbone", default="GRAM-Test-Tiny")
    p.add_argument("--text-dtype", default="fp32")
    p.add_argument("--out", default=".cache/chc_measure")
    args = p.parse_args(argv)
    problem = int_flag_problem(args, {"umap_scale": 2, "pairs": 1, "min_cluster_size": 2})  # hdbscan: size >= 2
    if not problem and not 0.0 <= args.mention_rate <= 1.0:  # a probability; nan fails too
        problem = f"--mention-rate: expected a probability 0 <= rate <= 1, got {args.mention_rate}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.umap_scale:
        for row in umap_fit_scaling(args.umap_scale):
            print(f"  UMAP+HDBSCAN fit on {row['n']:7d} vectors: {row['seconds']:7.1f} s, {row['clusters']} clusters")
        return 0
    if args.models:
        for name, value in model_throughput().items():
            print(f"  {name:40s} {value}" + ("" if "cosine" in name else " items/s"))
        return 0

    from gram_tools.synthetic import write_synthetic_shards
    from meta.chc import run_chc
    from meta.config import get_meta_cfg_default

    out = Path(args.out)
    t0 = time.time()
    truth = write_synthetic_shards(out / "data", n_pairs=args.pairs, mention_rate=args.mention_rate, seed=0)
    print(f"generated {args.pairs} pairs in {time.time() - t0:.1f}s")
    cfg = get_meta_cfg_default()
    cfg.MODEL.BACKBONE = args.backbone
    cfg.CHC.OUTPUT_DIR = str(out / "chc")
    cfg.CHC.INPUT.SHARDS = [str(out / "data" / "shard-*.tar")]
    cfg.CHC.TOPICS.MIN_CLUSTER_SIZE = args.min_cluster_size
    cfg.CHC.TEXT.DTYPE = args.text_dtype
    run_chc(cfg, show_progress=False)
    timings = json.loads((out / "chc" / "timings.json").read_text())
    print("\nstage throughput (this machine, OMP_NUM_THREADS=1 recommended):")
    for name, t in timings.items():
        print(f"  {name:26s} {t['items']:8d} items {t['seconds']:9.2f} s  {t['items_per_second']} items/s")

    uniq = json.loads((out / "chc" / "text" / "unique_captions.json").read_text())
    labels = np.load(out / "chc" / "topics" / "unique_cluster.npy")
    topic_of_caption = {c: t for c, t in zip(truth["caption"], truth["topic"])}
    true_topic = [topic_of_caption.get(c, "?") for c in uniq]
    rows = word_recovery(uniq, true_topic, labels, [0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2])
    print(
        f"\ntopic words vs presence threshold ({rows[0]['clusters']} HDBSCAN clusters, "
        f"{len(set(truth['topic']))} true topics):"
    )
    for r in rows:
        print(
            f"  presence >= {r['presence_min_fraction']:<6} cluster accuracy {r['cluster_accuracy']:.3f}   "
            f"topic recovery {r['topic_recovery']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
