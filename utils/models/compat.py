"""Version shims, applied once by `apply()` before any model is built.

transformers' Flax models were written against jax <= 0.4.13. On current JAX exactly one thing
breaks: Flax T5/mT5/LongT5 call `jnp.clip(x, a_min=..., a_max=...)`, keywords that newer JAX
removed in favour of `min=` / `max=`. We wrap `jnp.clip` to translate the old names.

One fix of transformers' own (its Flax code is frozen): `FlaxEncoderDecoderModel.encode`, which
`generate` runs, hands the encoder its position ids positionally, where BERT-style encoders take
token type ids; those look up past the type table and come back NaN. The encoder gets keywords,
as the model's forward pass gives them.

And the rotary decoders (Llama, Mistral, Gemma) get the positions, head sizes and windows their
configs define (`utils.models.decoder_positions`, which says what transformers' Flax code ignores).
"""

import inspect

import jax.numpy as jnp

from utils.models import decoder_positions

_applied = False


def _clip_accepts_old_keywords():
    return "a_min" in inspect.signature(jnp.clip).parameters


def _encoder_called_by_keyword(module):
    def encoder(input_ids, attention_mask, position_ids, **kwargs):
        return module.encoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              **kwargs)
    return encoder


def _clip_with_old_keywords(clip):
    def clip_with_old_keywords(x, *args, a_min=None, a_max=None, **kwargs):
        if a_min is not None:
            kwargs["min"] = a_min
        if a_max is not None:
            kwargs["max"] = a_max
        return clip(x, *args, **kwargs)
    return clip_with_old_keywords


def apply():
    """Install the shims. Idempotent; the clip one only on JAX versions that no longer take `a_min`/`a_max`."""
    global _applied
    if _applied:
        return
    # Here, not at the top: the Flax model code costs a second or two, after the quick checks.
    from transformers.models.encoder_decoder.modeling_flax_encoder_decoder import FlaxEncoderDecoderModule

    FlaxEncoderDecoderModule._get_encoder_module = _encoder_called_by_keyword
    decoder_positions.install()
    if not _clip_accepts_old_keywords():
        jnp.clip = _clip_with_old_keywords(jnp.clip)
    _applied = True
