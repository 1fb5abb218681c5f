"""The agent side of a trial: tokenizer and pinned chat template, Terminus-style harness, compaction.

Entry points: `harness.run_trial` / `harness.verify_trial` (one trial, token-in), `tokenizer.load_tokenizer`
(any HF tokenizer.json; the project's 2048-id BPE by default), `metrics.trial_metrics`.
"""
