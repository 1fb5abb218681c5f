"""The run config of `t1jax train`: one YAML file mapped onto frozen dataclasses, strictly.

Sections (each a dataclass below; `configs/runs/*.yaml` spell them out):

    run          name, seed, steps, pathways
    model        the architecture preset (or an HF checkpoint for the actor and the critic), dtypes,
                 the execution settings (kernels: `t1jax.model.execution.ExecutionConfig`)
    devices      how many of the visible devices train and how many sample (disjoint: trainer first)
    trainer      the trainer mesh: a named sharding plan or mesh axis sizes
    sampler      the embedded JAX engine (slots, context, prefix cache, mesh) or vLLM
    sandboxes    backend and admission control (concurrency cap, creation rate)
    tasks        the task directory and the pool's per-epoch shuffle seed
    harness      the agent loop's limits (`t1jax.agent.harness.HarnessConfig`)
    sampling     temperature / top-p / top-k of training rollouts
    rl           PPO, reward, advantages, optimizers, batching (`t1jax.rl.config.RLConfig`)
    schedule     batch (admitted) and launch (oversampled) sizes, one-step asynchrony
    checkpoint   weights-only interval (the paper's 10) and the full resumable state's interval and
                 location (the run directory, or an object-store URL such as gs://bucket/path)
    liveness     probe grace / period / deadline (§7.3: 600 / 30 / 120 s), control-plane deadlines
    logging      metrics, TensorBoard, trajectories, the live display
    partial_rollouts  continuation of cancelled trials (off by default)
    launch       the deployment on TPU pods (`t1jax.launch.LaunchParams`; optional: only
                 `t1jax launch` reads it, `t1jax train` ignores it)

Invariants:
- A key that names no field is an error naming its section path and the known keys; so is a
  value of the wrong kind, a required key left out, and every impossible combination that can
  be seen without touching a device (`RunConfig.check`; the device counts are checked against
  the visible devices by `check_devices` before any device work).
- Every paper hyperparameter is a named field whose default is the paper's value (ε = ε_v = 0.2,
  γ = λ = 1, S = 20, Adam β = (0.9, 0.98), weight decay 0.1, critic lr 15x actor, batch 512 of
  560 launched, weights every 10 steps, probes 600 / 30 / 120 s).
- `resolved()` is the complete config with every default filled in; a run directory keeps it,
  and `t1jax train --resume` runs exactly it.
- A location given as a URL (`gs://bucket/path`) is never touched while loading: its form is
  checked by tensorstore's own URL parser (`check_object_store_url`), no network is used, and
  its existence is not checked. Loading never imports the TPU packages (vllm, pathwaysutils).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from t1jax.rl.config import RLConfig, rl_config_from_dict
from t1jax.yamlio import load_yaml


class ConfigError(ValueError):
    """A run config that cannot run; the message names the key (`section.key`)."""


@dataclass(frozen=True)
class RunSection:
    name: str = "run"
    seed: int = 0
    steps: int = 10  # RL steps (learner updates) to run
    pathways: bool = False  # call pathwaysutils.initialize() before any JAX call


@dataclass(frozen=True)
class ModelSection:
    """`preset`: a model config (a `configs/*.yaml` preset or a `config.json`) for a fresh random
    actor; `actor_checkpoint`: an HF directory to start the actor from (e.g. an SFT checkpoint);
    `critic_checkpoint`: an HF directory for the critic (e.g. a warmed-up critic), else the critic
    is the actor's backbone with a fresh value head (§4.5)."""

    preset: str | None = None
    actor_checkpoint: str | None = None
    critic_checkpoint: str | None = None
    dtype: str = "float32"  # compute dtype
    param_dtype: str | None = None  # storage dtype (None: dtype); bf16 params get float32 masters
    init_seed: int = 0
    # A fresh value head's kernel std (`t1jax.model.critic.ValueHead`): None = the preset's
    # initializer_range, 0 = a zero kernel (the critic starts predicting a constant, EV 0)
    value_head_std: float | None = None
    # ExecutionConfig fields (kernels, blocks, layer scan); None: the preset's `execution:` section
    execution: Mapping[str, Any] | None = None

    def execution_config(self, base_dir: Path | None = None):
        """The `t1jax.model.execution.ExecutionConfig` actor and critic compute with."""
        from t1jax.model.execution import ExecutionConfig, load_execution

        if self.execution is not None:
            return ExecutionConfig.from_mapping(self.execution, source="model.execution")
        if self.preset:
            preset = Path(self.preset) if base_dir is None else resolve_path(self.preset, base_dir)
            return load_execution(preset) if preset.is_file() else ExecutionConfig()
        return ExecutionConfig()


