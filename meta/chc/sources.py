"""Readers for image-text pairs: webdataset ``.tar`` shards and CSV/TSV/JSONL manifests.

Reading builds a :class:`PairIndex`: one row per pair with an image and a non-empty caption, holding where the image
bytes live (shard + byte offset + size, or a file path); images are decoded (and unreadable ones counted) by the
image-feature stage.  Shards follow the webdataset convention: members ``<key>.<ext>``, ``key`` the member path up
to the first dot of its file name; images ``jpg|jpeg|png|webp``, captions ``txt``, metadata ``json`` (kept
verbatim, never used for clustering).

Bad input never stops the scan: every skip is counted by reason (``counts``), damaged files are listed in
``issues``; the rules for sizes, long lines, special files, the data root, invisible captions, repeated rows,
encodings and compressed shards are in docs/input_rules.md.  The others:

* a shard that cannot be opened, is cut inside a member, or whose member iteration ends before its end-of-archive
  marker (``tarfile`` stops silently at a bad later header) is a ``corrupt_shards``: the pairs read before the
  damage are kept, a pair it left incomplete is ``skipped_lost_in_corrupt_shard``, the bytes not read are reported
  with an estimate of the pairs they held; a file ending inside the archive is also ``corrupt_shards_cut_short``;
* a key repeated in one shard: its first group with an image and a non-empty caption is the pair
  (:func:`_member_group`), the other groups are ``skipped_duplicate_key``;
* a manifest row that is not a JSON object (or nested deeper than ``meta.infra.fileio.MAX_NESTING``) is
  ``skipped_invalid_row``; a caption or image value that is not text is ``skipped_non_text_caption`` /
  ``skipped_non_text_image``;
* a CSV field longer than ``CHC.INPUT.MAX_FIELD_CHARS`` is a one-line error naming the file and line.
"""

from __future__ import annotations

import codecs
import csv
import glob
import json
import logging
import os
import re
import stat
import tarfile
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional, Sequence

import numpy as np

from meta.chc.errors import InputError
from meta.data.input_limits import MAX_FIELD_CHARS, MAX_IMAGE_BYTES  # caps: docs/input_rules.md
from meta.infra.fileio import atomic_path, parse_json, write_text_atomic

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MAX_ISSUE_LINES = 5  # line numbers (manifests) or keys (shards) kept per problem in ``issues``
KIND_TAR, KIND_FILE = 0, 1
MIN_ITEMS_PER_READ_THREAD = 16  # a shorter run is read by fewer threads (a thread per handful of images costs more)
EMPTY_FILE = "empty file (0 bytes)"  # the unreadable-image reason of a 0-byte file or tar member
BLANK_GLYPHS = frozenset("\u115f\u1160\u3164\uffa0\u2800")  # Hangul fillers, braille blank: drawn as nothing
WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"))
WIDE_BOMS += ((codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))  # UTF-32 LE first: it starts FF FE
COMPRESSED_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))

log = logging.getLogger(__name__)


def visible(text: str) -> bool:
    """True when ``text`` holds a character drawn as something: a letter, digit, punctuation mark or symbol
    (Unicode categories L, N, P, S) other than :data:`BLANK_GLYPHS`.  Format characters (Cf: zero-width space,
    joiners, word joiner, BOM, bidi controls, soft hyphen, tag characters), marks alone (M), separators (Z),
    controls and private-use characters (C) are not."""
    return any(unicodedata.category(ch)[0] in "LNPS" and ch not in BLANK_GLYPHS for ch in text)


def wide_bom_error(path: str, head: bytes) -> str:
    """The one-line error of a manifest starting (``head``) with a UTF-16 / UTF-32 byte-order mark, else ``""``."""
    name = next((name for bom, name in WIDE_BOMS if head.startswith(bom)), "")
    return f"CHC.INPUT.MANIFEST: {path}: {name} (byte-order mark found): save as UTF-8" if name else ""


def compression_problem(head: bytes) -> str:
    """Why a shard whose first bytes are ``head`` is no tar file when it is compressed (``"gzip-compressed: ..."``),
    else ``""``.  Image bytes are read from shards by byte offset, so a shard must be a plain tar."""
    name = next((name for magic, name in COMPRESSED_MAGIC if head.startswith(magic)), "")
    return f"{name}-compressed: decompress it (shards are read as plain .tar, by byte offset)" if name else ""


# the PairIndex arrays saved in items.npz (besides the optional item_file_stamp)
_ARRAY_FIELDS = ("source_kind", "item_source", "item_offset", "item_size")


