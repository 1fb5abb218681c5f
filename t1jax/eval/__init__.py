"""`t1jax eval`: attempts, pass@k and Harbor-layout job results over any task directory, for a
checkpoint behind the JAX engine or for the oracle / no-op agents (`t1jax.eval.cli`)."""
