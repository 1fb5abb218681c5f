"""Verifier report parsers: per-assertion records from JUnit XML, CTRF JSON or pytest's summary text.

This module owns reading what a verifier wrote (files in its report directory and its console
output) and turning it into a `VerifierReport`.

Sources, in the order `build_report` prefers them:
1. `junit.xml` (pytest `--junitxml`): one record per test case, parametrized cases kept apart and
   collection errors counted as failures.
2. `ctrf.json` (pytest-json-ctrf `--ctrf`, what Terminal-Bench 2.x test scripts write): one record
   per test; pytest-json-ctrf 0.3.5 merges the cases of a parametrized test into one.
3. The text after pytest's "short test summary info" line (`pytest -rA`, Terminal-Bench 1.x).
Harbor's `reward.txt` (one number) / `reward.json` (flat name -> number) give the task-level reward.

Invariants:
- Status mapping follows Terminal-Bench: passed, skipped and xfail count as passed; failed, error,
  xpass(strict), pending and anything unknown count as failed.
- `build_report` never raises: a missing, oversized, malformed or empty report becomes
  `parsed=False` with a `FailureCause` and a `detail` saying which source failed and how.
- `binary_outcome` comes from the reward file when there is one (reward >= 1 means solved), else
  from the verifier's exit status; it is None when the verifier timed out or never ran.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

from sandbox_service.contracts import AssertionResult, FailureCause, VerifierReport

JUNIT_FILE = "junit.xml"
CTRF_FILE = "ctrf.json"
REWARD_TXT = "reward.txt"
REWARD_JSON = "reward.json"
MAX_REPORT_BYTES = 16 * 1024 * 1024  # a verifier cannot make the service parse an unbounded file

_PASSING_STATUSES = frozenset({"passed", "skipped", "xfail"})
_SUMMARY_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.+?)\s*$")


class ReportParseError(ValueError):
    """A report exists but is not a valid record of its format."""


def parse_junit_xml(text: str) -> tuple[AssertionResult, ...]:
    """Every `<testcase>` of a JUnit XML document; failed if it has `<failure>` or `<error>`."""
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise ReportParseError(f"invalid JUnit XML: {error}") from error
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportParseError(f"JUnit XML root is <{root.tag}>, expected <testsuites> or <testsuite>")
    results = []
    for case in root.iter("testcase"):
        name = case.get("name")
        if not name:
            raise ReportParseError("JUnit <testcase> without a name")
        classname = case.get("classname") or ""
        failed = case.find("failure") is not None or case.find("error") is not None
        results.append(AssertionResult(name=f"{classname}::{name}" if classname else name, passed=not failed))
    return tuple(results)


def parse_ctrf(text: str) -> tuple[AssertionResult, ...]:
    """`results.tests[*].{name, status}` of a CTRF JSON document."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ReportParseError(f"invalid CTRF JSON: {error}") from error
    results = document.get("results") if isinstance(document, dict) else None
    tests = results.get("tests") if isinstance(results, dict) else None
    if not isinstance(tests, list):
        raise ReportParseError("CTRF JSON has no results.tests list")
    parsed = []
    for index, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("name"), str) or not test["name"]:
            raise ReportParseError(f"CTRF results.tests[{index}] has no name")
        status = test.get("status")
        if not isinstance(status, str):
            raise ReportParseError(f"CTRF results.tests[{index}] ({test['name']}) has no status")
        parsed.append(AssertionResult(name=test["name"], passed=status.lower() in _PASSING_STATUSES))
    return tuple(parsed)


def parse_pytest_summary(text: str) -> tuple[AssertionResult, ...]:
    """The `STATUS name` lines after the last "short test summary info" header of pytest output."""
    lines = text.splitlines()
    header = max((i for i, line in enumerate(lines) if "short test summary info" in line), default=None)
    if header is None:
        raise ReportParseError("no 'short test summary info' section in the verifier output")
    results = []
    for line in lines[header + 1 :]:
        if line.startswith("="):  # the closing "=== 2 failed, 3 passed in 0.12s ===" line
            break
        match = _SUMMARY_STATUS.match(line.strip())
        if match:
            status, rest = match.groups()
            name = rest.split(" - ", 1)[0].strip()
            results.append(AssertionResult(name=name, passed=status.lower() in _PASSING_STATUSES))
    return tuple(results)


