"""utils/layout/layouts.py: the two layouts on 8 virtual devices: placing the state and batches, the sharding
rule, one step definition giving the same numbers in both, the dropout keys, checkpoints that move
between them, and the train step's memory known (utils/layout/memory.py: and checked) before it runs."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec

from utils.base.errors import UsageError
from utils.checkpoints.store import Checkpointer
from utils.layout import layouts, memory
from utils.layout.gradients import token_weighted_grads
from utils.layout.layouts import DataParallel, FullySharded, leaf_spec, make_layout
from utils.scoring.losses import cross_entropy_sums

N = 8


# ---------------------------------------------------------------------------------------------
# The sharding rule
# ---------------------------------------------------------------------------------------------
def test_leaf_spec_splits_the_largest_dimension_the_fsdp_size_divides():
    assert leaf_spec((1024, 4096), 8) == PartitionSpec(None, "fsdp")
    assert leaf_spec((50257, 1024), 8) == PartitionSpec(None, "fsdp")  # GPT-2's vocabulary: the width then
    assert leaf_spec((32128, 512), 8) == PartitionSpec("fsdp", None)
    assert leaf_spec((3, 1024, 1024), 8) == PartitionSpec(None, "fsdp", None)  # the first of equal ones


def test_leaf_spec_keeps_small_or_indivisible_leaves_whole():
    for shape in ((1024,), (), (7,), (50257, 1023), (64, 64)):
        assert leaf_spec(shape, 8) == PartitionSpec(), shape
    assert leaf_spec((1024, 4096), 1) == PartitionSpec()


def test_make_layout_checks_the_fsdp_size():
    assert isinstance(make_layout("dp"), DataParallel)
    assert make_layout("fsdp").mesh.shape == {"data": 1, "fsdp": 8}
    assert make_layout("fsdp", fsdp_size=4).mesh.shape == {"data": 2, "fsdp": 4}
    with pytest.raises(UsageError, match="--fsdp_size 3 does not divide the 8 devices"):
        make_layout("fsdp", fsdp_size=3)


# ---------------------------------------------------------------------------------------------
# A tiny model, trained the way the scripts train: one step definition for both layouts
# ---------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    vocab: int = 64
    width: int = 256

    @nn.compact
    def __call__(self, ids, train=False):
        x = nn.Embed(self.vocab, self.width)(ids)
        # Off: the tests below compare the layouts, which draw different masks by design (a key per
        # device under "dp", one for the global batch under "fsdp").
        x = nn.Dropout(0.0, deterministic=not train)(nn.relu(nn.Dense(self.width)(x)))
        return nn.Dense(self.vocab)(x)


MODEL = TinyLM()
# AdamW's eps at 1e-3, not 1e-8: its update m / (sqrt(v) + eps) then moves by at most 1/eps times a
# change of the gradient, so the rounding of a near-zero gradient (terms that cancel, summed in
# another order) cannot flip the sign of a whole lr-sized update; with 1e-8 it can, by 2 x lr.
ADAMW_EPS = 1e-3
# The runs compared below sum the same float32 numbers in other orders (per device, per micro-batch,
# then across). A mean loss over <= 128 tokens (~4 each): at worst 128 x eps32 (1.2e-7) = 1.5e-5
# relative off (measured: 2e-7).
LOSS_RTOL = 2e-5
# Parameters (|p| < 0.3) after <= 4 steps. Each step's update carries the rounding of the gradient,
# |dg| ~ sqrt(128) x eps32 x |per-token g| (< 1, measured 0.99: the output bias) = 1.4e-6; SGD moves by
# lr x dg = 7e-7, AdamW by at most lr x dg / ADAMW_EPS = 1.4e-5: 4 steps 5.6e-5. Measured: 4.5e-8.
PARAMS_ATOL = 6e-5


def init():
    return MODEL.init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"]


def make_state(layout):
    return layout.create_state(MODEL.apply, layout.init_params(init), optax.adamw(1e-2, eps=ADAMW_EPS))


def steps_of(layout, accumulation=1):
    def loss_fn(params, batch, rng):
        logits = MODEL.apply({"params": params}, batch["ids"][:, :-1], train=True, rngs={"dropout": rng})
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:])
        return losses.sum(), {"loss": losses.sum(), "tokens": jnp.float32(losses.size)}

    def train_step(state, batch):
        rng = layout.dropout_key(0, state.step)
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, accumulation, layout)
        return state.apply_gradients(grads=grads), sums

    def eval_step(params, batch):
        return layout.batch_sum(loss_fn(params, batch, jax.random.PRNGKey(0))[1])

    return train_step, eval_step


def batches(count, rows=16, length=9):
    rng = np.random.default_rng(0)
    return [{"ids": rng.integers(0, 64, (rows, length)).astype(np.int32)} for _ in range(count)]


def train(layout, accumulation=1, count=4):
    state = make_state(layout)
    train_step, eval_step = steps_of(layout, accumulation)
    data = batches(count)
    step = layout.compile_train_step(train_step, state, data[0], accumulation)
    losses = []
    for batch in layout.prefetch(iter(data)):
        state, sums = step(state, batch)
        losses.append(float(np.asarray(sums["loss"]).reshape(-1)[0] / np.asarray(sums["tokens"]).reshape(-1)[0]))
    evaluated = layout.compile_step("eval_step", eval_step)(state.params, layout.place_batch(data[0]))
    return state, losses, float(np.asarray(evaluated["loss"]).reshape(-1)[0])


@pytest.fixture(scope="module")
def trained():
    return {"dp": train(DataParallel()), "fsdp": train(FullySharded(8)), "fsdp 2x4": train(FullySharded(4)),
            "fsdp accumulated": train(FullySharded(8), accumulation=2), "dp accumulated": train(DataParallel(), 2)}


def params_on_host(layout, state):
    return layout.params_to_host(state.params)


def test_the_same_step_trains_the_same_in_both_layouts(trained):
    dp_state, dp_losses, dp_eval = trained["dp"]
    for name in ("fsdp", "fsdp 2x4"):
        state, losses, evaluated = trained[name]
        assert losses == pytest.approx(dp_losses, rel=LOSS_RTOL), name
        assert evaluated == pytest.approx(dp_eval, rel=LOSS_RTOL), name
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=PARAMS_ATOL),
                               params_on_host(FullySharded(8), state), params_on_host(DataParallel(), dp_state))


def test_accumulation_cuts_the_same_micro_batches_in_both_layouts(trained):
    _, dp_losses, _ = trained["dp accumulated"]
    _, fsdp_losses, _ = trained["fsdp accumulated"]
    assert fsdp_losses == pytest.approx(dp_losses, rel=LOSS_RTOL)
    assert fsdp_losses == pytest.approx(trained["dp"][1], rel=LOSS_RTOL)  # and the same as one big batch


def test_fsdp_splits_each_large_parameter_and_its_optimizer_state_eight_ways(trained):
    state = trained["fsdp"][0]
    kernel = state.params["Dense_0"]["kernel"]  # 256 x 256
    assert kernel.shape == (256, 256) and len(kernel.addressable_shards) == N
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(32, 256)}  # the first of equal dims
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding == kernel.sharding
    bias = state.params["Dense_0"]["bias"]  # small: whole on every device
    assert {shard.data.shape for shard in bias.addressable_shards} == {(256,)}


def test_dp_replicates_the_state(trained):
    state = trained["dp"][0]
    assert state.params["Dense_0"]["kernel"].shape == (N, 256, 256)
    assert int(state.step[3]) == 4


@pytest.mark.parametrize("devices", [1, N])
def test_dp_sums_the_batch_with_an_all_reduce_only_over_several_devices(devices):
    """On one device in all the sum is the device's own: no all-reduce in its program (a single-device one
    halted a v5e chip at XLA's lower optimization levels). The layout as planned for `devices` devices."""
    from utils.layout.tpu_plan import Topology

    layout = DataParallel(Topology("test", jax.devices()[:devices], 2**30))
    values = np.arange(devices * 3, dtype=np.float32).reshape(devices, 3)
    summed = jax.pmap(layout.batch_sum, axis_name=layouts.AXIS, devices=layout.local_devices)
    assert ("all_reduce" in summed.lower(values).as_text()) == (devices > 1)
    np.testing.assert_array_equal(summed(values), np.broadcast_to(values.sum(0), values.shape))


