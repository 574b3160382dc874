#!/usr/bin/env python3
"""Where product code gives a ``zero`` field (a ``ZeroSpec`` field name) a default, and whether
that default is written out or read from the contract.

Reads ``service/ workers/ contract/ storage/ migrations/`` with ``ast``: class fields and
function parameters named like a ``ZeroSpec`` field, with a default. Each line is ``literal``
(the value is written there) or ``derived`` (read from ``ZERO_DEFAULTS``, ``ZeroSpec`` or a
``DEFAULT_*`` constant). ``ZeroSpec`` itself is where the literals belong; a name that only
looks like a zero field (a data loader's ``prefetch``) shows up too and is for the reader to
judge.

Usage: ``python scripts/zero_defaults.py`` from the repository root.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contract.spec import ZeroSpec  # noqa: E402

PACKAGES = ("service", "workers", "contract", "storage", "migrations")
FIELDS = set(ZeroSpec.model_fields)


def kind(value: ast.expr) -> str | None:
    """``literal`` or ``derived`` for a default; None for a ``Field(...)`` without one."""
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
        given = next((kw.value for kw in value.keywords if kw.arg == "default"), None)
        return None if given is None else kind(given)
    text = ast.unparse(value)
    return "derived" if any(name in text for name in ("ZERO_DEFAULTS", "ZeroSpec", "DEFAULT_")) else "literal"


def defaults(path: str) -> list[tuple[str, int, str]]:
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                and node.target.id in FIELDS and (how := kind(node.value)):
            found.append((how, node.lineno, ast.unparse(node)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(arg, d) for arg, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(kind(d) or "literal", node.lineno, f"def {node.name}(... {arg.arg}={ast.unparse(d)})")
                      for arg, d in pairs if arg.arg in FIELDS]
    return found


def main() -> int:
    files = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, check=True).stdout.split()
    for path in sorted(f for f in files if f.split("/")[0] in PACKAGES):
        for how, line, text in defaults(path):
            print(f"{how:8} {path}:{line}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
