"""Cross-modal Hierarchical Clustering (CHC, paper section 3.2): image-text pairs -> topics -> domains.

Run it with ``python -m meta cluster --config-file configs/meta/chc_cc3m.yaml`` (see
:mod:`meta.chc.pipeline` for the stages and :mod:`meta.config` for every setting).

Output contract (what the meta-trainer relies on)
-------------------------------------------------
``meta.chc.load_hierarchy(out_dir) -> Hierarchy`` with

* ``topic_names: list[str]`` [L] - one class name per topic, all distinct (clusters that
  share a cluster-TF-IDF top word are merged into one topic);
* ``item_topic: np.ndarray[int64]`` [N] - topic id of each pair, ``-1`` = excluded
  (unreadable image, filtered pair, topic noise, or topic too small; the reason is in
  ``item_status.npy``, codes in ``meta['status_codes']``);
* ``item_domain: np.ndarray[int64]`` [N] - visual domain id inside the item's topic
  (``0 .. U_t - 1``, 0 = largest domain), ``-1`` where ``item_topic`` is ``-1``;
* ``image_features: np.ndarray[float32]`` [N, D] - L2-normalised image features of the
  frozen CLIP named in ``meta['backbone']`` (memory-mapped; zero rows for unreadable images);
* ``meta: dict`` - ``backbone``, ``pretrained`` (weights file), ``weights_sha256``,
  ``image_size``, ``mean``/``std`` (CLIP normalisation), ``settings`` (the CHC config),
  ``counts`` (pairs per stage);
* ``images(indices) -> np.ndarray[uint8]`` [n, H, W, 3] at the CLIP input size (shorter
  side resized bicubic + centre crop), decoded lazily from the tar shards / files, or read
  from the uint8 memmap cache ``image_features/images_u8.npy`` for small corpora;
* helpers ``domain_members(t) -> {u: item indices}``, ``topic_members(t)``, ``topic_sizes()``.

N counts every indexed pair (image member present, caption non-empty); pairs skipped
while reading are only counted.  Normalise images for CLIP with
:func:`meta.chc.imaging.normalize_uint8` and ``meta['mean']`` / ``meta['std']``.
"""

from meta.chc.hierarchy import STATUS, Hierarchy, load_hierarchy
from meta.chc.pipeline import run_chc

__all__ = ["Hierarchy", "load_hierarchy", "run_chc", "STATUS"]
