"""End-to-end CHC on a generated corpus (12 topics x 3 image styles, ~1.2 k pairs)."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from gram_tools.synthetic import write_synthetic_shards
from meta.chc import load_hierarchy, run_chc
from meta.chc.hierarchy import CLUSTERED, NOISE, UNREADABLE
from meta.chc.imaging import to_clip_uint8
from meta.chc.settings import read_chc_settings
from meta.config import get_meta_cfg_default

N_PAIRS = 1200


def make_cfg(data_dir, out_dir):
    cfg = get_meta_cfg_default()
    cfg.SEED = 0
    cfg.MODEL.BACKBONE = "GRAM-Test-Tiny"
    cfg.MODEL.DEVICE = "cpu"
    cfg.CHC.OUTPUT_DIR = str(out_dir)
    cfg.CHC.INPUT.SHARDS = [str(data_dir / "shard-*.tar")]
    cfg.CHC.IMAGES.CHUNK_SIZE = 300  # several chunks, so an interruption can land mid-stage
    cfg.CHC.TEXT.CHUNK_SIZE = 400
    cfg.CHC.TOPICS.MIN_CLUSTER_SIZE = 30  # ~100 pairs per true topic
    cfg.CHC.TOPICS.PLOT_POINTS = 400
    cfg.CHC.DOMAINS.NUM = 3
    cfg.CHC.DOMAINS.MIN_PER_DOMAIN = 5
    return cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("chc")
    truth = write_synthetic_shards(
        root / "data",
        n_pairs=N_PAIRS,
        n_shards=4,
        corrupt_fraction=0.03,
        empty_caption_fraction=0.03,
        missing_image_fraction=0.01,
        seed=1,
    )
    return root, truth


@pytest.fixture(scope="module")
def chc_run(corpus):
    root, truth = corpus
    cfg = make_cfg(root / "data", root / "out")
    out = run_chc(cfg, show_progress=False)
    return out, cfg, truth


def _truth_by_key(truth):
    return {k: i for i, k in enumerate(truth["key"])}


@pytest.mark.slow
def test_counts_skipped_and_unreadable(chc_run):
    out, _, truth = chc_run
    report = json.loads((out / "chc_report.json").read_text())
    counts = report["counts"]
    missing = np.array(truth["missing_image"])
    empty = np.array(truth["empty_caption"]) & ~missing
    corrupt = np.array(truth["corrupt"]) & ~missing & ~empty
    assert counts["pairs_seen"] == N_PAIRS
    assert counts["skipped_no_image"] == missing.sum() > 0
    assert counts["skipped_empty_caption"] == empty.sum() > 0
    assert counts["unreadable_images"] == corrupt.sum() > 0
    assert counts["pairs_indexed"] == N_PAIRS - missing.sum() - empty.sum()
    # every unreadable image is in the report's skipped-input table under its exception type
    image_rows = {r["reason"]: r["count"] for r in report["skipped_input"] if r["stage"] == "image_features"}
    assert sum(image_rows.values()) == counts["unreadable_images"]
    assert all(k.startswith("unreadable image: ") and "not recorded" not in k for k in image_rows)
    assert "## Skipped input" in (out / "chc_report.md").read_text()
    h = load_hierarchy(out)
    status = np.load(out / "item_status.npy")
    pos = _truth_by_key(truth)
    from meta.chc.sources import PairIndex

    keys = PairIndex.load(out / "index").item_key
    is_corrupt = np.array([truth["corrupt"][pos[k]] for k in keys])
    assert np.array_equal(status == UNREADABLE, is_corrupt)
    assert (h.item_topic[is_corrupt] == -1).all()
    assert counts["pairs_clustered"] == (status == CLUSTERED).sum() == (h.item_topic >= 0).sum()
    assert counts["noise_pairs"] == (status == NOISE).sum()


@pytest.mark.slow
def test_topic_words_recover_true_topics(chc_run):
    out, _, truth = chc_run
    h = load_hierarchy(out)
    true_topics = sorted(set(truth["topic"]))
    named = [t for t in true_topics if t in h.topic_names]
    assert len(named) >= 0.75 * len(true_topics), (h.topic_names, true_topics)
    assert len(set(h.topic_names)) == len(h.topic_names)
    # a topic named after a true topic is mostly made of that topic's pairs
    pos = _truth_by_key(truth)
    from meta.chc.sources import PairIndex

    keys = PairIndex.load(out / "index").item_key
    item_truth = np.array([truth["topic"][pos[k]] for k in keys])
    right = total = 0
    for t, name in enumerate(h.topic_names):
        if name in true_topics:
            members = item_truth[h.item_topic == t]
            assert (members == name).mean() > 0.75, name
            right, total = right + (members == name).sum(), total + len(members)
    assert right / total > 0.9


@pytest.mark.statistical
@pytest.mark.slow
def test_domains_recover_styles_above_chance(chc_run):
    from sklearn.metrics import adjusted_rand_score

    out, _, truth = chc_run
    h = load_hierarchy(out)
    pos = _truth_by_key(truth)
    from meta.chc.sources import PairIndex

    keys = PairIndex.load(out / "index").item_key
    style = np.array([truth["style"][pos[k]] for k in keys])
    scores, shuffled = [], []
    rng = np.random.default_rng(0)
    for t in range(h.num_topics):
        members = np.flatnonzero(h.item_topic == t)
        scores.append(adjusted_rand_score(style[members], h.item_domain[members]))
        shuffled.append(adjusted_rand_score(rng.permutation(style[members]), h.item_domain[members]))
    assert np.mean(scores) > 0.5, scores  # chance is ARI ~ 0
    assert np.mean(scores) > np.mean(shuffled) + 0.4


@pytest.mark.slow
def test_hierarchy_contract_and_images(chc_run):
    out, cfg, truth = chc_run
    h = load_hierarchy(out)
    n = len(h.item_topic)
    assert h.item_topic.dtype == np.int64 and h.item_domain.dtype == np.int64
    assert h.image_features.dtype == np.float32 and h.image_features.shape == (n, 64)
    ok = np.load(out / "image_features" / "image_ok.npy")
    norms = np.linalg.norm(h.image_features, axis=1)
    np.testing.assert_allclose(norms[ok], 1.0, atol=1e-5)
    assert (norms[~ok] == 0).all()
    assert ((h.item_domain >= 0) == (h.item_topic >= 0)).all()
    assert h.meta["backbone"] == "GRAM-Test-Tiny" and h.meta["image_size"] == 32
    assert not list((out / "image_features").glob("*.rank*"))  # rank files removed once merged + marked
    # images(): cache and lazy decoding agree with an independent read of the tar member
    from meta.chc.hierarchy import PairIndexImages
    from meta.chc.sources import PairIndex

    index = PairIndex.load(out / "index")
    pick = np.flatnonzero(ok)[[0, 5, 17]]
    cached = h.images(pick)
    lazy = PairIndexImages(index, 32)(pick)
    assert cached.dtype == np.uint8 and cached.shape == (3, 32, 32, 3)
    np.testing.assert_array_equal(cached, lazy)
    i = int(pick[1])
    with tarfile.open(index.sources[index.item_source[i]]) as tar:
        name = next(
            m for m in tar.getnames() if m.split(".")[0] == index.item_key[i] and not m.endswith((".txt", ".json"))
        )
        img = Image.open(io.BytesIO(tar.extractfile(name).read())).convert("RGB")
    np.testing.assert_array_equal(cached[1], to_clip_uint8(img, 32))


@pytest.mark.slow
def test_report_files(chc_run):
    out, _, _ = chc_run
    report = json.loads((out / "chc_report.json").read_text())
    md = (out / "chc_report.md").read_text()
    h = load_hierarchy(out)
    assert [t["name"] for t in report["topics"]] == h.topic_names
    for t in report["topics"]:
        assert (
            t["name"] in md
            and 1 <= len(t["samples"]) <= 3
            and t["size"] == (h.item_topic == h.topic_names.index(t["name"])).sum()
        )
        assert sum(t["domain_sizes"]) == t["size"]
    with Image.open(out / "umap_topics.png") as png:
        assert png.size[0] > 300 and png.size[1] > 300
    for stage in ("index", "image_features", "text_embeddings", "umap_hdbscan_fit", "domain_kmeans"):
        assert report["timings"][stage]["items"] > 0


@pytest.mark.slow
def test_tasks_from_chc_hierarchy(chc_run):
    from meta.metatrain.tasks import TaskSampler

    out, _, _ = chc_run
    h = load_hierarchy(out)
    sampler = TaskSampler(h, k_way=5, n_support=3, n_query=6, seed=3)
    for _ in range(20):
        task = sampler.sample()
        assert len(set(task.classnames)) == 5
        for k in range(5):
            sup = task.support_index[task.support_label == k]
            assert (h.item_topic[sup] == task.topics[k]).all()
            assert (h.item_domain[sup] == task.support_domain[k]).all()
        assert h.images(task.query_index[:4]).shape == (4, 32, 32, 3)


@pytest.mark.slow
def test_interrupted_run_resumes_to_identical_result(chc_run, corpus, monkeypatch):
    import meta.chc.image_features as imf
    import meta.chc.text_embed as te

    out_ref, _, _ = chc_run
    root, _ = corpus
    cfg = make_cfg(root / "data", root / "out_resume")

    class Crash(RuntimeError):
        pass

    calls = {"img": 0, "txt": 0}
    real_encode, real_embed = imf.encode_images, te.embed_texts

    def crashing_encode(*a, **k):
        calls["img"] += 1
        if calls["img"] == 3:
            raise Crash("killed during image features")
        return real_encode(*a, **k)

    monkeypatch.setattr(imf, "encode_images", crashing_encode)
    with pytest.raises(Crash):
        run_chc(cfg, show_progress=False)
    monkeypatch.setattr(imf, "encode_images", real_encode)

    def crashing_embed(*a, **k):
        calls["txt"] += 1
        if calls["txt"] == 2:
            raise Crash("killed during sentence embeddings")
        return real_embed(*a, **k)

    monkeypatch.setattr(te, "embed_texts", crashing_embed)
    with pytest.raises(Crash):
        run_chc(cfg, show_progress=False)
    monkeypatch.setattr(te, "embed_texts", real_embed)

    # the resumed run must not redo finished chunks: count what it still computes
    counted = {"img": 0, "txt": 0}
    monkeypatch.setattr(
        imf, "encode_images", lambda *a, **k: (counted.__setitem__("img", counted["img"] + 1), real_encode(*a, **k))[1]
    )
    monkeypatch.setattr(
        te, "embed_texts", lambda *a, **k: (counted.__setitem__("txt", counted["txt"] + 1), real_embed(*a, **k))[1]
    )
    out = run_chc(cfg, show_progress=False)
    assert counted["img"] == 0  # image stage had finished in the second attempt
    n_unique = len(json.loads((out / "text" / "unique_captions.json").read_text()))
    assert counted["txt"] == -(-n_unique // 400) - 1  # all text chunks but the one already on disk

    ref, res = load_hierarchy(out_ref), load_hierarchy(out)
    assert res.topic_names == ref.topic_names
    np.testing.assert_array_equal(res.item_topic, ref.item_topic)
    np.testing.assert_array_equal(res.item_domain, ref.item_domain)
    np.testing.assert_array_equal(np.asarray(res.image_features), np.asarray(ref.image_features))
    reasons = [json.loads((o / "image_features" / "unreadable.json").read_text()) for o in (out, out_ref)]
    assert reasons[0] == reasons[1] and sum(reasons[0].values()) > 0  # per-chunk reasons survive the crash
    # a finished run resumed is a no-op that changes nothing
    before = (out / "item_topic.npy").stat().st_mtime_ns
    run_chc(cfg, show_progress=False)
    assert (out / "item_topic.npy").stat().st_mtime_ns == before


@pytest.mark.slow
def test_rank_sharding_matches_single_process(chc_run, tmp_path):
    import warnings

    import torch

    from meta.chc.image_features import encode_rank, merge_ranks
    from meta.chc.imaging import clip_norm_stats
    from meta.chc.sources import PairIndex, rank_items
    from meta.model.backbone import load_clip

    out, cfg, _ = chc_run
    index = PairIndex.load(out / "index")
    parts = [rank_items(index, r, 2) for r in range(2)]
    assert len(np.intersect1d(parts[0], parts[1])) == 0
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(index)))
    for r in range(2):  # whole shards per rank
        assert set(index.item_source[parts[r]] % 2) == {r}
    torch.manual_seed(cfg.SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip("GRAM-Test-Tiny", None)
    mean, std = clip_norm_stats(clip)
    for rank in (1, 0):  # as two torchrun processes would, in either order (rank 1 decodes with threads)
        encode_rank(
            index,
            clip,
            rank,
            2,
            tmp_path,
            "fp",
            32,
            mean,
            std,
            batch_size=64,
            chunk_size=200,
            cache_images=True,
            show_progress=False,
            decode_workers=2 * rank,
        )
    stats = merge_ranks(index, 2, tmp_path, cache_images=True, remove_rank_files=True)
    ref = np.load(out / "image_features" / "image_features.npy")
    np.testing.assert_allclose(np.load(tmp_path / "image_features.npy"), ref, atol=1e-5)
    np.testing.assert_array_equal(np.load(tmp_path / "image_ok.npy"), np.load(out / "image_features" / "image_ok.npy"))
    np.testing.assert_array_equal(
        np.load(tmp_path / "images_u8.npy"), np.load(out / "image_features" / "images_u8.npy")
    )
    assert stats["unreadable_images"] == (~np.load(tmp_path / "image_ok.npy")).sum()
    assert not list(tmp_path.glob("*.rank*"))


@pytest.mark.slow
def test_quantile_filter_and_sample_fit_reuse_cached_stages(chc_run, tmp_path, monkeypatch):
    """Changing FILTER / FIT_SAMPLE reruns only the stages after image features."""
    import shutil

    import meta.chc.image_features as imf
    from meta.chc.hierarchy import FILTERED

    out_ref, cfg_ref, truth = chc_run
    shutil.copytree(out_ref, tmp_path / "out")
    cfg = cfg_ref.clone()
    cfg.CHC.OUTPUT_DIR = str(tmp_path / "out")
    cfg.CHC.FILTER.MODE = "quantile"
    cfg.CHC.FILTER.QUANTILE = 0.2
    cfg.CHC.TOPICS.FIT_SAMPLE = 500  # the rest goes to the nearest centroid
    cfg.CHC.TOPICS.MIN_CLUSTER_SIZE = 15
    cfg.CHC.TOPICS.PLOT_POINTS = 0

    def no_encoding(*a, **k):
        raise AssertionError("image features were recomputed")

    monkeypatch.setattr(imf, "encode_images", no_encoding)
    out = run_chc(cfg, show_progress=False)
    counts = json.loads((out / "chc_report.json").read_text())["counts"]
    ok = np.load(out / "image_features" / "image_ok.npy")
    status = np.load(out / "item_status.npy")
    assert abs(counts["filtered"] - 0.2 * ok.sum()) <= 2 and counts["filtered"] == (status == FILTERED).sum()
    cos = np.load(out / "filter" / "pair_cosine.npy")
    assert np.nanmin(cos[status != FILTERED]) >= np.nanmax(cos[status == FILTERED])
    assert counts["fit_sample"] == 500 < counts["unique_captions"]
    assert not (out / "umap_topics.png").exists()  # PLOT_POINTS 0: no (stale) picture
    h = load_hierarchy(out)
    from meta.chc.sources import PairIndex

    keys = PairIndex.load(out / "index").item_key
    pos = _truth_by_key(truth)
    item_truth = np.array([truth["topic"][pos[k]] for k in keys])
    named = [(t, n) for t, n in enumerate(h.topic_names) if n in set(truth["topic"])]
    assert len(named) >= 0.75 * len(set(truth["topic"]))
    right = sum((item_truth[h.item_topic == t] == n).sum() for t, n in named)
    assert right / sum((h.item_topic == t).sum() for t, _ in named) > 0.85


def _gloo_full_run(rank, world, init_file, cfg_dump):
    """One torchrun-like process running the whole ``python -m meta cluster`` pipeline."""
    import os

    import torch.distributed as dist
    from yacs.config import CfgNode

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = run_chc(CfgNode.load_cfg(cfg_dump), rank, world, dist.barrier, show_progress=False)
        assert (out is None) == (rank != 0)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_run(chc_run, tmp_path_factory):
    """The whole pipeline in two gloo processes (as ``torchrun --nproc_per_node 2``), once for the tests below;
    returns ``(its output folder, the 1-process output folder, the config)``."""
    import torch.multiprocessing as mp

    out_ref, cfg_ref, _ = chc_run
    tmp = tmp_path_factory.mktemp("gloo")
    cfg = cfg_ref.clone()
    cfg.CHC.OUTPUT_DIR = str(tmp / "out")
    mp.spawn(_gloo_full_run, args=(2, str(tmp / "pg_init"), cfg.dump()), nprocs=2, join=True)
    return tmp / "out", out_ref, cfg


@pytest.mark.slow
def test_two_gloo_processes_shard_image_features(gloo_run):
    """Each rank encodes its share of the images; the merged features equal the 1-process ones."""
    out, out_ref, _ = gloo_run
    stage = out / "image_features"
    assert (out / "image_features.done.json").is_file() and not list(stage.glob("*.rank*"))
    np.testing.assert_allclose(
        np.load(stage / "image_features.npy"), np.load(out_ref / "image_features" / "image_features.npy"), atol=1e-5
    )
    np.testing.assert_array_equal(np.load(stage / "image_ok.npy"), np.load(out_ref / "image_features" / "image_ok.npy"))


@pytest.mark.slow
def test_two_gloo_processes_run_the_whole_pipeline(gloo_run):
    """Image features and sentence embeddings sharded, fitting on rank 0: the 1-process hierarchy."""
    out, out_ref, cfg = gloo_run
    n_unique = len(json.loads((out_ref / "text" / "unique_captions.json").read_text()))
    assert n_unique > 2 * cfg.CHC.TEXT.CHUNK_SIZE  # both ranks embed whole chunks of their own
    assert not list(out.rglob("*.rank*"))
    # same chunks -> same batches -> the same embeddings bit for bit
    np.testing.assert_array_equal(
        np.load(out / "text" / "embeddings.npy"), np.load(out_ref / "text" / "embeddings.npy")
    )
    ref, res = load_hierarchy(out_ref), load_hierarchy(out)
    assert res.topic_names == ref.topic_names
    np.testing.assert_array_equal(res.item_topic, ref.item_topic)
    np.testing.assert_array_equal(res.item_domain, ref.item_domain)
    np.testing.assert_allclose(np.asarray(res.image_features), np.asarray(ref.image_features), atol=1e-5)


def test_text_rank_rows_are_whole_chunks_covering_all_rows():
    from meta.chc.pipeline import text_rank_rows

    for n, chunk, world in [(0, 4, 2), (5, 4, 2), (1000, 400, 2), (1000, 400, 3), (7, 1, 4), (3, 400, 2)]:
        rows = [text_rank_rows(n, chunk, r, world) for r in range(world)]
        assert rows[0][0] == 0 and rows[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous, disjoint, in rank order
        assert all(lo % chunk == 0 for lo, _ in rows)  # every block starts on a chunk boundary


@pytest.mark.slow
def test_hierarchy_names_the_builds_that_clustered_it(chc_run):
    import importlib.metadata

    out, _, _ = chc_run
    meta = json.loads((out / "hierarchy.json").read_text())["meta"]
    assert meta["versions"]["umap-learn"] == importlib.metadata.version("umap-learn")
    assert meta["versions"]["hdbscan"] == importlib.metadata.version("hdbscan")
    assert set(meta["versions"]) >= {"numba", "scikit-learn", "torch"}
    assert meta["numerics"]["cpu_model"] and meta["numerics"]["torch"] and "pinned" in meta["numerics"]
    assert meta["commit"]


@pytest.mark.slow
def test_image_features_are_encoded_again_under_another_decode_rule(chc_run, tmp_path, monkeypatch):
    """A cached image-feature stage is reused under the same decoding rule and recomputed under another
    (imaging.DECODE_RULE: features cached before EXIF orientation was applied are not reused)."""
    import shutil

    import meta.chc.pipeline as pipeline

    out_ref, cfg_ref, _ = chc_run
    shutil.copytree(out_ref, tmp_path / "out")
    cfg = cfg_ref.clone()
    cfg.CHC.OUTPUT_DIR = str(tmp_path / "out")
    calls = []

    def counting_encode(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("encoding started")

    monkeypatch.setattr(pipeline, "encode_rank", counting_encode)
    run = pipeline.ChcRun(read_chc_settings(cfg), show_progress=False)
    index, index_fp = run.stage_index()
    run.stage_image_features(index, index_fp)  # same rule: the cached stage is reused
    assert calls == []
    monkeypatch.setattr(pipeline, "DECODE_RULE", pipeline.DECODE_RULE + ",another-rule")
    with pytest.raises(RuntimeError, match="encoding started"):
        run.stage_image_features(index, index_fp)
    assert calls == [1]


@pytest.mark.slow
def test_the_torchvision_decoder_encodes_the_same_images_to_the_same_features(chc_run, tmp_path, monkeypatch):
    """CHC.IMAGES.DECODER torchvision (meta.chc.tensor_decode) on the corpus of the reference run: the same images
    are unreadable, with the same reasons; features at cosine >= 0.999; another decoder is another cached stage."""
    import shutil
    import warnings

    import torch

    import meta.chc.pipeline as pipeline
    from meta.chc.image_features import encode_rank, rank_reasons
    from meta.chc.imaging import clip_norm_stats
    from meta.chc.sources import PairIndex
    from meta.model.backbone import load_clip

    out, cfg, _ = chc_run
    index = PairIndex.load(out / "index")
    torch.manual_seed(cfg.SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, _ = load_clip("GRAM-Test-Tiny", None)
    mean, std = clip_norm_stats(clip)
    stats = encode_rank(
        index, clip, 0, 1, tmp_path, "fp", 32, mean, std, chunk_size=200, show_progress=False, decoder="torchvision"
    )
    feats = np.load(tmp_path / "feats.rank0.npy")
    ok = feats[:, -1] > 0.5
    ref_ok = np.load(out / "image_features" / "image_ok.npy")
    np.testing.assert_array_equal(ok, ref_ok)
    assert stats["unreadable_by_reason"] == rank_reasons(tmp_path, 0, "fp")
    ref_reasons = json.loads((out / "image_features" / "unreadable.json").read_text())
    assert stats["unreadable_by_reason"] == ref_reasons
    ref = np.load(out / "image_features" / "image_features.npy")
    cos = (feats[ok, :-1] * ref[ok]).sum(axis=1)
    assert cos.min() >= 0.999
    # the decoder is part of the stage's fingerprint
    shutil.copytree(out, tmp_path / "out")
    cfg2 = cfg.clone()
    cfg2.CHC.OUTPUT_DIR = str(tmp_path / "out")
    cfg2.CHC.IMAGES.DECODER = "torchvision"
    calls = []
    monkeypatch.setattr(pipeline, "encode_rank", lambda *a, **k: calls.append(k["decoder"]) or 1 / 0)
    run = pipeline.ChcRun(read_chc_settings(cfg2), show_progress=False)
    with pytest.raises(ZeroDivisionError):
        run.stage_image_features(*run.stage_index())
    assert calls == ["torchvision"]


@pytest.mark.slow
def test_read_threads_reach_the_image_stage_and_leave_its_cache_valid(chc_run, tmp_path, monkeypatch):
    """CHC.IMAGES.READ_THREADS is passed to encode_rank; it changes no byte, so it is not in the stage's fingerprint:
    the reference run (4 threads, the default) is reused at 1 thread, and a fresh stage gets the configured count."""
    import shutil

    import meta.chc.pipeline as pipeline

    out_ref, cfg_ref, _ = chc_run
    assert cfg_ref.CHC.IMAGES.READ_THREADS == 4
    shutil.copytree(out_ref, tmp_path / "out")
    cfg = cfg_ref.clone()
    cfg.CHC.OUTPUT_DIR = str(tmp_path / "out")
    cfg.CHC.IMAGES.READ_THREADS = 1
    calls = []
    monkeypatch.setattr(pipeline, "encode_rank", lambda *a, **k: calls.append(k["read_threads"]) or 1 / 0)
    run = pipeline.ChcRun(read_chc_settings(cfg), show_progress=False)
    index, index_fp = run.stage_index()
    run.stage_image_features(index, index_fp)  # cached under 4 threads, reused under 1
    assert calls == []
    (tmp_path / "out" / "image_features.done.json").unlink()  # the stage is to run again
    cfg.CHC.IMAGES.READ_THREADS = 3
    run = pipeline.ChcRun(read_chc_settings(cfg), show_progress=False)
    with pytest.raises(ZeroDivisionError):
        run.stage_image_features(index, index_fp)
    assert calls == [3]
