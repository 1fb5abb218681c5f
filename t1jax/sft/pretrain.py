"""The demo's base model: a short pretraining of a randomly initialised model on a copy-rich corpus.

A model the size of the demo's (~0.6M parameters) trained from scratch on the demonstrations
alone learns the reply format and which command a step needs, but is slow to learn to *copy* a
name from the instruction or an observation into its command: copying needs an induction-style
attention circuit, which forms abruptly and only on data that rewards it and with an attention
head wide enough to be sharp (measured, T=128, 16 rows a step, lr 3e-3: with head_dim 16 nothing
is copied in 250 steps; with head_dim 64 two 10-30-word lists a document are copied at ~98% after
~150 steps). This stage supplies that data cheaply, before any demonstration, in three phases:

1. `long_list_steps` steps of long lists of bare slot words (`list: a b c ...` / `again: a b c ...`):
   the copy circuit forms here;
2. `item_list_steps` steps of long lists of words *and paths* (`/app/a.sh /app/b/c.txt d ...`): a
   path's word is its own token (`/queue`, not ` queue`) and every path starts with the same
   `/app` tokens, so the circuit must learn to copy those tokens by the context before them. The
   demonstrations' copied tokens are mostly such path words; without this phase the model copied
   lists and never paths (path words at chance, 1/16, after SFT too: it wrote `/app/server.sh`
   whatever the task named);
3. the rest on short plain-text documents (no chat tokens, no task, no command) whose last line
   repeats what a line before it named (only that line carries loss), with, at `distractor_rate`,
   number lines between the two, so the copy is found by content at a varying distance and not at
   a fixed offset:

- `list: a b c` / `again: a b c` (random sequences of slot words, 2-8 long);
- `file /app/a.txt` / `same /app/a.txt` (paths built from slot words and the suite's suffixes);
- `a = b`, `c = d` ... / `get c: d` (key-value lookup);
- `ls -d /app/d/*` / `/app/d/a.sh` / `open /app/d/a.sh`, and `cat /app/d.ini` / `k = v` ... /
  `put k v` (what an inspection command printed, used by the next command: `_listing`);
- `count 7` / `again 7` (small numbers).

So the base knows the vocabulary and how to copy, and nothing about the harness, the tool-call
format or any task: its resolved rate is the demo's floor, and what SFT adds is measurable.

Invariant: the corpus is a pure function of (seed, number of documents, document length).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sandbox_service.cli_contract import OneLineArgumentParser, UsageError, checking_input, run_command
from t1jax.data.idioms import SLOT_WORDS
from t1jax.tito.types import Sample

SUFFIXES = (".txt", ".log", ".sh", ".py", ".ini", ".csv", ".key", ".conf")


def _sequence(rng: random.Random) -> list[str]:
    items = " ".join(rng.choice(SLOT_WORDS) for _ in range(rng.randint(2, 8)))
    return [f"list: {items}", f"again: {items}"]


def _item(rng: random.Random) -> str:
    """A slot word in one of the forms commands use it: a bare word or part of a path (a path's
    word is a different token from the bare word, so the copy circuit must learn both)."""
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(SLOT_WORDS)
    if roll < 0.8:
        return f"/app/{rng.choice(SLOT_WORDS)}{rng.choice(SUFFIXES)}"
    return f"/app/{rng.choice(SLOT_WORDS)}/{rng.choice(SLOT_WORDS)}{rng.choice(SUFFIXES)}"


def _long_sequence(rng: random.Random) -> list[str]:
    items = " ".join(rng.choice(SLOT_WORDS) for _ in range(rng.randint(10, 30)))
    return [f"list: {items}", f"again: {items}"]


def _long_item_sequence(rng: random.Random) -> list[str]:
    items = " ".join(_item(rng) for _ in range(rng.randint(6, 16)))
    return [f"list: {items}", f"again: {items}"]


def _path(rng: random.Random) -> list[str]:
    path = f"/app/{rng.choice(SLOT_WORDS)}{rng.choice(SUFFIXES)}"
    if rng.random() < 0.3:
        path = f"/app/{rng.choice(SLOT_WORDS)}/{rng.choice(SLOT_WORDS)}{rng.choice(SUFFIXES)}"
    return [f"file {path}", f"same {path}"]


def _settings(rng: random.Random, count: int) -> tuple[list[str], str, str]:
    """`count` distinct keys' `key = value` lines, and one key with its value."""
    keys = rng.sample(SLOT_WORDS, count)
    values = [rng.choice(SLOT_WORDS) for _ in keys]
    index = rng.randrange(len(keys))
    return [f"{k} = {v}" for k, v in zip(keys, values, strict=True)], keys[index], values[index]


def _lookup(rng: random.Random) -> list[str]:
    lines, key, value = _settings(rng, 3)
    return [*lines, f"get {key}: {value}"]


