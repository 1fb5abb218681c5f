"""Verifier planning (run the task's script or the pinned pytest), test checksums, the toolchain."""

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox_service.tasks import load_task
from sandbox_service.verifier import (
    HOST_MOUNT,
    IMAGE_MOUNT,
    PINNED_REQUIREMENTS,
    REPORT_DIR,
    TOOLCHAIN_MOUNT,
    Toolchain,
    ToolchainMissing,
    diff_manifests,
    find_runtime,
    manifest_of_sources,
    plan_verifier,
    provide_test_packages,
    resolve_in_root,
    script_test_requirements,
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
    # Only options any pytest has: a script that runs the image's own pytest must not die on --ctrf.
    assert "--ctrf" not in plan.env["PYTEST_ADDOPTS"]
    assert f"-c {TOOLCHAIN_MOUNT}/empty-pytest.ini" in plan.env["PYTEST_ADDOPTS"]
    assert plan.env["PYTHONNOUSERSITE"] == "1" and plan.env["HOME"] == "/root"
    tb1 = plan_verifier(load_task(TB1_LOGS), BASE_ENV)
    assert tb1.mode == "script" and tb1.argv[-1] == "/tests/run-tests.sh" and tb1.env["TEST_DIR"] == "/tests"


@pytest.mark.parametrize(
    "task_dir,script,tool", [(HARBOR_SALES, "test.sh", "apt-get"), (TB1_HELLO, "run-tests.sh", "curl")]
)
def test_script_that_downloads_is_replaced_by_pinned_pytest(task_dir, script, tool):
    plan = plan_verifier(load_task(task_dir), BASE_ENV)
    assert plan.mode == "pytest"
    assert plan.argv[0] == f"{TOOLCHAIN_MOUNT}/bin/pytest"  # no pristine runtime: the container's python3
    assert plan.argv[-1] == "/tests/test_outputs.py"
    assert "--rootdir=/tests" in plan.argv and f"--ctrf={REPORT_DIR}/ctrf.json" in plan.argv
    assert plan.note.startswith(
        f"ran pinned pytest on test_outputs.py instead of {script}, which uses {tool!r}"
    )
    assert "PYTEST_ADDOPTS" not in plan.env


def test_pinned_pytest_runs_on_the_pristine_interpreter():
    """With a pristine root (here: the host's own /, a real root with a real python3), every program
    the plan starts is a path under IMAGE_MOUNT run through that root's own dynamic loader."""
    runtime = find_runtime(Path("/"), search_path="/usr/local/bin:/usr/bin:/bin")
    assert runtime.python.program.startswith(IMAGE_MOUNT + "/usr/bin/python3.")
    assert runtime.python.loader.startswith(IMAGE_MOUNT) and "ld-linux" in runtime.python.loader
    assert runtime.python_home == IMAGE_MOUNT + "/usr" and runtime.host_mounts == ()
    pytest_plan = plan_verifier(load_task(HARBOR_SALES), BASE_ENV, runtime)
    assert pytest_plan.argv[:3] == (runtime.python.loader, "--library-path", runtime.python.library_path)
    assert pytest_plan.argv[3] == runtime.python.program and "-S" in pytest_plan.argv
    assert (
        pytest_plan.env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
        and pytest_plan.env["PYTHONHOME"] == runtime.python_home
    )
    script_plan = plan_verifier(load_task(HARBOR_HELLO), BASE_ENV, runtime)
    assert script_plan.argv[0] == runtime.bash.loader and script_plan.argv[3].startswith(
        IMAGE_MOUNT + "/usr/bin/bash"
    )
    # `pytest` and `python3 -m pytest` in the script: bash functions that run the pinned toolchain
    assert "run_pytest.py" in script_plan.env["BASH_FUNC_pytest%%"]
    assert "pytest" in script_plan.env["BASH_FUNC_python3%%"]
    # Really run the launcher the way the plan does (the host root stands for the image here).
    local = {k: v.replace(IMAGE_MOUNT, "") if k.startswith("T1JAX") else v for k, v in runtime.env().items()}
    assert local["T1JAX_PYTHON"].startswith("/usr/bin/python3.")


def test_runtime_falls_back_to_the_host_when_the_image_has_no_python(tmp_path):
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    shutil.copy("/usr/bin/bash", tmp_path / "usr" / "bin" / "bash")  # a bash, but not its loader
    (tmp_path / "bin").symlink_to("usr/bin")
    runtime = find_runtime(tmp_path, search_path="/usr/bin:/bin")
    assert runtime.python.program.startswith(HOST_MOUNT + "/usr/bin/python3")
    assert runtime.host_mounts == (("/usr", HOST_MOUNT + "/usr"),)
    assert runtime.site_dirs == () and "the image has no python3" in runtime.note
    assert runtime.bash.program == HOST_MOUNT + "/usr/bin/bash"  # a program that cannot load is not used


def test_resolve_in_root_keeps_absolute_links_inside(tmp_path):
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "python3.13").write_text("")
    (tmp_path / "usr" / "local" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "local" / "bin" / "python3").symlink_to(
        "/usr/bin/python3.13"
    )  # absolute, as in images
    (tmp_path / "escape").symlink_to("/../../etc/passwd")
    assert resolve_in_root(tmp_path, "/usr/local/bin/python3") == "/usr/bin/python3.13"
    assert resolve_in_root(tmp_path, "/escape") is None  # /etc/passwd of the root, which it does not have


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
    assert PINNED_REQUIREMENTS[:2] == ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")
    assert (toolchain.directory / "site" / "exceptiongroup").is_dir()  # pytest's backport for Python < 3.11
    assert (toolchain.directory / "site" / "pytest-8.4.1.dist-info").is_dir()
    assert (toolchain.directory / "site" / "pytest_json_ctrf-0.3.5.dist-info").is_dir()


