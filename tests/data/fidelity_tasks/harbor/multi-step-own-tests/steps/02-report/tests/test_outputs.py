from pathlib import Path


def test_report():
    assert Path("/app/report.txt").read_text().strip() == "8080"


def test_config_kept():
    assert Path("/etc/app.conf").read_text().strip() == "port=8080"
