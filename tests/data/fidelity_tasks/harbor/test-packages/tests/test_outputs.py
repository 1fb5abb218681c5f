from pathlib import Path

import tomlkit  # not in the image: only the test script's `uvx --with` brings it


def test_tomlkit_is_the_version_the_script_asks_for():
    assert tomlkit.__version__ == "0.13.2"


def test_config():
    document = tomlkit.parse(Path("/app/config.toml").read_text())
    assert document["server"]["port"] == 8080
