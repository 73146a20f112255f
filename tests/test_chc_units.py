"""CHC building blocks: readers, caches, TF-IDF, merging, filter, domains, CLI errors."""

import csv
import io
import json
import math
import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from meta.chc.domains import split_domains
from meta.chc.pair_filter import clip_text_features, keep_mask, pair_cosines
from meta.chc.sources import build_index, rank_items, scan_manifest
from meta.chc.stages import ChunkedArray
from meta.chc.topics import CAPTION_STOP_WORDS, cluster_tfidf_words, merge_clusters_by_word

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- cluster TF-IDF
def reference_tfidf(captions, labels, n_clusters, presence_min_fraction, stop):
    """Direct transcription of paper eq. 1 with python dicts (independent of the sparse code)."""
    docs = [[] for _ in range(n_clusters)]
    for cap, lab in zip(captions, labels):
        if lab >= 0:
            docs[lab].append([w for w in re.findall(r"\b[a-z]{3,}\b", cap.lower()) if w not in stop])
    present_in = {}
    for caps in docs:
        vocab = {w for c in caps for w in c}
        for w in vocab:
            n_caps_with = sum(w in c for c in caps)
            if n_caps_with >= max(1, presence_min_fraction * len(caps)):
                present_in[w] = present_in.get(w, 0) + 1
    best = []
    for caps in docs:
        words = [w for c in caps for w in c]
        scores = {
            w: words.count(w) / len(words) * math.log(n_clusters / (present_in.get(w, 0) + 1)) for w in set(words)
        }
        best.append(max(sorted(scores), key=lambda w: scores[w]))
    return best


def test_cluster_tfidf_matches_paper_formula_and_presence_threshold():
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    rng = np.random.default_rng(0)
    topics = ["dog", "car", "cake", "boat"]
    scenes = {
        "dog": ["park", "beach", "sofa"],
        "car": ["road", "garage", "track"],
        "cake": ["plate", "candles", "party"],
        "boat": ["lake", "harbour", "sea"],
    }
    captions, labels = [], []
    for i in range(400):
        t = i % 4
        cap = f"a photo of a {topics[t]} on the {rng.choice(scenes[topics[t]])}"
        if rng.random() < 0.15:  # cross-topic mention
            cap += f" near a {topics[(t + 1 + rng.integers(3)) % 4]}"
        captions.append(cap)
        labels.append(t * 2 + int(rng.random() < 0.5))  # 2 clusters per topic (over-segmentation)
    labels = np.array(labels)
    labels[:5] = -1  # noise is ignored
    stop = set(ENGLISH_STOP_WORDS) | CAPTION_STOP_WORDS
    for frac in (0.0, 0.1):
        got = cluster_tfidf_words(captions, labels, 8, None, frac).top_word
        assert got == reference_tfidf(captions, labels, 8, frac, stop)
    literal = cluster_tfidf_words(captions, labels, 8, None, 0.0).top_word
    thresholded = cluster_tfidf_words(captions, labels, 8, None, 0.1).top_word
    # mentions make every topic word "present" in (almost) every cluster under the literal rule
    assert sum(w in topics for w in literal) < sum(w in topics for w in thresholded) == 8
    assert "photo" not in literal  # caption stop-list


def test_tfidf_weights_equal_repeated_captions():
    caps = ["red dog runs", "red dog sleeps", "blue car parks", "blue car drives", "green cake"]
    labels = np.array([0, 0, 1, 1, 1])
    w = np.array([3, 1, 1, 1, 5])
    expanded_caps = [c for c, k in zip(caps, w) for _ in range(k)]
    expanded_lab = np.repeat(labels, w)
    a = cluster_tfidf_words(caps, labels, 2, w, 0.0)
    b = cluster_tfidf_words(expanded_caps, expanded_lab, 2, None, 0.0)
    assert a.top_words == b.top_words


def test_merge_clusters_sharing_a_word():
    names, mapping = merge_clusters_by_word(["dog", "car", "dog", "", "cake"], [10, 30, 25, 5, 1])
    assert names == ["dog", "car", "cake"]  # by merged size: dog 35, car 30, cake 1
    assert mapping.tolist() == [0, 1, 0, -1, 2]


# ---------------------------------------------------------------- readers
def _png_bytes(color):
    buf = io.BytesIO()
    Image.new("RGB", (20, 10), color).save(buf, format="PNG")
    return buf.getvalue()


