"""Tools around the GRAM library, not part of it: benchmarks (``python -m gram_tools.bench``,
``python -m gram_tools.bench_eval``), the CHC measurement study (``python -m gram_tools.chc_measure``) and
the synthetic image-text corpora that tests and smoke runs use (:mod:`gram_tools.synthetic`)."""
