"""Reply parsing: Qwen3.5 XML tool calls (and Qwen3 JSON), errors that name the problem, no raising."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.parsing import ShellCommand, parse_reply


def parse(text: str, **kwargs):
    return parse_reply(text, default_duration_sec=1.0, max_duration_sec=60.0, **kwargs)


def test_xml_calls_with_multiline_commands_and_durations():
    heredoc = "cat > /app/a.py << 'EOF'\nprint(\"hi\")\nEOF"
    text = (
        "Plan: write the file.\n\n"
        + render_tool_call_text("shell", {"command": heredoc, "duration": "0.5"})
        + "\n"
        + render_tool_call_text("shell", {"command": "python3 /app/a.py"})
    )
    reply = parse(text)
    assert reply.ok and not reply.warnings and not reply.task_complete
    assert reply.commands == (ShellCommand(heredoc, 0.5), ShellCommand("python3 /app/a.py", 1.0))


def test_qwen3_json_calls_are_accepted():
    reply = parse(
        '<tool_call>\n{"name": "shell", "arguments": {"command": "ls", "duration": 2}}\n</tool_call>'
    )
    assert reply.commands == (ShellCommand("ls", 2.0),)
    assert parse('<tool_call>{"name": "task_complete", "arguments": "{}"}</tool_call>').task_complete


def test_task_complete_alone_and_with_commands():
    assert parse(render_tool_call_text("task_complete", {})).task_complete
    both = parse(
        render_tool_call_text("shell", {"command": "ls"}) + render_tool_call_text("task_complete", {})
    )
    assert both.ok and both.task_complete and len(both.commands) == 1


def test_duration_is_capped_with_a_warning_and_bad_values_are_errors():
    capped = parse(render_tool_call_text("shell", {"command": "make", "duration": "600"}))
    assert capped.commands == (ShellCommand("make", 60.0),) and "capped at 60 s" in capped.warnings[0]
    for bad in ("soon", "-1", "nan", "inf"):
        reply = parse(render_tool_call_text("shell", {"command": "make", "duration": bad}))
        assert not reply.ok and not reply.commands and "duration" in reply.errors[0]


def test_errors_name_what_was_wrong():
    cases = {
        "just some text": "no tool call found",
        "<tool_call>\n<function=shell>\n<parameter=command>\nls": "never closed",
        "</tool_call>": "without a matching",
        render_tool_call_text("rm_rf", {"path": "/"}): "unknown function 'rm_rf'",
        render_tool_call_text("shell", {"cmd": "ls"}): "no parameter(s) ['cmd']",
        render_tool_call_text("shell", {}): "needs a command",
        "<tool_call>not a function</tool_call>": "expected <function=NAME>",
        '<tool_call>{"name": "shell", "arguments": [1]}</tool_call>': "must be a JSON object",
        "<tool_call>{broken json</tool_call>": "invalid JSON",
        "<tool_call><tool_call><function=shell></function></tool_call>": "never closed",
    }
    for text, message in cases.items():
        reply = parse(text)
        assert not reply.ok and not reply.commands, text
        assert any(message in error for error in reply.errors), (text, reply.errors)


def test_cut_off_reply_says_so_and_trailing_text_is_a_warning():
    cut = parse("<tool_call>\n<function=shell>\n<parameter=command>\nls -la", truncated=True)
    assert "cut off at the per-turn token limit" in cut.errors[0]
    trailing = parse(render_tool_call_text("shell", {"command": "ls"}) + "\nand then I will celebrate")
    assert trailing.ok and trailing.warnings == ("text after the last tool call was ignored",)


def test_one_bad_call_blocks_every_command():
    reply = parse(render_tool_call_text("shell", {"command": "ls"}) + render_tool_call_text("nope", {}))
    assert not reply.ok and reply.commands == (ShellCommand("ls", 1.0),)  # parsed, but the harness runs none


PARTS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<function=shell>",
        "</function>",
        "<parameter=command>",
        "<parameter=duration>",
        "</parameter>",
        "\n",
        "ls",
        "1e309",
        "{",
        "}",
        '"',
        "\x00",
        "\ufffd",
        "<function=",
        "task_complete",
        '{"name": "shell"}',
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(PARTS, max_size=25).map("".join), st.text(max_size=200)))
def test_parser_never_raises_on_arbitrary_replies(text):
    reply = parse(text)
    assert reply.ok == (not reply.errors)
    if reply.ok:
        assert reply.commands or reply.task_complete
        assert all(0 <= c.duration_sec <= 60.0 for c in reply.commands)
