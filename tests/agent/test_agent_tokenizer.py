"""The project tokenizer file and the `ChatTokenizer` wrapper around any HF tokenizer.json."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from t1jax.agent import train_tokenizer
from t1jax.agent.chat_template import CONTROL_TOKENS
from t1jax.agent.tokenizer import (
    PROJECT_TOKENIZER_PATH,
    ChatTokenizer,
    load_project_tokenizer,
    load_tokenizer,
)
from t1jax.agent.tokenizer_corpus import generate_corpus

TOK = load_project_tokenizer()


def test_shipped_tokenizer_has_exactly_the_model_vocabulary_and_qwen_control_tokens():
    assert TOK.vocab_size == 2048 == train_tokenizer.VOCAB_SIZE
    assert [TOK.token_id(t) for t in CONTROL_TOKENS] == list(range(len(CONTROL_TOKENS)))
    assert TOK.exact_bytes
    assert TOK.stop_token_ids == (TOK.im_end_id, TOK.end_of_text_id)
    # Every byte has its own token, so no text is ever unknown.
    single_bytes = {TOK.token_bytes(i) for i in range(TOK.vocab_size) if len(TOK.token_bytes(i)) == 1}
    assert len(single_bytes) == 256


def test_training_script_reproduces_the_shipped_file_byte_for_byte():
    fresh = train_tokenizer.tokenizer_json(train_tokenizer.build_tokenizer())
    assert fresh == PROJECT_TOKENIZER_PATH.read_text()


def test_held_out_agent_text_compresses_well():
    documents = list(generate_corpus(seed=12345, num_documents=200))
    characters = sum(len(d) for d in documents)
    tokens = sum(len(TOK.encode_text(d)) for d in documents)
    assert characters / tokens > 2.5  # raw bytes would give ~1.0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_byte_exactly(text):
    ids = TOK.encode_text(text)
    expected = text.encode("utf-8", errors="surrogatepass")
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        expected = "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text).encode()
    assert TOK.decode_bytes(ids) == expected
    if not any("\ud800" <= ch <= "\udfff" for ch in text):
        assert TOK.hf.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(list(CONTROL_TOKENS) + ["<", "|", ">", "im_end", "a", " ", "\n", "<|", "|>"]),
        max_size=20,
    ).map("".join)
)
def test_text_spelling_control_tokens_never_encodes_to_control_ids(text):
    ids = TOK.encode_text(text)
    assert not set(ids) & set(range(len(CONTROL_TOKENS)))
    assert TOK.decode(ids) == text


def test_out_of_vocabulary_ids_decode_to_a_replacement_character():
    assert TOK.decode([TOK.vocab_size + 5]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.token_bytes(TOK.vocab_size)


def _tokenizer_with(added: list[AddedToken]) -> Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(added)
    return tokenizer


def test_any_hf_tokenizer_json_with_the_control_tokens_loads(tmp_path):
    # Qwen marks <tool_call> and friends as non-special added tokens; they must still never be
    # produced from text.
    added = [
        AddedToken(t, special=t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")) for t in CONTROL_TOKENS
    ]
    path = tmp_path / "tokenizer.json"
    path.write_text(_tokenizer_with(added).to_str())
    other = load_tokenizer(path)
    ids = other.encode_text("a<tool_call>b<|im_end|>")
    assert other.token_id("<tool_call>") not in ids and other.im_end_id not in ids
    assert other.decode(ids) == "a<tool_call>b<|im_end|>"


def test_tokenizer_without_control_tokens_is_rejected_naming_them(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(_tokenizer_with([AddedToken("<|im_start|>", special=True)]).to_str())
    with pytest.raises(ValueError, match=r"missing chat control tokens \['<\|endoftext\|>', '<\|im_end\|>'"):
        ChatTokenizer.from_file(path)


def test_missing_or_malformed_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(ValueError, match="bad.json could not be parsed"):
        load_tokenizer(bad)
