"""The frozen CLIP side: open_clip models and their configs, our forward through its blocks, the text and image towers
prompts enter, weight files and mixed precision.  Modules are imported by their own names; the package imports nothing.
"""
