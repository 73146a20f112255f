"""Hostile inputs to the meta-training input side, through the commands a user runs (``python -m meta cluster``,
``python -m meta train`` on a labelled folder), plus small unit checks of the rules behind them:

* captions without one visible character (zero-width space / joiners, word joiner, BOM, bidi controls, marks
  alone, soft hyphen, Hangul filler, braille blank, tag characters) are empty captions, skipped and counted;
* 0-byte images are counted by reason (``empty file (0 bytes)``) and named; an image-folder class none of whose
  images can be read is a one-line error naming the class (not a task-size error);
* a manifest row repeating an image with another caption is counted and its rule reported;
* a UTF-16 / UTF-32 manifest is a one-line hint, invalid UTF-8 is listed with its file and byte offset, a
  compressed shard is named as such alone and beside good shards (then also in one warning on stderr).

One CHC run (a module fixture, a few seconds) carries every counted case; the refusals stop before any image is read.
"""

import bz2
import codecs
import gzip
import io
import json
import logging
import lzma

import pytest
from helpers import one_error_line, tiny_chc_args, tiny_meta_opts, tiny_task_opts
from helpers_chc import member_offsets, png_bytes, write_shard

from meta.chc.report import _issue_line
from meta.chc.sources import compression_problem, scan_tar, visible

# one caption per kind of invisible text (11 kinds), some with whitespace around them
INVISIBLE = [
    "\u200b\u200b",  # zero-width space
    "\u200c \u200d",  # zero-width non-joiner, joiner
    "\u2060",  # word joiner
    "\ufeff",  # BOM inside a line
    "\u202e\u202c\u2066\u2069",  # bidi override, pop, isolates
    "\u0301\u0308",  # combining marks alone
    "\u00ad\u00ad",  # soft hyphens
    "\u3164 \u115f\u1160\uffa0",  # Hangul fillers
    "\u2800\u2800",  # braille blank
    "\U000e0041\U000e0042\U000e007f",  # tag characters
    " \t\u3000\u00a0 ",  # whitespace only (ideographic and no-break spaces)
]
KEPT = "\u200ba cheesy pizza\u200d"  # zero-width characters around real words: a caption


def _main(argv) -> int:
    from meta.__main__ import main

    return main(argv)


def _cluster(out, *opts) -> int:
    return _main(["cluster", *tiny_chc_args(out, *opts)])


def _gzip_tar(path):
    """A shard of two pairs, gzip-compressed, written to ``path`` (named ``.tar``)."""
    plain = write_shard(path.with_suffix(".plain"), ["a red square", "a blue square"])
    path.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    return path


# ---------------------------------------------------------------- the rules, small
def test_visible_is_a_unicode_category_rule():
    assert not any(visible(c) for c in INVISIBLE) and not visible("")
    for text in (KEPT, "7", "...", "\U0001f355", "cafe\u0301", "\u72d7", "\u1100\u1161"):  # digits, emoji, CJK, jamo
        assert visible(text), ascii(text)


def test_compressed_shards_are_named_by_their_magic(tmp_path):
    plain = write_shard(tmp_path / "s.tar", ["a red square"]).read_bytes()
    for packed, name in ((gzip.compress(plain), "gzip"), (bz2.compress(plain), "bzip2"), (lzma.compress(plain), "xz")):
        assert compression_problem(packed[:6]).startswith(f"{name}-compressed: decompress it")
    assert compression_problem(plain[:6]) == ""


