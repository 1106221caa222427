"""benchmarks/sequence_curvature.py runs (smoke sizes) and reports every timed variant."""
from __future__ import annotations

from benchmarks import sequence_curvature


def test_quick_run_reports_every_variant(tmp_path) -> None:
    out = tmp_path / "seq.json"
    report = sequence_curvature.main(["--quick", "--repeats", "1", "--json", str(out)])
    assert out.exists()
    assert [r["model"] for r in report["results"]] == ["lm-mlp", "lm-attn"]
    for r in report["results"]:
        assert {"fisher", "fisher_mc", "empirical_fisher"} <= set(r["times"])
        assert r["vectors_exact"] == r["seq_len"] * (r["vocab"] - 1)
        if "backpack DiagGGNExact" in r["times"]:  # only where BackPACK is installed
            assert r["backpack_max_rel_diff"] < 1e-4
