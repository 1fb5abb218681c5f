"""Task data for training and evaluation: the synthetic task suite generator (`t1jax.data.suite`,
its step library `t1jax.data.idioms`, CLI `t1jax tasks generate`)."""
