"""The benchmark harness runs end to end (so it never rots); the numbers are not asserted.

Runs ``benchmarks.run --quick`` on the peer benchmarks with tiny settings, in a temporary
results/docs directory, with every peer disabled (``BENCH_DISABLE_PEERS=all``) so the
skip paths run and the test never needs BackPACK, curvlinops, laplace-torch, ASDL, IVON or
kfac_pytorch installed. The README tests regenerate the results block of a scratch copy
(``--readme`` in ``tmp_path``) from the repository's JSONs: they never write the real README.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")  # peers_training trains on sklearn's digits

from benchmarks import run as bench_run  # noqa: E402

MINE = ("peers_curvature", "peers_training", "memory", "width_scaling")
TINY = [
    "peers_curvature=--models mlp-xs cnn-xs --budget 0.01 --batch 8",
    "peers_training=--optimizers sgd sso-kfac ivon kfac_pytorch --epochs 1 --batch-size 256",
    "memory=--optimizers sgd sso-kfac ivon --width 16 --in-features 16 --steps 1 --batch 8",
    "width_scaling=--widths 16 32 --budget 0.01 --batch 8",
]


def test_discover_finds_every_benchmark() -> None:
    names = bench_run.discover()
    for name in ("linalg", *MINE):
        assert name in names
    assert not {"common", "_peer_utils", "run", "__init__"} & set(names)


def test_quick_run_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_DISABLE_PEERS", "all")
    results, docs = tmp_path / "results", tmp_path / "docs"
    argv = ["--quick", "--results-dir", str(results), "--docs-dir", str(docs), "--only", *MINE]
    for e in TINY:
        argv += ["--extra", e]
    assert bench_run.main(argv) == 0
    for name in MINE:
        report = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
        assert report["machine"]["torch"]
        assert isinstance(report["results"], list) and report["results"]
    skipped = json.loads((results / "peers_training.json").read_text(encoding="utf-8"))["skipped"]
    assert set(skipped) == {"ivon", "kfac_pytorch"}
    assert {"backpack", "asdl"} <= set(json.loads((results / "peers_curvature.json").read_text(encoding="utf-8"))["skipped"])
    page = (docs / "results.md").read_text(encoding="utf-8")
    assert "# Benchmark results" in page and "|" in page
    assert (docs / "width_scaling.png").exists() or "matplotlib" not in page


def test_report_only_and_bad_module(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as err:  # an argparse error, before any scratch directory is made
        bench_run.main(["--only", "no_such_benchmark", "--results-dir", str(tmp_path)])
    assert err.value.code == 2
    assert bench_run.main(["--report-only", "--results-dir", str(tmp_path), "--docs-dir", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").exists()


README_WITH_MARKERS = (
    "# title\n\nintro paragraph, kept as it is  \n\n## Results\n\n"
    f"{bench_run._readme_summary.BEGIN}\nhand-pasted table, replaced\n{bench_run._readme_summary.END}\n\n"
    "## Known gaps\n\n* stays\n"
)


def test_report_only_regenerates_readme_block(tmp_path: Path) -> None:
    """--report-only rewrites only the text between the markers of the README it is given."""
    readme = tmp_path / "README.md"
    readme.write_text(README_WITH_MARKERS, encoding="utf-8")
    before, after = README_WITH_MARKERS.split(bench_run._readme_summary.BEGIN)[0], \
        README_WITH_MARKERS.split(bench_run._readme_summary.END)[1]
    # the repository's JSONs (read only), a scratch docs dir and the scratch README
    assert bench_run.main(["--report-only", "--docs-dir", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    begin, end = bench_run._readme_summary.BEGIN, bench_run._readme_summary.END
    assert text.startswith(before + begin) and text.endswith(end + after)  # outside: byte-identical
    block = text[len(before) + len(begin):len(text) - len(end + after)]
    assert "hand-pasted table, replaced" not in block
    assert "docs/results.md" in block and "|---" in block
    # regenerating again is a fixed point
    assert bench_run.main(["--report-only", "--docs-dir", str(tmp_path), "--readme", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8") == text


def test_readme_without_markers_is_an_error(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="results:begin"):
        bench_run.main(["--report-only", "--docs-dir", str(tmp_path), "--readme", str(readme)])
    readme.write_text(f"# half\n{bench_run._readme_summary.BEGIN}\n", encoding="utf-8")
    with pytest.raises(ValueError, match="results:end"):
        bench_run.main(["--report-only", "--docs-dir", str(tmp_path), "--readme", str(readme)])
    assert readme.read_text(encoding="utf-8") == f"# half\n{bench_run._readme_summary.BEGIN}\n"


def test_scratch_results_dir_leaves_readme_alone(tmp_path: Path) -> None:
    args = bench_run.parse_args(["--quick", "--results-dir", str(tmp_path)])
    assert bench_run.readme_target(args) is None
    assert bench_run.readme_target(bench_run.parse_args(["--report-only"])) == bench_run.DEFAULT_README
    assert bench_run.readme_target(bench_run.parse_args(["--report-only", "--no-readme"])) is None
    explicit = tmp_path / "R.md"
    assert bench_run.readme_target(bench_run.parse_args(["--quick", "--results-dir", str(tmp_path),
                                                         "--readme", str(explicit)])) == explicit


def test_peer_benchmarks_default_json_only_for_the_readme_runs() -> None:
    """A full default run saves where README's block reads it; partial or quick runs never overwrite it."""
    from benchmarks import peers_curvature, peers_training

    assert peers_curvature.parse_args([]).json.name == "peers_curvature.json"
    for argv in (["--quick"], ["--models", "cnn-s"], ["--quantities", "diag_ggn"], ["--threads", "1"]):
        assert peers_curvature.parse_args(argv).json is None
    with pytest.raises(SystemExit):
        peers_curvature.parse_args(["--threads", "0"])
    assert peers_training.parse_args(["--full"]).json.name == "peers_training.json"
    for argv in ([], ["--quick"], ["--full", "--models", "mlp"], ["--full", "--optimizers", "sgd"]):
        assert peers_training.parse_args(argv).json is None


