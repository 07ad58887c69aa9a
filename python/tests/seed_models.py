"""The seed's families as ``py:`` references for the tracer tests:
``py:python/tests/seed_models.py:mlp(input=64,...)``. They live in ``gpumem_trace.families``."""

from gpumem_trace.families import cnn, mlp, transformer  # noqa: F401
