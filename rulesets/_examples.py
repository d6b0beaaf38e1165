"""The packs' example arguments: abstract arrays for a rule's ``example_inputs=`` and ``example_program=``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    """A float32 array of this shape."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    """An int32 array of this shape."""
    return jax.ShapeDtypeStruct(shape, jnp.int32)
