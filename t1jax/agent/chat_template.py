"""The pinned chat template: Qwen ChatML with Qwen3.5-style tool calls, rendered append-only.

This module owns how a conversation becomes a sequence of `Piece`s (plain text, or one control
token such as `<|im_start|>`). `ChatTokenizer.encode_pieces` turns pieces into ids: control
tokens map to their single id, text is encoded with added-token matching disabled, so text that
merely *looks* like a control token (a terminal printing `<|im_end|>`) can never become one.

Format (Qwen3.5 conventions, thinking disabled, no `<think>` injection):

    <|im_start|>system\\n# Tools ... <tools>\\n{tool json}\\n</tools> ... \\n\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{instruction}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n\\n<tool_call>\\n<function=shell>\\n<parameter=command>\\n
    ls -la\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                   <- generation prompt

Invariants:
- Append-only: for every conversation M and k <= len(M), `render_pieces(M[:k])` is a prefix of
  `render_pieces(M)`, and `render_pieces(M, add_generation_prompt=True)` is a prefix of
  `render_pieces(M + [assistant message])`. Each message renders independently of the messages
  after it, and every message begins with a control token, so the same holds for token ids.
  Two deliberate departures from Qwen's own template keep this true: (1) reasoning is never
  pruned from earlier assistant turns (Qwen drops it before the last user query); (2) a `tool`
  message carries *all* responses to one assistant turn (Qwen groups consecutive tool messages
  and closes the group only when the next message is not a tool, which is not append-only).
- The template is pinned: the same messages always render the same bytes; content is never
  stripped or normalised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
END_OF_TEXT = "<|endoftext|>"
CONTROL_TOKENS = (
    END_OF_TEXT,
    IM_START,
    IM_END,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
    THINK_OPEN,
    THINK_CLOSE,
)

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Piece:
    """A run of plain text, or (`control=True`) exactly one control token."""

    text: str
    control: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; rendered as one JSON line inside `<tools>`."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def to_json(self) -> str:
        payload = {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }
        return json.dumps(payload, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """One call: a function name and its arguments as ordered (name, text value) pairs."""

    name: str
    arguments: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Message:
    """One chat message. `tool` messages carry every response to the preceding assistant turn in
    `responses` (and no `content`); only `assistant` messages may carry `tool_calls` or
    `reasoning`."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    responses: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message role must be system/user/assistant/tool, got {self.role!r}")
        if self.role == "tool" and (self.content or not self.responses):
            raise ValueError(
                "a tool message carries its outputs in `responses` (at least one) and no content"
            )
        if self.role != "tool" and self.responses:
            raise ValueError(f"only tool messages carry responses, not {self.role!r}")
        if self.role != "assistant" and (self.tool_calls or self.reasoning is not None):
            raise ValueError(f"only assistant messages carry tool calls or reasoning, not {self.role!r}")


def _text(text: str) -> Piece:
    return Piece(text)


def _control(token: str) -> Piece:
    return Piece(token, control=True)


