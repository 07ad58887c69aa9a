"""Call a trainer's Python config function and dump its result as JSON.

torchtitan's newer releases describe a run as a Python function returning ``Trainer.Config``
(or a ``JobConfig``), chosen with ``--module``/``--config``. gpumem reads such a config by
calling that function: ``python -m gpumem_trace.config TARGET FUNCTION`` imports TARGET (a
``.py`` file, or an importable module), calls FUNCTION with no arguments and prints the result
as one JSON document on stdout: each dataclass a mapping of its fields with its class's
qualified name in ``_class``; enums by value; tuples and sets as lists; anything else by its
``repr``. Nothing here needs torch.

Failures print one line on stderr and exit 2: the message names a missing package (``torchtitan
is not installed for this interpreter``), the file, or the function.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import json
import math
import os
import sys


def to_json(value, depth=0):
    """``value`` as JSON data (see the module's docstring)."""
    if depth > 64:
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return to_json(value.value, depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"_class": f"{type(value).__module__}.{type(value).__qualname__}"}
        for f in dataclasses.fields(value):
            out[f.name] = to_json(getattr(value, f.name, None), depth + 1)
        return out
    if isinstance(value, dict):
        return {str(k): to_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v, depth + 1) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


def load(target):
    """The module TARGET names: a ``.py`` file or an importable module."""
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise LookupError(f"{target}: no such file")
        # Its directory first, as `python FILE` would have it: sibling modules import.
        sys.path.insert(0, os.path.dirname(path))
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    sys.path.insert(0, os.getcwd())
    return importlib.import_module(target)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m gpumem_trace.config TARGET FUNCTION", file=sys.stderr)
        return 2
    target, function = argv
    try:
        module = load(target)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        print(
            f"{top} is not installed for this interpreter ({sys.executable}): "
            f"the config imports it; install it there or set GPUMEM_PYTHON",
            file=sys.stderr,
        )
        return 2
    except LookupError as e:
        print(str(e), file=sys.stderr)
        return 2
    except Exception as e:  # the user's module failed as it was imported
        print(f"importing {target} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    fn = getattr(module, function, None)
    if not callable(fn):
        print(f"{target} has no function `{function}`", file=sys.stderr)
        return 2
    try:
        result = fn()
    except Exception as e:
        print(f"{function}() failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if not (dataclasses.is_dataclass(result) or isinstance(result, dict)):
        print(
            f"{function}() returned {type(result).__name__}, not a config (a dataclass or a dict)",
            file=sys.stderr,
        )
        return 2
    json.dump(to_json(result), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
