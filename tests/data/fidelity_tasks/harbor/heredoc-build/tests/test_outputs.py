from pathlib import Path


def test_report():
    assert Path("/app/report.txt").read_text().strip() == "report-ok"