def test_the_dropout_key_is_the_seed_folded_with_the_step_and_under_dp_the_device():
    """The keys a step draws, against plain `jax.random`: one per device under "dp" (the device's index
    among all of the run's), one under "fsdp"; the step counter as the train step sees it (traced)."""
    def key_of(seed, step):
        return jax.random.fold_in(jax.random.PRNGKey(seed), step)

    steps = np.full(N, 5, np.int32)
    dp = DataParallel()
    dp_keys = np.asarray(jax.pmap(lambda step: dp.dropout_key(3, step), layouts.AXIS)(steps))
    np.testing.assert_array_equal(dp_keys, [jax.random.fold_in(key_of(3, 5), i) for i in range(N)])
    assert len({key.tobytes() for key in dp_keys}) == N
    fsdp = FullySharded(8)
    np.testing.assert_array_equal(jax.jit(lambda step: fsdp.dropout_key(3, step))(np.int32(5)), key_of(3, 5))


def test_the_train_step_memory_is_known_before_it_runs_and_fsdp_needs_less(trained):
    dp, fsdp = DataParallel(), FullySharded(8)
    for layout in (dp, fsdp):
        train_step, _ = steps_of(layout)
        layout.compile_train_step(train_step, make_state(layout), batches(1)[0], 1)
    assert set(dp.train_step_memory) == {"arguments", "outputs", "temporaries", "aliased", "total"}
    assert fsdp.train_step_memory["arguments"] < dp.train_step_memory["arguments"] / 4
    assert fsdp.train_step_memory["total"] < dp.train_step_memory["total"]


