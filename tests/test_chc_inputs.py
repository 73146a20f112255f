"""Bad CHC input never stops or silently shrinks a run: odd images, damaged shards, odd manifests, full disks."""

import csv
import errno
import json

import numpy as np
import pytest
from helpers import tiny_chc_args
from helpers_chc import dds_bytes, member_offsets, overwrite_at, png_bytes, truncate_at, write_shard

from meta.chc.errors import DiskSpaceError, InputError
from meta.chc.imaging import NO_BYTES, decode_batch, decode_image_why
from meta.chc.sources import build_index, scan_manifest, scan_tar

CAPS = [f"a red square number {i}" for i in range(40)]


# ---------------------------------------------------------------- images
def test_any_decoding_exception_is_that_images_problem():
    img, why = decode_image_why(dds_bytes())  # Pillow: NotImplementedError
    assert img is None and why == "NotImplementedError"
    reasons = []
    pixels, ok = decode_batch([png_bytes(), dds_bytes(), None, b"garbage"], 16, reasons=reasons)
    assert ok.tolist() == [True, False, False, False] and pixels.shape == (4, 16, 16, 3)
    assert reasons == ["", "NotImplementedError", NO_BYTES, "UnidentifiedImageError"]
    assert not pixels[1:].any()
    # mutated images: decoding never raises, whatever Pillow throws
    rng = np.random.default_rng(0)
    base = [png_bytes((i * 20, 90, 30), (24, 16)) for i in range(4)] + [dds_bytes()]
    blobs = []
    for k in range(300):
        b = bytearray(base[k % len(base)])
        for pos in rng.integers(0, len(b), size=int(rng.integers(1, 6))):
            b[pos] = int(rng.integers(0, 256))
        blobs.append(bytes(b))
    reasons = []
    _, ok = decode_batch(blobs, 8, workers=2, reasons=reasons)
    assert len(reasons) == 300 and all(bool(r) != bool(o) for r, o in zip(reasons, ok))


def test_image_folder_counts_odd_image_by_exception_type(tiny_clip, tmp_path):
    from gram_tools.synthetic import write_synthetic_image_folder
    from meta.chc.image_folder import build_image_folder_hierarchy

    clip, _ = tiny_clip
    write_synthetic_image_folder(tmp_path / "d", ["apple", "bridge"], per_class=8, seed=0)
    (tmp_path / "d" / "apple" / "evil.jpg").write_bytes(dds_bytes())
    h = build_image_folder_hierarchy(tmp_path / "d", clip, num_domains=2, min_per_domain=2, seed=0, show_progress=False)
    assert h.meta["counts"]["unreadable_images"] == 1 and h.meta["counts"]["images"] == 17
    assert h.meta["unreadable_by_reason"] == {"NotImplementedError": 1}
    assert (h.item_topic >= 0).sum() == 16


# ---------------------------------------------------------------- damaged shards
@pytest.fixture
def shard(tmp_path):
    return write_shard(tmp_path / "good.tar", CAPS)


def _scan(path):
    counts, issues = {}, []
    return scan_tar(str(path), counts, issues), counts, issues


