"""Inputs: CoOp-layout datasets without Dassl (``coop_data``), image decoding and the size caps an image passes
before it is read.

Modules are imported by their own names (``meta.data.<module>``); the package itself imports nothing.
"""
