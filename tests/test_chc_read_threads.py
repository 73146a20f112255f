"""``PairIndex.read_image_bytes(threads=N)`` (``CHC.IMAGES.READ_THREADS``): the bytes and the reasons of one thread,
in the same order, whatever the mix of tar members, files and unreadable items."""

import tarfile
import threading

import numpy as np
import pytest
from helpers_chc import png_bytes, write_shard

from meta.chc import sources
from meta.chc.sources import KIND_FILE, KIND_TAR, PairIndex

CAP = 50_000  # bytes: the byte cap of these reads (CHC.INPUT.MAX_IMAGE_BYTES)


def _mixed_index(tmp_path, n_per_shard: int = 40) -> tuple[PairIndex, list]:
    """Two shards' image members, then files (present, missing, a folder, one over :data:`CAP`) and a member running
    past its shard's end; returns the index and, per item, the bytes expected (``None`` = unreadable)."""
    shards, expected = [], []
    offsets, sizes, item_source, paths = [], [], [], []
    for s in range(2):
        images = [
            png_bytes((s * 100 + i % 100, i % 7 * 30, 9), size=(8 + i % 13, 5 + i % 3)) for i in range(n_per_shard)
        ]
        path = write_shard(tmp_path / f"s{s}.tar", [f"c{i}" for i in range(n_per_shard)], images)
        shards.append(str(path))
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".png"):
                    offsets.append(m.offset_data)
                    sizes.append(m.size)
                    item_source.append(s)
                    paths.append("")
        expected += images
    (tmp_path / "big.png").write_bytes(bytes(CAP + 1))  # never read: its size is checked first
    (tmp_path / "a.png").write_bytes(png_bytes((1, 2, 3)))
    (tmp_path / "folder.png").mkdir()
    for name, want in [("a.png", png_bytes((1, 2, 3))), ("gone.png", None), ("folder.png", None), ("big.png", None)]:
        offsets.append(-1)
        sizes.append(-1)
        item_source.append(2)
        paths.append(str(tmp_path / name))
        expected.append(want)
    # a member whose recorded size runs past the shard's end (the shard was cut after indexing)
    offsets.append((tmp_path / "s0.tar").stat().st_size - 10)
    sizes.append(100)
    item_source.append(0)
    paths.append("")
    expected.append(None)
    n = len(offsets)
    index = PairIndex(
        sources=shards + ["m.csv"],
        source_kind=np.array([KIND_TAR, KIND_TAR, KIND_FILE], dtype=np.int8),
        item_source=np.array(item_source, dtype=np.int32),
        item_offset=np.array(offsets, dtype=np.int64),
        item_size=np.array(sizes, dtype=np.int64),
        item_key=[str(i) for i in range(n)],
        item_path=paths,
        captions=["x"] * n,
        meta_json=[""] * n,
    )
    return index, expected


@pytest.mark.parametrize("threads", [2, 4, 7])
def test_threads_read_the_same_bytes_and_reasons_in_order(tmp_path, threads):
    index, expected = _mixed_index(tmp_path)
    order = list(np.random.default_rng(threads).permutation(len(index)))  # a rank's items need not be sorted
    one_why: list = []
    one = index.read_image_bytes(order, one_why, max_bytes=CAP)
    many_why: list = []
    many = index.read_image_bytes(order, many_why, max_bytes=CAP, threads=threads)
    assert many == one and many_why == one_why
    assert one == [expected[i] for i in order]  # against the bytes written, not only against one thread
    why = dict(zip(order, one_why))
    n = len(index)
    assert [why[i] for i in range(n - 5, n)] == [
        "",
        "FileNotFoundError",
        "not a regular file",
        f"file larger than {CAP} bytes",
        "short read (shard changed or cut)",
    ]
    assert all(why[i] == "" for i in range(n - 5))


def test_a_chunk_is_read_by_as_many_threads_as_asked_and_a_short_one_by_fewer(tmp_path, monkeypatch):
    index, _ = _mixed_index(tmp_path)
    seen: list = []
    read_run = PairIndex._read_run

    def recording(self, indices, max_bytes):
        seen.append((threading.get_ident(), len(indices)))
        return read_run(self, indices, max_bytes)

    monkeypatch.setattr(PairIndex, "_read_run", recording)
    index.read_image_bytes(range(len(index)), threads=4)  # 85 items: runs of 22, 22, 22, 19
    assert sorted(k for _, k in seen) == [19, 22, 22, 22]
    seen.clear()
    short = 2 * sources.MIN_ITEMS_PER_READ_THREAD + 1  # room for two threads only
    index.read_image_bytes(range(short), threads=8)
    assert sorted(k for _, k in seen) == [short // 2, short - short // 2]
    seen.clear()
    index.read_image_bytes(range(5), threads=8)
    assert seen == [(threading.get_ident(), 5)]  # read in the calling thread
