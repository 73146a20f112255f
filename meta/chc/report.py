"""``chc_report.md`` + ``chc_report.json`` + ``umap_topics.png`` of a CHC run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from meta.chc.stages import groups, write_json_atomic
from meta.infra.fileio import atomic_path, write_text_atomic

MERGE_RULE = (
    "HDBSCAN clusters whose cluster-TF-IDF top word is identical are merged into one topic "
    "(same name = same class), so no K-way task holds two classes with one name."
)


# index counts that are skips or changes of input, with what happened to the pairs
_INDEX_REASONS = (
    ("skipped_no_image", "pair without an image member / image value", "pair skipped"),
    ("skipped_empty_caption", "empty caption (no visible character: blank, zero-width, marks alone)", "pair skipped"),
    (
        "skipped_caption_too_long",
        "shard caption member over CHC.INPUT.MAX_FIELD_CHARS bytes",
        "pair skipped (member never read)",
    ),
    (
        "metadata_too_long_dropped",
        "shard metadata (json) member over CHC.INPUT.MAX_FIELD_CHARS bytes",
        "pair kept without its metadata (member never read)",
    ),
    ("skipped_lost_in_corrupt_shard", "pair cut by the damage in a corrupt shard", "pair skipped"),
    (
        "pairs_lost_in_corrupt_shards_estimate",
        "pairs in the unread part of corrupt shards (estimate: bytes unread / mean bytes per pair read)",
        "not read",
    ),
    (
        "skipped_invalid_row",
        "manifest line that is not a JSON object (not JSON, nested too deep, a list)",
        "row skipped",
    ),
    ("skipped_non_text_caption", "caption is not text (number, list, ...)", "pair skipped"),
    ("skipped_non_text_image", "image value is not text", "pair skipped"),
    ("skipped_duplicate_pair", "exact repeat of an earlier (image, caption) row", "pair skipped"),
    (
        "rows_repeating_an_image",
        "manifest row naming an image path an earlier row named, with another caption",
        "kept: each distinct caption of an image is its own pair (exact repeats skipped)",
    ),
    (
        "skipped_duplicate_key",
        "key repeated in a shard: a member group after the first complete pair",
        "group skipped (first complete pair kept)",
    ),
    (
        "shards_not_regular_file",
        "shard path names a FIFO, device, socket or folder (symlinks followed)",
        "shard skipped (never opened)",
    ),
    (
        "skipped_not_regular_file",
        "manifest image path names a FIFO, device, socket or folder",
        "pair skipped (never opened)",
    ),
    (
        "skipped_outside_root",
        "manifest image path outside the data root (CHC.INPUT.IMAGE_ROOT), links resolved",
        "pair skipped (never read; CHC.INPUT.ALLOW_OUTSIDE_ROOT True reads it)",
    ),
    ("dropped_by_max_pairs", "beyond CHC.INPUT.MAX_PAIRS", "pair skipped"),
    ("invalid_utf8_replaced", "text not valid UTF-8 (caption or manifest line)", "kept, bad bytes -> U+FFFD"),
)
MAX_LISTED_ISSUES = 20


def skipped_input_rows(counts: dict, issues: list, unreadable_by_reason: dict, max_caption_chars: int) -> list:
    """Rows ``{stage, reason, count, action}`` of the report's "Skipped input" table (non-zero counts only)."""
    rows = []

    def row(stage: str, reason: str, count, action: str) -> None:
        rows.append({"stage": stage, "reason": reason, "count": int(count), "action": action})

    if counts.get("corrupt_shards"):
        unread, cut = counts.get("corrupt_shard_bytes_unread", 0), counts.get("corrupt_shards_cut_short", 0)
        action = (
            f"pairs before the damage kept; {unread} bytes after it not read; {cut} file(s) cut short "
            "(what followed the cut is unknown)"
        )
        row("index", "corrupt shard (listed below)", counts["corrupt_shards"], action)
    for key, reason, action in _INDEX_REASONS:
        if counts.get(key):
            row("index", reason, counts[key], action)
    for why, n in unreadable_by_reason.items():
        row("image_features", f"unreadable image: {why}", n, "pair not clustered")
    if counts.get("captions_cut_to_max_chars"):
        reason = f"caption longer than CHC.TEXT.MAX_CAPTION_CHARS={max_caption_chars}"
        row("text", reason, counts["captions_cut_to_max_chars"], "cut for embeddings and topic words")
    return rows


def _issue_line(e: dict) -> str:
    at = f" (byte offset(s) {', '.join(map(str, e['offsets']))})" if e.get("offsets") else ""
    if "rows" not in e and "offset" not in e:  # a whole file left out (a shard that is not a regular file)
        return f"- {e['source']}: {e['problem']}"
    if "offset" in e:
        cut = "; the file is cut short" if e.get("cut_short") else ""
        return (
            f"- {e['source']}: {e['problem']}; stopped at byte {e['offset']}, {e['bytes_unread']} bytes not read, "
            f"{e['pairs_read']} pairs read{cut}"
        )
    if "keys" in e:
        return f"- {e['source']}: {e['problem']}: {e['rows']} member group(s), key(s) {', '.join(e['keys'])}{at}"
    return f"- {e['source']}: {e['problem']}: {e['rows']} row(s), line(s) {', '.join(map(str, e['lines']))}{at}"


def _samples(captions, members: np.ndarray, k: int, rng) -> list:
    pick = rng.choice(members, size=min(k, len(members)), replace=False) if len(members) else []
    return [captions[int(i)] for i in sorted(pick)]


