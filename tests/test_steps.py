"""utils/scoring/losses.py and utils/layout/gradients.py: token-summed cross entropy and token-weighted
(accumulated) gradients, in both layouts."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from utils.layout.gradients import split_micro_batches, token_weighted_grads
from utils.layout.layouts import AXIS, DataParallel, FullySharded
from utils.scoring.losses import cross_entropy_sums

N, VOCAB, DIM, LENGTH = 8, 7, 4, 5


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_cross_entropy_sums_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, VOCAB)).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=(3, 4))
    weights = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    expected = -(np.take_along_axis(log_softmax(logits.astype(np.float64)), labels[..., None], -1)[..., 0] * weights)
    loss, tokens = cross_entropy_sums(logits, labels, weights)
    assert float(tokens) == 8.0
    # float32 log-softmax (a few eps32 per token) summed over 8 tokens, against float64: ~1e-6 relative.
    assert float(loss) == pytest.approx(expected.sum(), rel=1e-5)
    # masked tokens contribute nothing, whatever their logits
    logits[0, 3] = 1e4
    assert float(cross_entropy_sums(logits, labels, weights)[0]) == pytest.approx(expected.sum(), rel=1e-5)


def test_label_smoothing_matches_numpy_and_perfect_logits_score_zero():
    eps = 0.1
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, VOCAB)).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=(2, 3))
    weights = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    target = np.full((2, 3, VOCAB), eps / (VOCAB - 1))
    np.put_along_axis(target, labels[..., None], 1 - eps, -1)
    entropy = -(target * np.log(target)).sum(-1)
    expected = ((-(target * log_softmax(logits.astype(np.float64))).sum(-1) - entropy) * weights).sum()
    loss, tokens = cross_entropy_sums(logits, labels, weights, label_smoothing=eps)
    assert float(tokens) == 5 and float(loss) == pytest.approx(expected, rel=1e-5)  # as above, 5 tokens
    assert float(loss) > 0.1
    perfect, _ = cross_entropy_sums(np.log(target).astype(np.float32), labels, weights, label_smoothing=eps)
    # The smoothed target's entropy (~0.5 per token) subtracted in float32 from a cross-entropy as
    # large: 5 tokens leave ~5 x 2 ulps (6e-8) = 6e-7; 1e-4 is far below a real loss (> 0.1 above).
    assert abs(float(perfect)) < 1e-4
    # without smoothing, perfect means all mass on the label
    sharp = np.where(np.arange(VOCAB) == labels[..., None], 30.0, -30.0).astype(np.float32)
    assert float(cross_entropy_sums(sharp, labels, weights)[0]) < 1e-6


# Gradients and losses summed over the same <= 160 tokens (32 rows x 5) in other orders (devices,
# micro-batches). A float32 sum of T terms is off by at most (T - 1) x eps32 x the sum of |terms|: the
# mean gradient by 159 x 1.2e-7 x mean |x (p - y)| (< 0.8 for these normal x) = 1.5e-5, the loss
# (terms all positive) by 1.9e-5 relative.
# Measured: 3e-8 and 1e-7. A lost micro-batch or a per-device mean moves them by ~1e-2.
GRAD_ATOL = 2e-5
LOSS_RTOL = 2e-5


def linear_loss(params, batch, rng):
    logits = batch["x"] @ params["w"] + params["b"]
    loss, tokens = cross_entropy_sums(logits, batch["labels"], batch["mask"])
    return loss, {"loss": loss, "tokens": tokens}


def make_problem(global_batch, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(DIM, VOCAB)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(VOCAB,)), jnp.float32)}
    lengths = rng.integers(1, LENGTH + 1, size=global_batch)  # uneven tokens per row and per device
    batch = {"x": rng.normal(size=(global_batch, LENGTH, DIM)).astype(np.float32),
             "labels": rng.integers(0, VOCAB, size=(global_batch, LENGTH)).astype(np.int32),
             "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32)}
    return params, batch


LAYOUTS = {"dp": DataParallel(), "fsdp": FullySharded(8)}


def layout_grads(name, params, batch, accumulation):
    """(grads, sums) on the host from `token_weighted_grads` run as `name`'s layout runs its steps,
    and the gradients as the step returns them (every device's copy under "dp")."""
    layout = LAYOUTS[name]
    grads_of = partial(token_weighted_grads, linear_loss, accumulation_steps=accumulation, layout=layout)
    state = layout.create_state(None, jax.tree_util.tree_map(jnp.array, params), optax.sgd(0.0))  # fsdp donates
    key = jax.random.PRNGKey(0)  # the linear loss draws nothing
    if name == "dp":
        grads, sums = jax.pmap(grads_of, AXIS, in_axes=(0, 0, None))(state.params, layout.place_batch(batch), key)
        return jax.tree_util.tree_map(lambda x: np.asarray(x[0]), (grads, sums)) + (grads,)
    grads, sums = jax.jit(grads_of)(state.params, layout.place_batch(batch), key)
    return jax.device_get(grads), jax.device_get(sums), grads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_weighted_grads_equal_global_mean_gradient(layout):
    params, batch = make_problem(16)

    def global_mean(params):
        loss, sums = linear_loss(params, batch, None)
        return loss / sums["tokens"]

    expected = jax.jit(jax.grad(global_mean))(params)
    grads, sums, returned = layout_grads(layout, params, batch, accumulation=1)
    for name in params:
        np.testing.assert_allclose(grads[name], expected[name], rtol=0, atol=GRAD_ATOL)
        if layout == "dp":  # every device got the same, global gradient
            # Copies of one psum: bit-equal (default rtol 1e-7 = under one ulp).
            np.testing.assert_allclose(np.asarray(returned[name]), np.broadcast_to(grads[name], returned[name].shape))
    assert float(sums["tokens"]) == batch["mask"].sum()
    assert float(sums["loss"]) == pytest.approx(float(jax.jit(linear_loss)(params, batch, None)[0]), rel=LOSS_RTOL)
    # a per-device mean of means would differ (uneven token counts): the test can tell them apart
    def device_mean(params, rows):
        loss, sums = linear_loss(params, rows, None)
        return loss / sums["tokens"]

    per_device = jax.tree_util.tree_map(lambda x: x.reshape((N, -1) + x.shape[1:]), batch)
    mean_of_means = jax.jit(jax.vmap(jax.grad(device_mean), (None, 0)))(params, per_device)["w"].mean(0)
    assert not np.allclose(mean_of_means, expected["w"], rtol=1e-3)  # 100 x GRAD_ATOL: a real difference


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulation_equals_one_big_batch(layout):
    params, batch = make_problem(32, seed=3)
    grads1, sums1, _ = layout_grads(layout, params, batch, accumulation=1)
    grads4, sums4, _ = layout_grads(layout, params, batch, accumulation=4)
    for name in params:
        np.testing.assert_allclose(grads4[name], grads1[name], rtol=0, atol=GRAD_ATOL)
    assert float(sums4["tokens"]) == float(sums1["tokens"]) == batch["mask"].sum()
    assert float(sums4["loss"]) == pytest.approx(float(sums1["loss"]), rel=LOSS_RTOL)


def test_each_micro_batch_draws_with_a_key_of_its_own():
    """Micro-batch i's key is the step's key folded with i (plain `jax.random` here): each draws its own
    dropout masks, not the first one's again."""
    key, layout = jax.random.PRNGKey(7), LAYOUTS["fsdp"]

    def drawing_loss(params, batch, rng):
        return (params["w"] * batch["x"]).sum(), {"loss": jax.random.uniform(rng), "tokens": jnp.float32(1)}

    batch = layout.place_batch({"x": np.ones(32, np.float32)})
    _, sums = jax.jit(lambda params, batch: token_weighted_grads(drawing_loss, params, batch, key, 4, layout))(
        {"w": jnp.float32(1)}, batch)
    expected = sum(float(jax.random.uniform(jax.random.fold_in(key, i))) for i in range(4))
    assert float(sums["loss"]) == pytest.approx(expected, rel=1e-6)


def test_micro_batch_i_takes_the_ith_part_of_every_shard():
    """With the rows of 2 devices (shards), 2 micro-batches: each spans both devices, as under "dp",
    where each device cuts its own rows."""
    rows = np.arange(8)
    micro = split_micro_batches({"x": rows}, 2, shards=2)["x"]
    np.testing.assert_array_equal(micro, [[0, 1, 4, 5], [2, 3, 6, 7]])
    np.testing.assert_array_equal(split_micro_batches({"x": rows}, 2)["x"], [[0, 1, 2, 3], [4, 5, 6, 7]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_parameters_get_bf16_gradients(layout):
    """--param_dtype bfloat16: dividing by the float32 token count must not make the gradients (and,
    after the first update, the optimizer state) float32."""
    params, batch = make_problem(16)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    grads, _, _ = layout_grads(layout, params, batch, accumulation=2)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
