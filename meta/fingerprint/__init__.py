"""The golden numerics fingerprint (``golden``: a short fixed meta-training + fine-tuning run of every learner in both
task loops and its committed digest ``golden.json``) and :func:`~meta.fingerprint.record.computed_by`, what every
results file stores; ``python -m meta.fingerprint [--check | --write] [--perturb-ulp]`` runs it.  It sits above every
other group because the run uses them all; the package itself imports nothing.
"""