@dataclass
class PairIndex:
    """Where each of the N pairs lives.

    Attributes:
        sources: [S] shard paths (tar) or manifest paths, as strings.
        source_kind: [S] int8, 0 = tar shard, 1 = manifest (image files on disk).
        item_source: [N] int32 index into ``sources``.
        item_offset: [N] int64 byte offset of the image data inside its tar (-1 for files).
        item_size: [N] int64 image byte count inside its tar (-1 for files).
        item_key: [N] pair keys (tar member stem, or manifest row number as text).
        item_path: [N] image file paths for manifest pairs ("" for tar pairs).
        captions: [N] stripped caption strings.
        meta_json: [N] raw ``<key>.json`` text ("" if absent).
        counts: pairs seen / skipped, by reason.
        issues: damaged inputs, one dict each (``source``, ``problem``, and for shards
            ``offset`` where reading stopped, ``bytes_unread``, ``pairs_read``).
        item_file_stamp: [N, 3] int64 :func:`file_stamp` of each manifest image file when the
            index was built (kind, bytes, mtime ns; zeros for tar pairs); ``None`` without a
            manifest, and for an index saved before stamps were recorded.
        special_files: ``[path, kind, bytes, mtime ns]`` of the manifest image paths skipped
            as not regular files.
    """

    sources: list
    source_kind: np.ndarray
    item_source: np.ndarray
    item_offset: np.ndarray
    item_size: np.ndarray
    item_key: list
    item_path: list
    captions: list
    meta_json: list
    counts: dict = field(default_factory=dict)
    issues: list = field(default_factory=list)
    item_file_stamp: Optional[np.ndarray] = None
    special_files: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.captions)

    # ---------------------------------------------------------------- what the index read
    def file_items(self) -> np.ndarray:
        """int64 indices of the pairs whose image is a file named by a manifest."""
        return np.flatnonzero(self.source_kind[self.item_source] == KIND_FILE).astype(np.int64)

    def recorded_file_stamps(self) -> Optional[np.ndarray]:
        """int64 ``[F + S, 3]``: the stamps of the F manifest image files and S skipped special
        files as recorded when the index was built; ``None`` for an index without stamps."""
        if self.item_file_stamp is None:
            return None
        special = np.asarray([row[1:] for row in self.special_files], dtype=np.int64).reshape(-1, 3)
        return np.concatenate([np.asarray(self.item_file_stamp, dtype=np.int64)[self.file_items()], special])

    def current_file_stamps(self) -> np.ndarray:
        """int64 ``[F + S, 3]``: the same files stamped now (one ``os.stat`` each, none opened)."""
        paths = [self.item_path[int(i)] for i in self.file_items()] + [row[0] for row in self.special_files]
        return np.asarray([file_stamp(p) for p in paths], dtype=np.int64).reshape(-1, 3)

    # ---------------------------------------------------------------- persistence
    def save(self, directory: Path) -> None:
        """The three files :meth:`load` reads, each written atomically (:func:`meta.infra.fileio.atomic_path`)."""
        directory = Path(directory)
        with atomic_path(directory / "items.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for key, path, cap, mj in zip(self.item_key, self.item_path, self.captions, self.meta_json):
                fh.write(json.dumps([key, path, cap, mj], ensure_ascii=False) + "\n")
        arrays = {name: getattr(self, name) for name in _ARRAY_FIELDS}
        stamps = {} if self.item_file_stamp is None else {"item_file_stamp": self.item_file_stamp}
        with atomic_path(directory / "items.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays, **stamps)
        head = {name: getattr(self, name) for name in ("sources", "counts", "issues", "special_files")}
        write_text_atomic(directory / "sources.json", json.dumps(head, indent=1))

    @classmethod
    def load(cls, directory: Path) -> "PairIndex":
        directory = Path(directory)
        head = json.loads((directory / "sources.json").read_text())
        arrays = np.load(directory / "items.npz")
        keys, paths, caps, metas = [], [], [], []
        with open(directory / "items.jsonl", encoding="utf-8") as fh:
            for line in fh:
                k, p, c, m = json.loads(line)
                keys.append(k), paths.append(p), caps.append(c), metas.append(m)
        fields = {"sources": head["sources"], **{name: arrays[name] for name in _ARRAY_FIELDS}}
        fields.update(item_key=keys, item_path=paths, captions=caps, meta_json=metas, counts=head["counts"])
        stamp = arrays["item_file_stamp"] if "item_file_stamp" in arrays.files else None
        issues, special = head.get("issues", []), head.get("special_files", [])
        return cls(**fields, issues=issues, item_file_stamp=stamp, special_files=special)

    # ---------------------------------------------------------------- reading bytes
    def read_image_bytes(
        self, indices: Iterable[int], reasons: Optional[list] = None, max_bytes: int = MAX_IMAGE_BYTES, threads: int = 1
    ) -> list:
        """Raw image bytes of ``indices`` in order; ``None`` where the file cannot be read.

        ``reasons``, if given, receives one string per index: ``""`` when read, else why not (``FileNotFoundError``,
        ``short read``, :func:`too_large_reason` over ``max_bytes``, ...).  ``threads`` > 1
        (``CHC.IMAGES.READ_THREADS``) reads that many contiguous runs side by side, each with its own handles (faster
        on network file systems and cold disks); the result is the same as with one thread.
        """
        indices = [int(i) for i in indices]
        threads = max(1, min(int(threads), len(indices) // MIN_ITEMS_PER_READ_THREAD))
        if threads == 1:
            out, why = self._read_run(indices, max_bytes)
        else:
            step = -(-len(indices) // threads)
            runs = [indices[k : k + step] for k in range(0, len(indices), step)]
            with ThreadPoolExecutor(max_workers=len(runs)) as pool:
                parts = list(pool.map(lambda run: self._read_run(run, max_bytes), runs))
            out = [b for blobs, _ in parts for b in blobs]
            why = [w for _, whys in parts for w in whys]
        if reasons is not None:
            reasons.extend(why)
        return out

    def _read_run(self, indices: Sequence[int], max_bytes: int) -> tuple[list, list]:
        """``(bytes or None, reason)`` per index, read one after another with handles of its own."""
        out, reasons = [], []
        handles: dict = {}
        try:
            for i in indices:
                src = int(self.item_source[i])
                why = ""
                try:
                    if self.source_kind[src] == KIND_TAR and int(self.item_size[i]) > max_bytes:
                        data, why = None, too_large_reason(max_bytes)
                    elif self.source_kind[src] == KIND_TAR:
                        fh = handles.get(src)
                        if fh is None:
                            fh = handles[src] = open_regular(self.sources[src])  # never a FIFO or a device
                        fh.seek(int(self.item_offset[i]))
                        data = fh.read(int(self.item_size[i]))
                        if len(data) != int(self.item_size[i]):
                            data, why = None, "short read (shard changed or cut)"
                    else:
                        data = read_regular_file(self.item_path[i], max_bytes)
                    if data is not None and not data:
                        data, why = None, EMPTY_FILE
                except NotRegularFileError:
                    data, why = None, "not a regular file"
                except FileTooLargeError:
                    data, why = None, too_large_reason(max_bytes)
                except OSError as err:
                    data, why = None, type(err).__name__
                out.append(data)
                reasons.append(why)
        finally:
            for fh in handles.values():
                fh.close()
        return out, reasons

    def image_location(self, i: int) -> str:
        """Where pair ``i``'s image is read from: its file path, or ``shard.tar:<key>``."""
        src = int(self.item_source[int(i)])
        if self.source_kind[src] == KIND_TAR:
            return f"{self.sources[src]}:{self.item_key[int(i)]}"
        return self.item_path[int(i)]


# ------------------------------------------------------------------------ image files
STAMP_MISSING, STAMP_REGULAR, STAMP_SPECIAL = 0, 1, 2


def file_type(path: str) -> str:
    """``'regular file'``, ``'FIFO'``, ``'character device'``, ... of ``path`` (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        return type(err).__name__
    kinds = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"))
    kinds += ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def file_stamp(path: str) -> tuple[int, int, int]:
    """``(kind, size in bytes, mtime in ns)`` of ``path``, by ``os.stat`` (never opened); ``kind``:
    :data:`STAMP_REGULAR`, :data:`STAMP_SPECIAL` or :data:`STAMP_MISSING` (any ``OSError``; size and mtime -1)."""
    try:
        st = os.stat(path)
    except OSError:
        return STAMP_MISSING, -1, -1
    kind = STAMP_REGULAR if stat.S_ISREG(st.st_mode) else STAMP_SPECIAL
    return kind, int(st.st_size), int(st.st_mtime_ns)


def too_large_reason(max_bytes: int) -> str:
    """The unreadable-image reason for a file over the byte cap (one text per cap: reasons are counted)."""
    return f"file larger than {max_bytes} bytes"


def _check_regular(path: str, st: os.stat_result, max_bytes: Optional[int]) -> None:
    """Raise unless ``st`` (of ``path``) is a regular file of at most ``max_bytes`` bytes (``None``: any size)."""
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"{path}: not a regular file ({file_type(path)})")
    if max_bytes is not None and st.st_size > max_bytes:
        raise FileTooLargeError(f"{path}: expected an image file of at most {max_bytes} bytes, got {st.st_size}")


def open_regular(path: str, max_bytes: Optional[int] = None) -> BinaryIO:
    """``path`` opened for reading bytes, refusing anything but a regular file (of at most ``max_bytes`` bytes),
    without blocking: checked by ``os.stat`` before opening (``open()`` on a FIFO blocks; ``/dev/zero`` reads until
    memory runs out) and by ``fstat`` after.  Raises ``OSError``, :class:`NotRegularFileError` or
    :class:`FileTooLargeError`."""
    _check_regular(path, os.stat(path), max_bytes)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    fh = os.fdopen(fd, "rb")
    try:
        _check_regular(path, os.fstat(fd), max_bytes)
    except BaseException:
        fh.close()
        raise
    return fh


def read_regular_file(path: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of ``path`` through :func:`open_regular` (same refusals and errors); at most ``max_bytes + 1`` bytes
    are read (the file may grow meanwhile)."""
    with open_regular(path, max_bytes) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(f"{path}: expected an image file of at most {max_bytes} bytes, got more")
    return data


class NotRegularFileError(OSError):
    """A path names a FIFO, a device, a socket or a folder where an image file was expected."""


class FileTooLargeError(OSError):
    """An image file is larger than the byte cap (:data:`MAX_IMAGE_BYTES` by default); it is not read."""


# ------------------------------------------------------------------------ tar shards
def expand_shards(patterns: Sequence[str]) -> list:
    """Expand glob patterns / brace-free paths into a sorted, de-duplicated list of tar files."""
    found = []
    for pat in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pat)))
        if not matches:
            raise FileNotFoundError(f"CHC.INPUT.SHARDS: no file matches {pat!r}")
        found.extend(m for m in matches if m not in found)
    return found


def _split_member(name: str):
    """``'dir/000123.jpg'`` -> ``('dir/000123', 'jpg')`` (webdataset: stem up to the first dot)."""
    head, base = os.path.split(name)
    if "." not in base:
        return None, None
    stem, ext = base.split(".", 1)
    return (os.path.join(head, stem) if head else stem), ext.lower()


def _bump(counts: dict, key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def _clean_end(path: str, offset: int, size: int) -> bool:
    """True when bytes ``[offset, size)`` hold the end-of-archive marker (>= 2 zero blocks) and only zeros."""
    if size - offset < 2 * tarfile.BLOCKSIZE:
        return False
    with open(path, "rb") as fh:
        fh.seek(offset)
        for block in iter(lambda: fh.read(1 << 20), b""):
            if block.strip(b"\0"):
                return False
    return True


def _trailing_zeros(path: str, size: int) -> int:
    """Zero bytes at the end of the file (end-of-archive marker + record padding), up to 1 MiB."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read()
    except OSError:
        return 0
    return len(tail) - len(tail.rstrip(b"\0"))


def _decode_text(data: bytes, counts: dict) -> tuple[str, int]:
    """``(UTF-8 text, -1)``; invalid bytes become U+FFFD, counted in ``invalid_utf8_replaced``, and the second item
    is the offset of the first invalid byte in ``data``."""
    try:
        return data.decode("utf-8"), -1
    except UnicodeDecodeError as err:
        _bump(counts, "invalid_utf8_replaced")
        return data.decode("utf-8", errors="replace"), err.start


def _member_group(groups: dict, order: list, key: str, kind: Optional[str]) -> dict:
    """The member group of ``key`` a member of ``kind`` (image, txt, json or None = other) joins: the key's latest,
    unless that holds its kind already (``dup.png dup.txt dup.png dup.txt`` is two groups)."""
    found = groups.setdefault(key, [])
    if not found or (kind is not None and kind in found[-1]):
        found.append({})
        order.append((key, len(found) - 1))
    return found[-1]


def _first_complete(found: list) -> int:
    """Which of a key's member groups is its pair: the first with an image and a :func:`visible` caption (else 0)."""
    for number, g in enumerate(found):
        if "image" in g and visible(g.get("txt", "")):
            return number
    return 0


def _shard_issue(issues: Optional[list], path: str, problem: str, **found) -> None:
    """Append ``{"source", "problem", **found}`` for shard ``path`` to ``issues`` (when given)."""
    if issues is not None:
        issues.append({"source": os.path.abspath(path), "problem": problem, **found})


def scan_tar(path: str, counts: dict, issues: Optional[list] = None, max_text_bytes: int = MAX_FIELD_CHARS) -> list:
    """Records ``(key, offset, size, caption, meta_json)`` of one shard, in member order, under the module docstring's
    rules (``max_text_bytes``: ``CHC.INPUT.MAX_FIELD_CHARS``); a damaged shard appends ``{"source", "problem",
    "offset", "bytes_unread", "cut_short", "pairs_read"}`` to ``issues`` when given."""
    groups: dict = {}  # key -> its member groups, in order (more than one: a repeated key)
    order: list = []  # (key, group number) in the order groups were opened
    damage = None  # (byte offset where reading stopped, what was found there)
    bad_utf8: list = []  # (key, shard byte offset of the first invalid byte) of captions not valid UTF-8
    end = 0  # offset of the end-of-archive marker, when reached
    try:
        file_size = os.path.getsize(path)
    except OSError:
        file_size = 0
    tar = None
    try:
        handle = open_regular(path)
    except NotRegularFileError:
        _bump(counts, "shards_not_regular_file")
        _shard_issue(issues, path, f"shard is not a regular file ({file_type(path)}; never opened)")
        return []
    except OSError as err:
        damage = (0, f"cannot open as a tar file ({type(err).__name__}: {err})")
    else:
        try:
            tar = tarfile.open(fileobj=handle, mode="r:")
        except Exception as err:  # noqa: BLE001 - any failure to open is this shard's problem
            handle.seek(0)
            damage = (
                0,
                compression_problem(handle.read(6)) or f"cannot open as a tar file ({type(err).__name__}: {err})",
            )
            handle.close()
    if tar is not None:
        with handle, tar:
            while True:
                try:
                    member = tar.next()
                except Exception as err:  # noqa: BLE001
                    damage = (tar.offset, f"unreadable tar header ({type(err).__name__}: {err})")
                    break
                if member is None:  # tarfile also stops silently at a bad header after the first
                    end = tar.offset
                    if not _clean_end(path, tar.offset, file_size):
                        damage = (
                            tar.offset,
                            "member iteration ended before the end-of-archive marker (cut or overwritten header)",
                        )
                    break
                if member.offset_data + member.size > file_size:
                    damage = (member.offset, f"member {member.name} is cut short")
                    break
                if not member.isfile():
                    continue
                key, ext = _split_member(member.name)
                if key is None:
                    continue
                kind = "image" if ext in IMAGE_EXTS else ext if ext in ("txt", "json") else None
                g = _member_group(groups, order, key, kind)
                if kind == "image":
                    g["image"] = (member.offset_data, member.size)
                elif kind is not None and member.size > max_text_bytes:  # never read: a 2 GB "caption" eats memory
                    g[ext] = ""
                    g[f"{ext}_too_long"] = True
                elif kind is not None:
                    try:
                        fh = tar.extractfile(member)
                        data = fh.read() if fh is not None else b""
                    except Exception as err:  # noqa: BLE001
                        damage = (member.offset, f"member {member.name} unreadable ({type(err).__name__}: {err})")
                        break
                    g[ext], bad = _decode_text(data, counts) if ext == "txt" else (data.decode("utf-8", "replace"), -1)
                    if bad >= 0:
                        bad_utf8.append((key, member.offset_data + bad))
    _bump(counts, "shard_bytes_read", damage[0] if damage is not None else end)
    lost_key = None
    if damage is not None:
        zeros = _trailing_zeros(path, file_size)
        cut = zeros < 2 * tarfile.BLOCKSIZE  # no end-of-archive marker: the file itself was cut
        unread = max(0, file_size - zeros - damage[0])  # archive bytes after the damage, end padding excluded
        _bump(counts, "corrupt_shards")
        _bump(counts, "corrupt_shards_cut_short", int(cut))
        _bump(counts, "corrupt_shard_bytes_unread", unread)
        if order and not {"image", "txt"} <= groups[order[-1][0]][order[-1][1]].keys():
            lost_key = order[-1]  # its other member sat in the damaged part
        found = {"offset": int(damage[0]), "bytes_unread": int(unread), "cut_short": bool(cut)}
        _shard_issue(issues, path, damage[1], **found, pairs_read=len(order) - (lost_key is not None))
    chosen = {key: _first_complete(found) for key, found in groups.items()}
    repeated: list = []
    too_long: dict = {"txt": [], "json": []}  # keys whose caption / metadata member was over the cap
    records = []
    for key, number in order:
        g = groups[key][number]
        _bump(counts, "pairs_seen")
        if (key, number) == lost_key:
            _bump(counts, "skipped_lost_in_corrupt_shard")
            continue
        if number != chosen[key]:
            _bump(counts, "skipped_duplicate_key")
            repeated.append(key)
            continue
        caption = " ".join(g.get("txt", "").split())
        if "image" not in g:
            _bump(counts, "skipped_no_image")
            continue
        if g.get("txt_too_long"):
            _bump(counts, "skipped_caption_too_long")
            too_long["txt"].append(key)
            continue
        if not visible(caption):
            _bump(counts, "skipped_empty_caption")
            continue
        if g.get("json_too_long"):  # a pair kept without its metadata
            _bump(counts, "metadata_too_long_dropped")
            too_long["json"].append(key)
        records.append((key, g["image"][0], g["image"][1], caption, g.get("json", "")))
    if repeated:
        problem = "key repeated in the shard (the first complete pair kept, the other member groups skipped)"
        _shard_issue(issues, path, problem, rows=len(repeated), keys=list(dict.fromkeys(repeated))[:MAX_ISSUE_LINES])
    for ext, what in (("txt", "caption member larger than"), ("json", "metadata member larger than")):
        if too_long[ext]:
            problem = f"{what} CHC.INPUT.MAX_FIELD_CHARS={max_text_bytes} bytes (never read)"
            _shard_issue(issues, path, problem, rows=len(too_long[ext]), keys=too_long[ext][:MAX_ISSUE_LINES])
    if bad_utf8:
        keys, offsets = zip(*bad_utf8[:MAX_ISSUE_LINES])
        problem = "caption not valid UTF-8 (decoded with replacement characters)"
        _shard_issue(issues, path, problem, rows=len(bad_utf8), keys=list(keys), offsets=list(offsets))
    return records


# ------------------------------------------------------------------------ manifests


def _note(issues: Optional[list], path: str, problem: str, line: int, offset: Optional[int] = None) -> None:
    """Record ``problem`` at ``line`` of ``path`` (first few line numbers per problem, and the byte ``offset``s
    in the file when given)."""
    if issues is None:
        return
    entry = next((e for e in issues if e["source"] == path and e["problem"] == problem), None)
    if entry is None:
        entry = {"source": path, "problem": problem, "rows": 0, "lines": []}
        issues.append(entry)
    entry["rows"] += 1
    if len(entry["lines"]) < MAX_ISSUE_LINES:
        entry["lines"].append(line)
        if offset is not None:
            entry.setdefault("offsets", []).append(int(offset))


def max_line_bytes(max_field_chars: int) -> int:
    """Longest manifest line read (bytes): a field of ``max_field_chars`` characters at 4 UTF-8 bytes each, plus
    room for the row's other fields."""
    return 4 * int(max_field_chars) + 65536


def _raw_lines(fh, limit: int) -> Iterator[Optional[bytes]]:
    """Lines of a binary file; a line longer than ``limit`` bytes is skipped in 1 MiB steps, never held whole, and
    yields ``None`` (a 299 MiB JSON array on one line took 1.9 GiB to read and parse)."""
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit:
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = fh.readline(1 << 20)
        yield None


def _text_lines(fh, path: str, counts: dict, issues: Optional[list], limit: int) -> Iterator[Optional[str]]:
    """Decoded lines of a binary file: UTF-8 BOM dropped (UTF-16 / UTF-32 BOM: :func:`wide_bom_error`), invalid UTF-8
    replaced and counted (its byte offset noted); ``None`` for a line longer than ``limit`` bytes (not read:
    :func:`_raw_lines`)."""
    for lineno, raw in enumerate(_raw_lines(fh, limit), 1):
        if raw is None:
            yield None
            continue
        if lineno == 1 and wide_bom_error(path, raw):
            raise InputError(wide_bom_error(path, raw))
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            _bump(counts, "invalid_utf8_replaced")
            at = fh.tell() - len(raw) + err.start  # byte offset in the file
            _note(issues, path, "invalid UTF-8 (decoded with replacement characters)", lineno, at)
            text = raw.decode("utf-8", errors="replace")
        if "\r" in text.rstrip("\r\n"):  # old Mac line ends: split after a lone CR, as newline="" does
            yield from re.split(r"(?<=\r)(?!\n)", text)
        else:
            yield text


def _manifest_rows(path: str, counts: dict, issues: Optional[list], max_field_chars: int):
    """``(line, row)`` per data row; ``row`` is a dict, or ``None`` for a line that is not a JSON object.

    A line longer than :func:`max_line_bytes` is not read: in JSONL a row that is not an object, in CSV/TSV a
    one-line error."""
    ext = Path(path).suffix.lower()
    limit = max_line_bytes(max_field_chars)
    if ext in (".jsonl", ".json", ".ndjson"):
        with open(path, "rb") as fh:
            for lineno, line in enumerate(_text_lines(fh, path, counts, issues, limit), 1):
                if line is not None and not line.strip():
                    continue
                row, problem = None, f"line longer than {limit} bytes, not read (one JSON object per line?)"
                if line is not None:
                    try:
                        row = parse_json(line)
                        problem = "" if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
                    except json.JSONDecodeError as err:
                        problem = f"not JSON ({err.msg})"
                    except ValueError:  # nested deeper than meta.infra.fileio.MAX_NESTING
                        problem = "JSON nested too deep to read"
                if problem:
                    _note(issues, path, problem, lineno)
                yield lineno, None if problem else row
        return
    if ext not in (".csv", ".tsv", ".txt"):
        raise InputError(f"CHC.INPUT.MANIFEST: {path}: expected a .csv, .tsv or .jsonl file")
    delimiter = "\t" if ext in (".tsv", ".txt") else ","
    old_limit = csv.field_size_limit()
    csv.field_size_limit(max(int(max_field_chars), 1))  # process-wide: restored below
    try:

        def lines(fh) -> Iterator[str]:
            for lineno, line in enumerate(_text_lines(fh, path, counts, issues, limit), 1):
                if line is None:
                    raise InputError(
                        f"{path}:{lineno}: a line longer than {limit} bytes, not read: a field longer than "
                        f"CHC.INPUT.MAX_FIELD_CHARS={max_field_chars} characters, or not a CSV/TSV manifest?"
                    )
                yield line

        with open(path, "rb") as fh:
            reader = csv.DictReader(lines(fh), delimiter=delimiter)
            try:
                for row in reader:
                    yield reader.line_num, row
            except csv.Error as err:
                what = (
                    f"a field longer than CHC.INPUT.MAX_FIELD_CHARS={max_field_chars} characters (an unbalanced quote?)"
                    if "field limit" in str(err)
                    else str(err)
                )
                raise InputError(f"{path}:{reader.line_num + 1}: {what}") from None
    finally:
        csv.field_size_limit(old_limit)


OUTSIDE_ROOT_PROBLEM = (
    "image path outside the data root (CHC.INPUT.IMAGE_ROOT, '' = the manifest's folder; symlinks resolved); "
    "CHC.INPUT.ALLOW_OUTSIDE_ROOT True reads it"
)


class _DataRoot:
    """Whether image paths lie under one folder once symlinks are resolved; resolved folders are cached, so a row
    costs one ``lstat`` of its file name unless that name is itself a link."""

    def __init__(self, root: str):
        self.real = os.path.realpath(root)
        self.prefix = self.real if self.real.endswith(os.sep) else self.real + os.sep
        self._dirs: dict = {}

    def resolve(self, path: str) -> str:
        head, tail = os.path.split(path)
        if tail in ("", ".", ".."):
            return os.path.realpath(path)
        real_head = self._dirs.get(head)
        if real_head is None:
            real_head = self._dirs[head] = os.path.realpath(head)
        full = os.path.join(real_head, tail)
        return os.path.realpath(full) if os.path.islink(full) else full

    def holds(self, path: str) -> bool:
        real = self.resolve(path)
        return real == self.real or real.startswith(self.prefix)


def scan_manifest(
    path: str,
    image_column: str,
    caption_column: str,
    image_root: str,
    counts: dict,
    issues: Optional[list] = None,
    max_field_chars: int = MAX_FIELD_CHARS,
    special: Optional[list] = None,
    allow_outside_root: bool = False,
) -> list:
    """Records ``(key, path, caption, stamp)`` of a manifest (``stamp``: the image's :func:`file_stamp` when read);
    a missing column is a one-line error.  Skips follow the module docstring's rules, counted in ``counts`` with
    problem lines in ``issues``; a special file's ``[path, *stamp]`` goes to ``special`` when given, so a later run
    notices a replaced file; ``image_root`` ``""`` = the manifest's folder."""
    if not os.path.isfile(path):
        what = f"not a regular file ({file_type(path)})" if os.path.exists(path) else "no such file"
        raise FileNotFoundError(f"CHC.INPUT.MANIFEST: {what}: {path}")
    path = os.path.abspath(path)
    root = image_root or os.path.dirname(path)
    data_root = None if allow_outside_root else _DataRoot(root)
    records = []
    seen: set = set()
    images: set = set()
    checked = False
    for row_no, (lineno, row) in enumerate(_manifest_rows(path, counts, issues, max_field_chars)):
        _bump(counts, "pairs_seen")
        if row is None:
            _bump(counts, "skipped_invalid_row")
            continue
        if not checked:
            for col, key in ((image_column, "IMAGE_COLUMN"), (caption_column, "CAPTION_COLUMN")):
                if col not in row:
                    raise KeyError(
                        f"CHC.INPUT.{key}: column {col!r} not in {path} (columns: {', '.join(map(str, row.keys()))})"
                    )
            checked = True
        caption, image = row.get(caption_column), row.get(image_column)
        values = (("caption", caption), ("image", image))
        not_text = next(((what, v) for what, v in values if v is not None and not isinstance(v, str)), None)
        if not_text is not None:
            _bump(counts, f"skipped_non_text_{not_text[0]}")
            _note(issues, path, f"{not_text[0]} is a {type(not_text[1]).__name__}, not text", lineno)
            continue
        caption = " ".join((caption or "").split())
        image = (image or "").strip()
        if not image:
            _bump(counts, "skipped_no_image")
            continue
        if not visible(caption):
            _bump(counts, "skipped_empty_caption")
            continue
        image = image if os.path.isabs(image) else os.path.join(root, image)
        if (image, caption) in seen:
            _bump(counts, "skipped_duplicate_pair")
            _note(issues, path, "repeats an earlier (image, caption) row", lineno)
            continue
        seen.add((image, caption))
        if image in images:  # kept: each distinct caption of an image is a pair (COCO-style several per image)
            _bump(counts, "rows_repeating_an_image")
        images.add(image)
        stamp = file_stamp(image)
        if stamp[0] == STAMP_SPECIAL:
            _bump(counts, "skipped_not_regular_file")
            _note(issues, path, f"image is not a regular file ({file_type(image)}; never opened)", lineno)
            if special is not None:
                special.append([image, *stamp])
            continue
        if data_root is not None and not data_root.holds(image):
            _bump(counts, "skipped_outside_root")
            _note(issues, path, OUTSIDE_ROOT_PROBLEM, lineno)
            continue
        records.append((str(row_no), image, caption, stamp))
    return records


# ------------------------------------------------------------------------ build
def build_index(
    shards: Sequence[str] = (),
    manifest: str = "",
    image_column: str = "image",
    caption_column: str = "caption",
    image_root: str = "",
    max_pairs: int = 0,
    show_progress: bool = True,
    max_field_chars: int = MAX_FIELD_CHARS,
    allow_outside_root: bool = False,
) -> PairIndex:
    """Scan the inputs into a :class:`PairIndex` (no image decoding; arguments: the ``CHC.INPUT`` keys,
    :func:`scan_manifest`); :class:`~meta.chc.errors.InputError` when not one usable pair was found."""
    from tqdm import tqdm

    if not shards and not manifest:
        raise ValueError("CHC.INPUT: set SHARDS (webdataset .tar files) or MANIFEST (csv/tsv/jsonl)")
    counts: dict = {"pairs_seen": 0, "skipped_no_image": 0, "skipped_empty_caption": 0, "corrupt_shards": 0}
    issues: list = []
    sources, kinds = [], []
    rows: list = []  # (source id, offset, size, key, path, caption, meta_json, file stamp) per pair
    special: list = []
    shard_paths = expand_shards(shards) if shards else []
    for path in tqdm(shard_paths, desc="index shards", unit="shard", disable=not show_progress, dynamic_ncols=True):
        sid = len(sources)
        sources.append(os.path.abspath(path)), kinds.append(KIND_TAR)
        scanned = scan_tar(path, counts, issues, max_field_chars)
        rows += [(sid, off, n, key, "", cap, mj, (0, 0, 0)) for key, off, n, cap, mj in scanned]
    if counts["corrupt_shards"]:
        # pairs the damaged parts held: bytes not read / mean bytes per pair in what was read (a shard cut
        # short lost an unknown tail on top: counted in corrupt_shards_cut_short)
        read_bytes, pairs_read = counts.get("shard_bytes_read", 0), counts["pairs_seen"]
        counts["pairs_lost_in_corrupt_shards_estimate"] = (
            int(round(counts["corrupt_shard_bytes_unread"] * pairs_read / read_bytes))
            if pairs_read and read_bytes > 0
            else 0
        )
    if manifest:
        sid = len(sources)
        sources.append(os.path.abspath(manifest)), kinds.append(KIND_FILE)
        columns = (image_column, caption_column, image_root)
        scanned = scan_manifest(manifest, *columns, counts, issues, max_field_chars, special, allow_outside_root)
        rows += [(sid, -1, -1, key, path, cap, "", stamp) for key, path, cap, stamp in scanned]
    if not rows:
        skipped = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "pairs_seen") or "nothing read"
        named = [f"CHC.INPUT.SHARDS: {len(shard_paths)} shard(s)"] if shard_paths else []
        where = " and ".join(named + ([f"CHC.INPUT.MANIFEST: {manifest}"] if manifest else []))
        first = f"; first problem: {issues[0]['source']}: {issues[0]['problem']}" if issues else ""
        raise InputError(f"{where}: no usable image-text pair ({counts['pairs_seen']} seen; {skipped}){first}")
    damaged = [e for e in issues if e["source"] in sources[: len(shard_paths)] and ("offset" in e or "rows" not in e)]
    if damaged:
        log.warning(
            "CHC.INPUT.SHARDS: %d of %d shard(s) unreadable or damaged (counted in chc_report.md), e.g. %s: %s",
            len({e["source"] for e in damaged}),
            len(shard_paths),
            damaged[0]["source"],
            damaged[0]["problem"],
        )
    if max_pairs and len(rows) > max_pairs:
        counts["dropped_by_max_pairs"] = len(rows) - max_pairs
        del rows[max_pairs:]
    counts["pairs_indexed"] = len(rows)
    src_ids, offsets, sizes, keys, paths, caps, metas, stamps = (list(column) for column in zip(*rows))
    dtypes = ((kinds, np.int8), (src_ids, np.int32), (offsets, np.int64), (sizes, np.int64))  # _ARRAY_FIELDS
    arrays = [np.asarray(values, dtype=dtype) for values, dtype in dtypes]
    stamp = np.asarray(stamps, dtype=np.int64).reshape(-1, 3) if manifest else None
    return PairIndex(sources, *arrays, keys, paths, caps, metas, counts, issues, stamp, special)


def rank_items(index: PairIndex, rank: int, world_size: int) -> np.ndarray:
    """Item indices that process ``rank`` of ``world_size`` encodes (disjoint, covering): whole sources (shard ``s``
    to rank ``s % world_size``) when there are enough, else ``world_size`` contiguous blocks."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    n = len(index)
    if world_size == 1:
        return np.arange(n, dtype=np.int64)
    if len(index.sources) >= world_size:
        return np.flatnonzero(index.item_source % world_size == rank).astype(np.int64)
    bounds = np.linspace(0, n, world_size + 1).round().astype(np.int64)
    return np.arange(bounds[rank], bounds[rank + 1], dtype=np.int64)
