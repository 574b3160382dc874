"""The host-optimizer benchmark measures every AdamW CPU path on the same tensors and says how far each lands from the default."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import host_optimizer


def test_every_kind_is_timed_on_the_same_tensors_and_compared_with_the_default(tmp_path: Path):
    out = tmp_path / "host.json"
    assert host_optimizer.main(["--params", "2e5", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["kind"]: r for r in result["rows"]}
    assert list(rows) == list(host_optimizer.KINDS)
    assert rows["foreach=False"]["max_abs_diff"] == 0.0 and rows["foreach=False"]["ratio_to_default"] == 1.0
    assert rows["foreach=True"]["max_abs_diff"] == 0.0  # the same arithmetic, batched
    assert 0.0 <= rows["fused=True"]["max_abs_diff"] < 1e-6  # last-bit rounding after two steps
    assert all(r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows.values())
    assert result["params"] == sum(host_optimizer.shapes(2e5))
