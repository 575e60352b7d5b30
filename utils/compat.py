"""Version shims, applied once by `apply()` before any model is built.

transformers' Flax models were written against jax <= 0.4.13. On current JAX exactly one thing
breaks: Flax T5/mT5/LongT5 call `jnp.clip(x, a_min=..., a_max=...)`, keywords that newer JAX
removed in favour of `min=` / `max=`. We wrap `jnp.clip` to translate the old names.
"""

import inspect

import jax.numpy as jnp

_applied = False


def _clip_accepts_old_keywords():
    return "a_min" in inspect.signature(jnp.clip).parameters


def apply():
    """Install the shims. Idempotent; a no-op on JAX versions that still take `a_min`/`a_max`."""
    global _applied
    if _applied or _clip_accepts_old_keywords():
        _applied = True
        return
    clip = jnp.clip

    def clip_with_old_keywords(x, *args, a_min=None, a_max=None, **kwargs):
        if a_min is not None:
            kwargs["min"] = a_min
        if a_max is not None:
            kwargs["max"] = a_max
        return clip(x, *args, **kwargs)

    jnp.clip = clip_with_old_keywords
    _applied = True