def _listing(rng: random.Random) -> list[str]:
    """What an inspection command shows, then a command line that uses it, as the suite's
    inspection steps do (`ls -d /app/input/*` -> `sh /app/input/x.sh`, `cat /app/a.ini` ->
    `echo <value>`): a listing of full paths (the command repeats the listed path's tokens), or a
    settings file whose value for a key the command needs."""
    directory = rng.choice(SLOT_WORDS)
    if rng.random() < 0.5:
        path = f"/app/{directory}/{rng.choice(SLOT_WORDS)}{rng.choice(SUFFIXES)}"
        return [f"ls -d /app/{directory}/*", path, f"open {path}"]
    lines, key, value = _settings(rng, 2)
    return [f"cat /app/{directory}.ini", *lines, f"put {key} {value}"]


def _number(rng: random.Random) -> list[str]:
    number = rng.randint(0, 99)
    return [f"count {number}", f"again {number}"]


_KINDS = ((_sequence, 0.4), (_path, 0.2), (_lookup, 0.1), (_listing, 0.2), (_number, 0.1))
# The first documents: long lists only. In the mix above a 128-token document holds ~15 short groups
# over 16 recurring words, and no copy circuit forms within 250 steps (masked loss ~1.0, copied-word
# accuracy at chance 1/16); two 10-30-word lists a document form it in ~150 steps, and the mix is
# then learnt in ~50 more.
_LONG_LISTS = ((_long_sequence, 1.0),)
_LONG_ITEM_LISTS = ((_long_item_sequence, 1.0),)


