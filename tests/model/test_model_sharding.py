"""The forward on a 2x2x2 CPU mesh (fsdp x expert x tensor) equals the single-device forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t1jax.model import CausalLMOutput
from t1jax.parallel import make_mesh, state_shardings


def test_sharded_forward_equals_single_device(tiny_model, padded_batch):
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
