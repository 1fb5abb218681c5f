"""TITO stitching (paper §4.2 Box 4.2, Eq. 5, 10, 11; §4.3 Eq. 13-14) on constructed trajectories.

Every turn here records routing rows that encode themselves: row r of turn t is `[r, t]` in
every layer, so a test can read off, for any stitched row, which position of which turn's capture
it came from. Trajectories are built two ways: token-in (what our harness does: exact prefixes)
and by adversarial "harness behaviours" that re-render the next prompt (non-canonical sampled
splits re-encoded canonically, a closing token merging with the completion's last token,
whitespace changed in a re-rendered tool call, history pruned, an unrelated prompt).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.rollout.types import FinishReason
from t1jax.tito.assembler import REPAIR_MAX_DROP, assemble, assemble_trajectory
from t1jax.tito.audit import SampleProvenance, audit_metrics, audit_sample
from t1jax.tito.types import (
    BoundaryCase,
    RoutingAlignmentError,
    RoutingMissingError,
    Segment,
    Trajectory,
    TrialStatus,
    Turn,
)

TOK = load_project_tokenizer()
LAYERS = 3
FRAGMENTS = (
    "ls -la /app",
    "cat hello.txt",
    " ",
    "\n",
    "\n\n",
    "}",
    ">",
    '{"a": 1}',
    "echo 'hi'",
    "</parameter>",
    "é",
    "日本",
    "  x",
    "\t",
    "done.",
    "grep -rn foo .",
    "0123",
    "=",
    "..",
)


def routing_for(turn_index: int, rows: int) -> np.ndarray:
    routing = np.zeros((rows, LAYERS, 2), np.int32)
    routing[:, :, 0] = np.arange(rows)[:, None]
    routing[:, :, 1] = turn_index
    return routing


def make_turn(
    turn_index: int,
    prompt: list[int],
    completion: list[int],
    *,
    glue_start: int | None = None,
    finish: FinishReason = FinishReason.STOP,
    routing: bool = True,
    version: int = 0,
) -> Turn:
    logprobs = np.asarray([-0.01 * (turn_index * 100 + k + 1) for k in range(len(completion))], np.float32)
    rows = len(prompt) + len(completion) - 1
    return Turn(
        prompt_ids=np.asarray(prompt, np.int32),
        completion_ids=np.asarray(completion, np.int32),
        logprobs=logprobs,
        routing=routing_for(turn_index, rows) if routing else None,
        finish_reason=finish,
        policy_version=version,
        glue_start=glue_start,
        request_id=f"r{turn_index}",
    )


def trajectory_of(*segments: list[Turn]) -> Trajectory:
    return Trajectory(
        trial_id="trial",
        task_id="task",
        segments=tuple(Segment(i, tuple(turns)) for i, turns in enumerate(segments)),
        status=TrialStatus.COMPLETED,
    )


def text_ids(text: str) -> list[int]:
    return TOK.encode_text(text)


def byte_ids(text: str) -> list[int]:
    """A non-canonical split the sampler could emit: one byte-level token per byte."""
    return [_single_byte_id(b) for b in text.encode("utf-8")]


_BYTE_ID: dict[int, int] = {}


def _single_byte_id(byte: int) -> int:
    if not _BYTE_ID:
        for token_id in range(TOK.vocab_size):
            raw = TOK.token_bytes(token_id)
            if len(raw) == 1 and token_id not in TOK.stop_token_ids:
                _BYTE_ID.setdefault(raw[0], token_id)
    return _BYTE_ID[byte]


def check_sample_invariants(sample, turns_by_index: dict[int, Turn]) -> None:
    """Eq. 5 and Eq. 13 from the self-describing routing rows, independently of the assembler."""
    n = len(sample.tokens)
    assert sample.loss_mask[0] == 0
    assert np.all(sample.sampler_logprobs[sample.loss_mask == 0] == 0)
    if sample.routing is not None:
        assert len(sample.routing) == n - 1
        for j in np.nonzero(sample.loss_mask)[0]:
            row_position, turn_index = sample.routing[j - 1, 0]
            turn = turns_by_index[int(turn_index)]
            k = int(row_position) + 1 - len(turn.prompt_ids)  # the completion index this row predicts
            assert 0 <= k < len(turn.completion_ids), (j, row_position, turn_index)
            assert sample.tokens[j] == turn.completion_ids[k]
            assert sample.sampler_logprobs[j] == turn.logprobs[k]
            assert np.all(sample.routing[j - 1, :, 0] == row_position)


# ---- token-in: every boundary exact -----------------------------------------------------------


@st.composite
def token_in_segment(draw) -> list[Turn]:
    """Random turns joined the way the harness joins them: prompt_{i+1} = T_i + glue."""
    num_turns = draw(st.integers(1, 6))
    prompt = text_ids(draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6).map("".join)) or "x")
    turns = []
    glue_start = 0
    for index in range(num_turns):
        body = draw(st.lists(st.sampled_from(FRAGMENTS), max_size=5).map("".join))
        completion = byte_ids(body) if draw(st.booleans()) else text_ids(body)
        stopped = draw(st.booleans())
        if stopped:
            completion = completion + [TOK.im_end_id]
        turns.append(
            make_turn(
                index,
                prompt,
                completion,
                glue_start=glue_start,
                finish=FinishReason.STOP if stopped else FinishReason.LENGTH,
            )
        )
        glue = ([] if stopped else [TOK.im_end_id]) + text_ids("\n" + draw(st.sampled_from(FRAGMENTS)))
        glue_start = len(prompt) + len(completion)
        prompt = prompt + completion + glue
    return turns


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_in_segment())
def test_token_in_boundaries_are_exact_and_stream_is_the_sampler_view(turns):
    check_token_in_segment(turns)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_in_segment())
def test_token_in_boundaries_many_examples(turns):
    check_token_in_segment(turns)


def check_token_in_segment(turns):
    assembly = assemble_trajectory(trajectory_of(turns), reward=0.75, tokenizer=TOK)
    if len(turns[-1].full_ids) < 2:  # nothing to predict: no sample
        assert assembly.samples == ()
        return
    (sample,) = assembly.samples
    assert all(record.case is BoundaryCase.EXACT for record in assembly.boundaries)
    assert len(assembly.boundaries) == len(turns) - 1
    np.testing.assert_array_equal(sample.tokens, turns[-1].full_ids)
    # Every routing row is the capture of the earliest turn that fed that position.
    np.testing.assert_array_equal(sample.routing[:, 0, 0], np.arange(len(sample.tokens) - 1))
    ends = np.cumsum(
        [0]
        + [
            len(t.full_ids) - (len(prev.full_ids) if i else 0)
            for i, (prev, t) in enumerate(zip([turns[0]] + turns[:-1], turns, strict=True))
        ]
    )
    for index, turn in enumerate(turns):
        first_row = ends[index] - 1 if index else 0
        assert np.all(sample.routing[max(first_row, 0) : len(turn.full_ids) - 1, 0, 1] == index)
    expected_mask = np.zeros(len(sample.tokens), np.int8)
    for turn in turns:
        start = len(turn.prompt_ids)
        expected_mask[start : start + len(turn.completion_ids)] = 1
    np.testing.assert_array_equal(sample.loss_mask, expected_mask)
    check_sample_invariants(sample, dict(enumerate(turns)))
    audit = sample.audit
    assert audit.drift_in_loss_region == 0 and audit.retokenized == 0 and audit.placeholder == 0
    assert audit.aligned == len(sample.tokens) and audit.loss_tokens == int(expected_mask.sum())
    assert sample.reward == 0.75


def test_segments_become_samples_sharing_the_reward():
    first = make_turn(0, text_ids("system prompt"), text_ids("summary") + [TOK.im_end_id], glue_start=0)
    second = make_turn(1, text_ids("compacted prompt"), text_ids("ls") + [TOK.im_end_id], glue_start=0)
    samples = assemble(trajectory_of([first], [second]), reward=0.4, tokenizer=TOK)
    assert [s.segment_index for s in samples] == [0, 1]
    assert all(s.reward == 0.4 for s in samples)
    assert [s.num_loss_tokens for s in samples] == [len(first.completion_ids), len(second.completion_ids)]


# ---- adversarial boundaries ---------------------------------------------------------------------


def test_non_canonical_tail_is_repaired_within_the_window():
    """The sampler split 'done.' byte by byte; the re-rendered prompt encodes it canonically."""
    prompt = text_ids("Task: list files\n")
    completion = text_ids("ls -la /app ") + byte_ids("done.")  # no stop token: cut by max tokens
    first = make_turn(0, prompt, completion, finish=FinishReason.LENGTH)
    rerendered = prompt + text_ids("ls -la /app done.") + [TOK.im_end_id] + text_ids("\nnext")
    second = make_turn(1, rerendered, text_ids("ok") + [TOK.im_end_id])
    assembly = assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)
    (record,) = assembly.boundaries
    assert record.case is BoundaryCase.RETOKENIZED
    assert 1 <= record.dropped_tokens <= REPAIR_MAX_DROP
    (sample,) = assembly.samples
    # From the boundary on the stream is exactly what the sampler conditioned on for turn 1.
    np.testing.assert_array_equal(sample.tokens, second.full_ids)
    assert sample.audit.masked_by_repair == record.masked_loss_tokens > 0
    assert sample.audit.retokenized == record.retokenized_tokens
    assert sample.num_loss_tokens == len(completion) - record.masked_loss_tokens + len(second.completion_ids)
    check_sample_invariants(sample, {0: first, 1: second})
    assert sample.audit.drift_in_loss_region == 0


def test_closing_text_merging_with_the_last_sampled_token_is_repaired():
    """'>' sampled last, then the template's '\\n' re-encoded together as one token '>\\n'."""
    prompt = text_ids("<parameter=command")
    completion = text_ids(">")
    assert len(text_ids(">\n")) == 1
    first = make_turn(0, prompt, completion, finish=FinishReason.LENGTH)
    second_prompt = prompt + text_ids(">\nls\n</parameter>")
    second = make_turn(1, second_prompt, text_ids("x") + [TOK.im_end_id])
    assembly = assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)
    (record,) = assembly.boundaries
    assert (record.case, record.dropped_tokens, record.retokenized_tokens) == (BoundaryCase.RETOKENIZED, 1, 1)
    (sample,) = assembly.samples
    assert sample.audit.masked_by_repair == 1
    assert sample.loss_mask[len(prompt)] == 0  # the merged token carries no loss
    check_sample_invariants(sample, {0: first, 1: second})