def test_a_step_that_cannot_fit_stops_before_training(monkeypatch):
    monkeypatch.setattr(memory, "device_memory_limit", lambda: 100_000)
    layout = DataParallel()
    train_step, _ = steps_of(layout)
    with pytest.raises(UsageError, match=r"^the train step needs \d+\.\d MiB per device but a device has 97\.7 KiB: "
                                         r"use --sharding fsdp, a smaller --per_device_train_batch_size with more "
                                         r"--gradient_accumulation_steps \(now 1\), --dtype bfloat16, or "
                                         r"--gradient_checkpointing$"):
        layout.compile_train_step(train_step, make_state(layout), batches(1)[0], 1)
    fsdp = FullySharded(8)  # already split: the other levers only
    with pytest.raises(UsageError, match=r"per device but a device has 97\.7 KiB: use a smaller "):
        fsdp.compile_train_step(steps_of(fsdp)[0], make_state(fsdp), batches(1)[0], 1)


def test_no_recompile_after_the_first_step():
    """Each layout's step outputs carry the placement of its inputs: step 2 runs step 1's program."""
    from utils.run import perf

    for layout in (DataParallel(), FullySharded(8)):
        recorder = perf.StepRecorder()
        with recorder.active():
            train(layout)
        assert recorder.steps["train_step"].calls_that_compiled() == [1], layout.name


# ---------------------------------------------------------------------------------------------
# Steps in flight
# ---------------------------------------------------------------------------------------------
class Output:
    """A step's output that notes when it is waited for."""

    def __init__(self, number, events):
        self.number, self.events = number, events

    def block_until_ready(self):
        self.events.append(f"wait {self.number}")
        return self


