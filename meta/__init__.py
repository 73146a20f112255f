"""GRAM core: prompt learners over open_clip, the gradient regulator, meta-learning."""
__version__ = "0.1.0"