def test_whitespace_changed_in_a_rerendered_tool_call_falls_back_to_text_space():
    prompt = text_ids("user: run it\n")
    sampled_text = '{"name": "shell",  "arguments": {"command": "ls"}}'
    completion = text_ids(sampled_text) + [TOK.im_end_id]
    first = make_turn(0, prompt, completion)
    rerendered_call = '{"name":"shell","arguments":{"command":"ls"}}'
    glue = text_ids("\n<tool_response>\nfile.txt\n</tool_response>\n")
    second_prompt = prompt + text_ids(rerendered_call) + [TOK.im_end_id] + glue
    second = make_turn(1, second_prompt, text_ids("done") + [TOK.im_end_id])
    assembly = assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)
    (record,) = assembly.boundaries
    assert record.case is BoundaryCase.TEXT_FALLBACK
    (sample,) = assembly.samples
    # Eq. 10: the sampled a_i stays (mask 1), then p_{i+1}[e:] (mask 0), never the re-encoded copy.
    expected = prompt + completion + second_prompt[record.completion_end :] + list(second.completion_ids)
    np.testing.assert_array_equal(sample.tokens, expected)
    assert sample.num_loss_tokens == len(completion) + len(second.completion_ids)
    assert sample.audit.placeholder == 1 and sample.audit.context_drift > 0
    # The second turn's tokens are trained on a history the sampler never saw (paper §10).
    assert sample.audit.context_drift_loss_tokens == len(second.completion_ids)
    placeholder_row = len(prompt) + len(completion) - 1
    np.testing.assert_array_equal(sample.routing[placeholder_row], sample.routing[placeholder_row - 1])
    assert sample.loss_mask[placeholder_row + 1] == 0
    check_sample_invariants(sample, {0: first, 1: second})


