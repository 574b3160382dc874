"""No import circles in the product (issue 30): scripts/import_graph.py reads every module of
service/ workers/ contract/ storage/ migrations/ with ``ast`` and finds no cycle, and it does find one
when there is one."""

from __future__ import annotations

from tests.helpers.repo_scripts import load_script, run_script


def test_the_product_has_no_import_cycle():
    run = run_script("import_graph.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert ", 0 cycle(s)" in run.stdout


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path):
    graph = load_script("import_graph.py")
    package = tmp_path / "workers" / "zero"
    package.mkdir(parents=True)
    for root in ("workers", "workers/zero", "service", "contract", "storage", "migrations"):
        (tmp_path / root).mkdir(parents=True, exist_ok=True)
        (tmp_path / root / "__init__.py").write_text("")
    (package / "base.py").write_text("def make():\n    from .sub import Sub\n    return Sub()\n")
    (package / "sub.py").write_text("from workers.zero.base import make\nclass Sub: ...\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from service import user\n")
    (tmp_path / "service" / "user.py").write_text("from workers.zero import typed\n")
    (tmp_path / "contract" / "alone.py").write_text("import json\nfrom contract import alone\n")
    edges = graph.build_graph(tmp_path)
    assert edges["workers.zero.base"] == {"workers.zero.sub"}
    assert graph.cycles(edges) == [["service.user", "workers.zero.typed"], ["workers.zero.base", "workers.zero.sub"]]