def test_manifest_reader_counts_and_errors(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png_bytes((255, 0, 0)))
    (tmp_path / "img" / "bad.png").write_bytes(b"not an image")
    rows = [
        {"path": "img/a.png", "text": "a red square"},
        {"path": "img/bad.png", "text": "broken"},
        {"path": "img/a.png", "text": "   "},
        {"path": "img/missing.png", "text": "gone"},
    ]
    manifest = tmp_path / "pairs.tsv"
    with open(manifest, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["path", "text"], delimiter="\t")
        w.writeheader(), w.writerows(rows)
    index = build_index(manifest=str(manifest), image_column="path", caption_column="text", show_progress=False)
    assert index.counts["pairs_seen"] == 4 and index.counts["skipped_empty_caption"] == 1 and len(index) == 3
    from meta.chc.imaging import decode_batch

    pixels, ok = decode_batch(index.read_image_bytes(range(3)), 16)
    assert ok.tolist() == [True, False, False] and pixels.shape == (3, 16, 16, 3)
    assert (pixels[0, :, :, 0] == 255).all()
    with pytest.raises(KeyError, match=r"CHC.INPUT.CAPTION_COLUMN: column 'caption' not in .*pairs.tsv"):
        scan_manifest(str(manifest), "path", "caption", "", {})
    with pytest.raises(FileNotFoundError, match="CHC.INPUT.MANIFEST: no such file"):
        build_index(manifest=str(tmp_path / "nope.csv"), show_progress=False)
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"image": r["path"], "caption": r["text"]}) for r in rows))
    assert len(build_index(manifest=str(jsonl), show_progress=False)) == 3


def test_tar_reader_truncated_shard_and_bad_pattern(tmp_path):
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for i, color in enumerate([(0, 0, 255), (0, 255, 0), (9, 9, 9)]):
            for name, data in ((f"{i:03d}.png", _png_bytes(color)), (f"{i:03d}.txt", f"square {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    full = build_index([str(shard)], show_progress=False)
    assert len(full) == 3 and full.captions == ["square 0", "square 1", "square 2"]
    # cut the file inside the last member: earlier pairs survive, the shard is counted as corrupt
    data = shard.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: int(full.item_offset[2]) + 40])
    part = build_index([str(cut)], show_progress=False)
    assert len(part) == 2 and part.counts["corrupt_shards"] == 1
    with pytest.raises(FileNotFoundError, match=r"CHC.INPUT.SHARDS: no file matches '.*nothing-\*.tar'"):
        build_index([str(tmp_path / "nothing-*.tar")], show_progress=False)