def test_pruned_history_is_located_by_bytes_and_keeps_sampled_tokens():
    """The re-rendered prompt dropped turn 0's reasoning: the stream keeps what was sampled."""
    prompt = text_ids("question\n")
    completion0 = text_ids("<think>long reasoning</think> answer one") + [TOK.im_end_id]
    first = make_turn(0, prompt, completion0)
    prompt1 = prompt + completion0 + text_ids("\nobservation\n")
    completion1 = text_ids("answer two") + [TOK.im_end_id]
    second = make_turn(1, prompt1, completion1)
    pruned = (
        prompt
        + text_ids(" answer one")
        + [TOK.im_end_id]
        + text_ids("\nobservation\n")
        + completion1
        + text_ids("\nsecond observation\n")
    )
    third = make_turn(2, pruned, text_ids("three") + [TOK.im_end_id])
    assembly = assemble_trajectory(trajectory_of([first, second, third]), 1.0, TOK)
    assert [r.case for r in assembly.boundaries] == [BoundaryCase.EXACT, BoundaryCase.TEXT_FALLBACK]
    (sample,) = assembly.samples
    assert sample.num_loss_tokens == len(completion0) + len(completion1) + len(third.completion_ids)
    check_sample_invariants(sample, {0: first, 1: second, 2: third})