def test_a_step_waits_for_the_oldest_unfinished_one_while_the_limit_is_in_flight():
    events = []

    def step(number):
        events.append(f"run {number}")
        return Output(number, events)

    limited = layouts.InFlightLimit(2).wrap(step)
    for number in range(1, 5):
        limited(number)
    assert events == ["run 1", "run 2", "wait 1", "run 3", "wait 2", "run 4"]
    assert layouts.InFlightLimit(None).wrap(step) is step


@pytest.mark.parametrize("make", [DataParallel, lambda: FullySharded(8)], ids=["dp", "fsdp"])
def test_train_and_eval_steps_of_a_cpu_layout_share_one_limit(make, monkeypatch):
    """With a limit of one, each call waits for the call before it: the train steps for the sums of
    the step before (the state is donated, gone), the eval step for the last train step's sums."""
    monkeypatch.setattr(layouts, "CPU_STEPS_IN_FLIGHT", 1)
    waited = []
    block_until_ready = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda tree: waited.append(tree) or block_until_ready(tree))
    train(make(), count=3)
    assert [sorted(tree) for tree in waited] == [["loss", "tokens"]] * 3


# ---------------------------------------------------------------------------------------------
# Both layouts against an independent reference: plain jax.grad + optax on one device
# ---------------------------------------------------------------------------------------------
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adamw": lambda: optax.adamw(1e-2, eps=ADAMW_EPS, weight_decay=0.1)}
REFERENCE_STEPS = 3


def weighted_batches(count, rows=16, length=9):
    """Batches whose rows score different numbers of tokens (1 to 8), as padded text does: a mean per
    device or per micro-batch instead of per token would weigh them wrongly."""
    rng = np.random.default_rng(1)
    data = []
    for _ in range(count):
        scored = rng.integers(1, length, rows)
        weights = (np.arange(length - 1)[None, :] < scored[:, None]).astype(np.float32)
        data.append({"ids": rng.integers(0, 64, (rows, length)).astype(np.int32), "weights": weights})
    return data


def train_in_layout(layout, optimizer, accumulation):
    """REFERENCE_STEPS steps as the scripts take them: `token_weighted_grads` over the layout's
    devices (and micro-batches), then the layout's train state applies the optimizer."""
    def loss_fn(params, batch, rng):
        logits = MODEL.apply({"params": params}, batch["ids"][:, :-1], train=True, rngs={"dropout": rng})
        loss, tokens = cross_entropy_sums(logits, batch["ids"][:, 1:], batch["weights"])
        return loss, {"loss": loss, "tokens": tokens}

    def train_step(state, batch):
        rng = layout.dropout_key(0, state.step)
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, accumulation, layout)
        return state.apply_gradients(grads=grads), sums

    state = layout.create_state(MODEL.apply, layout.init_params(init), OPTIMIZERS[optimizer]())
    data = weighted_batches(REFERENCE_STEPS)
    step = layout.compile_train_step(train_step, state, data[0], accumulation)
    losses = []
    for batch in layout.prefetch(iter(data)):
        state, sums = step(state, batch)
        losses.append(float(np.asarray(sums["loss"]).reshape(-1)[0] / np.asarray(sums["tokens"]).reshape(-1)[0]))
    return layout.params_to_host(state.params), losses


