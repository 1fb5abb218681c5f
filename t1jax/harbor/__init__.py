"""Harbor interoperability: the Harbor fields of `t1jax eval`'s job records (`records`), ATIF
trajectories with t1jax's training extension (`atif`). Nothing here imports `harbor` except the
modules meant to be loaded by Harbor itself; Harbor's own models check all of it in
tests/harbor (`make test-harbor`, docs/harbor.md)."""