def test_unrelated_next_prompt_forks_a_new_sample():
    first = make_turn(0, text_ids("alpha"), text_ids("beta") + [TOK.im_end_id])
    second = make_turn(1, text_ids("something else entirely"), text_ids("gamma") + [TOK.im_end_id])
    assembly = assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)
    assert [r.case for r in assembly.boundaries] == [BoundaryCase.FORK]
    assert [s.fork_index for s in assembly.samples] == [0, 1]
    np.testing.assert_array_equal(assembly.samples[1].tokens, second.full_ids)
    assert assembly.audit.boundaries_forked == 1


def test_without_a_tokenizer_a_non_exact_boundary_forks_rather_than_guessing():
    first = make_turn(0, text_ids("a"), text_ids(">"), finish=FinishReason.LENGTH)
    second = make_turn(1, text_ids("a>\nb"), text_ids("c") + [TOK.im_end_id])
    assert [r.case for r in assemble_trajectory(trajectory_of([first, second]), 1.0).boundaries] == [
        BoundaryCase.FORK
    ]


def test_offset_map_locates_a_completion_whose_text_was_rewritten():
    prompt = text_ids("q\n")
    completion = text_ids("cd /app && make") + [TOK.im_end_id]
    first = make_turn(0, prompt, completion)
    rewritten = prompt + text_ids("cd /app; make") + [TOK.im_end_id]
    second_prompt = rewritten + text_ids("\nbuild ok\n")
    second = make_turn(1, second_prompt, text_ids("next") + [TOK.im_end_id], glue_start=len(rewritten))
    assembly = assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)
    (record,) = assembly.boundaries
    assert record.case is BoundaryCase.TEXT_FALLBACK and record.completion_end == len(rewritten)
    check_sample_invariants(assembly.samples[0], {0: first, 1: second})


# ---- routing failures -----------------------------------------------------------------------------


