"""The persistent XLA compilation cache every t1jax process shares (t1jax.compilation_cache):
where `configure` points jax, and that jax itself then writes there and reads back (its own
monitoring events, not our bookkeeping, say whether a compilation was served from the cache)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from t1jax import compilation_cache

REPO = Path(__file__).resolve().parents[1]


def test_the_default_directory_is_under_the_users_cache(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compilation_cache.configure(environ) == tmp_path / "t1jax" / "xla"
    assert environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "t1jax" / "xla")
    assert environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    # the size limit is what makes jax lock the directory between processes
    assert int(environ["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0


def test_a_chosen_directory_and_the_callers_own_jax_settings_win(tmp_path):
    mine = str(tmp_path / "mine")
    environ = {compilation_cache.ENV: mine, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
    assert compilation_cache.configure(environ) == tmp_path / "mine"
    assert environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "2"
    environ = {compilation_cache.ENV: mine, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    assert compilation_cache.configure(environ) == tmp_path / "jax"
    assert environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax")


def test_off_leaves_jax_alone():
    environ = {compilation_cache.ENV: "OFF"}
    assert compilation_cache.configure(environ) is None
    assert environ == {compilation_cache.ENV: "OFF"}


def test_a_file_where_the_directory_should_be_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="T1JAX_COMPILATION_CACHE=.*a-file: not a directory"):
        compilation_cache.configure({compilation_cache.ENV: str(blocker)})
    env = {**os.environ, compilation_cache.ENV: str(blocker)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "t1jax.cli", "tasks", "generate", "--out", str(tmp_path / "t"), "--n", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"t1jax tasks generate: error: {compilation_cache.ENV}={blocker}: not a directory "
        "(give a directory, or `off`)"
    ]
    assert not (tmp_path / "t").exists()


# A process as `t1jax.cli.main` leaves it: configured first, then jax imported (by the parser's
# subcommand modules), then a program compiled; jax's monitoring events report hits and misses.
_COMPILE = """
import sys
from t1jax import cli
cli.main(["tasks", "generate", "--out", sys.argv[1], "--n", "2"])
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
print(jax.config.jax_compilation_cache_dir)
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + x)(jnp.float32(2.0))))
print(sum(e == "/jax/compilation_cache/cache_hits" for e in events))
"""


def test_a_second_process_is_served_what_the_first_compiled(tmp_path):
    env = {**os.environ, compilation_cache.ENV: str(tmp_path / "cache")}
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)
    runs = []
    for attempt in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE, str(tmp_path / f"tasks{attempt}")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(done.stdout.split()[-3:])  # after what `tasks generate` printed
    (first_dir, first_value, first_hits), (second_dir, second_value, second_hits) = runs
    assert first_dir == second_dir == str(tmp_path / "cache")
    assert first_value == second_value
    assert (first_hits, int(second_hits) >= 1) == ("0", True)
    assert any(path.name.endswith("-cache") for path in (tmp_path / "cache").iterdir())