def test_requirements_of_a_replaced_script_are_what_it_installs_for_its_tests():
    script = (
        "curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh  # uv itself is no requirement\n"
        "python3 -m pip install --break-system-packages -q pytest==9.0.3 2>/dev/null || true\n"
        "pip install -r requirements.txt --index-url https://x numpy 'scipy>=1.14' $EXTRA ./local\n"
        "uvx --python 3.12 --with pytest==8.4.1 -w pandas,polars==1.0 \\\n"
        "  --with=pytest-json-ctrf==0.3.5 --with Pillow[avif]==11.0 pytest /tests/test_outputs.py\n"
        "uv add requests; echo uvicorn is not uv\n"
    )
    assert script_test_requirements(script) == (
        "numpy", "scipy>=1.14", "pandas", "polars==1.0", "Pillow[avif]==11.0", "requests",
    )  # fmt: skip
    assert script_test_requirements("pytest /tests -rA\n") == ()


def test_packages_a_replaced_script_installs_are_provided_to_the_pinned_pytest(tmp_path, toolchain_dir):
    """`uvx --with tomlkit==0.13.2`: the service installs it from PyPI (once, for the verifier's
    interpreter version) into the toolchain, and the launcher really imports it from there."""
    task_dir = shutil.copytree(HARBOR_HELLO, tmp_path / "t")
    script = "uvx --with pytest==8.4.1 --with tomlkit==0.13.2 pytest /tests/test_outputs.py\n"
    (task_dir / "tests" / "test.sh").write_text(script)
    (task_dir / "tests" / "test_outputs.py").write_text(
        "import tomlkit\n\ndef test_it():\n    assert tomlkit.__version__ == '0.13.2'\n"
    )
    runtime = find_runtime(Path("/"), search_path="/usr/local/bin:/usr/bin:/bin")
    plan = plan_verifier(load_task(task_dir), BASE_ENV, runtime)
    assert plan.mode == "pytest" and plan.requirements == ("tomlkit==0.13.2",)
    toolchain = Toolchain.at(toolchain_dir)
    provided = provide_test_packages(plan, toolchain, runtime)
    assert provided.note.endswith("with tomlkit==0.13.2 (installed from PyPI by the service)")
    mounted = provided.env["T1JAX_TEST_PACKAGES"]
    assert mounted.startswith(f"{TOOLCHAIN_MOUNT}/test-packages/cp{runtime.python_version[0]}")
    packages = mounted.replace(TOOLCHAIN_MOUNT, str(toolchain.directory))
    launch = [runtime.python.program.replace(IMAGE_MOUNT, ""), *runtime.python_flags(),
              str(toolchain.directory / "run_pytest.py"), "-q", "-p", "no:cacheprovider",
              str(task_dir / "tests" / "test_outputs.py")]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    without = subprocess.run(launch, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert without.returncode != 0 and "No module named 'tomlkit'" in without.stdout
    done = subprocess.run(launch, env={**env, "T1JAX_TEST_PACKAGES": packages}, capture_output=True,
                          text=True, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # Installing them cannot fail the verifier: the note says why they are missing.
    again = provide_test_packages(dataclasses.replace(plan, requirements=("tomlkit==0.13.1",)), toolchain,
                                  runtime, python="/nonexistent/python3")  # fmt: skip
    assert "T1JAX_TEST_PACKAGES" not in again.env
    assert "without tomlkit==0.13.1: installing them failed" in again.note
    script_plan = plan_verifier(load_task(HARBOR_HELLO), BASE_ENV, runtime)
    assert provide_test_packages(script_plan, toolchain, runtime) is script_plan  # runs its own script