def test_rank_items_blocks_when_fewer_sources_than_ranks(tmp_path):
    (tmp_path / "a.png").write_bytes(_png_bytes((1, 2, 3)))
    (tmp_path / "m.csv").write_text("image,caption\n" + "".join(f"a.png,cap {i}\n" for i in range(10)))
    index = build_index(manifest=str(tmp_path / "m.csv"), show_progress=False)
    parts = [rank_items(index, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [3, 4, 3]
    assert np.array_equal(np.concatenate(parts), np.arange(10))


# ---------------------------------------------------------------- caches
def test_chunked_array_resumes_after_crash(tmp_path):
    calls = []

    def compute(s, e):
        calls.append(s)
        if len(calls) == 3 and not resumed[0]:
            raise RuntimeError("crash")
        return np.arange(s, e, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)

    resumed = [False]
    store = ChunkedArray(tmp_path / "x.npy", 10, (2,), np.float32, "fp1")
    with pytest.raises(RuntimeError):
        store.fill(compute, 3, disable_progress=True)
    assert store.rows_done() == 6
    resumed[0] = True
    calls.clear()
    arr = store.fill(compute, 3, disable_progress=True)
    assert calls == [6, 9]
    np.testing.assert_array_equal(arr[:, 0], np.arange(10))
    other = ChunkedArray(tmp_path / "x.npy", 10, (2,), np.float32, "fp2")  # settings changed -> restart
    assert other.rows_done() == 0


# ---------------------------------------------------------------- filter + domains
def test_keep_mask_threshold_and_quantile():
    cos = np.array([0.1, 0.5, np.nan, 0.3, 0.2, 0.9, 0.05, 0.4, 0.6, 0.7, 0.8], dtype=np.float32)
    assert keep_mask(cos, "none").sum() == 10
    assert keep_mask(cos, "threshold", threshold=0.35).tolist() == [
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        True,
        True,
        True,
        True,
    ]
    kept = keep_mask(cos, "quantile", quantile=0.2)
    assert kept.sum() == 8 and not kept[[2, 6, 0]].any()
    with pytest.raises(ValueError, match="CHC.FILTER.MODE"):
        keep_mask(cos, "median")


def test_pair_cosines_match_direct_clip(tiny_clip, tmp_path):
    import open_clip
    import torch

    clip, dims = tiny_clip
    tok = open_clip.get_tokenizer("GRAM-Test-Tiny")
    caps = ["a dog", "a cat", "a dog", "a red car"]
    img = torch.nn.functional.normalize(torch.randn(4, dims.embed_dim), dim=-1).numpy()
    ok = np.array([True, True, False, True])
    cos = pair_cosines(clip, tok, caps, img, ok, tmp_path, "fp", chunk_size=2, show_progress=False)
    with torch.no_grad():
        txt = torch.nn.functional.normalize(clip.encode_text(tok(caps)), dim=-1).numpy()
    expected = (img * txt).sum(1)
    np.testing.assert_allclose(cos[ok], expected[ok], atol=1e-5)
    assert np.isnan(cos[2])
    np.testing.assert_allclose(clip_text_features(clip, tok, caps[:1]), txt[:1], atol=1e-5)


def test_split_domains_sizes_and_fallbacks():
    rng = np.random.default_rng(0)
    centers = np.eye(4, dtype=np.float32)[:3] * 5
    x = np.concatenate([c + rng.normal(scale=0.1, size=(n, 4)) for c, n in zip(centers, (30, 20, 10))])
    split = split_domains(x, num_domains=3, min_per_domain=5)
    assert split.num_domains == 3 and np.bincount(split.labels).tolist() == [30, 20, 10]
    assert split_domains(x[:12], 3, 5).num_domains == 2  # 12 // 5 = 2 domains
    assert split_domains(x[:4], 3, 5).excluded  # fewer than MIN_PER_DOMAIN
    assert split_domains(x, 3, 15).num_domains == 2  # 10-image domain too small -> fewer


# ---------------------------------------------------------------- CLI
def test_chc_settings_are_the_chc_node_typed():
    """read_chc_settings reads every CHC key into the typed view once, and node() gives the node back as the JSON
    that the stage fingerprints and hierarchy.json recorded before the view existed (cached stages stay valid)."""
    from meta.chc.settings import read_chc_settings
    from meta.config import get_meta_cfg_default

    cfg = get_meta_cfg_default()
    cfg.CHC.INPUT.SHARDS = ["a.tar", "b.tar"]
    cfg.CHC.TOPICS.EXTRA_STOP_WORDS = ["stock"]
    settings = read_chc_settings(cfg)
    assert settings.node() == json.loads(json.dumps(cfg.CHC))
    assert settings.input.node() == json.loads(json.dumps(cfg.CHC.INPUT))
    assert settings.input.shards == ("a.tar", "b.tar") and settings.topics.extra_stop_words == ("stock",)
    assert (settings.seed, settings.device, settings.model.backbone) == (cfg.SEED, cfg.MODEL.DEVICE, cfg.MODEL.BACKBONE)


def test_cli_errors_are_one_line(tmp_path, capsys):
    from meta.__main__ import main

    assert main(["cluster", "--config-file", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.yaml" in err
    assert main(["cluster", "CHC.NOT_A_KEY", "1"]) == 2
    assert "NOT_A_KEY" in capsys.readouterr().err
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'bogus'" in err and "cluster, train, export" in err
    assert main(["train", "--config-file", str(tmp_path / "x.yaml")]) == 2  # dispatched to meta.metatrain
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --config-file") and "x.yaml" in err


def test_cli_bad_input_path_one_line(tmp_path, capsys):
    from meta.chc.cli import main

    code = main(["--no-progress", "CHC.OUTPUT_DIR", str(tmp_path / "o"), "CHC.INPUT.SHARDS", f"['{tmp_path}/x-*.tar']"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "CHC.INPUT.SHARDS" in err[0] and "x-*.tar" in err[0]


def test_shadowed_hf_datasets_is_worked_around(tmp_path):
    """A fake installed HF `datasets` + a repo-root `datasets/`: the plain import fails, ours works."""
    site = tmp_path / "site"
    (site / "datasets").mkdir(parents=True)
    (site / "datasets" / "__init__.py").write_text(
        "class Dataset: pass\nclass DatasetDict(dict): pass\nclass IterableDataset: pass\n"
        "class IterableDatasetDict(dict): pass\nclass Value: pass\nclass Sequence: pass\n"
        "def disable_caching(): pass\ndef enable_caching(): pass\ndef is_caching_enabled(): return True\n"
    )
    dist = site / "datasets-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: datasets\nVersion: 9.9.9\nHome-page: https://github.com/huggingface/datasets\n"
    )
    (dist / "RECORD").write_text("datasets/__init__.py,,\n")
    repo = tmp_path / "repo"
    (repo / "datasets").mkdir(parents=True)
    (repo / "datasets" / "__init__.py").write_text("# a CoOp-style dataset package\n")
    script = textwrap.dedent("""
        import importlib, sys
        try:
            import sentence_transformers
            print("PLAIN_OK")
        except ImportError as e:
            print("PLAIN_FAIL", type(e).__name__)
        for m in [m for m in sys.modules if m.startswith(("sentence_transformers", "datasets"))]:
            del sys.modules[m]
        from meta.chc.text_embed import import_sentence_transformers
        st = import_sentence_transformers()
        import datasets
        print("GUARD_OK", hasattr(st, "SentenceTransformer"), datasets.__file__)
    """)
    env = {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert "PLAIN_FAIL" in res.stdout, res.stdout + res.stderr[-2000:]
    assert "GUARD_OK True" in res.stdout, res.stdout + res.stderr[-2000:]
    # after the window the repository's own datasets package is back in place
    assert str(repo / "datasets") in res.stdout.split("GUARD_OK True")[1]
