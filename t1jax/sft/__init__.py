"""The SFT warm start (the paper's RST-SFT role): an imperfect scripted demonstrator's trials in
real sandboxes (`demonstrator`, `demos`), trained with masked cross-entropy (`train`), CLI `t1jax sft`."""
