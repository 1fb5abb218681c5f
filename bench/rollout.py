"""Rollout-layer benchmark: 16 concurrent 4-turn trials in real sandboxes vs the engine alone.

Peer, measured in the same run: the ideal of the embedded JAX engine serving exactly the same
requests (the recorded prompts of every turn, the same seeds, so the same tokens) from 16
threads with no sandbox, no harness and no verifier between the turns. Printed:
- trials/s of the full rollout (create -> 4 turns -> verify -> close, 16 at once);
- the engine-alone time for the same tokens, and their ratio, which is the sampler-busy
  fraction of the rollout (1.0: the sandboxes and the harness added nothing to the critical path);
- where the rollout's trial time went (queue / create / generate / environment / verify / close).

The policy is a tiny random Qwen3.5-MoE (its replies are garbage, answered with a parse error:
each trial runs exactly 4 turns of 32 tokens). Run: `.venv/bin/python bench/rollout.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flax import nnx  # noqa: E402

from sandbox_service.admission import AdmissionConfig, AdmissionController  # noqa: E402
from sandbox_service.backends.local import LocalBackend  # noqa: E402
from sandbox_service.tasks import load_dataset  # noqa: E402
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain  # noqa: E402
from t1jax.agent.harness import HarnessConfig  # noqa: E402
from t1jax.agent.tokenizer import load_project_tokenizer  # noqa: E402
from t1jax.model import Qwen35MoeForCausalLM, load_config  # noqa: E402
from t1jax.rl.reward import RewardConfig  # noqa: E402
from t1jax.rollout.engine import EngineConfig, JaxEngine  # noqa: E402
from t1jax.rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from t1jax.runtime.metrics import rollout_metrics  # noqa: E402
from t1jax.runtime.scheduler import TrialFate, TrialScheduler, TrialSpec  # noqa: E402

TRIALS, TURNS, TOKENS, CONTEXT = 16, 4, 32, 2048
HARNESS = HarnessConfig(
    max_turns=TURNS,
    max_tokens_per_turn=TOKENS,
    min_turn_tokens=TOKENS,
    observation_reserve_tokens=64,
    context_window=CONTEXT,
    compaction=False,
    summary_max_tokens=64,
    max_output_bytes=1000,
)


def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def replay(engine: JaxEngine, trials) -> float:
    """Serve every recorded turn again, each trial's turns in order, 16 trials at once."""
    engine.clear_prefix_cache()

    def play(trial):
        for index, turn in enumerate(trial.trajectory.turns):
            # Exactly as many tokens as the turn produced (no stop ids: none ends early).
            params = SamplingParams(max_new_tokens=len(turn.completion_ids), temperature=1.0, seed=index)
            request = GenerateRequest(f"ideal/{trial.trial_id}/{index}", turn.prompt_ids, params)
            engine.generate([request])

    threads = [threading.Thread(target=play, args=(t,)) for t in trials]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def main() -> None:
    tasks = sorted(load_dataset(ROOT / "tests" / "data" / "tasks").tasks, key=lambda t: t.task_id)
    tokenizer = load_project_tokenizer()
    policy = Qwen35MoeForCausalLM(load_config(ROOT / "configs" / "tiny_cpu.yaml"), rngs=nnx.Rngs(0))
    toolchain = setup_toolchain(ROOT / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    backend = LocalBackend(cache_dir=Path(tempfile.mkdtemp()), toolchain_dir=toolchain)
    sandboxes = AdmissionController(
        backend, AdmissionConfig(max_live_sandboxes=TRIALS, create_rate_per_sec=None)
    )
    config = EngineConfig(max_batch=TRIALS, max_context=CONTEXT, block_size=64)
    try:
        with JaxEngine(policy, jax.devices()[-1:], config) as engine:
            engine.warmup()
            with TrialScheduler(
                sampler=engine, sandboxes=sandboxes, tokenizer=tokenizer, harness=HARNESS,
                reward=RewardConfig(), run_id="bench-rollout", concurrency=TRIALS, assemble=False,
            ) as scheduler:  # fmt: skip
                sampling = SamplingParams(max_new_tokens=TOKENS, temperature=1.0, seed=0)
                # One untimed round first: environments built, every shape compiled.
                scheduler.run(
                    [TrialSpec(f"warm-{i}", tasks[i % len(tasks)], sampling) for i in range(TRIALS)]
                )
                engine.clear_prefix_cache()
                specs = [TrialSpec(f"bench-{i}", tasks[i % len(tasks)], sampling) for i in range(TRIALS)]
                started = time.perf_counter()
                trials = scheduler.run(specs)
                rollout_sec = time.perf_counter() - started
                peak = scheduler.peak_active
            bad = [(t.trial_id, t.fate, t.detail) for t in trials if t.fate is not TrialFate.COMPLETED]
            if bad:
                raise SystemExit(f"bench trials did not complete: {bad[:3]}")
            ideal_sec = replay(engine, trials)
    finally:
        sandboxes.leak_check("bench-rollout")
        sandboxes.shutdown()
        backend.close()
    metrics = rollout_metrics(trials)
    tokens = int(metrics["rollout/completion_tokens_total"])
    print(f"machine: {processor()}, jax {jax.__version__} on {jax.devices()[0].platform}")
    print(
        f"rollout: {TRIALS} trials x {TURNS} turns x {TOKENS} tokens ({tokens} generated), "
        f"peak concurrency {peak}"
    )
    print(
        f"  rollout (sandboxes, harness, verify): {rollout_sec:.2f} s = {TRIALS / rollout_sec:.2f} trials/s"
    )
    print(f"  engine alone, the same requests:      {ideal_sec:.2f} s = {TRIALS / ideal_sec:.2f} trials/s")
    print(f"  ratio engine-alone / rollout (sampler-busy fraction): {ideal_sec / rollout_sec:.2f}")
    split = ", ".join(
        f"{phase} {metrics[f'rollout/time_{phase}_fraction']:.0%}"
        for phase in ("queue", "create", "generate", "environment", "verify", "close")
    )
    print(f"  trial time split: {split}")


if __name__ == "__main__":
    main()
