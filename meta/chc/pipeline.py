"""The CHC pipeline: stages, their caches, and their order.

Stages (each cached under ``CHC.OUTPUT_DIR`` and skipped when its fingerprint matches):

1. ``index``           scan shards / manifest                       -> ``index/``
2. ``image_features``  CLIP image tower, sharded over ranks          -> ``image_features/``
3. ``filter``          optional CLIP image-text cosine filter        -> ``filter/``
4. ``text``            sentence embeddings of unique kept captions   -> ``text/``
5. ``topics``          UMAP -> HDBSCAN (sample) -> nearest centroid -> TF-IDF words -> merge -> ``topics/``
6. ``domains``         k-means per topic                             -> ``item_topic.npy`` ...
7. report              ``chc_report.md``, ``chc_report.json``, ``umap_topics.png``, ``hierarchy.json``

Under ``torchrun`` every rank runs stages 2 and 4 on its own share; rank 0 runs the rest alone and merges.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import open_clip

from meta.chc import domains as domains_mod
from meta.chc import text_embed
from meta.chc import topics as topics_mod
from meta.chc.errors import InputError
from meta.chc.hierarchy import CLUSTERED, FILTERED, NOISE, SMALL_TOPIC, STATUS, UNREADABLE
from meta.chc.image_features import encode_rank, merge_ranks, remove_rank_files_of
from meta.chc.imaging import DECODE_RULE, clip_norm_stats
from meta.chc.outputs import load_image_features, load_index, load_npy_output, read_json_output
from meta.chc.pair_filter import keep_mask, pair_cosines
from meta.chc.report import skipped_input_rows, write_report
from meta.chc.settings import ChcSettings, read_chc_settings
from meta.chc.sources import PairIndex, build_index
from meta.chc.stages import (
    ChunkedArray,
    StageMarker,
    create_memmap,
    dedupe,
    fingerprint,
    groups,
    save_npy_atomic,
    write_json_atomic,
)
from meta.chc.text_embed import cap_caption, caption_over_cap, model_digest, resolve_model_path
from meta.config import get_meta_cfg_default
from meta.data.input_limits import caps_away_from_defaults, image_caps
from meta.infra.fileio import clean_stale_temps
from meta.infra.hashing import file_sha256
from meta.infra.numerics import numerics_record, package_versions
from meta.infra.provenance import REPO, git_commit
from meta.infra.runlock import RunLock
from meta.model.backbone import resolve_device
from meta.model.clip_config import clip_from_settings
from meta.model.precision import resolve_autocast

log = logging.getLogger(__name__)


# CHC.INPUT keys that do not change what the index holds (checks made later; the image caps are in the
# image-features fingerprint) ...
_INDEX_FP_IGNORED = ("MAX_UNREADABLE_FRACTION", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_IMAGE_ASPECT")
# ... and keys added after runs were cached: they enter the fingerprint only when set away from their
# default, so an index (and the image features after it) cached before the key existed stays valid.
_INDEX_FP_IF_CHANGED = ("MAX_FIELD_CHARS", "ALLOW_OUTSIDE_ROOT")


# the CHC.INPUT settings build_index takes under their own names (besides SHARDS)
_INDEX_ARGS = "manifest image_column caption_column image_root max_pairs max_field_chars allow_outside_root".split()


def index_settings(inp) -> dict:
    """The ``CHC.INPUT`` settings (a node or :meth:`meta.chc.settings.InputSettings.node`) the index stage's
    fingerprint covers."""
    default = get_meta_cfg_default().CHC.INPUT
    return {
        k: v
        for k, v in json.loads(json.dumps(inp, default=list)).items()  # as plain JSON values
        if k not in _INDEX_FP_IGNORED and not (k in _INDEX_FP_IF_CHANGED and v == default[k])
    }


class ChcRun:
    """One CHC run of ``settings`` (:func:`meta.chc.settings.read_chc_settings`) as process ``rank`` of
    ``world_size``; ``barrier`` is called where ranks must wait for each other (``None`` = single process)."""

    def __init__(
        self,
        settings: ChcSettings,
        rank: int = 0,
        world_size: int = 1,
        barrier: Optional[Callable[[], None]] = None,
        show_progress: bool = True,
    ):
        self.s = settings
        self.out = Path(settings.output_dir)
        self.rank, self.world_size = int(rank), int(world_size)
        self.barrier = barrier or (lambda: None)
        self.show_progress = show_progress and rank == 0
        self.device = resolve_device(settings.device)
        self.where = {"device": self.device, "show_progress": self.show_progress}  # the stages' keyword arguments
        self.timings: dict = {}
        self._clip = None

    # ------------------------------------------------------------------ helpers
    def _timed(self, name: str, seconds: float, items: int) -> None:
        self.timings[name] = {
            "seconds": round(seconds, 3),
            "items": int(items),
            "items_per_second": round(items / seconds, 1) if seconds > 0 else None,
        }

    def clip(self):
        """The frozen CLIP (random weights seeded by ``SEED`` when ``MODEL.PRETRAINED`` is empty)."""
        if self._clip is None:
            self._clip = clip_from_settings(self.s.model, self.device, warn_random=False)
        return self._clip

    def backbone_meta(self) -> dict:
        if getattr(self, "_backbone_meta", None) is not None:
            return dict(self._backbone_meta)
        clip, dims = self.clip()
        mean, std = clip_norm_stats(clip)
        model = self.s.model
        weights = model.pretrained
        sha = file_sha256(weights) if weights and os.path.isfile(weights) else None
        found = {"backbone": model.backbone, "pretrained": weights or None, "weights_sha256": sha}
        found.update({k: getattr(model, k) for k in ("precision", "quick_gelu")})
        found.update({k: getattr(dims, k) for k in ("image_size", "embed_dim")}, mean=list(mean), std=list(std))
        self._backbone_meta = found
        return dict(self._backbone_meta)

    def unreadable_by_reason(self) -> dict:
        """``{reason: count}`` of unreadable images (``image_features/unreadable.json``)."""
        path = self.out / "image_features" / "unreadable.json"
        if path.is_file():
            return read_json_output(path, "{reason: count} of unreadable images", "image_features")
        ok = self._image_ok()
        return {"unreadable (reason not recorded)": int((~ok).sum())} if (~ok).any() else {}

    def _image_ok(self) -> np.ndarray:
        return load_npy_output(
            self.out / "image_features" / "image_ok.npy", "bool [N] image decoded per pair", "image_features", bool, 1
        )

    # ------------------------------------------------------------------ stage 1
    def stage_index(self) -> tuple[PairIndex, str]:
        """Returns ``(index, fp)``; redone when a setting, a shard's or the manifest's size or mtime, or the stamp of
        an image file the manifest names changed (those stamps enter ``fp``: a file replaced in place is re-read)."""
        inp = self.s.input
        stamps = []
        for pattern in list(inp.shards) + ([inp.manifest] if inp.manifest else []):
            for p in sorted(glob.glob(os.path.expanduser(pattern))):
                st = os.stat(p)
                stamps.append([os.path.abspath(p), st.st_size, int(st.st_mtime)])
        base = fingerprint("index", index_settings(inp.node()), stamps)
        marker = StageMarker(self.out, "index", base)
        index = None
        if self.rank == 0:
            if marker.is_done():
                index = load_index(self.out / "index")
                if image_files_changed(index):
                    log.warning(
                        "image files named by CHC.INPUT.MANIFEST changed since the index was built: re-reading them"
                    )
                    index = None
            if index is None:
                t0 = time.time()
                same_named = {k: getattr(inp, k) for k in _INDEX_ARGS}  # build_index's arguments: CHC.INPUT's keys
                index = build_index(list(inp.shards), show_progress=self.show_progress, **same_named)
                index.save(self.out / "index")
                self._timed("index", time.time() - t0, index.counts.get("pairs_seen", 0))
                marker.mark({"pairs": len(index)})
        self.barrier()
        if not marker.is_done():
            raise RuntimeError(f"rank {self.rank}: the index stage of {self.out} is not finished")
        if index is None:
            index = load_index(self.out / "index")
        files = index.recorded_file_stamps()
        # shards only: the fingerprint of runs cached before image-file stamps existed
        return index, base if files is None or not len(files) else fingerprint(base, files)

    # ------------------------------------------------------------------ stage 2
    def image_cache_wanted(self, n: int) -> bool:
        size = self.backbone_meta()["image_size"]
        return n * size * size * 3 <= self.s.images.cache_max_gb * 1e9

    def stage_image_features(self, index: PairIndex, index_fp: str) -> str:
        imgs, inp = self.s.images, self.s.input
        bmeta = self.backbone_meta()
        cache = self.image_cache_wanted(len(index))
        autocast = resolve_autocast(imgs.autocast, self.device, "CHC.IMAGES.AUTOCAST")
        caps = image_caps(inp.node())
        # fp32 (the default) keeps the fingerprint features computed before the key existed had; so do the
        # image caps at their defaults (constants then, in DECODE_RULE)
        fp = fingerprint(
            "image_features",
            index_fp,
            bmeta,
            imgs.chunk_size,
            imgs.batch_size,
            cache,
            self.s.seed,
            *(() if autocast == "none" else (autocast,)),
            DECODE_RULE,  # images decoded under another rule (before EXIF orientation) are encoded again
            *(() if imgs.decoder == "pil" else (f"decoder={imgs.decoder}",)),  # other pixels: other features
            *caps_away_from_defaults(caps),  # ... and under other caps (CHC.INPUT.MAX_IMAGE_*)
        )
        marker = StageMarker(self.out, "image_features", fp)
        stage_dir = self.out / "image_features"
        if marker.is_done():
            return fp
        clip, dims = self.clip()
        mean, std = clip_norm_stats(clip)
        t0 = time.time()
        rank_fp = fingerprint(fp, self.world_size)
        # encode_rank's keywords: the CHC.IMAGES / CHC.INPUT settings of the same name, then this run's
        kw = {k: getattr(imgs, k) for k in ("batch_size", "chunk_size", "decode_workers", "decoder", "read_threads")}
        kw.update(max_unreadable_fraction=inp.max_unreadable_fraction, image_root=inp.image_root, **caps)
        kw.update(cache_images=cache, autocast=autocast, **self.where)
        stats = encode_rank(
            index, clip, self.rank, self.world_size, stage_dir, rank_fp, dims.image_size, mean, std, **kw
        )
        self._timed("image_features", time.time() - t0, stats["items"])
        self.barrier()
        if self.rank == 0:
            merged = merge_ranks(index, self.world_size, stage_dir, cache, fp=rank_fp)
            marker.mark(merged)
            remove_rank_files_of(stage_dir, self.world_size)  # only after the mark: a crash never loses work
        return fp

    # ------------------------------------------------------------------ stage 3
    def filter_fingerprint(self, image_fp: str) -> str:
        return fingerprint("filter", image_fp, self.s.filter.node())

    def stage_filter(self, index: PairIndex, image_fp: str) -> tuple[np.ndarray, np.ndarray, str]:
        """Returns ``(ok [N] bool, keep [N] bool, fp)``."""
        filt = self.s.filter
        fp = self.filter_fingerprint(image_fp)
        stage_dir = self.out / "filter"
        marker = StageMarker(self.out, "filter", fp)
        ok = self._image_ok()
        if not ok.any():
            reasons = self.unreadable_by_reason()
            key = "CHC.INPUT.IMAGE_ROOT" if self.s.input.manifest else "CHC.INPUT.SHARDS"
            found = ", ".join(f"{k} {v}" for k, v in reasons.items())
            raise InputError(f"{key}: none of the {len(ok)} images could be read ({found})")
        if not marker.is_done():
            stage_dir.mkdir(parents=True, exist_ok=True)
            if filt.mode == "none":
                cos = np.where(ok, 0.0, np.nan).astype(np.float32)
            else:
                clip, _ = self.clip()
                feats = load_image_features(self.out, len(ok))
                t0 = time.time()
                tokenizer, template = open_clip.get_tokenizer(self.s.model.backbone), filt.template or "{}"
                cos = pair_cosines(clip, tokenizer, index.captions, feats, ok, stage_dir, fp, template, **self.where)
                self._timed("filter", time.time() - t0, len(index))
            keep = keep_mask(cos, filt.mode, filt.threshold, filt.quantile)
            save_npy_atomic(stage_dir / "pair_cosine.npy", cos)
            save_npy_atomic(stage_dir / "keep.npy", keep)
            marker.mark({"filtered": int((ok & ~keep).sum())})
        n = len(ok)
        keep = load_npy_output(stage_dir / "keep.npy", f"bool [{n}] pairs kept by the filter", "filter", bool, 1, n)
        return ok, keep, fp

    # ------------------------------------------------------------------ stage 4
    def stage_text(
        self, index: Optional[PairIndex], keep: Optional[np.ndarray], filter_fp: str
    ) -> tuple[list, np.ndarray, str]:
        """Returns ``(unique_captions [U], item_unique [N] (-1 = not kept), fp)``; embeddings on disk.  Rank 0
        deduplicates the kept captions; under torchrun rank ``r`` embeds its block of the single-process chunks into
        ``text/embeddings.rank{r}.npy`` (each caption in the same batch as without torchrun), rank 0 merges."""
        text = self.s.text
        model_path = resolve_model_path(text.model)
        fp = fingerprint("text", filter_fp, text.node(), model_digest(model_path))
        stage_dir = self.out / "text"
        marker = StageMarker(self.out, "text", fp)
        if not marker.is_done():
            if self.rank == 0:
                stage_dir.mkdir(parents=True, exist_ok=True)
                kept = np.flatnonzero(keep)
                uniq, inverse = dedupe([cap_caption(index.captions[i], text.max_caption_chars) for i in kept])
                # identical captions are embedded once
                item_unique = np.full(len(index), -1, dtype=np.int64)
                item_unique[kept] = inverse
                write_json_atomic(stage_dir / "unique_captions.json", uniq)
                save_npy_atomic(stage_dir / "item_unique.npy", item_unique)
            self.barrier()
            uniq = read_json_output(stage_dir / "unique_captions.json", "the list of unique captions", "text")

            model = text_embed.load_sentence_model(model_path, text.dtype, self.device)
            dim_fn = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
            dim = int(dim_fn())
            lo, hi = text_rank_rows(len(uniq), text.chunk_size, self.rank, self.world_size)
            path = stage_dir / ("embeddings.npy" if self.world_size == 1 else f"embeddings.rank{self.rank}.npy")
            store = ChunkedArray(
                path, hi - lo, (dim,), np.float32, fp if self.world_size == 1 else fingerprint(fp, self.world_size)
            )
            t0, before = time.time(), store.rows_done()
            store.fill(
                lambda s, e: text_embed.embed_texts(model, uniq[lo + s : lo + e], text.batch_size),
                text.chunk_size,
                desc=f"sentence embeddings (rank {self.rank}/{self.world_size})",
                disable_progress=not self.show_progress,
            )
            self._timed("text_embeddings", time.time() - t0, hi - lo - before)
            self.barrier()
            if self.rank == 0:
                if self.world_size > 1:
                    merge_text_ranks(stage_dir, len(uniq), dim, text.chunk_size, self.world_size)
                marker.mark({"unique_captions": int(len(uniq)), "model": model_path})
                for r in range(self.world_size if self.world_size > 1 else 0):  # after the mark: no work is lost
                    for suffix in ("", ".progress.json"):
                        (stage_dir / f"embeddings.rank{r}.npy{suffix}").unlink(missing_ok=True)
        uniq = read_json_output(stage_dir / "unique_captions.json", "the list of unique captions", "text")
        item_unique = load_npy_output(
            stage_dir / "item_unique.npy", "int64 [N] unique-caption id per pair", "text", np.int64, 1
        )
        return uniq, item_unique, fp

    # ------------------------------------------------------------------ stage 5
    def stage_topics(self, uniq: list, item_unique: np.ndarray, text_fp: str) -> tuple[dict, str]:
        tc, seed = self.s.topics, self.s.seed
        fp = fingerprint("topics", text_fp, tc.node(), seed)
        stage_dir = self.out / "topics"
        marker = StageMarker(self.out, "topics", fp)
        if not marker.is_done():
            stage_dir.mkdir(parents=True, exist_ok=True)
            n_unique, path = len(uniq), self.out / "text" / "embeddings.npy"
            what = f"float32 [{n_unique}, d] sentence embeddings"
            emb = load_npy_output(path, what, "text", np.float32, 2, n_unique, mmap=True)
            rng = np.random.default_rng(seed)
            sample = np.sort(rng.choice(n_unique, size=min(tc.fit_sample, n_unique), replace=False))
            sample_emb = np.asarray(emb[sample])
            t0 = time.time()
            fit = (tc.umap_dim, tc.umap_neighbors, tc.umap_min_dist, tc.umap_metric, tc.umap_init)
            sample_labels = topics_mod.fit_sample_clusters(sample_emb, *fit, tc.min_cluster_size, tc.min_samples, seed)
            self._timed("umap_hdbscan_fit", time.time() - t0, len(sample))
            n_clusters = int(sample_labels.max()) + 1
            if n_clusters < 1:
                raise InputError(
                    f"CHC.TOPICS.MIN_CLUSTER_SIZE: HDBSCAN found no cluster of at least {tc.min_cluster_size} "
                    f"captions among the {len(sample)} fitted (corpus: {n_unique} unique captions, "
                    f"{int(np.count_nonzero(item_unique >= 0))} pairs); lower CHC.TOPICS.MIN_CLUSTER_SIZE "
                    f"or give a larger corpus"
                )
            cents = topics_mod.centroids(sample_emb, sample_labels, n_clusters)
            cut = topics_mod.member_similarity_cut(sample_emb, sample_labels, cents, tc.assign_quantile)
            t0 = time.time()
            unique_cluster = topics_mod.assign_nearest(emb, cents, cut)
            unique_cluster[sample] = sample_labels  # fitted captions keep their HDBSCAN label
            self._timed("assign_nearest_centroid", time.time() - t0, n_unique)

            weights = np.bincount(item_unique[item_unique >= 0], minlength=n_unique)
            t0 = time.time()
            word_rule = (tc.presence_min_fraction, tc.min_word_len, tc.extra_stop_words)
            words = topics_mod.cluster_tfidf_words(uniq, unique_cluster, n_clusters, weights, *word_rule)
            cluster_sizes = np.bincount(
                unique_cluster[unique_cluster >= 0], weights=weights[unique_cluster >= 0], minlength=n_clusters
            ).astype(np.int64)
            names, cluster_to_topic = topics_mod.merge_clusters_by_word(words.top_word, cluster_sizes)
            self._timed("topic_words", time.time() - t0, n_unique)
            unique_topic = np.where(unique_cluster >= 0, cluster_to_topic[np.maximum(unique_cluster, 0)], -1)

            plot = {}
            (stage_dir / "plot.npz").unlink(missing_ok=True)  # never draw a previous run's points
            if tc.plot_points > 0:
                pick = np.sort(rng.choice(len(sample), size=min(tc.plot_points, len(sample)), replace=False))
                xy = topics_mod.project_2d(sample_emb[pick], tc.umap_neighbors, tc.umap_metric, seed)
                np.savez(stage_dir / "plot.npz", xy=xy, topic=unique_topic[sample[pick]])
                plot = {"points": int(len(pick))}
            save_npy_atomic(stage_dir / "unique_cluster.npy", unique_cluster)
            save_npy_atomic(stage_dir / "unique_topic.npy", unique_topic)
            info = {
                "fit_sample": int(len(sample)),
                "clusters": n_clusters,
                "similarity_cut": cut,
                "sample_noise": int((sample_labels < 0).sum()),
                "assigned_noise": int((unique_cluster < 0).sum() - (sample_labels < 0).sum()),
                "cluster_top_word": words.top_word,
                "cluster_top_words": words.top_words,
                "cluster_sizes": cluster_sizes.tolist(),
                "cluster_to_topic": cluster_to_topic.tolist(),
                "topic_names": names,
                "vocabulary_size": words.vocabulary_size,
                "plot": plot,
                "timings": {k: self.timings[k] for k in ("umap_hdbscan_fit", "assign_nearest_centroid", "topic_words")},
            }
            write_json_atomic(stage_dir / "topics.json", info)
            marker.mark({"topics": len(names)})
        return read_json_output(stage_dir / "topics.json", "the topic fit's summary", "topics"), fp

    # ------------------------------------------------------------------ stage 6
    def stage_domains(
        self, ok: np.ndarray, keep: np.ndarray, item_unique: np.ndarray, topic_info: dict, topics_fp: str, image_fp: str
    ) -> tuple[dict, str]:
        dc = self.s.domains
        fp = fingerprint("domains", topics_fp, image_fp, dc.node(), self.s.seed)
        marker = StageMarker(self.out, "domains", fp)
        if not marker.is_done():
            unique_topic = load_npy_output(
                self.out / "topics" / "unique_topic.npy", "int64 [U] topic id per unique caption", "topics", np.int64, 1
            )
            feats = load_image_features(self.out, len(ok))
            n = len(ok)
            pre_topic = np.where(item_unique >= 0, unique_topic[np.maximum(item_unique, 0)], -1)
            status = np.full(n, CLUSTERED, dtype=np.int8)
            status[~ok] = UNREADABLE
            status[ok & ~keep] = FILTERED
            status[keep & (pre_topic < 0)] = NOISE
            names = topic_info["topic_names"]
            new_names, per_topic = [], []
            item_topic = np.full(n, -1, dtype=np.int64)
            item_domain = np.full(n, -1, dtype=np.int64)
            t0 = time.time()
            members_of = groups(pre_topic)
            for t, name in enumerate(names):
                members = members_of.get(t, np.zeros(0, dtype=np.int64))
                split = domains_mod.split_domains(
                    np.asarray(feats[members]), dc.num, dc.min_per_domain, dc.minibatch_above, dc.n_init, self.s.seed
                )
                entry = {"name": name, "images": int(len(members)), "domains": split.num_domains}
                if split.excluded:
                    status[members] = SMALL_TOPIC
                    entry["excluded"] = True
                else:
                    new_id = len(new_names)
                    new_names.append(name)
                    item_topic[members] = new_id
                    item_domain[members] = split.labels
                    entry["domain_sizes"] = np.bincount(split.labels, minlength=split.num_domains).tolist()
                per_topic.append(entry)
            self._timed("domain_kmeans", time.time() - t0, int((pre_topic >= 0).sum()))
            save_npy_atomic(self.out / "item_topic.npy", item_topic)
            save_npy_atomic(self.out / "item_domain.npy", item_domain)
            save_npy_atomic(self.out / "item_status.npy", status)
            write_json_atomic(self.out / "domains.json", {"topic_names": new_names, "per_topic": per_topic})
            marker.mark({"topics": len(new_names)})
        return read_json_output(self.out / "domains.json", "the topic names and domains per topic", "domains"), fp

    # ------------------------------------------------------------------ all
    def run(self) -> Optional[Path]:
        """Run (or resume) every stage; returns the output dir on rank 0, ``None`` on other ranks."""
        self.out.mkdir(parents=True, exist_ok=True)
        index, index_fp = self.stage_index()
        image_fp = self.stage_image_features(index, index_fp)
        if self.rank == 0:
            ok, keep, filter_fp = self.stage_filter(index, image_fp)
        else:  # the filter runs on rank 0; its fingerprint depends on settings only
            ok = keep = None
            filter_fp = self.filter_fingerprint(image_fp)
        uniq, item_unique, text_fp = self.stage_text(index, keep, filter_fp)
        if self.rank != 0:
            self.barrier()  # wait while rank 0 fits topics and domains and writes the outputs
            return None
        topic_info, topics_fp = self.stage_topics(uniq, item_unique, text_fp)
        domain_info, _ = self.stage_domains(ok, keep, item_unique, topic_info, topics_fp, image_fp)
        self.write_outputs(index, ok, keep, uniq, item_unique, topic_info, domain_info)
        self.barrier()
        return self.out

    def write_outputs(self, index, ok, keep, uniq, item_unique, topic_info, domain_info) -> None:
        status = load_npy_output(
            self.out / "item_status.npy", f"int8 [{len(ok)}] status per pair", "domains", np.int8, 1, len(ok)
        )
        counts = dict(index.counts)
        limit = self.s.text.max_caption_chars
        counts["captions_cut_to_max_chars"] = sum(
            caption_over_cap(index.captions[i], limit) for i in np.flatnonzero(keep)
        )
        counts.update(
            {
                "pairs_indexed": len(index),
                "unreadable_images": int((~ok).sum()),
                "filtered": int((ok & ~keep).sum()),
                "kept_after_filter": int(keep.sum()),
                "unique_captions": len(uniq),
                "fit_sample": topic_info["fit_sample"],
                "hdbscan_clusters": topic_info["clusters"],
                "noise_in_fit_sample": topic_info["sample_noise"],
                "noise_assigned": topic_info["assigned_noise"],
                "noise_pairs": int((status == NOISE).sum()),
                "topics_after_merge": len(topic_info["topic_names"]),
                "clusters_merged_away": topic_info["clusters"] - len(topic_info["topic_names"]),
                "topics_excluded_small": sum(1 for e in domain_info["per_topic"] if e.get("excluded")),
                "pairs_in_excluded_topics": int((status == SMALL_TOPIC).sum()),
                "topics_with_fewer_domains": sum(
                    1 for e in domain_info["per_topic"] if 0 < e["domains"] < self.s.domains.num
                ),
                "topics": len(domain_info["topic_names"]),
                "pairs_clustered": int((status == CLUSTERED).sum()),
            }
        )
        meta = self.backbone_meta()
        meta.update(
            {
                "settings": {"CHC": self.s.node(), "SEED": self.s.seed},
                "status_codes": STATUS,
                "counts": counts,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "versions": package_versions(CLUSTERING_PACKAGES),
                # CPU, kernel pins, builds and the commit (cheap; the golden-run fingerprint is meta-training's)
                "numerics": numerics_record(),
                "commit": git_commit(REPO),
            }
        )
        write_json_atomic(self.out / "hierarchy.json", {"topic_names": domain_info["topic_names"], "meta": meta})
        old = self.out / "timings.json"
        try:
            timings = json.loads(old.read_text()) if old.is_file() else {}
        except (ValueError, RecursionError):  # a garbled timings file is rewritten, not fatal
            timings = {}
        timings = timings if isinstance(timings, dict) else {}
        timings.update(self.timings)
        write_json_atomic(old, timings)
        skipped = skipped_input_rows(counts, index.issues, self.unreadable_by_reason(), limit)
        write_report(
            self.out, index.captions, counts, topic_info, domain_info, timings, self.s.seed, skipped, index.issues
        )


# The packages whose builds decide the hierarchy's numbers, their versions written into ``hierarchy.json``.
CLUSTERING_PACKAGES = tuple(
    "torch numpy scikit-learn umap-learn hdbscan numba sentence-transformers open_clip_torch".split()
)


def text_rank_rows(n: int, chunk_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the ``n`` unique captions that ``rank`` embeds: a contiguous block of whole chunks."""
    n_chunks = -(-n // max(1, chunk_size))
    first, last = (n_chunks * rank) // world_size, (n_chunks * (rank + 1)) // world_size
    return min(n, first * chunk_size), min(n, last * chunk_size)


def merge_text_ranks(stage_dir: Path, n: int, dim: int, chunk_size: int, world_size: int) -> None:
    """``embeddings.rank{r}.npy`` -> ``embeddings.npy`` float32 ``[n, dim]`` (atomic)."""
    tmp = stage_dir / "embeddings.tmp.npy"
    merged = create_memmap(tmp, np.float32, (n, dim))
    for r in range(world_size):
        lo, hi = text_rank_rows(n, chunk_size, r, world_size)
        part = np.load(stage_dir / f"embeddings.rank{r}.npy", mmap_mode="r")
        if part.shape != (hi - lo, dim):
            raise RuntimeError(
                f"{stage_dir}/embeddings.rank{r}.npy: shape {part.shape}, rank {r} owns {(hi - lo, dim)}"
            )
        merged[lo:hi] = part
    merged.flush()
    del merged
    os.replace(tmp, stage_dir / "embeddings.npy")


def image_files_changed(index: PairIndex) -> bool:
    """True when an image file the manifest named (or skipped as special) is not as the index recorded it."""
    if not len(index.file_items()) and not index.special_files:
        return False
    recorded = index.recorded_file_stamps()
    return recorded is None or not np.array_equal(recorded, index.current_file_stamps())


def run_chc(
    cfg, rank: int = 0, world_size: int = 1, barrier: Optional[Callable[[], None]] = None, show_progress: bool = True
) -> Optional[Path]:
    """Run or resume CHC for ``cfg`` (read once by :func:`meta.chc.settings.read_chc_settings`); returns
    ``CHC.OUTPUT_DIR`` on rank 0, which holds its :class:`meta.infra.runlock.RunLock` for the whole run."""
    settings = read_chc_settings(cfg)
    out = Path(settings.output_dir)
    with RunLock(out, key="CHC.OUTPUT_DIR", enabled=int(rank) == 0) as lock:  # a refused run leaves no folder
        if lock.held:
            for folder in [out] + [p for p in out.iterdir() if p.is_dir()]:
                clean_stale_temps(folder, all_pids=True)
        return ChcRun(settings, rank, world_size, barrier, show_progress).run()
