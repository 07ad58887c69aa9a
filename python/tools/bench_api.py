"""Speed of the Python API (pytest-benchmark), reported in docs/results.md, not a test.

    pip install pytest-benchmark==5.3.1   # into the venv the wheel is installed in
    cd /tmp && python -m pytest /work/main/python/tools/bench_api.py -p no:cacheprovider

`cold_command`: the issue's one-liner in a fresh interpreter with an empty trace cache
(imports, the user's own model construction, the trace, the replay). `cached_estimate`: the
same estimate again in a live process, the trace cached (fingerprint + read + replay).
"""

import os
import subprocess
import sys
import tempfile

import pytest

gpumem = pytest.importorskip("gpumem")
transformers = pytest.importorskip("transformers")

ONE_LINER = (
    "import gpumem, transformers as t; "
    "print(gpumem.estimate(t.GPT2LMHeadModel(t.GPT2Config()), batch=8, seq_len=1024))"
)


def test_cold_command(benchmark):
    def once():
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, GPUMEM_CACHE=cache)
            subprocess.run(
                [sys.executable, "-c", ONE_LINER], env=env, check=True, capture_output=True
            )

    benchmark.pedantic(once, rounds=5, iterations=1)


def test_cached_estimate(benchmark):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    gpumem.estimate(model, batch=8, seq_len=1024)  # traces once
    benchmark(gpumem.estimate, model, batch=8, seq_len=1024)