def test_shard_captions_invisible_or_not_utf8_are_counted_and_located(tmp_path):
    caps = ["a red square", INVISIBLE[0], "caf\u00e9", INVISIBLE[9], "a blue square"]
    path = write_shard(tmp_path / "s.tar", caps, caption_bytes={2: b"caf\xe9 au lait"})
    counts, issues = {}, []
    records = scan_tar(str(path), counts, issues)
    assert [r[3] for r in records] == ["a red square", "caf\ufffd au lait", "a blue square"]
    assert counts["skipped_empty_caption"] == 2 and counts["invalid_utf8_replaced"] == 1
    data_at = next(m[2] for m in member_offsets(path) if m[0] == "0002.txt")
    assert issues == [
        {
            "source": str(path),
            "problem": "caption not valid UTF-8 (decoded with replacement characters)",
            "rows": 1,
            "keys": ["0002"],
            "offsets": [data_at + 3],  # 'caf' then the bad byte
        }
    ]
    assert _issue_line(issues[0]).endswith(f"key(s) 0002 (byte offset(s) {data_at + 3})")


# ---------------------------------------------------------------- refusals through `python -m meta cluster`
@pytest.mark.parametrize(
    "encoding, bom, name",
    [
        ("utf-16-le", codecs.BOM_UTF16_LE, "UTF-16"),
        ("utf-16-be", codecs.BOM_UTF16_BE, "UTF-16"),
        ("utf-32-le", codecs.BOM_UTF32_LE, "UTF-32"),
    ],
)
@pytest.mark.parametrize("ext", ["csv", "jsonl"])
def test_a_utf16_or_utf32_manifest_is_one_line_saying_save_as_utf8(tmp_path, capsys, encoding, bom, name, ext):
    (tmp_path / "a.png").write_bytes(png_bytes())
    text = "image,caption\na.png,a red square\n" if ext == "csv" else '{"image": "a.png", "caption": "a red"}\n'
    manifest = tmp_path / f"m.{ext}"
    manifest.write_bytes(bom + text.encode(encoding))
    assert _cluster(tmp_path / "out", "CHC.INPUT.MANIFEST", str(manifest)) == 2
    line = one_error_line(capsys)
    assert line == f"error: CHC.INPUT.MANIFEST: {manifest}: {name} (byte-order mark found): save as UTF-8"


def test_a_gzip_file_named_tar_alone_is_one_line_naming_the_compression(tmp_path, capsys):
    only = _gzip_tar(tmp_path / "only.tar")
    assert _cluster(tmp_path / "out", "CHC.INPUT.SHARDS", f"['{only}']") == 2
    line = one_error_line(capsys, "CHC.INPUT.SHARDS", "corrupt_shards 1")
    assert line.endswith(
        f"first problem: {only}: gzip-compressed: decompress it (shards are read as plain .tar, by byte offset)"
    )


