"""Scripted policies for harness tests: a solver, a garbage emitter, a context filler."""

from __future__ import annotations

import random

from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.scripted import PolicyCall
from t1jax.agent.tokenizer import ChatTokenizer


def shell(command: str, duration: float = 0.1) -> str:
    return render_tool_call_text("shell", {"command": command, "duration": str(duration)})


def complete() -> str:
    return render_tool_call_text("task_complete", {})


def previous_replies(call: PolicyCall) -> int:
    """Assistant turns already in this segment's prompt (the generation prompt excluded)."""
    return call.prompt_text.count("<|im_start|>assistant\n") - 1


def solver(steps: list[str], duration: float = 0.1):
    """Runs `steps` one per turn (waiting `duration` each), then calls task_complete, then confirms it."""

    def policy(call: PolicyCall) -> str:
        done = previous_replies(call)
        if "Are you sure" in call.last_user_text:
            return "Yes, it is done.\n\n" + complete()
        if done < len(steps):
            return f"Step {done + 1}: running the next command.\n\n" + shell(steps[done], duration)
        return "The task should be complete now.\n\n" + complete()

    return policy


def garbage(tokenizer: ChatTokenizer, seed: int = 0):
    """Random ids (control tokens, stray bytes, half tags), random text, and broken calls."""
    rng = random.Random(seed)

    def policy(call: PolicyCall):
        kind = call.call_index % 4
        if kind == 0:
            return [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))]
        if kind == 1:
            return "".join(
                chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000), 0])) for _ in range(80)
            )
        if kind == 2:
            return "<tool_call>\n<function=shell>\n<parameter=command>\nrm -rf /\n"  # never closed
        return '<tool_call>{"name": "shell", "arguments": {"command": 5</tool_call>'

    return policy


def filler(summary_words: int = 30, command: str = "seq 1 400"):
    """Keeps printing output so the context fills; writes a summary when asked."""

    def policy(call: PolicyCall) -> str:
        if "context window is almost full" in call.last_user_text:
            return (
                "Summary: I printed numbers with seq. "
                + "Still printing. " * summary_words
                + "Next: continue."
            )
        return f"Printing more numbers (turn {previous_replies(call) + 1}).\n\n" + shell(command, 0.05)

    return policy
