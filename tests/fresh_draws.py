"""Fresh weights drawn in one program: for models transformers builds only with weights (composed models), and
for the tests' own tiny models, which transformers would draw op by op (hundreds of small compiles)."""

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from utils.models.loading import init_in_one_program
from utils.run import perf


def fresh_model(model_class, config, seed=0, **kwargs):
    """`model_class(config, seed=seed, **kwargs)`, its weights drawn in one compiled program (the same
    draws, float32 rounding apart)."""
    with init_in_one_program(model_class):
        return model_class(config, seed=seed, **kwargs)


def assert_drawn_in_one_program(model_class, config, seed, build):
    """`build()` (-> the parameters of a fresh `model_class` of `config` and `seed`) lowers at most 3 programs
    where transformers' own build lowers one per operation, draws the same weights as transformers for the
    seed (float32 rounding apart), and leaves `model_class` as it was."""
    init_weights = model_class.init_weights
    jax.clear_caches()  # every program lowered anew: the count is the build's own
    before = perf.compile_count()
    params = build()
    assert len(perf.compiled_since(before)) <= 3
    assert model_class.init_weights is init_weights
    stock = flatten_dict(model_class(config, seed=seed).params)  # op by op
    ours = flatten_dict(params)
    assert ours.keys() == stock.keys()
    for key, value in stock.items():
        np.testing.assert_allclose(ours[key], value, rtol=0, atol=1e-6, err_msg=str(key))
