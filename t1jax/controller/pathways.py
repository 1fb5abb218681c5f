"""Pathways (multi-slice TPU from one controller): `pathwaysutils.initialize()` must run before
any JAX call, so `t1jax train` calls this before it builds anything when the run config says
`run.pathways: true`. With it false, or on CPU, nothing here runs and the same code runs
unchanged."""

from __future__ import annotations


def initialize_pathways() -> None:
    try:
        import pathwaysutils
    except ImportError as error:
        raise RuntimeError(
            "run.pathways is true but pathwaysutils is not installed (pip install 't1jax[tpu]')"
        ) from error
    pathwaysutils.initialize()
