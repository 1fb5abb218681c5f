"""The run config (strict keys, the paper's defaults, impossible combinations refused before any
device work, one-line CLI errors) and the grain task pool (per-epoch shuffle, resumable cursor)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from sandbox_service.tasks import load_dataset
from t1jax.cli import main
from t1jax.controller.config import ConfigError, RunConfig, load_run_config, run_config_from_dict
from t1jax.data.pool import TaskPool

REPO = Path(__file__).resolve().parents[2]
TINY_RUN = REPO / "configs" / "runs" / "tiny_cpu.yaml"
TASKS = REPO / "tests" / "data" / "tasks"


def test_defaults_are_the_papers():
    config = RunConfig()
    ppo, reward, adv = config.rl.ppo, config.rl.reward, config.rl.advantages
    assert (ppo.clip_eps, ppo.value_clip_eps) == (0.2, 0.2)
    assert (adv.gamma, adv.lam) == (1.0, 1.0) and reward.scale == 20.0
    actor, critic = config.rl.actor_optimizer, config.rl.critic_optimizer
    assert (actor.b1, actor.b2, actor.weight_decay) == (0.9, 0.98, 0.1)
    assert critic.learning_rate == pytest.approx(15 * actor.learning_rate)
    assert (config.schedule.batch_size, config.schedule.launch_size) == (512, 560)
    assert config.checkpoint.weights_every == 10
    live = config.liveness
    assert (live.probe_grace_sec, live.probe_period_sec, live.probe_deadline_sec) == (600, 30, 120)
    assert config.schedule.async_rollouts and not config.partial_rollouts.enabled
    assert config.schedule.rollouts_per_task == 1 and adv.baseline == "critic"  # one trajectory a task (§5.3)


def test_the_bundled_run_config_loads_and_resolves_every_default():
    config = load_run_config(TINY_RUN)
    resolved = config.resolved()
    assert resolved["rl"]["ppo"]["clip_eps"] == 0.2 and resolved["liveness"]["probe_period_sec"] == 10
    again = run_config_from_dict(yaml.safe_load(yaml.safe_dump(resolved)))
    assert again == config  # the run directory's copy is the same config


def write(tmp_path, **sections) -> Path:
    raw = yaml.safe_load(TINY_RUN.read_text())
    raw["model"]["preset"] = str(REPO / "configs" / "tiny_cpu.yaml")
    raw["tasks"]["directory"] = str(TASKS)
    for dotted, value in sections.items():
        section, _, key = dotted.partition("__")
        if key:
            raw.setdefault(section, {})[key] = value
        else:
            raw[section] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        ({"harness__max_turnz": 3}, "harness.max_turnz: unknown key"),
        ({"bogus": {}}, "bogus: unknown section"),
        ({"schedule__batch_size": "many"}, "schedule.batch_size: must be an integer"),
        ({"schedule__batch_size": 8}, "schedule.batch_size: 8 admitted cannot exceed the 6 launched"),
        ({"harness__context_window": 4096}, "harness.context_window: 4096 exceeds sampler.max_context"),
        ({"tasks__directory": "/nowhere/tasks"}, "tasks.directory: /nowhere/tasks does not exist"),
        ({"trainer__mesh": {"fsdp": 4, "expert": 2}}, "trainer.mesh: axis sizes"),
        ({"rl": {"ppo": {"clip": 0.3}}}, "unknown key(s) ['clip'] in section 'ppo'"),
        ({"sandboxes__backend": "docker-swarm"}, "sandboxes.backend: unknown backend 'docker-swarm'"),
        ({"sampling__top_p": 0.9}, "sampling.top_p: training rollouts need top_p 1 and top_k 0"),
        ({"sampling__temperature": 0.0}, "sampling.temperature: must be > 0"),
        (
            {"schedule__rollouts_per_task": 4},
            "schedule.rollouts_per_task: 4 does not divide schedule.launch_size 6",
        ),
        ({"schedule__rollouts_per_task": 0}, "schedule.rollouts_per_task: must be > 0"),
        ({"rl": {"advantages": {"baseline": "group"}}}, "advantages.baseline must be one of critic, task"),
        ({"rl": {"ppo": {"temperature": 0.5}}}, "rl.ppo.temperature 0.5 differs from sampling.temperature"),
    ],
)
def test_a_bad_config_names_the_key(tmp_path, change, message):
    with pytest.raises(ConfigError) as raised:
        load_run_config(write(tmp_path, **change))
    assert message in str(raised.value)


def test_the_learner_scores_the_temperature_rollouts_sample_at(tmp_path):
    config = load_run_config(write(tmp_path, sampling={"temperature": 0.6}))
    assert config.rl.ppo.temperature == 0.6 == config.sampling.temperature
    assert load_run_config(write(tmp_path)).rl.ppo.temperature == 1.0
    both = {"temperature": 0.6}
    assert load_run_config(write(tmp_path, sampling=both, rl={"ppo": both})).rl.ppo.temperature == 0.6
    # The run directory's copy (rl.ppo.temperature written out) reads back as the same config.
    assert run_config_from_dict(yaml.safe_load(yaml.safe_dump(config.resolved()))) == config


def test_learning_rates_written_as_people_write_them_are_numbers(tmp_path):
    # `1e-4` is a YAML 1.2 float but a string to PyYAML's YAML 1.1; the rl section then refused it
    # ("must be real number, not str"), in a config file and in `t1jax train --set` alike.
    path = write(tmp_path)
    text = path.read_text()
    assert "actor_optimizer:\n    learning_rate: 0.001\n" in text  # the bundled 1.0e-3, dumped
    old, new = "actor_optimizer:\n    learning_rate: 0.001", "actor_optimizer:\n    learning_rate: 3e-5"
    path.write_text(text.replace(old, new))
    assert load_run_config(path).rl.actor_optimizer.learning_rate == 3e-5
    from t1jax.controller.cli import parse_overrides

    overrides = parse_overrides(["rl.critic_optimizer.learning_rate=6e-4", "run.steps=3"])
    config = load_run_config(path, overrides=overrides)
    assert config.rl.critic_optimizer.learning_rate == 6e-4 and config.run.steps == 3


def test_impossible_device_splits_fail_before_any_device_work(tmp_path):
    config = load_run_config(write(tmp_path))
    with pytest.raises(ConfigError, match=r"trainer 4 \+ sampler 4 = 8 devices, but the process sees 6"):
        config.check_devices(6)
    with pytest.raises(ConfigError, match="trainer.plan: plan .* needs 8 devices, devices.trainer is 4"):
        config.check_devices(8, plan_devices=8)


def test_a_cpu_run_gets_the_devices_its_split_needs_unless_the_user_chose_a_count(monkeypatch):
    """`t1jax train` on a CPU host asks XLA for devices.trainer + devices.sampler devices when
    XLA_FLAGS names no count (a fresh process, so jax really starts with them); a count the user
    set, and every other flag, are kept."""
    import os
    import subprocess
    import sys

    from t1jax import host_devices
    from t1jax.host_devices import request_host_devices

    monkeypatch.setattr(host_devices, "_backends_started", lambda: False)  # this worker's have
    environ = {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true"}
    assert request_host_devices(3, environ)
    assert environ["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=3"
    chosen = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert not request_host_devices(3, chosen) and chosen["XLA_FLAGS"].endswith("=8")
    probe = (
        "import os, jax; from t1jax.host_devices import request_host_devices; "
        "asked = request_host_devices(3); n = len(jax.devices()); del os.environ['XLA_FLAGS']; "
        "print(asked, n, request_host_devices(5))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.stdout.split() == ["True", "3", "False"], out.stderr[-2000:]  # started: not asked again


def test_the_cli_answers_bad_input_with_one_line_and_status_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    bad = write(tmp_path, run__stepz=3)
    assert main(["train", "--config", str(bad), "--run-dir", str(tmp_path / "r")]) == 2
    assert main(["train", "--resume", str(tmp_path / "not-a-run")]) == 2
    assert main(["plan", "--config", str(tmp_path / "missing.yaml")]) == 2  # was a traceback
    # a resumed run may be extended, not changed (a new reward mid-run would be another run)
    assert main(["train", "--resume", str(tmp_path / "r"), "--set", "rl.ppo.clip_eps=0.3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5, lines
    assert lines[0].startswith("t1jax train: error:") and "missing.yaml does not exist" in lines[0]
    assert "run.stepz: unknown key" in lines[1]
    assert "is not a run directory" in lines[2]
    assert lines[3].startswith("t1jax plan: error:")
    assert "--set rl.ppo.clip_eps: a resumed run keeps its own config.yaml" in lines[4]
    assert "run.steps" in lines[4]
    assert not (tmp_path / "r").exists()  # nothing was created for a config that cannot run


def test_the_pool_shuffles_every_epoch_and_resumes_at_its_cursor():
    tasks = load_dataset(TASKS).tasks
    pool = TaskPool(tasks, seed=7)
    n = len(pool)
    draws = pool.draw(3 * n)
    epochs = [[d.task.task_id for d in draws[e * n : (e + 1) * n]] for e in range(3)]
    for epoch in epochs:
        assert Counter(epoch) == Counter(t.task_id for t in tasks)  # each task once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled, not one order repeated
    assert [d.epoch for d in draws] == [i // n for i in range(3 * n)]
    state = TaskPool(tasks, seed=7)
    state.draw(4)
    resumed = TaskPool(list(reversed(tasks)), seed=7)  # the directory walked in another order
    resumed.restore(state.state())
    assert [d.task.task_id for d in resumed.draw(n)] == [d.task.task_id for d in draws[4 : 4 + n]]
    with pytest.raises(ValueError, match="the task directory changed"):
        TaskPool(tasks[:-1], seed=7).restore(state.state())
    assert [d.task.task_id for d in TaskPool(tasks, seed=8).draw(n)] != epochs[0]
