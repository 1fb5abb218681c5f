from pathlib import Path


def test_config():
    assert Path("/etc/app.conf").read_text().strip() == "port=8080"
