"""What every job leans on: pinned CPU kernels, the code's commit, file
reading with one-line errors, run locks, hashing, torchrun helpers, Dassl run folders, copy profiling, resident
memory peaks.

Modules are imported by their own names (``meta.infra.<module>``); the package itself imports nothing.
"""
