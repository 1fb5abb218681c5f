"""Tests of the sandbox core: task loaders, reports, environment builder, local backend."""