def copy_document(
    rng: random.Random, tokenizer, length: int, kinds=_KINDS, distractor_rate: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one document, exactly `length` long. Only the last line of each
    group (the copy, which the lines before it determine) carries loss: the gradient goes to the
    copy circuit, not to guessing random words. With probability `distractor_rate` a group's copy
    is separated from what it copies by 1-6 number groups (which name no slot word): the copy must
    then be found by content at a varying distance, not at a fixed offset."""
    ids: list[int] = []
    mask: list[int] = []
    makers, weights = zip(*kinds, strict=True)
    while len(ids) < length:
        lines = rng.choices(makers, weights=weights)[0](rng)
        context = tokenizer.encode_text("\n".join(lines[:-1]) + "\n")
        ids += context
        mask += [0] * len(context)
        if rng.random() < distractor_rate:
            for _ in range(rng.randint(1, 6)):
                head, again = _number(rng)
                first, second = tokenizer.encode_text(head + "\n"), tokenizer.encode_text(again + "\n")
                ids += first + second
                mask += [0] * len(first) + [1] * len(second)
        copy = tokenizer.encode_text(lines[-1] + "\n")
        ids += copy
        mask += [1] * len(copy)
    mask[0] = 0
    return np.asarray(ids[:length], np.int32), np.asarray(mask[:length], np.int8)


def copy_corpus(
    seed: int, num_documents: int, length: int, tokenizer, *, long_list_documents: int = 0,
    item_list_documents: int = 0, distractor_rate: float = 0.0,
) -> list[Sample]:
    """`num_documents` samples whose loss covers the copies (see `copy_document`); the first
    `long_list_documents` of them hold long lists only (`_LONG_LISTS`)."""
    rng = random.Random(f"t1jax-copy-corpus/{seed}")
    samples = []
    for index in range(num_documents):
        curriculum = index < long_list_documents + item_list_documents
        if index < long_list_documents:
            kinds = _LONG_LISTS
        elif curriculum:
            kinds = _LONG_ITEM_LISTS
        else:
            kinds = _KINDS
        rate = 0.0 if curriculum else distractor_rate
        tokens, loss_mask = copy_document(rng, tokenizer, length, kinds, rate)
        samples.append(
            Sample(
                tokens=tokens,
                loss_mask=loss_mask,
                sampler_logprobs=np.zeros(length, np.float32),
                routing=None,
                reward=0.0,
                task_id="copy-corpus",
                trajectory_id=f"copy-{index}",
            )
        )
    return samples


@dataclass(frozen=True)
class PretrainConfig:
    """`steps` optimizer steps of `rows` documents of `length` tokens each: the first
    `long_list_steps` on long lists of bare words (`_LONG_LISTS`), the next `item_list_steps` on
    long lists of words and paths (`_LONG_ITEM_LISTS`), the rest on the mix (`_KINDS`), where a
    copy is separated from its source by number lines with probability `distractor_rate`."""

    model: str = ""  # a model preset (YAML) or config.json: `run_pretrain` needs one
    seed: int = 0
    steps: int = 450
    long_list_steps: int = 150
    item_list_steps: int = 150
    distractor_rate: float = 0.6
    rows: int = 16
    length: int = 128
    # Whether the copy circuit forms depends on the seed and this rate: 1.5e-3 formed it for seeds
    # 0-4 (10-16 of 16 path words copied at distances 10-250), 3e-3 for three of the five, 6e-3
    # for none (the runs: docs/history/demo.md).
    learning_rate: float = 1.5e-3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if min(self.steps, self.rows, self.length) < 1:
            raise ValueError("pretrain steps, rows and length must be >= 1")
        if self.long_list_steps < 0 or self.item_list_steps < 0:
            raise ValueError("pretrain long_list_steps and item_list_steps must be >= 0")
        if not 0.0 <= self.distractor_rate <= 1.0:
            raise ValueError(f"pretrain distractor_rate must be in [0, 1], got {self.distractor_rate}")


def run_pretrain(
    config: PretrainConfig, out_dir: str | Path, *, progress: Callable[[str], None] | None = None
) -> dict:
    """Pretrain from a random init (module docstring); writes `out_dir/checkpoint` (HF layout),
    `out_dir/metrics.jsonl` and `out_dir/summary.json`. `out_dir` must not exist or be empty."""
    from flax import nnx

    from t1jax.agent.tokenizer import load_project_tokenizer
    from t1jax.model import Qwen35MoeCritic, Qwen35MoeForCausalLM, load_config, save_pretrained
    from t1jax.rl.batching import BatchingConfig
    from t1jax.rl.config import RLConfig
    from t1jax.rl.learner import Learner
    from t1jax.rl.optim import OptimizerConfig

    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    if not config.model:
        raise UsageError("PretrainConfig.model: give a model preset (YAML) or config.json")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir} exists and is not empty; choose a new --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tokenizer = load_project_tokenizer()
    long_lists = min(config.long_list_steps, config.steps) * config.rows
    item_lists = max(0, min(config.item_list_steps, config.steps - config.long_list_steps)) * config.rows
    corpus = copy_corpus(
        config.seed, config.steps * config.rows, config.length + 1, tokenizer, long_list_documents=long_lists,
        item_list_documents=item_lists, distractor_rate=config.distractor_rate,
    )
    actor = Qwen35MoeForCausalLM(load_config(config.model), rngs=nnx.Rngs(config.seed))
    critic = Qwen35MoeCritic.from_actor(actor, rngs=nnx.Rngs(config.seed + 1))
    rl_config = RLConfig(
        actor_optimizer=OptimizerConfig(
            learning_rate=config.learning_rate,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
        ),
        batching=BatchingConfig(
            row_length_buckets=(config.length,), rows_per_micro_batch=config.rows, pack=False
        ),
    )
    learner = Learner(actor, critic, rl_config, take_ownership=True)
    del actor, critic
    metrics = {}
    with (out_dir / "metrics.jsonl").open("w") as log:
        for step in range(config.steps):
            batch = corpus[step * config.rows : (step + 1) * config.rows]
            metrics = learner.sft_step(batch)
            line = {
                "step": step + 1,
                "loss": metrics["sft/sft_loss"],
                "mean_target_prob": metrics["sft/mean_target_prob"],
                "grad_norm": metrics["sft/grad_norm"],
                "step_sec": metrics["time/step_sec"],
                "elapsed_sec": time.monotonic() - started,
            }
            log.write(json.dumps(line) + "\n")
            if (step + 1) % 25 == 0 or step + 1 == config.steps:
                say(
                    f"pretrain step {step + 1}/{config.steps} loss {line['loss']:.4f} "
                    f"({line['elapsed_sec']:.0f} s)"
                )
    save_pretrained(learner.actor_model(), out_dir / "checkpoint")
    summary = {
        "steps": config.steps,
        "tokens": config.steps * config.rows * config.length,
        "final_loss": metrics.get("sft/sft_loss"),
        "seconds": time.monotonic() - started,
        "checkpoint": str(out_dir / "checkpoint"),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m t1jax.sft.pretrain --model PRESET --out DIR [--steps N ...]` (the demo's base
    stage runs it as a subprocess, as every other stage)."""
    parser = OneLineArgumentParser(prog="python -m t1jax.sft.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model preset (YAML) or config.json")
    parser.add_argument("--out", required=True, type=Path, help="new run directory")
    defaults = PretrainConfig()
    for name in ("seed", "steps", "rows", "length", "long_list_steps", "item_list_steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--distractor-rate", type=float, default=defaults.distractor_rate)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)

    def body() -> int:
        if not Path(args.model).is_file():
            raise UsageError(f"--model {args.model} does not exist")
        with checking_input():
            config = PretrainConfig(model=args.model, seed=args.seed, steps=args.steps, rows=args.rows,
                                    length=args.length, learning_rate=args.learning_rate,
                                    long_list_steps=args.long_list_steps,
                                    item_list_steps=args.item_list_steps,
                                    distractor_rate=args.distractor_rate)  # fmt: skip
        summary = run_pretrain(config, args.out)  # a non-empty --out is a UsageError before any work
        print(json.dumps(summary, indent=1))
        return 0

    return run_command("python -m t1jax.sft.pretrain", body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
