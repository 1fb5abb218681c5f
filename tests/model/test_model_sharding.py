"""The forward on a 2x2x2 CPU mesh (fsdp x expert x tensor) equals the single-device forward.

Known jaxlib problem worked around here: on CPU, `jax.scipy.linalg.solve_triangular` is a LAPACK
custom call whose batch loop (`ParallelBatchMap`) waits on the same thread pool that runs the 8
fake devices' programs; with all 8 devices inside such a call at once the process deadlocks (seen
with jax 0.10.2 on 2 cores: threads parked in `TriMatrixEquationSolver` -> `BlockingCounter::Wait`).
The gated delta rule (t1jax/ops, another owner) uses it for its unit lower-triangular solve. Until
that op stops calling LAPACK, this test swaps in an exact matmul-only solve for *both* the sharded
and the single-device run it compares, so it still checks every sharding of the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t1jax.model import CausalLMOutput
from t1jax.parallel import make_mesh, state_shardings


def unit_lower_triangular_solve(a, b, lower=True, unit_diagonal=True, **_):
    """Solve (I + N) x = b for strictly lower N: (I + N)^-1 = prod_i (I + (-N)^(2^i)), exact once
    2^i reaches the size because N is nilpotent."""
    assert lower and unit_diagonal
    size = a.shape[-1]
    power = -jnp.tril(a, -1)
    inverse = jnp.eye(size, dtype=a.dtype) + power
    reach = 2
    while reach < size:
        power = power @ power
        inverse = inverse + inverse @ power
        reach *= 2
    return inverse @ b


@pytest.fixture
def lapack_free_triangular_solve(monkeypatch):
    monkeypatch.setattr(jax.scipy.linalg, "solve_triangular", unit_lower_triangular_solve)


def test_sharded_forward_equals_single_device(tiny_model, padded_batch, lapack_free_triangular_solve):
    ids, segments, _ = padded_batch
    ids = np.concatenate([ids, ids[:1, ::-1]])  # 4 rows, so the batch splits over fsdp
    segments = np.concatenate([segments, np.ones_like(segments[:1])])
    graphdef, state = nnx.split(tiny_model)

    def forward(state, ids, segments):
        return nnx.merge(graphdef, state)(ids, segment_ids=segments)

    single = jax.jit(forward)(state, jnp.asarray(ids), jnp.asarray(segments))

    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    shardings = state_shardings(state, mesh)
    experts = shardings["model"]["layers"][0]["mlp"]["experts"]
    assert experts["w_gate"].get_value().spec == P("expert", "fsdp", "tensor")
    assert shardings["model"]["embed_tokens"].get_value().spec == P("tensor", "fsdp")
    assert shardings["model"]["layers"][3]["self_attn"]["q_proj"].get_value().spec == P(
        "fsdp", "tensor", None
    )
    batch = NamedSharding(mesh, P("fsdp", None))
    out_shardings = CausalLMOutput(
        logits=NamedSharding(mesh, P("fsdp", None, "tensor")), routing=NamedSharding(mesh, P("fsdp"))
    )
    with jax.set_mesh(mesh):
        sharded_forward = jax.jit(
            forward, in_shardings=(shardings, batch, batch), out_shardings=out_shardings
        )
        placed = jax.device_put(state, shardings)
        out = sharded_forward(placed, jax.device_put(ids, batch), jax.device_put(segments, batch))
    assert out.logits.sharding.spec == P("fsdp", None, "tensor")
    assert len(out.logits.sharding.device_set) == 8
    logits, reference = np.asarray(out.logits), np.asarray(single.logits)
    np.testing.assert_allclose(logits, reference, atol=1e-5 * np.abs(reference).max(), rtol=0)
    np.testing.assert_array_equal(np.asarray(out.routing), np.asarray(single.routing))
