"""Golden tests: the real ``check-composition`` in a subprocess on ``examples/``.

``examples/expected.toml`` lists each case's command line and the fields to compare: exit code,
verdict status, per-condition statuses, rule names and witness fields. Prose is never compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES: list[dict[str, Any]] = tomllib.loads((ROOT / "examples" / "expected.toml").read_text())["case"]
CLI = [sys.executable, "-c", "from checker.cli import main; main()"]


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def results() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's JSON run, two at a time (each is a fresh interpreter that imports z3)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda case: run([*case["args"], "--json"]), CASES)
        return {case["name"]: result for case, result in zip(CASES, done, strict=True)}


def violation_record(v: dict[str, Any]) -> dict[str, Any]:
    return {**v["witness"], **{k: v[k] for k in ("rule", "condition", "state", "group", "axis")}}


def matches(expected: Any, actual: Any) -> bool:
    if expected == "*":
        return actual is not None
    if expected == "null":
        return actual is None
    return bool(expected == actual)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_example(case: dict[str, Any], results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = results[case["name"]]
    assert result.returncode == case["exit"], result.stderr
    assert "Traceback" not in result.stderr
    if case["exit"] == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")
        assert result.stdout == ""
        return
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["status"] == case["status"]
    for condition in ("gradient_integrity", "state_consistency", "composition_rules"):
        if condition in case:
            assert verdict[condition] == case[condition], condition
    fired = {v["rule"]: v for v in verdict["violations"]}
    assert set(case.get("rules", [])) <= set(fired), sorted(fired)
    if case["status"] == "proved":
        assert not fired and not verdict["unknown"]
    for note in case.get("notes", []):
        assert any(note in n for n in verdict["notes"])
    if "witness" in case:
        record = violation_record(fired[case["rules"][0]])
        for key, value in case["witness"].items():
            assert matches(value, record.get(key)), (key, value, record.get(key))


def test_human_report_has_a_verdict_section_and_explain() -> None:
    case = next(c for c in CASES if c["name"].startswith("ZeRO-1 without"))
    result = run([*case["args"], "--explain"])
    assert result.returncode == 1
    assert "Verdict: REFUTED" in result.stdout
    assert "refresh[P.attention, dp]" in result.stdout
    assert "single_device:" in result.stdout  # --explain prints the counterexample's fields
    proved = run(["dp2xpp2", "--model", "gpt3-1.3b", "--explain=all"])  # cores only with =all
    assert proved.returncode == 0 and "Unsat cores" in proved.stdout
    assert "integrity[G.embedding, pp]" in proved.stdout
    assert "state_consistency[embedding, pp]" in proved.stdout  # brackets are not taken as markup


def test_json_explain_lists_every_obligation_with_its_core() -> None:
    result = run(["zero24", "--model", "gpt3-1.3b", "--json", "--explain"])
    verdict = json.loads(result.stdout)["verdict"]
    assert len(verdict["explain"]) == verdict["obligations"]
    assert all(
        o["status"] == "proved" and o["core"] for o in verdict["explain"] if o["obligation"] != "composition_rules"
    )
