"""Verifier planning (run the task's script or the pinned pytest), test checksums, the toolchain."""

import shutil

import pytest

from sandbox_service.tasks import load_task
from sandbox_service.verifier import (
    PINNED_REQUIREMENTS,
    REPORT_DIR,
    TOOLCHAIN_MOUNT,
    Toolchain,
    ToolchainMissing,
    diff_manifests,
    manifest_of_sources,
    plan_verifier,
)
from sandbox_service.verifier import tests_manifest as manifest_of_tree

from .conftest import HARBOR_HELLO, HARBOR_SALES, TB1_HELLO, TB1_LOGS

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "PYTEST_PLUGINS": "evil"}


def test_script_that_only_needs_pytest_runs_itself_with_reports_added():
    plan = plan_verifier(load_task(HARBOR_HELLO), BASE_ENV)
    assert plan.mode == "script"
    assert plan.argv == ("/bin/bash", "--noprofile", "--norc", "/tests/test.sh")
    assert plan.env["PATH"].startswith(f"{TOOLCHAIN_MOUNT}/bin:")
    assert f"--junitxml={REPORT_DIR}/junit.xml" in plan.env["PYTEST_ADDOPTS"]
    assert "--confcutdir=/tests" in plan.env["PYTEST_ADDOPTS"] and "PYTEST_PLUGINS" not in plan.env
    assert plan.env["PYTHONNOUSERSITE"] == "1" and plan.env["HOME"] == "/root"
    tb1 = plan_verifier(load_task(TB1_LOGS), BASE_ENV)
    assert tb1.mode == "script" and tb1.argv[-1] == "/tests/run-tests.sh" and tb1.env["TEST_DIR"] == "/tests"


@pytest.mark.parametrize(
    "task_dir,script,tool", [(HARBOR_SALES, "test.sh", "apt-get"), (TB1_HELLO, "run-tests.sh", "curl")]
)
def test_script_that_downloads_is_replaced_by_pinned_pytest(task_dir, script, tool):
    plan = plan_verifier(load_task(task_dir), BASE_ENV)
    assert plan.mode == "pytest"
    assert plan.argv[:4] == ("/usr/bin/python3", "-P", "-s", f"{TOOLCHAIN_MOUNT}/run_pytest.py")
    assert plan.argv[-1] == "/tests/test_outputs.py"
    assert "--rootdir=/tests" in plan.argv and f"--ctrf={REPORT_DIR}/ctrf.json" in plan.argv
    assert plan.note == f"ran pinned pytest on test_outputs.py instead of {script}, which uses {tool!r}"
    assert "PYTEST_ADDOPTS" not in plan.env


def test_download_detection_and_test_file_choice(tmp_path):
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    tests = task_dir / "tests"
    (tests / "test_extra.py").write_text("def test_x():\n    pass\n")
    (tests / "helper.py").write_text("")
    cases = {
        "pip install pytest\npytest /tests/test_outputs.py\n": ("pytest", ("/tests/test_outputs.py",)),
        "python -m pip install -r req.txt\npytest\n": (
            "pytest",
            ("/tests/test_extra.py", "/tests/test_outputs.py"),
        ),
        "git clone https://x/y\npytest $TEST_DIR/test_extra.py\n": ("pytest", ("/tests/test_extra.py",)),
        "pytest /tests -rA  # no network, uvicorn is not uv\n": ("script", None),
        "echo pipeline | cat\npytest\n": ("script", None),
    }
    for script, (mode, files) in cases.items():
        (tests / "test.sh").write_text(script)
        plan = plan_verifier(load_task(task_dir), BASE_ENV)
        assert plan.mode == mode, script
        if files:
            assert plan.argv[-len(files) :] == files, script


def test_tests_manifest_detects_every_change(tmp_path):
    task = load_task(TB1_LOGS)
    manifest = manifest_of_sources(task)
    assert set(manifest) == {"test_outputs.py", "run-tests.sh"}  # TB 1.x: run-tests.sh goes to /tests too
    copy = shutil.copytree(task.tests_dir, tmp_path / "copy")
    shutil.copy(task.source_dir / "run-tests.sh", copy)
    assert diff_manifests(manifest, manifest_of_tree(copy)) == []
    (copy / "test_outputs.py").write_text("def test_ok(): pass\n")
    (copy / "conftest.py").write_text("")
    (copy / "run-tests.sh").unlink()
    assert diff_manifests(manifest, manifest_of_tree(copy)) == [
        "missing run-tests.sh",
        "unexpected conftest.py",
        "changed test_outputs.py",
    ]


def test_toolchain_must_be_set_up(tmp_path, toolchain_dir):
    with pytest.raises(ToolchainMissing, match="python -m sandbox_service.verifier --setup"):
        Toolchain.at(tmp_path)
    toolchain = Toolchain.at(toolchain_dir)
    assert (toolchain.directory / "run_pytest.py").is_file() and (
        toolchain.directory / "bin" / "pytest"
    ).is_file()
    assert PINNED_REQUIREMENTS == ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")
    assert (toolchain.directory / "site" / "pytest-8.4.1.dist-info").is_dir()
    assert (toolchain.directory / "site" / "pytest_json_ctrf-0.3.5.dist-info").is_dir()
