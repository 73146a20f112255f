"""Test-time use of θ* and R_φ, one engine for the Dassl trainers and the evaluator: the regulated stepper and launch
step (``regulated``), the start of a fine-tuning run (``engine``), init files (``init_io``) and Dassl's per-epoch
schedules (``schedule``).  Modules are imported by their own names; the package itself imports nothing.
"""
