"""One definition of each ``zero`` default: scripts/zero_defaults.py finds no default of a zero
field written out anywhere but ``ZeroSpec`` (contract/spec.py), and does find one when it is."""

from __future__ import annotations

from tests.helpers.repo_scripts import load_script, run_script


def test_each_zero_default_is_defined_once_in_the_contract():
    run = run_script("zero_defaults.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "places defining a zero field's default: [1] (per field" in run.stdout
    assert "literals outside contract/spec.py: 0" in run.stdout


def test_a_second_default_is_found_and_a_not_given_none_is_not_one(tmp_path):
    source = tmp_path / "engine_like.py"
    source.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Config:\n    stage: int = 2\n    bucket_mb: float = ZERO_DEFAULTS['bucket_mb']\n"
        "def build(precision=None, offload_params=None, stage: int = 'auto'):\n    ...\n")
    kinds = {(field, how) for how, _, field, _ in load_script("zero_defaults.py").defaults(str(source))}
    assert kinds == {("stage", "literal"), ("bucket_mb", "derived"), ("precision", "sentinel"),
                     ("offload_params", "literal"), ("stage", "literal")}
