import os
import subprocess
from pathlib import Path


def test_config_in_etc():
    assert Path("/etc/tracker/tracker.conf").read_text().strip() == "mode=strict"


def test_helper_in_usr_local():
    assert subprocess.run(["tracker"], capture_output=True, text=True).stdout.strip() == "tracking"


def test_state_dir_in_opt():
    assert Path("/opt/tracker/state").is_dir()


def test_log_in_var_log():
    assert "started" in Path("/var/log/tracker.log").read_text()
    assert os.stat("/var/log/tracker.log").st_uid == 0
