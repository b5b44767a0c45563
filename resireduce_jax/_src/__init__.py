"""Implementation modules with no public API: the XLA scheduling mechanics of a step.

As ``optax._src`` keeps optax's, these are imported by the library's own modules and its
tests; their names may change without notice (docs/design.md, "Module boundaries").
"""
