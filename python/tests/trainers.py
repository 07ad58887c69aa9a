"""The trainers whose own code tests compare gpumem's restatements with (torchtitan, torchtune):
installed in the environment scripts/test.sh makes for them, absent from the others."""

import importlib
import os

import pytest


def requires(module):
    """A pytest mark skipping the tests without ``module``, saying why — except where
    GPUMEM_TEST_REQUIRE_TITAN=1 (CI, in the trainers' environment), where its absence fails."""
    try:
        importlib.import_module(module)
        return pytest.mark.skipif(False, reason="")
    except ImportError as e:
        why = f"{module} is not installed here ({e}); scripts/test.sh installs it"
        if os.environ.get("GPUMEM_TEST_REQUIRE_TITAN") == "1":
            raise RuntimeError(f"GPUMEM_TEST_REQUIRE_TITAN=1 but {why}") from e
        return pytest.mark.skipif(True, reason=why)
