"""The golden numerics fingerprint and the record of what computed a result.

``golden``: a short fixed meta-training + fine-tuning run of every learner in both task loops and its digest
(``golden.json``, committed); ``record``: :func:`~meta.fingerprint.record.computed_by`, what every results file
stores; ``python -m meta.fingerprint [--check | --write] [--perturb-ulp]`` runs it.  It sits above every other
group because the run uses them all; the package itself imports nothing.
"""
