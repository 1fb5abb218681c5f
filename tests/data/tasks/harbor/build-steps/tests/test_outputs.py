from pathlib import Path


def test_greeting_uses_installed_tool():
    assert Path("/app/greeting.txt").read_text().strip() == "Hello, agent! (greeter 1.2.3)"


def test_inventory_count():
    assert Path("/app/count.txt").read_text().strip() == "3"


def test_debug_disabled():
    lines = Path("/app/config/app.ini").read_text().splitlines()
    assert "debug = false" in lines and "debug = true" not in lines


def test_other_config_lines_kept():
    lines = Path("/app/config/app.ini").read_text().splitlines()
    assert lines[:2] == ["[server]", "port = 8080"] and "name = demo" in lines


def test_seeded_data_kept():
    assert Path("/app/data/seed.txt").read_text() == "seeded by RUN\n"
