from pathlib import Path

import pytest

SUMMARY = Path("/app/summary.txt")


def _summary():
    return dict(line.split("=", 1) for line in SUMMARY.read_text().splitlines() if line)


@pytest.mark.parametrize(
    "key,expected",
    [("requests", "7"), ("unique_ips", "4"), ("errors", "3"), ("bytes", "1632"), ("top_path", "/index.html")],
)
def test_summary_value(key, expected):
    assert _summary().get(key) == expected


def test_summary_has_no_extra_lines():
    assert sorted(_summary()) == ["bytes", "errors", "requests", "top_path", "unique_ips"]


def test_errors_log():
    assert Path("/app/errors.log").read_text().splitlines() == [
        "10.0.0.1 POST /api/login 401 64",
        "10.0.0.2 GET /missing 404 32",
        "10.0.0.4 GET /index.html 500 0",
    ]
