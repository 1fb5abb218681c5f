"""Train the project tokenizer: a 2048-id byte-level BPE on generated shell-agent text.

    python -m t1jax.agent.train_tokenizer            # rewrites t1jax/agent/assets/t1jax-bpe-2048.json
    python -m t1jax.agent.train_tokenizer --check    # exits 1 if the shipped file differs

Invariants of the produced file:
- exactly `VOCAB_SIZE` (2048) ids, the tiny model's vocabulary; ids 0..8 are the chat control
  tokens in `chat_template.CONTROL_TOKENS` order (Qwen's spellings), marked special;
- byte-level: the 256-byte alphabet is always present, so any text round-trips exactly (no
  normaliser, no unknown token);
- the pre-tokeniser splits like Qwen's (letters with one leading non-letter, single digits,
  punctuation runs, newline runs, spaces) before the byte-level mapping;
- reproducible: the corpus is `tokenizer_corpus.generate_corpus(SEED, NUM_DOCUMENTS)` and BPE
  training is deterministic, so rerunning this script reproduces the file byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from sandbox_service.cli_contract import OneLineArgumentParser, run_command
from t1jax.agent.chat_template import CONTROL_TOKENS
from t1jax.agent.tokenizer import PROJECT_TOKENIZER_PATH
from t1jax.agent.tokenizer_corpus import generate_corpus

VOCAB_SIZE = 2048
SEED = 0
NUM_DOCUMENTS = 12000
# Letters (optionally led by one non-letter), single digits, punctuation runs, newline runs,
# and whitespace: the same split points as Qwen2/3's pre-tokeniser, written out here.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(
    seed: int = SEED, num_documents: int = NUM_DOCUMENTS, vocab_size: int = VOCAB_SIZE
) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(seed, num_documents), trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {tokenizer.get_vocab_size(with_added_tokens=True)} ids, wanted "
            f"{vocab_size}: the generated corpus is too small to supply enough merges"
        )
    return tokenizer


def tokenizer_json(tokenizer: Tokenizer) -> str:
    return tokenizer.to_str(pretty=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(
        prog="python -m t1jax.agent.train_tokenizer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=PROJECT_TOKENIZER_PATH)
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    return run_command("python -m t1jax.agent.train_tokenizer", lambda: _train(args), debug=args.debug)


def _train(args) -> int:
    print(f"training a {VOCAB_SIZE}-id byte-level BPE on {NUM_DOCUMENTS} generated documents (seed {SEED})")
    text = tokenizer_json(build_tokenizer())
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'matches' if same else 'DIFFERS from'} a fresh training run")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
