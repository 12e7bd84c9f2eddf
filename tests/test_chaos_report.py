"""The reliability report's arithmetic and its table (benchmarks/chaos/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chaos import report
from benchmarks.chaos.security import count


def row(kind: str, injected: int, survived: int, samples: list[float], duplicates: int = 0) -> dict:
    return {"kind": kind, "injected": injected, "survived": survived, "duplicates": duplicates, "losses": 0,
            "recovery_s": report.recovery(samples), "detail": {}}


def test_percentiles_interpolate_between_ranks() -> None:
    assert report.percentile([], 50) is None
    assert report.percentile([4.0], 95) == 4.0
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert report.percentile(list(map(float, range(1, 21))), 95) == pytest.approx(19.05)


def test_a_row_of_the_wrong_shape_names_its_part() -> None:
    with pytest.raises(report.FormatError, match=r"^runtime: a row lacks recovery_s, detail$"):
        report.check_rows("runtime", [{"kind": "x", "injected": 1, "survived": 1, "duplicates": 0, "losses": 0}])
    with pytest.raises(report.FormatError, match="survived 3 > injected 2"):
        report.check_rows("operator", [row("operator_kill", 2, 3, [])])


def test_the_campaign_is_ok_only_when_every_fault_is_survived_without_duplicates() -> None:
    fuzz, security, meta = {"passed": True, "examples": {"verdicts": 2000}}, {"passed": 9, "failed": 0}, {}
    good = report.check_rows("runtime", [row("worker_kill", 20, 20, [3.0, 5.0])])
    assert report.summarise(good, fuzz, security, meta)["ok"]
    assert not report.summarise(report.check_rows("runtime", [row("worker_kill", 20, 19, [1.0])]), fuzz,
                                security, meta)["ok"]
    assert not report.summarise(report.check_rows("runtime", [row("worker_kill", 2, 2, [], duplicates=1)]), fuzz,
                                security, meta)["ok"]
    assert not report.summarise(good, {"passed": False}, security, meta)["ok"]
    assert not report.summarise(good, fuzz, {"passed": 9, "failed": 1}, meta)["ok"]


def test_the_table_has_a_line_per_kind_and_the_totals(tmp_path: Path) -> None:
    rows = report.check_rows("runtime", [row("worker_kill", 20, 20, [2.0, 4.0]), row("checkpoint_write", 1, 1, [])])
    doc = report.summarise(rows, {"passed": True, "examples": {"verdicts": 2000}},
                           {"passed": 12, "failed": 0, "files": ["tests/test_security.py"]},
                           {"date": "2026-12-02", "machine": "x86_64, 2 cores", "wall_s": 600.0,
                            "part_wall_s": {"runtime": 480.0, "security": 120.0}})
    text = report.table(doc)
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert "(`make chaos`: runtime 8 min, security 2 min;" in text
    assert "| worker_kill | runtime | 20 | 20 | 0 | 0 | 3.0 s | 3.9 s |" in text
    assert "| checkpoint_write | runtime | 1 | 1 | 0 | 0 | n/a | n/a |" in text
    assert "| **all** | | **21** | **21** | **0** | **0** | | |" in text
    assert "verdicts 2,000 examples; all properties held" in text
    assert "Security checks: 12 passed, 0 failed" in text
    report.plot(doc, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_junit_counts_errors_as_failures(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite tests="7" failures="1" errors="1" skipped="2"/></testsuites>')
    assert count(junit) == {"passed": 3, "failed": 2, "skipped": 2}


def test_parts_kept_from_earlier_runs_are_put_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.chaos.__main__ import main

    parts = {"runtime": [row("worker_kill", 20, 20, [2.0, 4.0])], "operator": [row("operator_kill", 20, 20, [9.0])],
             "fuzz": {"passed": True, "examples": {"verdicts": 2000}}, "security": {"passed": 5, "failed": 0,
                                                                                   "files": ["tests/test_security.py"]}}
    for part, result in parts.items():
        (tmp_path / f"reliability-{part}.json").write_text(json.dumps({"wall_s": 60.0, "result": result}))
    assert main(["--reuse", "runtime,operator,fuzz,security", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "reliability.json").read_text())
    assert doc["totals"] == {"injected": 40, "survived": 40, "duplicates": 0, "losses": 0}
    assert doc["wall_s"] == 240.0 and doc["reused"] == ["runtime", "operator", "fuzz", "security"]
    section = (tmp_path / "README-section.md").read_text()
    assert "| operator_kill | operator | 20 | 20 |" in section
    assert f"; `{tmp_path / 'reliability.json'}`)." in section
    lost_one = {"wall_s": 1.0, "result": [row("worker_kill", 2, 1, [])]}
    (tmp_path / "reliability-runtime.json").write_text(json.dumps(lost_one))
    assert main(["--reuse", "runtime,operator,fuzz,security", "--out", str(tmp_path)]) == 1
    capsys.readouterr()


def test_an_unknown_part_or_a_missing_earlier_result_is_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.chaos.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--parts", "runtime,nope", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "unknown part nope; allowed: runtime, operator, fuzz, security" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reuse", "fuzz", "--parts", "", "--out", str(tmp_path)])
    assert f"--reuse fuzz: no {tmp_path / 'reliability-fuzz.json'} from an earlier run" in capsys.readouterr().err
