"""Sandbox service: tasks, isolated sandboxes, verifier reports, admission control. Never imports t1jax."""
