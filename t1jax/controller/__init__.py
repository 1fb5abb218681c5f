"""The single controller of a training run (`t1jax train`): the run config, the trainer / sampler
split with its versions and publication, the one-step-ahead loop, checkpoints and resume,
liveness probes, the run directory and the live display."""