def train_by_hand(optimizer):
    """The same steps written out on one device with nothing of ours but the model: the gradient of
    the mean loss over the scored tokens of the whole batch, one optax update."""
    def mean_token_loss(params, batch):
        logits = MODEL.apply({"params": params}, batch["ids"][:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:])
        return (losses * batch["weights"]).sum() / batch["weights"].sum()

    params, tx = init(), OPTIMIZERS[optimizer]()
    opt_state, losses = tx.init(params), []
    for batch in weighted_batches(REFERENCE_STEPS):
        loss, grads = jax.value_and_grad(mean_token_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("name, optimizer, accumulation", [
    ("dp", "sgd", 1), ("fsdp", "sgd", 1), ("dp", "sgd", 2), ("fsdp", "adamw", 2), ("fsdp 2x4", "adamw", 1)])
def test_both_layouts_train_as_a_plain_optax_step_on_one_device(name, optimizer, accumulation):
    """SGD moves each parameter by the gradient itself, so a wrong gradient scale shows; AdamW is
    blind to the scale (it divides it out) but not to a skipped or misweighted micro-batch."""
    layout = {"dp": DataParallel, "fsdp": lambda: FullySharded(8), "fsdp 2x4": lambda: FullySharded(4)}[name]()
    params, losses = train_in_layout(layout, optimizer, accumulation)
    expected_params, expected_losses = train_by_hand(optimizer)
    assert losses == pytest.approx(expected_losses, rel=LOSS_RTOL)
    # A gradient off by 2x moves SGD's parameters ~1e-2 away, 200 x PARAMS_ATOL.
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=PARAMS_ATOL),
                           params, expected_params)


# ---------------------------------------------------------------------------------------------
# Batches and outputs
# ---------------------------------------------------------------------------------------------
def test_dp_places_rows_per_device_and_brings_them_back_in_order():
    dp = DataParallel()
    batch = {"x": np.arange(16 * 3).reshape(16, 3)}
    placed = dp.place_batch(batch)
    assert placed["x"].shape == (N, 2, 3)
    np.testing.assert_array_equal(np.asarray(placed["x"][1]), batch["x"][2:4])  # device 1 gets rows 2, 3
    np.testing.assert_array_equal(dp.rows_to_host(placed["x"]), batch["x"])
    with pytest.raises(ValueError, match="batch of 12 does not split over 8 devices"):
        dp.place_batch({"x": np.zeros((12, 2))})