def render_tool_call_pieces(
    call_name: str, arguments: Sequence[tuple[str, str]] | Mapping[str, str]
) -> list[Piece]:
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`."""
    items = arguments.items() if isinstance(arguments, Mapping) else arguments
    body = f"\n<function={call_name}>\n"
    for key, value in items:
        body += f"<parameter={key}>\n{value}\n</parameter>\n"
    body += "</function>\n"
    return [_control(TOOL_CALL_OPEN), _text(body), _control(TOOL_CALL_CLOSE)]


def render_tool_call_text(call_name: str, arguments: Sequence[tuple[str, str]] | Mapping[str, str]) -> str:
    return "".join(piece.text for piece in render_tool_call_pieces(call_name, arguments))


def _tools_preamble(tools: Sequence[ToolSpec]) -> list[Piece]:
    example_call = render_tool_call_pieces(
        "example_function_name",
        (
            ("example_parameter_1", "value_1"),
            (
                "example_parameter_2",
                "This is the value for the second parameter\nthat can span\nmultiple lines",
            ),
        ),
    )
    return [
        _text("# Tools\n\nYou have access to the following functions:\n\n<tools>"),
        *[_text("\n" + tool.to_json()) for tool in tools],
        _text(
            "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format "
            "with NO suffix:\n\n"
        ),
        *example_call,
        _text(
            "\n\n<IMPORTANT>\nReminder:\n"
            "- Function calls MUST follow the specified format: an inner <function=...></function> "
            "block must be nested within "
        ),
        _control(TOOL_CALL_OPEN),
        _control(TOOL_CALL_CLOSE),
        _text(
            " XML tags\n- Required parameters MUST be specified\n"
            "- You may provide optional reasoning for your function call in natural language BEFORE "
            "the function call, but NOT after\n"
            "- If there is no function call available, answer the question like normal with your "
            "current knowledge and do not tell the user about function calls\n</IMPORTANT>"
        ),
    ]


def _tools_system_turn(tools: Sequence[ToolSpec]) -> list[Piece]:
    return [_control(IM_START), _text("system\n"), *_tools_preamble(tools), _control(IM_END), _text("\n")]


def render_message_pieces(
    message: Message, *, first: bool = False, tools: Sequence[ToolSpec] = ()
) -> list[Piece]:
    """The pieces of one message. The first message also carries the tools block (in a system
    turn of its own when it is not a system message)."""
    pieces: list[Piece] = []
    if first and tools and message.role != "system":
        pieces += _tools_system_turn(tools)
    if message.role == "system":
        pieces += [_control(IM_START), _text("system\n")]
        if first and tools:
            pieces += _tools_preamble(tools)
            if message.content:
                pieces.append(_text("\n\n" + message.content))
        else:
            pieces.append(_text(message.content))
    elif message.role == "user":
        pieces += [_control(IM_START), _text("user\n" + message.content)]
    elif message.role == "assistant":
        pieces += [_control(IM_START), _text("assistant\n")]
        if message.reasoning is not None:
            pieces += [
                _control(THINK_OPEN),
                _text("\n" + message.reasoning + "\n"),
                _control(THINK_CLOSE),
                _text("\n\n"),
            ]
        pieces.append(_text(message.content))
        for index, call in enumerate(message.tool_calls):
            if index > 0:
                pieces.append(_text("\n"))
            elif message.content.strip():
                pieces.append(_text("\n\n"))
            pieces += render_tool_call_pieces(call.name, call.arguments)
    else:  # tool
        pieces += [_control(IM_START), _text("user")]
        for response in message.responses:
            pieces += [
                _text("\n"),
                _control(TOOL_RESPONSE_OPEN),
                _text("\n" + response + "\n"),
                _control(TOOL_RESPONSE_CLOSE),
            ]
    pieces += [_control(IM_END), _text("\n")]
    return merge_pieces(pieces)


def generation_prompt_pieces() -> list[Piece]:
    return [_control(IM_START), _text("assistant\n")]


def render_pieces(
    messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), add_generation_prompt: bool = False
) -> list[Piece]:
    pieces: list[Piece] = []
    for index, message in enumerate(messages):
        pieces += render_message_pieces(message, first=index == 0, tools=tools)
    if add_generation_prompt:
        if not messages and tools:  # the reply will be the first message: it brings the tools turn
            pieces += _tools_system_turn(tools)
        pieces += generation_prompt_pieces()
    return merge_pieces(pieces)


def render_text(
    messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (), add_generation_prompt: bool = False
) -> str:
    return "".join(
        p.text for p in render_pieces(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    )


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Join adjacent text pieces and drop empty ones, so a rendering has one canonical piece list
    (text runs are always delimited by control tokens)."""
    merged: list[Piece] = []
    for piece in pieces:
        if not piece.control and not piece.text:
            continue
        if merged and not piece.control and not merged[-1].control:
            merged[-1] = Piece(merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged
