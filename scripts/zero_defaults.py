#!/usr/bin/env python3
"""Where product code gives a ``zero`` field (a ``ZeroSpec`` field name) a default, and of what kind.

Reads ``service/ workers/ contract/ storage/ migrations/`` with ``ast``: class fields and
function parameters named like a ``ZeroSpec`` field, with a default. Each line is one of:

``literal``   the value is written there: a definition of the default. ``contract/spec.py``
              (``ZeroSpec``) is the one place for these; anywhere else it is a second definition.
``derived``   read from the contract (``ZERO_DEFAULTS``, ``ZeroSpec`` or a ``DEFAULT_*`` constant).
``sentinel``  ``None`` meaning "not given": take the spec's value, or there is none to show. It is
              no default: ``None`` where the spec's default is not ``None`` (it cannot restate it),
              or a place listed in ``SENTINELS`` with why.
``other``     a name that only looks like a zero field (``OTHER``, with what it is).

A field or column with no default at all (``Field(...)`` without one, a database column) is no
line. Exits 1 when any ``literal`` stands outside ``contract/spec.py`` (``tests/test_zero_defaults.py``
keeps it at zero), and prints how many places define each field's default.

Usage: ``python scripts/zero_defaults.py`` from the repository root.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contract.spec import ZeroSpec  # noqa: E402

PACKAGES = ("service", "workers", "contract", "storage", "migrations")
FIELDS = set(ZeroSpec.model_fields)
HOME = "contract/spec.py"
CONTRACT_NAMES = ("ZERO_DEFAULTS", "ZeroSpec", "DEFAULT_")

#: ``None`` defaults of fields whose spec default is ``None`` too, that mean "not given"
SENTINELS = {
    ("workers/zero/config.py", "from_spec", "nvme_path"): "None keeps the block's nvme_path",
    ("service/api/plan.py", "PlanRequest", "offload_params"): "None: the spec's zero.offload_params",
    ("service/dashboard/schemas.py", "Prediction", "offload_params"): "a prediction-less answer has none",
}
#: parameters named like a zero field that are something else
OTHER = {
    ("workers/data/loader.py", "__init__", "prefetch"): "the data loader reads the next batch ahead (a bool)",
}


def _default_of(value: ast.expr) -> ast.expr | None:
    """The default a field's value gives: itself, ``Field(default=...)``'s, or None for a
    ``Field``/``mapped_column`` without one (no default)."""
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("Field", "mapped_column"):
        return next((kw.value for kw in value.keywords if kw.arg in ("default", "server_default")), None)
    return value


def kind(value: ast.expr, path: str, owner: str, name: str) -> str | None:
    """The kind of ``name``'s default ``value`` in ``owner`` (a class or function) of ``path``."""
    if (path, owner, name) in OTHER:
        return "other"
    value = _default_of(value)
    if value is None:
        return None
    if any(word in ast.unparse(value) for word in CONTRACT_NAMES):
        return "derived"
    if isinstance(value, ast.Constant) and value.value is None and path != HOME and (
            ZeroSpec.model_fields[name].default is not None or (path, owner, name) in SENTINELS):
        return "sentinel"
    return "literal"


def defaults(path: str) -> list[tuple[str, int, str, str]]:
    """(kind, line, field, text) for each default of a zero-named field or parameter in ``path``."""
    found = []
    for owner in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(owner, ast.ClassDef):
            for node in owner.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                        and node.target.id in FIELDS and (how := kind(node.value, path, owner.name, node.target.id)):
                    found.append((how, node.lineno, node.target.id, ast.unparse(node)))
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = owner.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(arg, d) for arg, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(how, owner.lineno, arg.arg, f"def {owner.name}(... {arg.arg}={ast.unparse(d)})")
                      for arg, d in pairs if arg.arg in FIELDS and (how := kind(d, path, owner.name, arg.arg))]
    return found


def main() -> int:
    files = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, check=True).stdout.split()
    places: Counter[str] = Counter()  # literal lines, and ZeroSpec's line where it names a contract constant
    strays = 0
    for path in sorted(f for f in files if f.split("/")[0] in PACKAGES):
        for how, line, field, text in defaults(path):
            print(f"{how:8} {path}:{line}  {text}")
            places[field] += how == "literal" or (how == "derived" and path == HOME)
            strays += how == "literal" and path != HOME
    counts = sorted({places[name] for name in FIELDS})
    print(f"places defining a zero field's default: {counts} (per field, over {len(FIELDS)} fields); "
          f"literals outside {HOME}: {strays}")
    return 1 if strays else 0


if __name__ == "__main__":
    sys.exit(main())