def parse_reward_txt(text: str) -> float:
    """Harbor `reward.txt`: a single finite number."""
    try:
        value = float(text.strip())
    except ValueError as error:
        raise ReportParseError(f"reward.txt is not a number: {text.strip()[:80]!r}") from error
    if not math.isfinite(value):
        raise ReportParseError(f"reward.txt is not finite: {value}")
    return value


def parse_reward_json(text: str) -> float:
    """Harbor `reward.json`: flat name -> number; the `reward` entry, or the only entry."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ReportParseError(f"invalid reward.json: {error}") from error
    if not isinstance(document, dict) or not document:
        raise ReportParseError("reward.json must be a non-empty object of name -> number")
    for name, value in document.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ReportParseError(f"reward.json entry {name!r} is not a finite number: {value!r}")
    if "reward" in document:
        return float(document["reward"])
    if len(document) == 1:
        return float(next(iter(document.values())))
    raise ReportParseError(f"reward.json has several entries {sorted(document)} and no 'reward'")


def build_report(
    *,
    report_dir: Path | None,
    output: str,
    exit_code: int | None,
    timed_out: bool = False,
    detail: str = "",
) -> VerifierReport:
    """Combine what a finished verifier left behind into a `VerifierReport`. Never raises.

    `report_dir` is the verifier's fresh report directory (Harbor's /logs/verifier), `output` its
    combined console output, `exit_code` its exit status (None if it never finished).
    """
    notes = [detail] if detail else []
    if timed_out:
        notes.append("verifier killed at its deadline")
        return VerifierReport((), False, FailureCause.VERIFIER_TIMEOUT, None, None, "; ".join(notes))

    reward, reward_note = _read_reward(report_dir)
    if reward_note:
        notes.append(reward_note)
    if reward is not None:
        binary: bool | None = reward >= 1.0
    else:
        binary = None if exit_code is None else exit_code == 0

    sources: list[tuple[str, Callable[[], str | None], Callable[[str], tuple[AssertionResult, ...]]]] = [
        (JUNIT_FILE, lambda: _read_report_file(report_dir, JUNIT_FILE), parse_junit_xml),
        (CTRF_FILE, lambda: _read_report_file(report_dir, CTRF_FILE), parse_ctrf),
        (
            "pytest summary",
            lambda: output if "short test summary info" in output else None,
            parse_pytest_summary,
        ),
    ]
    saw_broken = saw_empty = False
    for label, read, parse in sources:
        try:
            text = read()
            if text is None:
                continue
            assertions = parse(text)
        except (ReportParseError, OSError, UnicodeDecodeError) as error:
            saw_broken = True
            notes.append(f"{label}: {error}")
            continue
        if not assertions:
            saw_empty = True
            notes.append(f"{label}: no tests recorded")
            continue
        return VerifierReport(assertions, True, FailureCause.NONE, binary, reward, "; ".join(notes))

    if saw_broken:
        cause = FailureCause.PARSE_ERROR
    elif saw_empty:
        cause = FailureCause.EMPTY_REPORT
    else:
        cause = FailureCause.MISSING_REPORT
        notes.append("no junit.xml, ctrf.json or pytest summary")
    return VerifierReport((), False, cause, binary, reward, "; ".join(notes))


def _read_report_file(report_dir: Path | None, name: str) -> str | None:
    if report_dir is None:
        return None
    path = report_dir / name
    if path.is_symlink() or not path.exists():
        return None  # a symlink could point the service at a file the verifier does not own
    if not path.is_file():
        raise ReportParseError(f"{name} is not a regular file")
    size = path.stat().st_size
    if size > MAX_REPORT_BYTES:
        raise ReportParseError(f"{name} is {size} bytes, over the {MAX_REPORT_BYTES}-byte limit")
    return path.read_text(encoding="utf-8")


def _read_reward(report_dir: Path | None) -> tuple[float | None, str]:
    for name, parse in ((REWARD_JSON, parse_reward_json), (REWARD_TXT, parse_reward_txt)):
        try:
            text = _read_report_file(report_dir, name)
            if text is None:
                continue
            return parse(text), ""
        except (ReportParseError, OSError, UnicodeDecodeError) as error:
            return None, f"{name}: {error}"
    return None, ""
