"""Report parsers against reports the pinned pytest / pytest-json-ctrf really write, and broken ones."""

import json
import subprocess
import textwrap

import pytest

from sandbox_service.contracts import FailureCause
from sandbox_service.reports import (
    MAX_REPORT_BYTES,
    ReportParseError,
    build_report,
    parse_ctrf,
    parse_junit_xml,
    parse_pytest_summary,
    parse_reward_json,
    parse_reward_txt,
)

SAMPLE_TESTS = textwrap.dedent(
    """
    import pytest

    def test_pass():
        assert 1 + 1 == 2

    def test_fail():
        assert 1 + 1 == 3

    @pytest.mark.skip(reason="not today")
    def test_skipped():
        pass

    @pytest.mark.xfail(reason="known bug")
    def test_xfail():
        assert False

    @pytest.mark.parametrize("value", [1, 2, 3])
    def test_param(value):
        assert value != 2

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture exploded")

    def test_fixture_error(broken):
        pass
    """
)
# pass, fail, skip (counts as passed), xfail (passed), param[1] pass, param[2] fail, param[3] pass, error
EXPECTED_BY_CASE = [True, False, True, True, True, False, True, False]


@pytest.fixture(scope="module")
def real_reports(tmp_path_factory, toolchain_dir):
    """Run the service's pinned pytest (as the verifier does) on a sample file; keep its outputs."""
    work = tmp_path_factory.mktemp("reports")
    (work / "test_sample.py").write_text(SAMPLE_TESTS)
    run = subprocess.run(
        ["/usr/bin/python3", "-P", "-s", str(toolchain_dir / "run_pytest.py"),
         "-rA", "-p", "no:cacheprovider",
         f"--junitxml={work}/junit.xml", f"--ctrf={work}/ctrf.json", str(work / "test_sample.py")],
        capture_output=True, text=True, cwd=work, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # some tests failed
    return work, run.stdout


def test_junit_from_real_pytest(real_reports):
    work, _ = real_reports
    results = parse_junit_xml((work / "junit.xml").read_text())
    assert [r.passed for r in results] == EXPECTED_BY_CASE
    assert results[0].name == "test_sample::test_pass"
    assert [r.name for r in results][4:7] == [f"test_sample::test_param[{v}]" for v in (1, 2, 3)]


def test_ctrf_from_real_pytest_json_ctrf(real_reports):
    work, _ = real_reports
    results = {r.name: r.passed for r in parse_ctrf((work / "ctrf.json").read_text())}
    # pytest-json-ctrf 0.3.5 merges a parametrized test's cases into one record (failed if any failed)
    assert results == {
        "test_sample.py::test_pass": True,
        "test_sample.py::test_fail": False,
        "test_sample.py::test_skipped": True,
        "test_sample.py::test_xfail": True,
        "test_sample.py::test_param": False,
        "test_sample.py::test_fixture_error": False,
    }


def test_summary_from_real_pytest_output(real_reports):
    _, output = real_reports
    results = parse_pytest_summary(output)
    by_name = {r.name: r.passed for r in results}
    assert by_name["test_sample.py::test_pass"] is True
    assert by_name["test_sample.py::test_fail"] is False
    assert by_name["test_sample.py::test_param[2]"] is False
    assert by_name["test_sample.py::test_xfail"] is True
    assert by_name["test_sample.py::test_fixture_error"] is False
    assert len(results) == 8


def test_build_report_prefers_junit_then_ctrf_then_summary(real_reports, tmp_path):
    work, output = real_reports
    report = build_report(report_dir=work, output=output, exit_code=1)
    assert report.parsed and report.failure_cause == FailureCause.NONE
    assert (report.passed, report.total) == (5, 8) and report.binary_outcome is False
    (tmp_path / "ctrf.json").write_text((work / "ctrf.json").read_text())
    report = build_report(report_dir=tmp_path, output="", exit_code=1)
    assert (report.passed, report.total) == (3, 6)
    report = build_report(report_dir=tmp_path / "none", output=output, exit_code=1)
    assert (report.passed, report.total) == (5, 8)


def test_broken_junit_falls_back_and_is_noted(real_reports, tmp_path):
    work, _ = real_reports
    (tmp_path / "junit.xml").write_text("<testsuites><testcase name='x'>")  # truncated
    (tmp_path / "ctrf.json").write_text((work / "ctrf.json").read_text())
    report = build_report(report_dir=tmp_path, output="", exit_code=1)
    assert report.parsed and report.total == 6
    assert "junit.xml: invalid JUnit XML" in report.detail


@pytest.mark.parametrize(
    "files,output,cause",
    [
        ({}, "", FailureCause.MISSING_REPORT),
        ({"junit.xml": "not xml"}, "", FailureCause.PARSE_ERROR),
        ({"ctrf.json": "{"}, "", FailureCause.PARSE_ERROR),
        ({"ctrf.json": '{"results": {"tests": []}}'}, "", FailureCause.EMPTY_REPORT),
        ({"junit.xml": "<testsuites><testsuite/></testsuites>"}, "", FailureCause.EMPTY_REPORT),
        ({"ctrf.json": '{"results": {"tests": [{"status": "passed"}]}}'}, "", FailureCause.PARSE_ERROR),
        ({"ctrf.json": '{"results": {"tests": [{"name": "a"}]}}'}, "", FailureCause.PARSE_ERROR),
        ({"ctrf.json": "[1, 2]"}, "", FailureCause.PARSE_ERROR),
        ({"junit.xml": "<html><body/></html>"}, "", FailureCause.PARSE_ERROR),
        ({}, "=== short test summary info ===\n=== 0 passed in 0.01s ===\n", FailureCause.EMPTY_REPORT),
        ({}, "collected 0 items\nno summary here\n", FailureCause.MISSING_REPORT),
    ],
)
def test_broken_reports_never_raise(tmp_path, files, output, cause):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    report = build_report(report_dir=tmp_path, output=output, exit_code=2)
    assert report.parsed is False and report.failure_cause == cause
    assert report.assertions == () and report.total == 0
    assert report.binary_outcome is False  # from the exit status
    assert report.detail


def test_timeout_wins_over_everything(tmp_path):
    (tmp_path / "reward.txt").write_text("1")
    report = build_report(report_dir=tmp_path, output="", exit_code=None, timed_out=True)
    assert report.failure_cause == FailureCause.VERIFIER_TIMEOUT and report.binary_outcome is None


def test_reward_files(tmp_path):
    assert parse_reward_txt(" 1\n") == 1.0
    assert parse_reward_json('{"reward": 0.5, "style": 1}') == 0.5
    assert parse_reward_json('{"accuracy": 0.25}') == 0.25
    for bad in ("", "one", "nan", "inf"):
        with pytest.raises(ReportParseError):
            parse_reward_txt(bad)
    for bad in ("{}", "[]", '{"a": 1, "b": 2}', '{"reward": "high"}', '{"reward": true}', "{"):
        with pytest.raises(ReportParseError):
            parse_reward_json(bad)
    (tmp_path / "reward.txt").write_text("1\n")
    report = build_report(report_dir=tmp_path, output="", exit_code=1)
    assert report.binary_outcome is True and report.reward_value == 1.0  # the reward file decides
    (tmp_path / "reward.json").write_text(json.dumps({"reward": 0.0}))
    report = build_report(report_dir=tmp_path, output="", exit_code=0)
    assert report.binary_outcome is False and report.reward_value == 0.0  # reward.json before .txt
    (tmp_path / "reward.json").write_text("garbage")
    report = build_report(report_dir=tmp_path, output="", exit_code=0)
    assert report.reward_value is None and report.binary_outcome is True and "reward.json" in report.detail


def test_report_files_that_are_symlinks_or_huge_are_refused(tmp_path, real_reports):
    work, _ = real_reports
    (tmp_path / "junit.xml").symlink_to(work / "junit.xml")  # a verifier could point at any host file
    assert (
        build_report(report_dir=tmp_path, output="", exit_code=1).failure_cause == FailureCause.MISSING_REPORT
    )
    (tmp_path / "junit.xml").unlink()
    with open(tmp_path / "ctrf.json", "wb") as handle:
        handle.truncate(MAX_REPORT_BYTES + 1)
    report = build_report(report_dir=tmp_path, output="", exit_code=1)
    assert report.failure_cause == FailureCause.PARSE_ERROR and "limit" in report.detail


def test_summary_statuses():
    text = textwrap.dedent(
        """
        ============ short test summary info ============
        PASSED tests/test_a.py::test_one
        FAILED tests/test_a.py::test_two - AssertionError: assert 1 == 2
        ERROR tests/test_a.py::test_three - RuntimeError
        XPASS tests/test_a.py::test_four unexpectedly passing
        XFAIL tests/test_a.py::test_five - reason
        SKIPPED [1] tests/test_a.py:10: skipped
        ============ 1 failed, 1 passed in 0.1s ============
        PASSED tests/test_a.py::after_the_summary
        """
    )
    results = parse_pytest_summary(text)
    assert [(r.name, r.passed) for r in results] == [
        ("tests/test_a.py::test_one", True),
        ("tests/test_a.py::test_two", False),
        ("tests/test_a.py::test_three", False),
        ("tests/test_a.py::test_four unexpectedly passing", False),
        ("tests/test_a.py::test_five", True),
        ("[1] tests/test_a.py:10: skipped", True),
    ]
    with pytest.raises(ReportParseError, match="short test summary"):
        parse_pytest_summary("1 passed")
