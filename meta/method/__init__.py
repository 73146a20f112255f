"""What GRAM learns and how: prompt learners (θ), R_φ, the zero-shot-consistency terms, the inner rule, the outer
objective, the bi-level meta-learner (sequential and stacked), the method table (``methods.yaml``) and top-1
accuracy.  Modules are imported by their own names (``meta.method.<module>``); the package itself imports nothing.
"""
