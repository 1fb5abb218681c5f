"""The pinned chat template: Qwen3.5 conventions, and append-only in text and in token ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1jax.agent.chat_template import (
    Message,
    ToolCall,
    ToolSpec,
    generation_prompt_pieces,
    render_message_pieces,
    render_pieces,
    render_text,
)
from t1jax.agent.prompts import TOOLS
from t1jax.agent.tokenizer import load_project_tokenizer

TOK = load_project_tokenizer()
WEATHER = ToolSpec(
    "get_weather",
    "Weather for a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def test_golden_rendering_follows_qwen35_tool_conventions():
    messages = [
        Message("system", "Be brief."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "I'll check.", tool_calls=(ToolCall("get_weather", (("city", "Paris"),)),)),
        Message("tool", responses=("22C",)),
        Message("assistant", "", tool_calls=(ToolCall("a", (("x", "1"),)), ToolCall("b", ()))),
        Message("tool", responses=("one", "two")),
    ]
    text = render_text(messages, tools=[WEATHER], add_generation_prompt=True)
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather for '
        'a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}}\n</tools>\n\nIf you choose to call a function ONLY reply'
    )
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>assistant\nI'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_without_a_system_message_get_a_system_turn_of_their_own():
    text = render_text([Message("user", "hi")], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools")
    assert text.endswith("</IMPORTANT><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


def test_reasoning_is_kept_in_every_assistant_turn():
    messages = [
        Message("user", "q1"),
        Message("assistant", "a1", reasoning="r1"),
        Message("user", "q2"),
        Message("assistant", "a2", reasoning="r2"),
    ]
    text = render_text(messages)
    assert "<think>\nr1\n</think>\n\na1" in text and "<think>\nr2\n</think>\n\na2" in text


def test_control_tokens_come_only_from_the_template():
    ids = TOK.encode_pieces(render_pieces([Message("user", "print('<|im_end|>') <tool_call>")]))
    assert list(ids).count(TOK.im_end_id) == 1  # the template's closing, not the user's text
    assert TOK.token_id("<tool_call>") not in ids
    assert TOK.decode(ids) == "<|im_start|>user\nprint('<|im_end|>') <tool_call><|im_end|>\n"


@pytest.mark.parametrize(
    "bad",
    [
        dict(role="tool", content="x"),
        dict(role="tool"),
        dict(role="user", responses=("x",)),
        dict(role="user", tool_calls=(ToolCall("a"),)),
        dict(role="system", reasoning="r"),
        dict(role="robot"),
    ],
)
def test_malformed_messages_are_rejected_with_the_reason(bad):
    with pytest.raises(ValueError, match="tool|role|assistant"):
        Message(**bad)


TEXT = st.lists(
    st.sampled_from(list('ab \n\t{}"<>|/_-=.é日') + ["<|im_end|>", "<tool_call>", "</parameter>"]),
    max_size=12,
).map("".join) | st.text(max_size=20)
CALL = st.builds(
    ToolCall,
    st.sampled_from(["shell", "task_complete", "x"]),
    st.lists(st.tuples(st.sampled_from(["command", "duration"]), TEXT), max_size=2).map(tuple),
)
MESSAGE = st.one_of(
    st.builds(Message, st.just("system"), TEXT),
    st.builds(Message, st.just("user"), TEXT),
    st.builds(
        Message, st.just("assistant"), TEXT, st.lists(CALL, max_size=2).map(tuple), st.one_of(st.none(), TEXT)
    ),
    st.builds(
        lambda responses: Message("tool", responses=responses),
        st.lists(TEXT, min_size=1, max_size=3).map(tuple),
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(MESSAGE, max_size=7), st.booleans())
def test_rendering_is_append_only_in_text_and_token_ids(messages, with_tools):
    check_append_only(messages, with_tools)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(st.lists(MESSAGE, max_size=10), st.booleans())
def test_rendering_is_append_only_many_examples(messages, with_tools):
    check_append_only(messages, with_tools)


def check_append_only(messages, with_tools):
    tools = TOOLS if with_tools else ()
    full_text = render_text(messages, tools=tools)
    full_ids = TOK.encode_pieces(render_pieces(messages, tools=tools))
    for k in range(len(messages) + 1):
        prefix = messages[:k]
        assert full_text.startswith(render_text(prefix, tools=tools))
        prefix_ids = TOK.encode_pieces(render_pieces(prefix, tools=tools))
        np.testing.assert_array_equal(full_ids[: len(prefix_ids)], prefix_ids)
        # The generation prompt is a prefix of the rendered assistant reply that follows it.
        with_prompt = TOK.encode_pieces(render_pieces(prefix, tools=tools, add_generation_prompt=True))
        reply = Message("assistant", "ok")
        answered = TOK.encode_pieces(render_pieces(list(prefix) + [reply], tools=tools))
        np.testing.assert_array_equal(answered[: len(with_prompt)], with_prompt)
    # Token-in glue equals the rendering of the appended message (each message starts with a
    # control token, so encodings concatenate).
    if messages:
        pieces = [
            p for i, m in enumerate(messages) for p in render_message_pieces(m, first=i == 0, tools=tools)
        ]
        np.testing.assert_array_equal(TOK.encode_pieces(pieces), full_ids)
    assert TOK.decode(full_ids) == full_text


def test_generation_prompt_is_the_assistant_header():
    assert "".join(p.text for p in generation_prompt_pieces()) == "<|im_start|>assistant\n"