@dataclass(frozen=True)
class DevicesSection:
    """The visible devices split into a trainer share (the first `trainer`) and a sampler share
    (the next `sampler`), disjoint: actor and critic time-share the trainer's."""

    trainer: int = 4
    sampler: int = 4


@dataclass(frozen=True)
class TrainerSection:
    """A named sharding plan (`t1jax/parallel/plans/<plan>.yaml`), or mesh axis sizes over the trainer
    devices (e.g. {fsdp: 2, expert: 2}); neither: every trainer device on `fsdp`."""

    plan: str | None = None
    mesh: Mapping[str, int] | None = None
    # Compile the learner's programs for every `rl.batching.row_length_buckets` entry while a
    # process's first rollout is generated (`Learner.precompile`), instead of at its first steps.
    # Off by default: it pays where the trainer's devices and the host's cores idle during the
    # first rollout (an accelerator), and compiles buckets a run may never fill. On the 2-core
    # CPU demo the warm-up took 165 s with it and 162 s without (the rollout uses both cores).
    precompile: bool = False


@dataclass(frozen=True)
class SamplerSection:
    engine: str = "jax"  # jax (embedded) | vllm
    max_batch: int = 16  # concurrent sequences (slots)
    max_context: int = 4096
    block_size: int = 64
    prefix_cache_mb: int = 256
    mesh: Mapping[str, int] | None = None  # axis sizes over the sampler devices (default: tensor)


@dataclass(frozen=True)
class SandboxesSection:
    backend: str = "local"  # a registered sandbox backend: local | container | kubernetes | modal
    url: str | None = None  # a running sandbox service instead of an in-process backend
    max_live: int = 16  # the node's concurrency cap (§7.4)
    create_rate_per_sec: float | None = 6.0  # token bucket (§7.4: 6/s)
    cache_dir: str | None = None  # local: built environments and sandbox state
    toolchain_dir: str | None = None  # the pinned verifier toolchain (default: the one make setup builds)
    namespace: str = "t1jax-sandboxes"  # kubernetes
    image_registry: str | None = None  # kubernetes
    runtime_class: str | None = None  # kubernetes, e.g. gvisor
    create_attempts: int = 1  # > 1 retries a failed create (bounded)
    agent_timeout_sec: float = 3600.0  # node caps on every task's deadlines (§7.4: 3600 / 900 / 5400)
    verifier_timeout_sec: float = 900.0
    total_timeout_sec: float = 5400.0


@dataclass(frozen=True)
class TasksSection:
    directory: str = ""
    shuffle_seed: int | None = None  # None: run.seed


@dataclass(frozen=True)
class HarnessSection:
    """The fields of `t1jax.agent.harness.HarnessConfig` a run sets (defaults: the paper's)."""

    max_turns: int = 60
    max_tokens_per_turn: int = 8192
    context_window: int = 96_000
    min_turn_tokens: int = 256
    observation_reserve_tokens: int = 256
    compaction: bool = True
    summary_max_tokens: int = 2048
    max_compactions: int = 8
    max_output_bytes: int = 10_000
    default_command_duration_sec: float = 1.0
    max_command_duration_sec: float = 60.0
    agent_timeout_sec: float | None = None
    terminal: str = "tmux"
    sampler_timeout_sec: float = 900.0
    prompt_profile: str = "full"  # system prompt, tool schemas, completion protocol (prompts.PROMPT_PROFILES)