def test_peers_block_names_threads_and_the_one_thread_run(tmp_path: Path) -> None:
    """The README's peer paragraph says how many threads its run used and, when a 1-thread run
    exists, the lowest peer/ours ratio of each (computed from the rows, not copied)."""
    summary = bench_run._readme_summary

    def report(threads: int, ratios: list) -> dict:
        rows = [{"quantity": "diag_ggn", "model": f"m{i}", "peer": peer, "method": "x", "ratio_min": r,
                 "max_rel_diff": 1e-7, "agree": True}
                for i, (peer, r) in enumerate(ratios)]
        return {"benchmark": "peers_curvature", "machine": {"torch_threads": threads},
                "config": {"dtype": "float32", "batch": 8, "agree_tol": 1e-4, "threads": threads},
                "results": rows, "skipped": {}, "disagreements": 0}

    two = report(2, [("backpack", 0.8), ("curvlinops", 1.5), ("asdl", 0.5)])
    one = report(1, [("backpack", 1.2), ("laplace", 1.1)])
    (tmp_path / "peers_curvature.json").write_text(json.dumps(two), encoding="utf-8")
    text = summary.render(tmp_path)
    assert "2 torch threads" in text and "1 torch thread " not in text
    (tmp_path / "peers_curvature_1thread.json").write_text(json.dumps(one), encoding="utf-8")
    text = " ".join(summary.render(tmp_path).split())
    assert "ratio 0.80 (diag_ggn on m0 vs backpack)" in text  # asdl is not a peer of the speed goal
    assert "1 torch thread (`peers_curvature_1thread.json`" in text and "ratio 1.10 (diag_ggn on m1 vs laplace)" in text


def test_reports_are_dated_by_their_stamp(tmp_path: Path) -> None:
    """write_json stamps the report with the time it was written; the README's sources take that
    stamp over file times and commits (a commit or checkout must not re-date a measurement)."""
    import os
    import time

    from benchmarks._readme_summary import load_sources
    from benchmarks.common import write_json

    before = time.time()
    write_json(tmp_path / "new.json", {"x": 1})
    stamped = json.loads((tmp_path / "new.json").read_text())
    assert before <= stamped["measured_at_unix"] <= time.time() and stamped["x"] == 1
    write_json(tmp_path / "old.json", {"measured_at_unix": 1000.0, "x": 2})  # a given stamp is kept
    (tmp_path / "plain.json").write_text(json.dumps({"x": 3}))  # no stamp: the file time
    os.utime(tmp_path / "plain.json", (5000.0, 5000.0))
    sources = {p.name: t for p, _, t in load_sources(tmp_path, "*.json")}
    assert sources["old.json"] == 1000.0 and sources["plain.json"] == 5000.0
    assert sources["new.json"] == stamped["measured_at_unix"]


@pytest.mark.parametrize("name", ["kfac_robustness", "kfac_time_to_accuracy", "adaptive_step_cost"])
def test_results_page_sections_of_the_issue_30_benchmarks_render_from_their_json(name: str, tmp_path: Path) -> None:
    """docs/results.md's section of each committed JSON is its tables, not a formatting error."""
    path = Path(bench_run.__file__).resolve().parent / "results" / f"{name}.json"
    section = bench_run._section(name, path, tmp_path)
    assert "could not format" not in section and "no results" not in section
    assert section.count("\n|") >= 4  # a Markdown table with rows


