"""Data of a training run: the grain task pool (`t1jax.data.pool`)."""