def test_a_manifest_of_invisible_captions_has_no_usable_pair(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(png_bytes())
    rows = [json.dumps({"image": "a.png", "caption": c}) for c in INVISIBLE]
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert _cluster(tmp_path / "out", "CHC.INPUT.MANIFEST", str(tmp_path / "m.jsonl")) == 2
    one_error_line(capsys, "no usable image-text pair (11 seen; skipped_empty_caption 11)")


# ---------------------------------------------------------------- one run that goes on: counted and named
@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """``python -m meta cluster`` over a good shard beside a gzip one named ``.tar``, and a manifest holding the 11
    invisible captions, an image named twice with two captions, a 0-byte image and a caption with a bad byte."""
    from gram_tools.synthetic import write_synthetic_shards

    root = tmp_path_factory.mktemp("hostile_chc")
    data = root / "data"
    write_synthetic_shards(
        data, n_pairs=60, topics=["pizza", "dog", "car"], n_shards=1, corrupt_fraction=0.0, empty_caption_fraction=0.0
    )
    gz = _gzip_tar(data / "shard-zz.tar")
    for name in ("inv", "x", "y", "z"):
        (root / f"{name}.png").write_bytes(png_bytes((200, 60, 10)))
    (root / "zero.png").write_bytes(b"")
    raw = b"image,caption\n" + b"".join(f"inv.png,{c}\n".encode() for c in INVISIBLE)
    raw += "x.png,a cheesy pizza in a box\nx.png,a sliced pizza on a board\n".encode()
    raw += f"z.png,{KEPT}\nzero.png,a pizza nobody saved\n".encode()
    bad_at = len(raw) + len(b"y.png,caf")
    raw += b"y.png,caf\xe9 pizza\n"
    (root / "m.csv").write_bytes(raw)
    err = io.StringIO()
    handler = logging.StreamHandler(err)  # outside pytest the CLI's logging.basicConfig writes warnings to stderr
    logging.getLogger("meta").addHandler(handler)
    try:
        code = _cluster(
            root / "out",
            "CHC.INPUT.SHARDS",
            f"['{data}/shard-*.tar']",
            "CHC.INPUT.MANIFEST",
            str(root / "m.csv"),
            "CHC.TOPICS.MIN_CLUSTER_SIZE",
            "5",
            "CHC.TOPICS.PLOT_POINTS",
            "0",
            "CHC.DOMAINS.MIN_PER_DOMAIN",
            "2",
        )
    finally:
        logging.getLogger("meta").removeHandler(handler)
    report = json.loads((root / "out" / "chc_report.json").read_text()) if code == 0 else {}
    return {"code": code, "log": err.getvalue(), "report": report, "gz": gz, "root": root, "bad_at": bad_at}


def test_the_run_finishes_and_names_the_gzip_shard_in_one_warning(hostile_run):
    assert hostile_run["code"] == 0, hostile_run["log"][-2000:]
    named = [line for line in hostile_run["log"].splitlines() if "CHC.INPUT.SHARDS" in line]
    assert len(named) == 1, hostile_run["log"]
    assert named[0] == (
        "CHC.INPUT.SHARDS: 1 of 2 shard(s) unreadable or damaged (counted in chc_report.md), "
        f"e.g. {hostile_run['gz']}: gzip-compressed: decompress it (shards are read as plain .tar, by byte offset)"
    )
    assert hostile_run["report"]["counts"]["corrupt_shards"] == 1


def test_invisible_captions_are_counted_as_empty_and_real_ones_kept(hostile_run):
    report, out = hostile_run["report"], hostile_run["root"] / "out"
    c = report["counts"]
    assert c["skipped_empty_caption"] == len(INVISIBLE) == 11
    assert c["pairs_seen"] == 60 + 16 and c["pairs_indexed"] == 60 + 5
    captions = [json.loads(line)[2] for line in (out / "index" / "items.jsonl").read_text().splitlines()]
    assert KEPT in captions and not [cap for cap in captions if not visible(cap)]
    rows = {r["reason"]: (r["count"], r["action"]) for r in report["skipped_input"]}
    assert rows["empty caption (no visible character: blank, zero-width, marks alone)"] == (11, "pair skipped")


def test_an_image_named_twice_and_a_zero_byte_image_are_counted_with_their_rule(hostile_run):
    report = hostile_run["report"]
    assert report["counts"]["rows_repeating_an_image"] == 1
    rows = {r["reason"]: (r["count"], r["action"]) for r in report["skipped_input"]}
    assert rows["manifest row naming an image path an earlier row named, with another caption"] == (
        1,
        "kept: each distinct caption of an image is its own pair (exact repeats skipped)",
    )
    assert rows["unreadable image: empty file (0 bytes)"] == (1, "pair not clustered")
    md = (hostile_run["root"] / "out" / "chc_report.md").read_text()
    assert "| index | manifest row naming an image path an earlier row named, with another caption | 1 |" in md


def test_invalid_utf8_is_listed_with_file_line_and_byte_offset(hostile_run):
    manifest = str(hostile_run["root"] / "m.csv")
    entry = next(e for e in hostile_run["report"]["damaged_inputs"] if e["source"] == manifest)
    assert entry["problem"] == "invalid UTF-8 (decoded with replacement characters)"
    assert entry["lines"] == [17] and entry["offsets"] == [hostile_run["bad_at"]]
    md = (hostile_run["root"] / "out" / "chc_report.md").read_text()
    line = f"- {manifest}: invalid UTF-8 (decoded with replacement characters): 1 row(s), line(s) 17"
    assert f"{line} (byte offset(s) {hostile_run['bad_at']})" in md
    assert f"- {hostile_run['gz']}: gzip-compressed: decompress it" in md


# ---------------------------------------------------------------- `python -m meta train` on a labelled folder
def _folder(root, layout: dict):
    """``root/<class>/`` with ``layout[class] = (readable, empty)`` PNG files: ``<k>.png`` and 0-byte ``z<k>.png``."""
    for c, (name, (good, empty)) in enumerate(layout.items()):
        (root / name).mkdir(parents=True)
        for k in range(good):
            (root / name / f"{k}.png").write_bytes(png_bytes((70 * k, 100 * c, 90)))
        for k in range(empty):
            (root / name / f"z{k}.png").write_bytes(b"")
    return root


def _train_on(root, out) -> int:
    opts = ["TASKS.SOURCE", "image_folder", "TASKS.IMAGE_FOLDER", str(root), "CHC.DOMAINS.NUM", "1"]
    return _main(["train", "--output-dir", str(out), *tiny_meta_opts(*opts, "CHC.DOMAINS.MIN_PER_DOMAIN", "1")])


def test_a_class_of_unreadable_images_is_named_not_blamed_on_k_way(tmp_path, capsys):
    root = _folder(tmp_path / "data", {"apple": (3, 0), "bridge": (3, 1), "cherry": (0, 3)})
    assert _train_on(root, tmp_path / "run") == 2
    line = one_error_line(capsys)
    assert line == (
        "error: TASKS.IMAGE_FOLDER: class 'cherry': none of its 3 images can be read (empty file (0 bytes) 3), "
        f"e.g. {root / 'cherry' / 'z0.png'}; repair or remove the folder {root / 'cherry'}"
    )


def test_unreadable_images_of_a_folder_are_counted_and_named_before_the_task_sizes(tmp_path, capsys, caplog):
    root = _folder(tmp_path / "data", {"apple": (3, 2), "bridge": (3, 0), "cherry": (3, 0)})
    assert _train_on(root, tmp_path / "run") == 2  # K_WAY 5 of 3 classes: the error the run ends in
    one_error_line(capsys, "TASKS.K_WAY")
    warned = [r.getMessage() for r in caplog.records if r.name == "meta.chc.image_folder"]
    assert warned == [
        f"TASKS.IMAGE_FOLDER: 2 of 11 images unreadable (empty file (0 bytes) 2), left out; e.g. "
        f"{root / 'apple' / 'z0.png'} (empty file (0 bytes))"
    ]


def test_a_run_on_a_folder_with_unreadable_images_records_them_in_run_json(tmp_path):
    root = _folder(
        tmp_path / "data", {name: (4, int(name == "bridge")) for name in ("apple", "bridge", "cherry", "dune")}
    )
    out = tmp_path / "run"
    opts = ["TASKS.SOURCE", "image_folder", "TASKS.IMAGE_FOLDER", str(root), "CHC.DOMAINS.NUM", "1"]
    opts += ["CHC.DOMAINS.MIN_PER_DOMAIN", "1", "META.STEPS", "1", "META.CHECKPOINT_EVERY", "1"]
    opts += tiny_task_opts(meta_batch=1, way=2, support=1, query=1, val_fraction=0.25)
    assert _main(["train", "--output-dir", str(out), *tiny_meta_opts(*opts)]) == 0
    summary = json.loads((out / "run.json").read_text())["hierarchy"]
    assert summary["source"] == "image_folder" and summary["num_items"] == 17
    assert summary["unreadable_by_reason"] == {"empty file (0 bytes)": 1}
    assert summary["unreadable_example"] == f"{root / 'bridge' / 'z0.png'} (empty file (0 bytes))"
    assert summary["counts"]["images"] == 17 and summary["counts"]["unreadable_images"] == 1, summary["counts"]
