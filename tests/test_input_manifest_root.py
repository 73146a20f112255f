"""The manifest data-root rule (meta.chc.sources): image paths resolving outside CHC.INPUT.IMAGE_ROOT (or the
manifest's folder) are skipped and counted as ``skipped_outside_root`` unless CHC.INPUT.ALLOW_OUTSIDE_ROOT."""

import os

import pytest
from helpers_chc import png_bytes

from meta.chc.errors import InputError
from meta.chc.sources import OUTSIDE_ROOT_PROBLEM, build_index, scan_manifest


@pytest.fixture
def tree(tmp_path):
    """data/ (manifest folder = data root) with images and links; outside/ next to it."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "img").mkdir(parents=True)
    outside.mkdir()
    for name, rgb in (("a", (200, 0, 0)), ("b", (0, 200, 0)), ("c", (0, 0, 200))):
        (data / "img" / f"{name}.png").write_bytes(png_bytes(rgb))
    (outside / "secret.png").write_bytes(png_bytes((9, 9, 9)))
    (outside / "secret2.png").write_bytes(png_bytes((8, 8, 8)))
    os.symlink(outside / "secret.png", data / "link.png")  # a file link pointing out of the root
    os.symlink(outside, data / "linkdir", target_is_directory=True)  # a folder link pointing out
    os.symlink(data / "img" / "a.png", data / "inlink.png")  # a link that stays inside
    rows = [
        ("img/a.png", "inside relative"),  # line 2
        ("../outside/secret.png", "climbs out with dots"),  # line 3
        (str(outside / "secret.png"), "absolute outside"),  # line 4
        (str(data / "img" / "b.png"), "absolute inside"),  # line 5
        ("link.png", "file link out"),  # line 6
        ("linkdir/secret2.png", "folder link out"),  # line 7
        ("img/../img/c.png", "dots that stay inside"),  # line 8
        ("inlink.png", "link that stays inside"),  # line 9
    ]
    (data / "m.csv").write_text("image,caption\n" + "".join(f"{p},{c}\n" for p, c in rows))
    return data, outside


def test_rows_outside_the_data_root_are_skipped_and_counted_by_default(tree):
    data, _ = tree
    counts, issues = {}, []
    records = scan_manifest(str(data / "m.csv"), "image", "caption", "", counts, issues)
    assert [r[2] for r in records] == [
        "inside relative",
        "absolute inside",
        "dots that stay inside",
        "link that stays inside",
    ]
    assert counts["skipped_outside_root"] == 4 and counts["pairs_seen"] == 8
    problem = [i for i in issues if i["problem"] == OUTSIDE_ROOT_PROBLEM]
    assert len(problem) == 1 and problem[0]["rows"] == 4 and problem[0]["lines"] == [3, 4, 6, 7]
    assert "CHC.INPUT.ALLOW_OUTSIDE_ROOT" in OUTSIDE_ROOT_PROBLEM and "CHC.INPUT.IMAGE_ROOT" in OUTSIDE_ROOT_PROBLEM
    index = build_index(manifest=str(data / "m.csv"), show_progress=False)
    assert len(index) == 4 and index.counts["skipped_outside_root"] == 4
    assert index.read_image_bytes(range(4))[0] == png_bytes((200, 0, 0))


def test_rows_outside_the_root_are_read_when_the_key_allows_them(tree):
    data, outside = tree
    counts, issues = {}, []
    records = scan_manifest(str(data / "m.csv"), "image", "caption", "", counts, issues, allow_outside_root=True)
    assert len(records) == 8 and "skipped_outside_root" not in counts
    assert not [i for i in issues if i["problem"] == OUTSIDE_ROOT_PROBLEM]
    index = build_index(manifest=str(data / "m.csv"), show_progress=False, allow_outside_root=True)
    blobs = index.read_image_bytes(range(len(index)))
    assert index.captions[2] == "absolute outside" and blobs[2] == (outside / "secret.png").read_bytes()
    assert index.captions[5] == "folder link out" and blobs[5] == (outside / "secret2.png").read_bytes()


def test_explicit_image_root_is_the_data_root_and_may_itself_be_a_link(tree, tmp_path):
    data, _ = tree
    os.symlink(data, tmp_path / "root_link", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    manifest = tmp_path / "elsewhere" / "m.jsonl"
    manifest.write_text(
        '{"image": "img/a.png", "caption": "in the root"}\n'
        '{"image": "../elsewhere/m.jsonl", "caption": "the manifest itself, outside IMAGE_ROOT"}\n'
        f'{{"image": "{data / "img" / "b.png"}", "caption": "absolute path through the real folder"}}\n'
    )
    counts = {}
    records = scan_manifest(str(manifest), "image", "caption", str(tmp_path / "root_link"), counts)
    assert [r[2] for r in records] == ["in the root", "absolute path through the real folder"]
    assert counts["skipped_outside_root"] == 1


def test_a_manifest_with_only_outside_rows_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.csv").write_text("image,caption\n../a.png,a red square\n")
    with pytest.raises(InputError) as err:
        build_index(manifest=str(tmp_path / "sub" / "m.csv"), show_progress=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"CHC.INPUT.MANIFEST: {tmp_path / 'sub' / 'm.csv'}: no usable")
    assert "skipped_outside_root 1" in msg and "CHC.INPUT.ALLOW_OUTSIDE_ROOT True reads it" in msg
    assert len(build_index(manifest=str(tmp_path / "sub" / "m.csv"), show_progress=False, allow_outside_root=True)) == 1


def test_allow_outside_root_key_defaults_off_and_is_checked():
    from meta.chc.settings import check_chc_cfg
    from meta.config import get_meta_cfg_default, load_meta_cfg
    from meta.infra.cli_errors import UserError

    cfg = get_meta_cfg_default()
    assert cfg.CHC.INPUT.ALLOW_OUTSIDE_ROOT is False
    assert load_meta_cfg("", ["CHC.INPUT.ALLOW_OUTSIDE_ROOT", "True"]).CHC.INPUT.ALLOW_OUTSIDE_ROOT is True
    cfg.CHC.INPUT.ALLOW_OUTSIDE_ROOT = "yes"
    with pytest.raises(UserError, match=r"^CHC.INPUT.ALLOW_OUTSIDE_ROOT: expected True or False, got 'yes'$"):
        check_chc_cfg(cfg)
