"""Commands and tools that sit on top of the whole stack (they may import every package).

- ``t1jax.tools.lowering``: lowering and compiling the learner's programs without running them
  (abstract production meshes; the capacity model's calibration and validation).
- ``t1jax.tools.planner``: ``t1jax plan``, ranking sharding plans by the capacity model.
"""