def test_modules_returning_their_report_pass_and_no_quick_modules_are_skipped(tmp_path: Path) -> None:
    """A module whose main returns its report (a dict) succeeded (it was counted FAILED); in a quick run
    a module without --quick is skipped with a message, and the standalone studies are not discovered."""
    args = bench_run.parse_args(["--quick", "--results-dir", str(tmp_path / "r"), "--docs-dir", str(tmp_path / "d")])
    args.results_dir.mkdir(parents=True)
    args.docs_dir.mkdir(parents=True)
    status = bench_run.run_modules(["kfac_time_to_accuracy", "soak"], args)
    assert status["kfac_time_to_accuracy"]["ok"] and status["kfac_time_to_accuracy"]["rc"] == "report"
    assert status["soak"]["ok"] and status["soak"]["skipped"] == "no --quick mode"
    assert not {"sequence_curvature", "vi_differences", "vi_kfac_intervals", "vi_step_time"} & set(bench_run.discover())


def test_common_summarize_takes_the_min_and_the_middle_of_the_timings() -> None:
    """benchmarks.common.summarize by hand: (4, 1, 3, 2) ms: min 1 ms, median (2 + 3) / 2 = 2.5 ms (the
    mean of the middle two, not the upper); (0.5, 0.1, 0.2) s: min 0.1, median 0.2; the times are kept
    in their order."""
    from benchmarks import common

    s = common.summarize([0.004, 0.001, 0.003, 0.002])
    assert s["min_s"] == 0.001 and s["median_s"] == pytest.approx(0.0025, abs=1e-15)
    assert s["times_s"] == [0.004, 0.001, 0.003, 0.002]
    s = common.summarize([0.5, 0.1, 0.2])
    assert s["min_s"] == 0.1 and s["median_s"] == 0.2


def test_common_table_and_text_helpers() -> None:
    """markdown_table: ``l`` columns ``---``, ``r`` columns ``---:`` (default: first left, rest right), None
    an empty cell; epochs_per_seed_text writes ``missed`` for a seed without epochs; fmt_ratio rounds."""
    from benchmarks import common

    assert common.markdown_table(["a", "b", "c"], [[1, None, "x"]], align="lrl").splitlines() == \
        ["| a | b | c |", "|---|---:|---|", "| 1 |  | x |"]
    assert common.markdown_table(["a", "b"], [[1, 2]]).splitlines()[1] == "|---|---:|"
    assert common.epochs_per_seed_text({"epochs_per_seed": [3, None, 12]}) == "3 - 12"
    assert common.epochs_per_seed_text({"epochs_per_seed": [None, 4]}, missed="–") == "– 4"
    assert common.fmt_ratio(1.2345) == "1.23x" and common.fmt_ratio(None) == "" and common.fmt_ratio(0.5, 3) == "0.500x"


def test_results_page_header_names_the_load_average_a_report_recorded(tmp_path: Path) -> None:
    """docs/results.md's header line of a section names the load average of ``machine.load_average`` or,
    where a report records it only as ``config.load_average_before`` (kfac_time_to_accuracy.json),
    that one; the committed kfac_time_to_accuracy.json's section shows its load and its targets table."""
    def section(report: dict) -> str:
        path = tmp_path / "no_such_module.json"
        path.write_text(json.dumps(report), encoding="utf-8")
        return bench_run._section("no_such_module", path, tmp_path)

    machine = {"torch": "2.x", "torch_threads": 1}
    text = section({"machine": machine, "config": {"load_average_before": [0.5, 0.25, 0.125]}})
    assert "1 threads, load average [0.5, 0.25, 0.125]" in text
    text = section({"machine": {**machine, "load_average": [2.0, 1.0, 0.5]},
                    "config": {"load_average_before": [0.5, 0.25, 0.125]}})
    assert "load average [2.0, 1.0, 0.5]" in text and "0.125" not in text
    assert "load average" not in section({"machine": machine})
    path = Path(bench_run.__file__).resolve().parent / "results" / "kfac_time_to_accuracy.json"
    load = json.loads(path.read_text(encoding="utf-8"))["config"]["load_average_before"]
    text = bench_run._section("kfac_time_to_accuracy", path, tmp_path)
    assert f"load average {load}" in text
    assert "| setting | K-FAC | vs | epochs | fewer epochs | time ratio | <= 0.7x |" in text