def test_placeholder_before_a_loss_token_raises():
    """Case 8 with no glue between the two completions: Eq. 14 forbids the placeholder."""
    prompt = text_ids("q\n")
    completion = text_ids("hello  world") + [TOK.im_end_id]
    first = make_turn(0, prompt, completion)
    second_prompt = prompt + text_ids("hello world") + [TOK.im_end_id]
    second = make_turn(1, second_prompt, text_ids("more") + [TOK.im_end_id])
    with pytest.raises(RoutingAlignmentError, match="Eq. 14"):
        assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)


def test_missing_routing_in_one_turn_aborts():
    first = make_turn(0, text_ids("a"), text_ids("b") + [TOK.im_end_id])
    second = make_turn(1, list(first.full_ids) + text_ids("\nc"), text_ids("d"), routing=False)
    with pytest.raises(RoutingMissingError, match="no routing record"):
        assemble_trajectory(trajectory_of([first, second]), 1.0, TOK)


def test_trimmed_routing_that_lacks_a_needed_row_aborts():
    first = make_turn(0, text_ids("a"), text_ids("b") + [TOK.im_end_id])
    prompt = list(first.full_ids) + text_ids("\nc")
    full = make_turn(1, prompt, text_ids("d"))
    trimmed = Turn(
        prompt_ids=full.prompt_ids,
        completion_ids=full.completion_ids,
        logprobs=full.logprobs,
        routing=full.routing[len(first.full_ids) :],
        routing_start=len(first.full_ids),
        finish_reason=full.finish_reason,
        policy_version=0,
        request_id="r1",
    )
    with pytest.raises(RoutingMissingError, match="no routing record for position"):
        assemble_trajectory(trajectory_of([first, trimmed]), 1.0, TOK)


def test_dense_trajectories_have_no_routing():
    first = make_turn(0, text_ids("a"), text_ids("b") + [TOK.im_end_id], routing=False)
    second = make_turn(1, list(first.full_ids) + text_ids("\nc"), text_ids("d"), routing=False)
    (sample,) = assemble(trajectory_of([first, second]), 1.0, TOK)
    assert sample.routing is None and sample.num_loss_tokens == 3


# ---- adversarial property test --------------------------------------------------------------------

BEHAVIOURS = ("token_in", "rerender_last", "whitespace", "prune", "unrelated")


@st.composite
def adversarial_segment(draw) -> tuple[list[Turn], list[str]]:
    num_turns = draw(st.integers(2, 5))
    prompt = text_ids("task: " + draw(st.lists(st.sampled_from(FRAGMENTS), max_size=4).map("".join)))
    turns, behaviours = [], []
    for index in range(num_turns):
        body = "run " + draw(st.lists(st.sampled_from(FRAGMENTS), max_size=5).map("".join))
        split = draw(st.sampled_from(("canonical", "bytes", "tail_bytes")))
        if split == "canonical":
            completion = text_ids(body)
        elif split == "bytes":
            completion = byte_ids(body)
        else:
            completion = text_ids(body[:-3]) + byte_ids(body[-3:])
        stopped = draw(st.booleans())
        completion = completion + ([TOK.im_end_id] if stopped else [])
        turn = make_turn(
            index, prompt, completion, finish=FinishReason.STOP if stopped else FinishReason.LENGTH
        )
        turns.append(turn)
        if index == num_turns - 1:
            break
        behaviour = draw(st.sampled_from(BEHAVIOURS))
        behaviours.append(behaviour)
        glue_text = "\n" + draw(st.sampled_from(FRAGMENTS)) + " output\n"
        closing = [] if stopped else [TOK.im_end_id]
        if behaviour == "token_in":
            prompt = list(turn.full_ids) + closing + text_ids(glue_text)
        elif behaviour == "rerender_last":
            prompt = list(turn.prompt_ids) + text_ids(body) + [TOK.im_end_id] + text_ids(glue_text)
        elif behaviour == "whitespace":
            prompt = (
                list(turn.prompt_ids)
                + text_ids(body.replace(" ", "  ", 1) + " ")
                + [TOK.im_end_id]
                + text_ids(glue_text)
            )
        elif behaviour == "prune":
            cut = draw(st.integers(1, max(1, len(turn.prompt_ids) - 1)))
            prompt = list(turn.prompt_ids[:cut]) + list(turn.completion_ids) + closing + text_ids(glue_text)
        else:
            prompt = text_ids("unrelated " + glue_text)
    return turns, behaviours


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial_segment())
def test_adversarial_boundaries_never_drift_in_the_loss_region(case):
    check_adversarial_segment(case)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial_segment())
