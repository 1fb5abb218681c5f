"""t1jax: PPO for terminal agents on a Qwen3.5-style hybrid MoE, in JAX."""
