"""`make demo`: base -> SFT -> critic warm-up -> RL -> held-out evaluation (`t1jax.demo.driver`)."""
