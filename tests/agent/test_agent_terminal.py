"""Terminal output becomes safe, capped text whatever a command printed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from t1jax.agent.terminal import cap_text, sanitize_terminal_text


def test_binary_bytes_become_replacement_characters_and_controls_are_visible():
    raw = b"ok\x00\x07\xff\xfe\x1b[31mred\x1b[0m\r\nnext\x7f"
    text = sanitize_terminal_text(raw.decode("utf-8", errors="surrogateescape"))
    assert text == "ok^@^G\ufffd\ufffdred\nnext^?"
    text.encode("utf-8")  # valid UTF-8


def test_cap_keeps_head_and_tail_and_states_the_omission():
    text = "".join(f"line {i}\n" for i in range(10_000))
    capped, omitted = cap_text(text, 1000)
    assert capped.startswith("line 0\n") and capped.endswith("line 9999\n")
    assert f"[... {omitted} bytes of output omitted ...]" in capped
    kept = len(capped.encode()) - len(f"\n[... {omitted} bytes of output omitted ...]\n")
    assert kept + omitted == len(text.encode()) and kept <= 1000


def test_cap_counts_bytes_the_sandbox_already_cut():
    assert cap_text("short", 100, upstream_omitted=5000) == (
        "short\n[... 5000 bytes of output omitted ...]",
        5000,
    )
    assert cap_text("short", 100) == ("short", 0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 300))
def test_any_bytes_become_valid_capped_text(raw, max_bytes):
    text = sanitize_terminal_text(raw.decode("utf-8", errors="surrogateescape"))
    capped, omitted = cap_text(text, max_bytes)
    capped.encode("utf-8")
    body = len(text.encode())
    if body <= max_bytes:
        assert capped == text and omitted == 0
    else:
        assert omitted > 0 and len(capped.encode()) <= max_bytes + len(
            f"\n[... {omitted} bytes of output omitted ...]\n"
        )


class _RecordingSandbox:
    def __init__(self):
        self.sent = []

    def send_keys(self, keys, wait_sec):
        from sandbox_service.contracts import TerminalRead

        self.sent.append(keys)
        return TerminalRead(text="x" * 50, omitted_bytes=7)


def test_tmux_terminal_sends_enter_except_for_key_names():
    from t1jax.agent.terminal import TmuxTerminal

    sandbox = _RecordingSandbox()
    terminal = TmuxTerminal(sandbox, max_bytes=20)
    output = terminal.run("ls -la", 0.0)
    terminal.run("C-c", 0.0)
    terminal.run("", 0.0)
    assert sandbox.sent == ["ls -la\n", "C-c", ""]
    assert output.omitted_bytes == 30 + 7 and "[... 37 bytes of output omitted ...]" in output.text