def test_shard_cut_inside_a_caption_member_keeps_earlier_pairs(shard, tmp_path):
    members = member_offsets(shard)
    name, _, data_at, size = next(m for m in members if m[0] == "0025.txt")
    cut = truncate_at(shard, tmp_path / "cut.tar", data_at + size // 2)
    records, counts, issues = _scan(cut)
    assert [r[3] for r in records] == CAPS[:25]
    assert counts["corrupt_shards"] == 1 and counts["skipped_lost_in_corrupt_shard"] == 1
    assert counts.get("skipped_empty_caption", 0) == 0  # the lost caption is not an "empty caption"
    assert issues[0]["pairs_read"] == 25 and issues[0]["bytes_unread"] == cut.stat().st_size - issues[0]["offset"]


@pytest.mark.parametrize("where", ["zero_bytes", "first_header"])
def test_unopenable_shard_is_counted_and_the_others_are_read(shard, tmp_path, where):
    bad = truncate_at(shard, tmp_path / "bad.tar", 0 if where == "zero_bytes" else 100)
    index = build_index([str(shard), str(bad)], show_progress=False)
    assert len(index) == 40 and index.counts["corrupt_shards"] == 1
    assert index.issues[0]["source"] == str(bad) and "cannot open" in index.issues[0]["problem"]


@pytest.mark.parametrize("damage", ["cut_in_later_header", "random_bytes_over_header", "cut_at_member_boundary"])
def test_shard_that_ends_early_is_detected(shard, tmp_path, damage):
    """tarfile ends these iterations without an exception; the pairs after the damage must be reported."""
    members = member_offsets(shard)
    head = next(m for m in members if m[0] == "0010.png")[1]  # header of pair 10's first member
    if damage == "cut_in_later_header":
        bad = truncate_at(shard, tmp_path / "bad.tar", head + 200)
    elif damage == "random_bytes_over_header":
        rnd = np.random.default_rng(1).integers(1, 256, 100, dtype=np.uint8).tobytes()
        bad = overwrite_at(shard, tmp_path / "bad.tar", head + 10, rnd)
    else:
        bad = truncate_at(shard, tmp_path / "bad.tar", head)
    index = build_index([str(bad)], show_progress=False)
    assert index.captions == CAPS[:10]
    c, issue = index.counts, index.issues[0]
    assert c["corrupt_shards"] == 1 and issue["offset"] == head and issue["pairs_read"] == 10
    if damage == "random_bytes_over_header":  # the 30 pairs behind the damaged header are estimated from bytes
        assert not issue["cut_short"] and c["corrupt_shards_cut_short"] == 0
        assert c["pairs_lost_in_corrupt_shards_estimate"] == len(CAPS) - 10
    else:  # the file itself ends early: what followed is unknown, and said so
        assert issue["cut_short"] and c["corrupt_shards_cut_short"] == 1
        assert issue["bytes_unread"] <= bad.stat().st_size - head


def test_intact_shard_is_not_flagged_and_all_corrupt_shards_are_one_line(shard, tmp_path):
    assert _scan(shard)[1].get("corrupt_shards", 0) == 0
    empty = truncate_at(shard, tmp_path / "empty.tar", 0)
    with pytest.raises(InputError, match=r"^CHC.INPUT.SHARDS: 1 shard\(s\): no usable image-text pair .*empty.tar"):
        build_index([str(empty)], show_progress=False)


def test_tar_caption_with_invalid_utf8_is_kept_and_counted(tmp_path):
    path = write_shard(tmp_path / "s.tar", CAPS[:3], caption_bytes={1: b"caf\xe9 au lait"})
    counts = {}
    records = scan_tar(str(path), counts)
    assert records[1][3] == "caf\ufffd au lait" and counts["invalid_utf8_replaced"] == 1


# ---------------------------------------------------------------- manifests
def _img(tmp_path, name="a.png"):
    (tmp_path / name).write_bytes(png_bytes())
    return name


def test_manifest_long_field_bom_bad_utf8_and_duplicates(tmp_path):
    _img(tmp_path)
    long_caption = "pizza " * 25_000  # 150 KB > the csv module's 128 KB default
    raw = (
        f"\ufeffimage,caption\na.png,{long_caption}\na.png,a red square\na.png,a red square\na.png,a  red   square\n"
    ).encode() + b"a.png,caf\xe9 square\n"
    (tmp_path / "m.csv").write_bytes(raw)
    counts, issues = {}, []
    records = scan_manifest(str(tmp_path / "m.csv"), "image", "caption", "", counts, issues)
    assert [len(r[2]) for r in records[:1]] == [len(long_caption.strip())]
    assert [r[2] for r in records[1:]] == ["a red square", "caf\ufffd square"]
    assert counts["skipped_duplicate_pair"] == 2 and counts["invalid_utf8_replaced"] == 1
    assert counts["pairs_seen"] == 5
    assert {e["problem"]: e["lines"] for e in issues} == {
        "repeats an earlier (image, caption) row": [4, 5],
        "invalid UTF-8 (decoded with replacement characters)": [6],
    }
    with pytest.raises(InputError, match=r"m.csv:2: a field longer than CHC.INPUT.MAX_FIELD_CHARS=30000 characters"):
        scan_manifest(str(tmp_path / "m.csv"), "image", "caption", "", {}, max_field_chars=30_000)  # line < cap
    # a line longer than 4 x 1000 + 64 KiB bytes is not even read (sources.max_line_bytes)
    with pytest.raises(InputError, match=r"m.csv:2: a line longer than 69536 bytes, not read: a field longer than "):
        scan_manifest(str(tmp_path / "m.csv"), "image", "caption", "", {}, max_field_chars=1000)
    assert csv.field_size_limit() == 131072  # the process-wide limit is restored


def test_jsonl_rows_that_are_not_objects_or_not_text(tmp_path):
    _img(tmp_path)
    lines = [
        '["a.png", "a list"]',
        '"just a string"',
        "{broken",
        json.dumps({"image": "a.png", "caption": 12345}),
        json.dumps({"image": "a.png", "caption": ["x", "y"]}),
        json.dumps({"image": 7, "caption": "seven"}),
        json.dumps({"image": "a.png", "caption": "a fine pair"}),
        json.dumps({"image": "a.png", "caption": None}),
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    index = build_index(manifest=str(tmp_path / "m.jsonl"), show_progress=False)
    assert index.captions == ["a fine pair"]
    c = index.counts
    assert (
        c["pairs_seen"],
        c["skipped_invalid_row"],
        c["skipped_non_text_caption"],
        c["skipped_non_text_image"],
        c["skipped_empty_caption"],
    ) == (8, 3, 2, 1, 1)
    index.save(tmp_path / "idx")
    from meta.chc.sources import PairIndex

    assert PairIndex.load(tmp_path / "idx").issues == index.issues and len(index.issues) == 6


# ---------------------------------------------------------------- disk space
def test_memmap_on_a_full_disk_is_a_one_line_error(tmp_path, monkeypatch):
    import shutil

    import meta.chc.stages as stages
    from meta.chc.stages import ChunkedArray, create_memmap

    real = shutil.disk_usage
    monkeypatch.setattr(stages.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    store = ChunkedArray(tmp_path / "sub" / "x.npy", 100, (4,), np.float32, "fp")
    with pytest.raises(DiskSpaceError, match=rf"^{tmp_path / 'sub'}: needs 1728 bytes for x.npy, 1000 free$"):
        store.fill(lambda s, e: np.zeros((e - s, 4), np.float32), 10, disable_progress=True)
    assert not (tmp_path / "sub" / "x.npy").exists()
    monkeypatch.setattr(stages.shutil, "disk_usage", real)
    half = ChunkedArray(tmp_path / "z.npy", 10, (2,), np.float32, "fp")  # a run killed after one chunk

    def first_chunk_only(s, e):
        if s:
            raise KeyboardInterrupt
        return np.ones((e - s, 2), np.float32)

    with pytest.raises(KeyboardInterrupt):
        half.fill(first_chunk_only, 5, disable_progress=True)

    def no_space(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stages.os, "posix_fallocate", no_space)
    with pytest.raises(DiskSpaceError, match=r"needs 528 bytes for y.npy"):
        create_memmap(tmp_path / "y.npy", np.uint8, (20, 20))
    assert not (tmp_path / "y.npy").exists()
    with pytest.raises(DiskSpaceError, match=r"needs 208 bytes for z.npy"):  # resuming maps it too
        half.fill(first_chunk_only, 5, disable_progress=True)
    assert half.rows_done() == 5  # work kept


# ---------------------------------------------------------------- wrong image paths (CLI)
def _cli(tmp_path, *opts):
    from meta.chc.cli import main

    return main(tiny_chc_args(tmp_path / "out", *opts))


def test_wrong_image_root_stops_early_naming_path_and_key(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    for i in range(30):
        (tmp_path / "img" / f"{i}.png").write_bytes(png_bytes((i * 8, 0, 0)))
    (tmp_path / "m.csv").write_text("image,caption\n" + "".join(f"{i}.png,red square {i}\n" for i in range(30)))
    code = _cli(tmp_path, "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), "CHC.INPUT.IMAGE_ROOT", str(tmp_path / "imgs"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "error: CHC.INPUT.IMAGE_ROOT: 30 of 30 images of the first chunk are unreadable "
        "(FileNotFoundError 30); tried " + str(tmp_path / "imgs" / "0.png")
    )
    # relative base: IMAGE_ROOT '' means the manifest's folder, which the message says
    code = _cli(tmp_path, "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"the manifest's folder {tmp_path}" in err[0]
    # told to go on, the run still ends in one line (not 'only 0 unique captions')
    code = _cli(tmp_path, "CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), "CHC.INPUT.MAX_UNREADABLE_FRACTION", "1.0")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "error: CHC.INPUT.IMAGE_ROOT: none of the 30 images could be read (FileNotFoundError 30)"
    ]


# ---------------------------------------------------------------- caption length
def test_caption_cap_keeps_a_runaway_caption_from_renaming_its_topic():
    from gram_tools.synthetic import TOPICS, make_caption
    from meta.chc.text_embed import cap_caption, caption_over_cap
    from meta.chc.topics import cluster_tfidf_words
    from meta.config import get_meta_cfg_default

    assert cap_caption("a dog on a sofa", 9) == "a dog on" and cap_caption("a dog on a sofa", 8) == "a dog on"
    assert cap_caption("a dog", 0) == "a dog" and not caption_over_cap("a dog", 5) and caption_over_cap("a dog", 4)
    rng = np.random.default_rng(0)
    caps, labels = [], []
    for t, name in enumerate(["pizza", "dog", "car"]):
        for _ in range(50):
            caps.append(make_caption(name, rng, list(TOPICS), 0.1)), labels.append(t)
    rogue = (
        "this homemade pizza has a crisp crust and a thick layer of melted cheese; the cheese is a blend of "
        "mozzarella and cheddar cheese, with parmesan cheese grated on top. "
    ) * 700  # 108 KB
    caps.append(rogue), labels.append(0)
    labels = np.array(labels)
    assert cluster_tfidf_words(caps, labels, 3, None, 0.1).top_word[0] == "cheese"  # uncapped: renamed
    limit = get_meta_cfg_default().CHC.TEXT.MAX_CAPTION_CHARS
    capped = [cap_caption(c, limit) for c in caps]
    assert cluster_tfidf_words(capped, labels, 3, None, 0.1).top_word == ["pizza", "dog", "car"]
    assert [caption_over_cap(c, limit) for c in caps].count(True) == 1 and len(capped[-1]) <= limit


# ---------------------------------------------------------------- end to end
def test_run_with_bad_input_finishes_reports_and_resumes(tmp_path):
    """A DDS .jpg, a shard with a damaged header and a runaway caption: the run finishes, the report
    says what was skipped and why, and a re-launch is a no-op."""
    from gram_tools.synthetic import write_synthetic_shards
    from meta.chc import load_hierarchy, run_chc
    from meta.config import get_meta_cfg_default

    data = tmp_path / "data"
    write_synthetic_shards(
        data,
        n_pairs=240,
        topics=["pizza", "dog", "car"],
        n_shards=2,
        corrupt_fraction=0.0,
        empty_caption_fraction=0.0,
        seed=0,
    )
    members = member_offsets(data / "shard-00001.tar")
    head = members[3 * 40][1]  # the 41st pair's first header: 80 pairs sit behind it
    overwrite_at(data / "shard-00001.tar", data / "shard-00001.tar", head + 20, b"\xff" * 100)
    long_caption = "a cheesy pizza with " + "melted cheese and more cheese " * 40
    write_shard(
        data / "shard-00002.tar",
        ["homemade pizza in a box", long_caption, "a sliced pizza on a board"],
        images=[dds_bytes(), png_bytes((200, 100, 0)), png_bytes((190, 90, 10))],
        ext="jpg",
    )
    cfg = get_meta_cfg_default()
    cfg.MODEL.BACKBONE, cfg.MODEL.DEVICE = "GRAM-Test-Tiny", "cpu"
    cfg.CHC.OUTPUT_DIR = str(tmp_path / "out")
    cfg.CHC.INPUT.SHARDS = [str(data / "shard-*.tar")]
    cfg.CHC.TOPICS.MIN_CLUSTER_SIZE, cfg.CHC.TOPICS.PLOT_POINTS = 10, 0
    cfg.CHC.DOMAINS.MIN_PER_DOMAIN = 3
    out = run_chc(cfg, show_progress=False)
    report = json.loads((out / "chc_report.json").read_text())
    c = report["counts"]
    assert c["pairs_seen"] == 120 + 40 + 3 and c["corrupt_shards"] == 1 and c["corrupt_shards_cut_short"] == 0
    assert abs(c["pairs_lost_in_corrupt_shards_estimate"] - 80) <= 8  # estimated from the bytes not read
    assert c["unreadable_images"] == 1 and c["captions_cut_to_max_chars"] == 1
    rows = {(r["stage"], r["reason"]): r["count"] for r in report["skipped_input"]}
    assert rows[("image_features", "unreadable image: NotImplementedError")] == 1
    assert rows[("index", "corrupt shard (listed below)")] == 1
    assert report["damaged_inputs"][0]["source"].endswith("shard-00001.tar")
    assert report["damaged_inputs"][0]["offset"] == head
    md = (out / "chc_report.md").read_text()
    assert "## Skipped input" in md and "| image_features | unreadable image: NotImplementedError | 1 |" in md
    assert "shard-00001.tar: member iteration ended before the end-of-archive marker" in md
    uniq = json.loads((out / "text" / "unique_captions.json").read_text())
    assert max(map(len, uniq)) <= cfg.CHC.TEXT.MAX_CAPTION_CHARS
    h = load_hierarchy(out)
    assert len(h.topic_names) >= 2 and (h.item_topic >= 0).sum() > 100
    before = (out / "item_topic.npy").stat().st_mtime_ns
    run_chc(cfg, show_progress=False)
    assert (out / "item_topic.npy").stat().st_mtime_ns == before


def test_new_input_keys_keep_cached_index_fingerprints():
    """MAX_UNREADABLE_FRACTION is a check, MAX_FIELD_CHARS at its default was the old behaviour: neither
    may invalidate an index cached before they existed (the image features, weeks of CPU, hang on it)."""
    from meta.chc.pipeline import index_settings
    from meta.config import get_meta_cfg_default

    inp = get_meta_cfg_default().CHC.INPUT
    assert "MAX_UNREADABLE_FRACTION" not in index_settings(inp) and "MAX_FIELD_CHARS" not in index_settings(inp)
    inp.MAX_UNREADABLE_FRACTION = 1.0
    assert "MAX_UNREADABLE_FRACTION" not in index_settings(inp)
    inp.MAX_FIELD_CHARS = 500
    assert index_settings(inp)["MAX_FIELD_CHARS"] == 500