def test_adversarial_boundaries_many_examples(case):
    check_adversarial_segment(case)


def check_adversarial_segment(case):
    turns, behaviours = case
    assembly = assemble_trajectory(trajectory_of(turns), 1.0, TOK)
    assert len(assembly.boundaries) == len(turns) - 1
    by_index = dict(enumerate(turns))
    for behaviour, record in zip(behaviours, assembly.boundaries, strict=True):
        if behaviour == "token_in":
            assert record.case is BoundaryCase.EXACT
        if record.case is BoundaryCase.RETOKENIZED:
            assert 1 <= record.dropped_tokens <= REPAIR_MAX_DROP
    total_kept = 0
    for sample in assembly.samples:
        check_sample_invariants(sample, by_index)
        assert sample.audit.drift_in_loss_region == 0
        assert sample.audit.aligned + sample.audit.retokenized == len(sample.tokens)
        if sample.routing is not None:
            placeholder_rows = [
                j
                for j in range(1, len(sample.routing))
                if np.array_equal(sample.routing[j], sample.routing[j - 1])
            ]
            assert all(sample.loss_mask[j + 1] == 0 for j in placeholder_rows)
        total_kept += sample.num_loss_tokens
    sampled = sum(len(t.completion_ids) for t in turns)
    assert total_kept == sampled - assembly.audit.masked_by_repair
    assert audit_metrics(list(assembly.samples))["tito/drift_rate"] == 0.0


# ---- the audit itself can fail ----------------------------------------------------------------------


def test_audit_counts_tampered_loss_positions():
    first = make_turn(0, text_ids("prompt"), text_ids("answer") + [TOK.im_end_id])
    second = make_turn(1, list(first.full_ids) + text_ids("\nobs\n"), text_ids("next") + [TOK.im_end_id])
    (sample,) = assemble(trajectory_of([first, second]), 1.0, TOK)
    provenance = SampleProvenance(turns=(first, second), masked_by_repair=(0, 0))
    assert audit_sample(sample, provenance) == 0
    loss_positions = np.nonzero(sample.loss_mask)[0]

    def tampered(**changes):
        import dataclasses

        return dataclasses.replace(sample, **changes)

    tokens = sample.tokens.copy()
    tokens[loss_positions[0]] = (tokens[loss_positions[0]] + 1) % TOK.vocab_size
    assert audit_sample(tampered(tokens=tokens), provenance) == 1
    logprobs = sample.sampler_logprobs.copy()
    logprobs[loss_positions[1]] = np.nextafter(logprobs[loss_positions[1]], np.float32(0))
    assert audit_sample(tampered(sampler_logprobs=logprobs), provenance) == 1
    routing = sample.routing.copy()
    routing[loss_positions[2] - 1, 1, 0] += 1
    assert audit_sample(tampered(routing=routing), provenance) == 1
    mask = sample.loss_mask.copy()
    mask[loss_positions[-1] + 1 if loss_positions[-1] + 1 < len(mask) else 1] = 1
    assert audit_sample(tampered(loss_mask=mask), provenance) >= 1


def test_audit_metrics_are_flat_and_sum_over_samples():
    first = make_turn(0, text_ids("a"), text_ids("b") + [TOK.im_end_id])
    metrics = audit_metrics(assemble(trajectory_of([first], [first]), 1.0, TOK))
    assert metrics["tito/samples"] == 2.0
    assert metrics["tito/loss_tokens"] == 2.0 * len(first.completion_ids)
    assert metrics["tito/drift_in_loss_region"] == 0.0 and metrics["tito/drift_rate"] == 0.0
