"""Task data: the grain task pool of a training run (`t1jax.data.pool`) and the synthetic task
suite generator (`t1jax.data.suite`, its step library `t1jax.data.idioms`, CLI `t1jax tasks
generate`)."""