def test_fsdp_places_one_global_array_over_all_devices():
    fsdp = FullySharded(4)
    batch = {"x": np.arange(16 * 3).reshape(16, 3)}
    placed = fsdp.place_batch(batch)
    assert placed["x"].shape == (16, 3) and len(placed["x"].addressable_shards) == N
    assert {shard.data.shape for shard in placed["x"].addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(fsdp.rows_to_host(placed["x"]), batch["x"])


@pytest.mark.parametrize("layout", [DataParallel(), FullySharded(8)], ids=["dp", "fsdp"])
def test_prefetch_yields_every_batch_in_order(layout):
    data = [{"x": np.full((8, 2), i)} for i in range(5)]
    out = [int(layout.rows_to_host(b["x"])[0, 0]) for b in layout.prefetch(iter(data))]
    assert out == [0, 1, 2, 3, 4]
    assert list(layout.prefetch(iter([]))) == []


def test_pretrained_weights_go_from_the_host_straight_to_their_shards():
    fsdp = FullySharded(8)
    host = jax.tree_util.tree_map(np.asarray, init())
    placed = fsdp.place_params(host)
    assert {s.data.shape for s in placed["Dense_0"]["kernel"].addressable_shards} == {(32, 256)}
    jax.tree_util.tree_map(np.testing.assert_array_equal, fsdp.params_to_host(placed), host)


def test_fresh_weights_are_initialised_into_their_shards():
    """The init program writes each device's part only: no device holds a whole large parameter."""
    fsdp = FullySharded(8)
    params = fsdp.init_params(init)
    assert {s.data.shape for s in params["Embed_0"]["embedding"].addressable_shards} == {(64, 32)}
    jax.tree_util.tree_map(np.testing.assert_array_equal, fsdp.params_to_host(params),
                           jax.tree_util.tree_map(np.asarray, init()))


# ---------------------------------------------------------------------------------------------
# Checkpoints move between layouts
# ---------------------------------------------------------------------------------------------
def save_and_restore(tmp_path, saving, state, restoring):
    checkpointer = Checkpointer(str(tmp_path / saving.name), async_save=False)
    checkpointer.save(4, saving.checkpoint_tree(state), {"step": 4})
    restored, _ = checkpointer.restore(4, restoring.checkpoint_target(make_state(restoring)))
    checkpointer.close()
    return restored


@pytest.mark.parametrize("saving, restoring", [(DataParallel(), FullySharded(8)), (FullySharded(8), DataParallel()),
                                               (FullySharded(8), FullySharded(4))],
                         ids=["dp->fsdp", "fsdp->dp", "fsdp 8->2x4"])
def test_a_checkpoint_restores_exactly_in_another_layout(tmp_path, trained, saving, restoring):
    state = trained["dp" if saving.name == "dp" else "fsdp"][0]
    restored = save_and_restore(tmp_path, saving, state, restoring)
    if restoring.name == "fsdp":  # straight into the target's shards
        kernel = restored.params["Dense_0"]["kernel"]
        assert {s.data.shape for s in kernel.addressable_shards} == {(256 // restoring.fsdp_size, 256)}
    expected = jax.device_get(saving.checkpoint_tree(state))
    got = jax.device_get(restored)
    for name in ("params", "opt_state", "step"):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                               getattr(got, name), getattr(expected, name))
    placed = restoring.from_checkpoint(restored)
    train_step, _ = steps_of(restoring)
    step = restoring.compile_train_step(train_step, placed, batches(1)[0], 1)
    placed, sums = step(placed, restoring.place_batch(batches(1)[0]))  # it trains on
    assert np.isfinite(np.asarray(sums["loss"])).all()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_splits_each_layers_gradients_as_it_finishes_and_they_stay_exact(monkeypatch, checkpointing):
    """`FullySharded.split_layer_gradients`: each numbered layer of a transformers model hands on its
    parameters' gradients split over "fsdp" (one barrier per layer in the traced step), and the
    gradients are those of the plain backward pass, with gradient checkpointing too."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    from utils.models.loading import enable_gradient_checkpointing

    model = FlaxGPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=16))
    if checkpointing:
        enable_gradient_checkpointing(model)

    def loss_fn(params, batch, rng):
        logits = model(batch["ids"], params=params, dropout_rng=rng, train=True).logits
        loss, tokens = cross_entropy_sums(logits, batch["ids"], jnp.ones(batch["ids"].shape))
        return loss, {"loss": loss, "tokens": tokens}

    layout = FullySharded(8)
    params, batch = layout.place_params(model.params), layout.place_batch(batches(1, rows=8, length=16)[0])
    assert_layers_hand_on_split_gradients(loss_fn, params, batch, layout, monkeypatch, layers=2, rtol=1e-6,
                                          atol=1e-7)


def assert_layers_hand_on_split_gradients(loss_fn, params, batch, layout, monkeypatch, layers, rtol, atol):
    """Under `layout` (fsdp), each of the model's `layers` hands on its gradients split: one barrier per layer
    in the traced step beyond the plain backward pass's (checkpointing has barriers of its own), and the
    gradients are the plain pass's within `rtol` / `atol`."""
    def grads_and_barriers():
        def grads(params, batch):  # a new function each time: JAX caches traces by function
            return token_weighted_grads(loss_fn, params, batch, jax.random.PRNGKey(0), 1, layout)[0]

        return jax.jit(grads)(params, batch), str(jax.make_jaxpr(grads)(params, batch)).count("optimization_barrier")

    split, split_barriers = grads_and_barriers()
    monkeypatch.setattr(layout, "split_layer_gradients", lambda: contextlib.nullcontext())
    plain, plain_barriers = grads_and_barriers()
    assert split_barriers - plain_barriers == layers
    for a, b in zip(jax.tree_util.tree_leaves(split), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
