from pathlib import Path


def test_hostname_exists():
    assert Path("/etc/hostname").exists()