@dataclass(frozen=True)
class SamplingSection:
    """Training rollouts sample the policy as it is (temperature 1, no filters), so the
    behaviour policy's processed log-probs are the model's own. Another `temperature` makes the
    policy PPO optimises softmax(logits / temperature): the run passes it to the learner
    (`rl.ppo.temperature`), which scores samples by the same numbers. top-p / top-k stay off in a
    training run: the learner scores the whole vocabulary, so a truncated distribution would
    make every ratio wrong."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class ScheduleSection:
    """`batch_size` trials admitted per step out of `launch_size` launched (§4.4: 512 of 560);
    `async_rollouts`: generate step t+1 while step t trains (App. 12.1; staleness exactly 1).

    `rollouts_per_task` (default 1, the paper's: one rollout per task, §9.4): a step draws
    `launch_size / rollouts_per_task` tasks and launches each that many times (distinct trial ids,
    hence distinct sampling seeds), so the batch holds groups of rollouts of one task, which
    `rl.advantages.baseline: task` uses as a per-task baseline. The oversampling tail is cancelled
    as ever, so an admitted group may be smaller than `rollouts_per_task`."""

    batch_size: int = 512
    launch_size: int = 560
    rollouts_per_task: int = 1
    async_rollouts: bool = True
    # False holds the actor: a critic warm-up run (§4.5) trains the value network on rollouts of a
    # fixed policy, and its critic weights seed the RL run (model.critic_checkpoint).
    train_actor: bool = True


@dataclass(frozen=True)
class CheckpointSection:
    """Weights only (actor and critic, HF safetensors) every `weights_every` steps, as the paper
    does; the full resumable state (learner, pool cursor, counters) every `state_every` steps."""

    weights_every: int = 10
    state_every: int = 10
    keep_states: int = 2
    # where the orbax learner states go: None = RUN/checkpoints/state; a local directory or a
    # gs://bucket/path URL (orbax writes it through tensorstore's gcs driver)
    state_directory: str | None = None


@dataclass(frozen=True)
class LivenessSection:
    """§7.3: component probes with an initial grace, a period and a deadline; control-plane
    deadlines (publication barrier, sandbox and sampler calls); bulk work (a training step, a
    weight transfer) has none."""

    probe_grace_sec: float = 600.0
    probe_period_sec: float = 30.0
    probe_deadline_sec: float = 120.0
    publish_barrier_timeout_sec: float = 1800.0
    sandbox_call_grace_sec: float = 30.0


@dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool = True
    trajectories: bool = True  # each step's trajectories (ids and text, gzip JSON lines)
    display: bool = True  # the live rich display (off when not a terminal)
    # {project, mode: online | offline | disabled}: the metrics to Weights & Biases too
    # (t1jax.runtime.wandb_log)
    wandb: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PartialRolloutsSection:
    """Continue the straggler tail in the next step instead of cancelling it (paper §10, slime's
    partial rollouts): the tail is paused at a turn boundary with its sandbox kept, and the next
    rollout continues it under the newly published version. Turns an older version sampled stay
    in the stream as context and are masked out of the loss (Eq. 26 needs one behaviour version
    per sample, so staleness stays exactly as asserted); the routing replayed over them is the one
    the newer sampler recorded when it re-fed the history. A trial paused more than
    `max_age_steps` times is dropped (closed). After a crash, paused trials start afresh."""

    enabled: bool = False
    max_age_steps: int = 1  # a trial older than this is dropped, not continued


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    sandboxes: SandboxesSection = field(default_factory=SandboxesSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    rl: RLConfig = field(default_factory=RLConfig)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    liveness: LivenessSection = field(default_factory=LivenessSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    partial_rollouts: PartialRolloutsSection = field(default_factory=PartialRolloutsSection)
    launch: Any = None  # t1jax.launch.LaunchParams, or None (no deployment described)

    def __post_init__(self) -> None:
        # One knob: the learner scores the distribution the rollouts sample (SamplingSection), so
        # `rl.ppo.temperature` follows `sampling.temperature`; set apart from it, it is an error.
        sampled, scored = self.sampling.temperature, self.rl.ppo.temperature
        if scored != 1.0 and scored != sampled:
            raise ValueError(
                f"rl.ppo.temperature {scored} differs from sampling.temperature {sampled}; set "
                f"sampling.temperature only (the learner takes it from there)"
            )
        if sampled > 0 and scored != sampled:
            ppo = dataclasses.replace(self.rl.ppo, temperature=float(sampled))
            object.__setattr__(self, "rl", dataclasses.replace(self.rl, ppo=ppo))

    # ---- checks ------------------------------------------------------------------------------

    def check(self, *, base_dir: Path | None = None) -> None:
        """Every combination that cannot run, visible without devices (module docstring).
        `base_dir`: also check that local paths exist (relative ones resolved against it)."""

        def need(condition: bool, key: str, message: str) -> None:
            if not condition:
                raise ConfigError(f"{key}: {message}")

        def positive(section: str, names: tuple[str, ...]) -> None:
            for name in names:
                value = getattr(getattr(self, section), name)
                need(value is not None and value > 0, f"{section}.{name}", f"must be > 0, got {value}")

        positive("run", ("steps",))
        positive("devices", ("trainer", "sampler"))
        positive("sampler", ("max_batch", "max_context", "block_size"))
        positive("sandboxes", ("max_live", "create_attempts", "agent_timeout_sec", "verifier_timeout_sec"))
        positive("schedule", ("batch_size", "launch_size", "rollouts_per_task"))
        positive("checkpoint", ("weights_every", "state_every", "keep_states"))
        positive("liveness", ("probe_period_sec", "probe_deadline_sec", "publish_barrier_timeout_sec"))
        need(self.liveness.probe_grace_sec >= 0, "liveness.probe_grace_sec", "must be >= 0")
        need(self.model.preset or self.model.actor_checkpoint, "model.preset",
             "give a model preset (fresh actor) or model.actor_checkpoint")  # fmt: skip
        for key in ("dtype", "param_dtype"):
            value = getattr(self.model, key)
            need(value in (None, "float32", "bfloat16", "float16"), f"model.{key}",
                 f"must be float32, bfloat16 or float16, got {value!r}")  # fmt: skip
        need(
            self.sampler.engine in ("jax", "vllm"),
            "sampler.engine",
            f"must be jax or vllm, got {self.sampler.engine!r}",
        )
        from sandbox_service.backends import backend_names

        need(self.sandboxes.backend in backend_names(), "sandboxes.backend",
             f"unknown backend {self.sandboxes.backend!r} (known: {', '.join(backend_names())})")  # fmt: skip
        need(
            bool(self.tasks.directory),
            "tasks.directory",
            "is required (a Terminal-Bench 1.x or Harbor directory)",
        )
        for key, value in self.locations():
            if value and is_url(value):
                need(key == "checkpoint.state_directory", key,
                     f"{value}: only checkpoint.state_directory may be an object-store URL (this one "
                     "is read from a local path: mount or copy it there)")  # fmt: skip
                problem = check_object_store_url(value)
                need(problem is None, key, str(problem))
            elif value and base_dir is not None and key != "checkpoint.state_directory":
                need(resolve_path(value, base_dir).exists(), key, f"{value} does not exist")
        try:
            self.model.execution_config(base_dir)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"model.execution: {error}") from error
        if self.launch is not None:
            self._check_launch()
        schedule = self.schedule
        need(schedule.batch_size <= schedule.launch_size, "schedule.batch_size",
             f"{schedule.batch_size} admitted cannot exceed the {schedule.launch_size} launched "
             "(schedule.launch_size)")  # fmt: skip
        need(schedule.launch_size % schedule.rollouts_per_task == 0, "schedule.rollouts_per_task",
             f"{schedule.rollouts_per_task} does not divide schedule.launch_size {schedule.launch_size} "
             "(a step launches whole groups)")  # fmt: skip
        sampling = self.sampling
        need(
            sampling.temperature > 0,
            "sampling.temperature",
            f"must be > 0 (a greedy rollout has no distribution to optimise), got {sampling.temperature}",
        )
        need(sampling.top_p == 1.0 and sampling.top_k == 0, "sampling.top_p",
             f"training rollouts need top_p 1 and top_k 0 (the learner scores the whole vocabulary), "
             f"got top_p {sampling.top_p}, top_k {sampling.top_k}")  # fmt: skip
        harness = self.harness
        need(
            harness.terminal in ("tmux", "exec"),
            "harness.terminal",
            f"must be tmux or exec, got {harness.terminal!r}",
        )
        need(harness.context_window <= self.sampler.max_context, "harness.context_window",
             f"{harness.context_window} exceeds sampler.max_context {self.sampler.max_context}")  # fmt: skip
        rows = self.rl.batching.row_length_buckets[-1]
        need(harness.context_window - 1 <= rows, "harness.context_window",
             f"a trial's stream of up to {harness.context_window} tokens needs a row bucket of "
             f"{harness.context_window - 1}; the largest rl.batching.row_length_buckets is "
             f"{rows}")  # fmt: skip
        if self.trainer.plan is not None and self.trainer.mesh is not None:
            raise ConfigError("trainer.plan / trainer.mesh: give one of them, not both")
        for key, mesh in (("trainer.mesh", self.trainer.mesh), ("sampler.mesh", self.sampler.mesh)):
            if mesh is not None:
                need(
                    all(isinstance(v, int) and v > 0 for v in mesh.values()),
                    key,
                    f"axis sizes must be positive ints: {dict(mesh)}",
                )
        for key, mesh, count in (
            ("trainer.mesh", self.trainer.mesh, self.devices.trainer),
            ("sampler.mesh", self.sampler.mesh, self.devices.sampler),
        ):
            if mesh is not None:
                size = 1
                for value in mesh.values():
                    size *= value
                need(
                    size == count,
                    key,
                    f"axis sizes {dict(mesh)} make {size} devices, devices.{key.split('.')[0]} is {count}",
                )
        need(self.rl.batching.rows_per_micro_batch > 0, "rl.batching.rows_per_micro_batch", "must be > 0")
        need(self.partial_rollouts.max_age_steps >= 1, "partial_rollouts.max_age_steps", "must be >= 1")

    def locations(self) -> tuple[tuple[str, str | None], ...]:
        """(key, value) of every path or URL the config names."""
        return (
            ("tasks.directory", self.tasks.directory),
            ("model.preset", self.model.preset),
            ("model.actor_checkpoint", self.model.actor_checkpoint),
            ("model.critic_checkpoint", self.model.critic_checkpoint),
            ("checkpoint.state_directory", self.checkpoint.state_directory),
        )

    def _check_launch(self) -> None:
        """The deployment must prepare what the sandbox backend will use."""
        launch, sandboxes = self.launch, self.sandboxes
        if sandboxes.backend != "kubernetes":
            raise ConfigError(f"launch: a TPU pod deployment runs sandboxes on Kubernetes; sandboxes.backend "
                              f"is {sandboxes.backend!r}")  # fmt: skip
        if sandboxes.namespace != launch.sandbox_namespace:
            raise ConfigError(f"sandboxes.namespace {sandboxes.namespace!r} differs from "
                              f"launch.sandbox_namespace {launch.sandbox_namespace!r}")  # fmt: skip
        if sandboxes.runtime_class != launch.runtime_class:
            raise ConfigError(f"sandboxes.runtime_class {sandboxes.runtime_class!r} differs from "
                              f"launch.runtime_class {launch.runtime_class!r}")  # fmt: skip
        if sandboxes.max_live > launch.max_sandboxes:
            raise ConfigError(f"sandboxes.max_live {sandboxes.max_live} exceeds the namespace quota "
                              f"launch.max_sandboxes {launch.max_sandboxes}")  # fmt: skip

    def check_devices(self, available: int, plan_devices: int | None = None) -> None:
        """The split against the devices the process sees (before any device work)."""
        need = self.devices.trainer + self.devices.sampler
        if need > available:
            raise ConfigError(
                f"devices: trainer {self.devices.trainer} + sampler {self.devices.sampler} = {need} devices, "
                f"but the process sees {available} (a CPU host shows more when XLA_FLAGS has "
                f"--xla_force_host_platform_device_count={need} before jax starts; t1jax train sets it "
                "when XLA_FLAGS names no count)"
            )
        if plan_devices is not None and plan_devices != self.devices.trainer:
            raise ConfigError(
                f"trainer.plan: plan {self.trainer.plan!r} needs {plan_devices} devices, "
                f"devices.trainer is {self.devices.trainer}"
            )

    # ---- (de)serialisation -------------------------------------------------------------------

    def resolved(self) -> dict[str, Any]:
        plain = _to_plain(self)
        plain["launch"] = None if self.launch is None else self.launch.to_mapping()
        return plain

    def with_absolute_paths(self, base_dir: Path) -> RunConfig:
        """The same config with every path absolute (a run directory's copy must not depend on
        where the original config file was)."""

        def absolute(value):
            if value and is_url(value):
                return value
            return None if not value else str(resolve_path(value, base_dir))

        model = dataclasses.replace(
            self.model,
            preset=absolute(self.model.preset),
            actor_checkpoint=absolute(self.model.actor_checkpoint),
            critic_checkpoint=absolute(self.model.critic_checkpoint),
        )
        tasks = dataclasses.replace(self.tasks, directory=absolute(self.tasks.directory) or "")
        checkpoint = dataclasses.replace(
            self.checkpoint, state_directory=absolute(self.checkpoint.state_directory)
        )
        sandboxes = dataclasses.replace(
            self.sandboxes,
            cache_dir=absolute(self.sandboxes.cache_dir),
            toolchain_dir=absolute(self.sandboxes.toolchain_dir),
        )
        trainer = self.trainer
        if trainer.plan and ("/" in trainer.plan or trainer.plan.endswith(".yaml")):
            trainer = dataclasses.replace(trainer, plan=absolute(trainer.plan))
        return dataclasses.replace(
            self, model=model, tasks=tasks, sandboxes=sandboxes, trainer=trainer, checkpoint=checkpoint
        )


def is_url(value: str) -> bool:
    """A location with a scheme (gs://...), as opposed to a local path."""
    return "://" in value


def check_object_store_url(url: str) -> str | None:
    """What is wrong with an object-store URL, by tensorstore's own parser (the one orbax writes
    through), or None. Only gs:// is accepted (the TPU pods' storage); nothing is contacted."""
    if not url.startswith("gs://"):
        return f"{url}: an object-store location must be a gs://bucket/path URL"
    import tensorstore

    try:
        spec = tensorstore.KvStore.Spec(url).to_json()
    except ValueError as error:
        return f"{url}: {': '.join(str(error).split(': ')[-2:])}"  # tensorstore's own reason
    if not spec.get("path"):
        return f"{url}: give a path inside the bucket (gs://bucket/path), not the bucket's root"
    return None


def resolve_path(value: str, base_dir: Path) -> Path:
    """A path in a config: absolute, or relative to the config file's directory `base_dir`."""
    path = Path(value).expanduser()
    return path.resolve() if path.is_absolute() else (base_dir / path).resolve()


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # StrEnum
        return value.value
    return value


def section_from_dict(cls, raw: Any, path: str):
    """A frozen dataclass `cls` from a YAML mapping, strictly (unknown keys, wrong kinds: ConfigError
    naming `path.key`); None gives the defaults."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping of keys, got {type(raw).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key (known in {path}: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(value, hints[name], f"{path}.{name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: {error}") from error


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check a YAML value against a field's type (ints for floats allowed; None for optionals)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {value!r}")
        return {str(k): v for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    return value


_SECTIONS = {f.name: f for f in dataclasses.fields(RunConfig)}


def run_config_from_dict(raw: Mapping[str, Any], *, source: str = "<dict>") -> RunConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: a run config must be a mapping of sections")
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown section (known: {', '.join(_SECTIONS)})")
    sections = {}
    hints = typing.get_type_hints(RunConfig)
    for name, value in raw.items():
        if name == "rl":
            try:
                sections[name] = rl_config_from_dict(value or {}, source=f"{source}: rl")
            except ValueError as error:
                raise ConfigError(str(error)) from error
        elif name == "launch":
            sections[name] = None if value is None else _launch_from_dict(value)
        else:
            sections[name] = section_from_dict(hints[name], value, name)
    try:
        return RunConfig(**sections)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from error


def _launch_from_dict(value: Any):
    from t1jax.launch_params import LaunchParams

    if not isinstance(value, Mapping):
        raise ConfigError(f"launch: must be a mapping of keys, got {type(value).__name__}")
    try:
        return LaunchParams.from_mapping(dict(value))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"launch: {error}") from error


def load_run_config(
    path: str | Path, *, overrides: Mapping[str, Any] | None = None, check_paths: bool = True
) -> RunConfig:
    """Read, check and return a run config (`overrides`: dotted keys, e.g. {"run.steps": 3}).
    `check_paths=False` skips the existence of local paths (a config for another machine, e.g.
    the pod's paths of `t1jax launch --dry-run`); everything else is checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"run config {path} does not exist")
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from error
    raw = apply_overrides(raw, overrides or {})
    config = run_config_from_dict(raw, source=str(path))
    config.check(base_dir=path.parent if check_paths else None)
    return config


def override_within(key: str, prefixes: Iterable[str]) -> bool:
    """Whether a dotted override key is one of `prefixes` or lies under one (`liveness` covers
    `liveness.probe_grace_sec`; `run.steps` does not cover `run.stepsize`)."""
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(dict(raw))
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = merged
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {part} is not a section")
        node[parts[-1]] = value
    return merged
