from pathlib import Path


def test_page():
    assert "Example Domain" in Path("/app/page.html").read_text()
