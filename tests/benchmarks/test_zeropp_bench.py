"""benchmarks/zeropp.py runs end to end on a tiny GPT: both rows, bytes per kind from the
engines' own counts, the ratios the engine tests check, a JSON file and a table."""

from __future__ import annotations

import json

from benchmarks import zeropp


def test_the_zeropp_benchmark_reports_bytes_times_and_losses(tmp_path, capsys):
    out = tmp_path / "zeropp.json"
    assert zeropp.main(["--preset", "gpt-nano", "--steps", "3", "--warmup", "1", "--seq-len", "16",
                        "--micro-batch", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"exact", "zero++"}
    assert rows["exact"]["bytes"]["all_gather"] == 2 * rows["exact"]["elements"]["all_gather"]  # bf16
    assert rows["zero++"]["bytes_vs_exact"]["all_gather"] <= 0.55
    assert rows["zero++"]["bytes_vs_exact"]["reduce_scatter"] <= 0.30
    assert rows["zero++"]["elements"] == rows["exact"]["elements"]
    for row in rows.values():
        assert len(row["losses"]) == 3 and row["step_time_s"] > 0
    assert "zero++" in capsys.readouterr().out