def plot_topics(out_dir: Path, names: list) -> bool:
    """PNG of the 2-D UMAP coloured by topic (noise grey); False when no plot data exists."""
    path = Path(out_dir) / "topics" / "plot.npz"
    if not path.is_file():
        (Path(out_dir) / "umap_topics.png").unlink(missing_ok=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = np.load(path)
    xy, topic = data["xy"], data["topic"]
    fig, ax = plt.subplots(figsize=(8, 7), dpi=110)
    noise = topic < 0
    ax.scatter(xy[noise, 0], xy[noise, 1], s=3, c="#c8c8c8", label="noise", linewidths=0)
    cmap = plt.get_cmap("tab20")
    for t in np.unique(topic[~noise]):
        sel = topic == t
        ax.scatter(xy[sel, 0], xy[sel, 1], s=4, color=cmap(int(t) % 20), linewidths=0)
        cx, cy = np.median(xy[sel], axis=0)
        label = names[int(t)] if int(t) < len(names) else str(t)
        ax.text(
            cx, cy, label, fontsize=7, ha="center", bbox=dict(boxstyle="round,pad=0.15", fc="white", alpha=0.7, lw=0)
        )
    ax.set_title(f"CHC topics: 2-D UMAP of {len(xy)} sampled captions")
    ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    with atomic_path(Path(out_dir) / "umap_topics.png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def write_report(
    out_dir: Path,
    captions: list,
    counts: dict,
    topic_info: dict,
    domain_info: dict,
    timings: dict,
    seed: int = 0,
    skipped: Optional[list] = None,
    issues: Optional[list] = None,
) -> dict:
    """Write the three report files; returns the JSON payload.

    ``skipped``: rows of :func:`skipped_input_rows`; ``issues``: damaged inputs
    (:attr:`meta.chc.sources.PairIndex.issues`), both shown in a "Skipped input" section.
    """
    out_dir = Path(out_dir)
    item_topic = np.load(out_dir / "item_topic.npy")
    rng = np.random.default_rng(seed)
    topics = []
    final_names = domain_info["topic_names"]
    members_of = groups(item_topic)
    for t, name in enumerate(final_names):
        members = members_of.get(t, np.zeros(0, dtype=np.int64))
        entry = next(e for e in domain_info["per_topic"] if e["name"] == name)
        names_of = topic_info["topic_names"]
        merged_from = [c for c, tt in enumerate(topic_info["cluster_to_topic"]) if tt >= 0 and names_of[tt] == name]
        topics.append(
            {
                "name": name,
                "size": int(len(members)),
                "domains": entry["domains"],
                "domain_sizes": entry.get("domain_sizes", []),
                "merged_clusters": len(merged_from),
                "top_words": topic_info["cluster_top_words"][merged_from[0]] if merged_from else [],
                "samples": _samples(captions, members, 3, rng),
            }
        )
    excluded = [e for e in domain_info["per_topic"] if e.get("excluded")]
    drew = plot_topics(out_dir, topic_info["topic_names"])
    payload = {
        "counts": counts,
        "skipped_input": skipped or [],
        "damaged_inputs": issues or [],
        "merge_rule": MERGE_RULE,
        "topics": topics,
        "excluded_topics": [{"name": e["name"], "images": e["images"]} for e in excluded],
        "timings": timings,
        "plot": "umap_topics.png" if drew else None,
    }
    write_json_atomic(out_dir / "chc_report.json", payload)

    lines = ["# CHC report", "", "## Counts per stage", "", "| stage | count |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in counts.items()]
    lines += ["", "## Skipped input", ""]
    if skipped:
        lines += ["| stage | reason | count | what happened |", "|---|---|---:|---|"]
        lines += [f"| {r['stage']} | {r['reason'].replace('|', '/')} | {r['count']} | {r['action']} |" for r in skipped]
    else:
        lines += ["Nothing was skipped."]
    if issues:
        lines += ["", f"Damaged inputs ({len(issues)}):", ""]
        lines += [_issue_line(e) for e in issues[:MAX_LISTED_ISSUES]]
        if len(issues) > MAX_LISTED_ISSUES:
            lines.append(f"- ... {len(issues) - MAX_LISTED_ISSUES} more in chc_report.json")
    lines += [
        "",
        "## Rules",
        "",
        f"- {MERGE_RULE}",
        "- Domains: k-means per topic; topics too small for all domains get fewer, "
        "topics with fewer than MIN_PER_DOMAIN images are excluded.",
        "",
        f"## Topics ({len(topics)})",
        "",
        "| topic | pairs | domains (sizes) | merged clusters | samples |",
        "|---|---:|---|---:|---|",
    ]
    for e in topics:
        samples = " / ".join(s.replace("|", "\\|")[:80] for s in e["samples"])
        lines.append(
            f"| {e['name']} | {e['size']} | {e['domains']} ({', '.join(map(str, e['domain_sizes']))}) "
            f"| {e['merged_clusters']} | {samples} |"
        )
    if excluded:
        lines += ["", f"## Excluded topics ({len(excluded)})", ""]
        lines += [f"- {e['name']}: {e['images']} images" for e in excluded]
    lines += ["", "## Throughput (this run)", "", "| stage | items | seconds | items/s |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['items']} | {v['seconds']} | {v['items_per_second']} |" for k, v in timings.items()]
    if drew:
        lines += ["", "![2-D UMAP by topic](umap_topics.png)"]
    write_text_atomic(out_dir / "chc_report.md", "\n".join(lines) + "\n")
    return json.loads(json.dumps(payload))
