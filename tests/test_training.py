"""utils/run/spine.py: steps built from a loss (vs a hand-written step), per-row eval outputs, and a
whole run's bookkeeping (when it evaluates, saves, and what it writes)."""

import json
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transformers import PretrainedConfig

from tasks.summarization import TASK
from utils.base.arguments import TrainingArguments
from utils.base.errors import UsageError
from utils.checkpoints import saving
from utils.kernels import model_attention
from utils.layout import layouts as layout_module
from utils.layout.layouts import DataParallel, FullySharded, Layout, Pending, finished
from utils.run import run_directory
from utils.run.loop import InMemoryData
from utils.run.setup import training_plan
from utils.run.spine import TrainingRun, make_steps
from utils.scoring.losses import cross_entropy_sums

N, DIM, CLASSES, EXAMPLES = 8, 3, 4, 16


class TinyModel:
    """Logits = features @ w: a model whose gradient numpy can check, and that the export can save."""

    config = PretrainedConfig()

    def __call__(self, features, params, dropout_rng=None, train=False):
        return (features @ params["w"],)

    _auto_class = None

    def can_generate(self):
        return False


MODEL = TinyModel()


def loss_fn(params, batch, dropout_rng, train, label_smoothing):
    logits = MODEL(batch["features"], params=params)[0]
    weights = batch.get("example_weight", jnp.ones(len(logits)))
    loss, tokens = cross_entropy_sums(logits, batch["labels"], weights, label_smoothing)
    return loss, {"loss": loss, "tokens": tokens}


def predicted_class(params, batch):
    return MODEL(batch["features"], params=params)[0].argmax(-1)


def examples(count=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    return {"features": rng.normal(size=(count, DIM)).astype(np.float32),
            "labels": rng.integers(0, CLASSES, size=count).astype(np.int32)}


# Each test so marked runs under both layouts: `make_layout()` makes a fresh one.
EACH_LAYOUT = pytest.mark.parametrize("make_layout", [DataParallel, lambda: FullySharded(4)], ids=["dp", "fsdp"])


def init_params():
    return {"w": np.random.default_rng(1).normal(size=(DIM, CLASSES)).astype(np.float32)}


def args(tmp_path, **overrides):
    # A large adam epsilon makes the first update ~ lr * gradient (not its sign): it checks the gradient's values.
    values = dict(output_dir=str(tmp_path / "out"), do_train=True, per_device_train_batch_size=1,
                  per_device_eval_batch_size=1, learning_rate=0.1, adam_epsilon=1.0, weight_decay=0.0,
                  num_train_epochs=1)
    return TrainingArguments(**{**values, **overrides})


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@EACH_LAYOUT
def test_fresh_weights_are_made_while_the_train_step_compiles(tmp_path, monkeypatch, make_layout):
    """Fresh weights (`init_params_in_background`) are traced at once, so they are the model's as it was
    then, and made on the background thread, which the train step's compile does not wait for: here that
    thread is held until the compile has begun. The state and its first step are those of weights made at once."""
    training_args = args(tmp_path)
    data = InMemoryData(examples(), EXAMPLES)
    plan = training_plan(training_args, EXAMPLES)
    layout = make_layout()
    release = threading.Event()
    Pending(None, lambda: release.wait(20))  # occupies the background thread until released
    scale = {"w": 1.0}
    params = layout.init_params_in_background(lambda: {"w": jnp.asarray(init_params()["w"]) * scale["w"]})
    scale["w"] = 2.0  # changed after the trace: not seen
    waiting_at_compile = []
    compile_train_step = layout.compile_train_step

    def compile_then_release(*arguments, **settings):
        waiting_at_compile.append(not params._future.done())
        release.set()
        return compile_train_step(*arguments, **settings)

    monkeypatch.setattr(layout, "compile_train_step", compile_then_release)
    state, steps = make_steps(loss_fn, MODEL, params, layout, training_args, plan, data)
    assert waiting_at_compile == [True]
    at_once = make_layout()
    expected, expected_steps = make_steps(loss_fn, MODEL, init_params(), at_once, training_args, plan, data)
    for got, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    batch = data.example_batch(plan.batch_size)
    _, sums = steps.train(state, layout.place_batch(batch))
    _, expected_sums = expected_steps.train(expected, at_once.place_batch(batch))
    np.testing.assert_array_equal(np.asarray(sums["loss"]), np.asarray(expected_sums["loss"]))


@EACH_LAYOUT
def test_fresh_weights_pending_lets_go_once_the_state_holds_them(tmp_path, make_layout):
    """The script's variable holding fresh weights' `Pending` keeps them no longer than the state is being made
    of them: on a TPU host their host copy held 1.7 GiB for the Llama row's whole run. (Here, on CPU devices,
    the replicas may share the host copy's memory, so it is the `Pending` that is checked.)"""
    training_args = args(tmp_path)
    data = InMemoryData(examples(), EXAMPLES)
    layout = make_layout()
    params = layout.init_params_in_background(lambda: {"w": jnp.asarray(init_params()["w"])})
    state, _ = make_steps(loss_fn, MODEL, params, layout, training_args, training_plan(training_args, EXAMPLES), data)
    np.testing.assert_array_equal(layout.params_to_host(state.params)["w"], init_params()["w"])
    with pytest.raises(RuntimeError, match="handed over"):
        finished(params)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_train_step_is_the_hand_written_step(tmp_path, smoothing):
    """The spine gives the train step --label_smoothing_factor (every script's loss takes it from there)."""
    training_args = args(tmp_path, label_smoothing_factor=smoothing)
    data = InMemoryData(examples(), EXAMPLES)
    plan = training_plan(training_args, EXAMPLES)
    layout = DataParallel()
    state, steps = make_steps(loss_fn, MODEL, init_params(), layout, training_args, plan, data)
    batch = data.example_batch(plan.batch_size)
    state, sums = steps.train(state, layout.place_batch(batch))

    # By hand, in numpy: the mean token loss over the whole global batch, its gradient, one AdamW step.
    w = init_params()["w"].astype(np.float64)
    x, y = batch["features"].astype(np.float64), batch["labels"]
    probs = np.exp(log_softmax(x @ w))
    # Smoothed targets: 1 - smoothing on the label, the rest spread evenly; less their entropy (a perfect
    # prediction scores 0).
    targets = np.eye(CLASSES)[y] * (1 - smoothing - smoothing / (CLASSES - 1)) + smoothing / (CLASSES - 1)
    entropy = -(targets * np.log(np.where(targets > 0, targets, 1))).sum(-1)
    loss = (-(targets * log_softmax(x @ w)).sum(-1) - entropy).sum()
    grad = x.T @ (probs - targets) / N
    tx = optax.adamw(0.1, eps=1.0, weight_decay=0.0)  # the linear schedule starts at its peak
    update, _ = tx.update({"w": grad}, tx.init({"w": grad}), {"w": w})
    # float32 forward/backward and psum over 8 devices vs float64 in one sum: a few float32 eps.
    np.testing.assert_allclose(np.asarray(state.params["w"])[0], w + update["w"], rtol=1e-5, atol=1e-6)
    assert float(np.asarray(sums["loss"])[0]) == pytest.approx(loss, rel=1e-5)  # same: float32 vs float64
    assert float(np.asarray(sums["tokens"])[0]) == N
    assert int(np.asarray(state.step)[0]) == 1


class DroppingModel(TinyModel):
    """TinyModel that drops half of its features when training."""

    def __call__(self, features, params, dropout_rng=None, train=False):
        if train:
            features = features * jax.random.bernoulli(dropout_rng, 0.5, features.shape) * 2
        return (features @ params["w"],)


def dropping_loss(params, batch, dropout_rng, train, label_smoothing):
    logits = DroppingModel()(batch["features"], params, dropout_rng, train)[0]
    loss, tokens = cross_entropy_sums(logits, batch["labels"], jnp.ones(len(logits)))
    return loss, {"loss": loss, "tokens": tokens}


def weights_after_two_steps(tmp_path, seed, layout=None, **overrides):
    training_args = args(tmp_path, seed=seed, **overrides)
    data, plan = InMemoryData(examples(), EXAMPLES), training_plan(training_args, EXAMPLES)
    layout = layout or DataParallel()
    state, steps = make_steps(dropping_loss, DroppingModel(), init_params(), layout, training_args, plan, data)
    for _ in range(2):
        state, _ = steps.train(state, layout.place_batch(data.example_batch(plan.batch_size)))
    return np.asarray(state.params["w"])


def test_the_seed_picks_the_dropout_masks(tmp_path):
    """Two train steps with dropout: the same --seed gives the same weights to the bit, another seed others."""
    first = weights_after_two_steps(tmp_path, seed=0)
    assert first.tobytes() == weights_after_two_steps(tmp_path, seed=0).tobytes()
    assert not np.allclose(first, weights_after_two_steps(tmp_path, seed=1), rtol=1e-3)


def test_the_train_steps_program_holds_no_learning_rate_schedule_length_or_seed(tmp_path, monkeypatch):
    """Those numbers are the train step's argument: a rerun that changes them finds its program in the
    compilation cache. The schedule's kind is part of the program (which shows the comparison can fail)."""
    programs = []
    compile_or_refuse = layout_module.compile_or_refuse
    monkeypatch.setattr(layout_module, "compile_or_refuse",
                        lambda lowered: programs.append(lowered.as_text()) or compile_or_refuse(lowered))

    def program(**overrides):
        training_args = args(tmp_path, **overrides)
        make_steps(dropping_loss, DroppingModel(), init_params(), DataParallel(), training_args,
                   training_plan(training_args, EXAMPLES), InMemoryData(examples(), EXAMPLES))
        return programs[-1]

    first = program()
    assert program(learning_rate=0.3, warmup_steps=2, max_steps=7, seed=5) == first
    assert program(num_train_epochs=3, dropout_rng="rbg") != first  # another generator: another program
    assert program(lr_scheduler_type="cosine") != first


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_train_step_follows_the_schedule_and_seed_it_is_given(tmp_path, kind):
    """Three steps with warmup and dropout, against optax's own schedules and AdamW by hand, each device's rows
    masked with the key of (--seed, step, device): the numbers the step takes are the run's."""
    training_args = args(tmp_path, seed=5, warmup_steps=2, max_steps=5, lr_scheduler_type=kind)
    data, plan = InMemoryData(examples(), EXAMPLES), training_plan(training_args, EXAMPLES)
    layout = DataParallel()
    state, steps = make_steps(dropping_loss, DroppingModel(), init_params(), layout, training_args, plan, data)
    batch = data.example_batch(plan.batch_size)
    for _ in range(3):
        state, _ = steps.train(state, layout.place_batch(batch))

    decay = (optax.linear_schedule(0.1, 0.0, 3) if kind == "linear" else optax.cosine_decay_schedule(0.1, 3))
    tx = optax.adamw(optax.join_schedules([optax.linear_schedule(0.0, 0.1, 2), decay], [2]), eps=1.0,
                     weight_decay=0.0)
    w = jnp.asarray(init_params()["w"])
    opt_state = tx.init(w)
    x, y = jnp.asarray(batch["features"]), jnp.asarray(batch["labels"])
    for step in range(3):
        keys = [jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(5), step), device) for device in range(N)]
        masks = jnp.concatenate([jax.random.bernoulli(key, 0.5, (1, DIM)) for key in keys])

        def mean_loss(w):
            return -jnp.take_along_axis(jax.nn.log_softmax((x * masks * 2) @ w), y[:, None], -1).mean()

        update, opt_state = tx.update(jax.grad(mean_loss)(w), opt_state, w)
        w = optax.apply_updates(w, update)
    np.testing.assert_allclose(np.asarray(state.params["w"])[0], np.asarray(w), rtol=1e-5, atol=1e-6)


@EACH_LAYOUT
def test_dropout_rng_picks_the_generator_of_the_masks(tmp_path, make_layout):
    """--dropout_rng rbg draws other masks than threefry, the same ones again for the same seed (with
    accumulation's micro-batch keys too); auto is threefry off TPUs, the masks of every earlier run."""
    def weights(generator, seed=0):
        return weights_after_two_steps(tmp_path, seed, make_layout(), dropout_rng=generator,
                                       gradient_accumulation_steps=2)

    rbg = weights("rbg")
    assert rbg.tobytes() == weights("rbg").tobytes()
    assert not np.allclose(rbg, weights("threefry"), rtol=1e-3)
    assert not np.allclose(rbg, weights("rbg", seed=1), rtol=1e-3)
    assert weights("auto").tobytes() == weights("threefry").tobytes()


def test_auto_draws_dropout_on_the_chip_beside_the_attention_kernels_under_dp_and_with_rbg_otherwise_on_tpus():
    dp, fsdp = DataParallel(), FullySharded(4)
    assert dp.dropout_generator("auto", True) == fsdp.dropout_generator("auto", True) == "threefry"
    dp.platform = fsdp.platform = "tpu"
    assert (dp.dropout_generator("auto", True), fsdp.dropout_generator("auto", True)) == ("chip", "rbg")
    assert dp.dropout_generator("auto", False) == fsdp.dropout_generator("auto", False) == "rbg"
    assert dp.dropout_generator("threefry") == "threefry" and dp.dropout_generator("rbg") == "rbg"
    assert dp.dropout_generator("chip", False) == "chip"  # asked for: the stock attention's dropout too
    with pytest.raises(UsageError, match="--dropout_rng chip runs under --sharding dp"):
        fsdp.dropout_generator("chip")


def test_make_steps_hands_the_kernels_fsdps_mesh(tmp_path, monkeypatch):
    """Under fsdp's jit the attention kernels get its mesh, to run on each device's rows (`attention.on_each_device`:
    XLA cannot split a Pallas call); under dp none, pmap giving a step one device's rows already."""
    handed = []
    monkeypatch.setattr(model_attention, "supports", lambda model: True)
    monkeypatch.setattr(model_attention, "use_attention_kernels", lambda model, interpret, mesh: handed.append(mesh))
    training_args = args(tmp_path, attention="splash")
    data, plan = InMemoryData(examples(), EXAMPLES), training_plan(training_args, EXAMPLES)
    layouts = [DataParallel(), FullySharded(4)]
    for layout in layouts:
        make_steps(loss_fn, MODEL, init_params(), layout, training_args, plan, data)
    assert handed == [None, layouts[1].mesh] and layouts[1].mesh is not None


def test_a_transformers_model_drops_out_with_an_rbg_key():
    """transformers' Flax models take the typed key rbg makes as their dropout_rng."""
    from transformers import BertConfig, FlaxBertModel

    model = FlaxBertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16), seed=0)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    key = Layout().dropout_key(0, 3, "rbg")  # as fsdp draws it (dp also folds in the device)

    def hidden(rng):
        return np.asarray(model(ids, dropout_rng=rng, train=True).last_hidden_state)

    assert hidden(key).tobytes() == hidden(key).tobytes()
    assert not np.allclose(hidden(key), hidden(jax.random.fold_in(key, 1)))
    assert not np.allclose(hidden(key), np.asarray(model(ids).last_hidden_state))


def test_eval_with_predict_fn_gives_every_real_row_once(tmp_path):
    training_args = args(tmp_path, do_train=False, do_eval=True, label_smoothing_factor=0.2)  # not in evaluation
    layout = DataParallel()
    params = init_params()
    state, steps = make_steps(loss_fn, MODEL, params, layout, training_args, training_plan(training_args, None),
                              predict_fn=predicted_class)
    assert steps.train is None
    arrays = examples(10, seed=2)  # 10 rows: a full batch of 8, then 2 real rows and 6 padded
    means, rows = steps.evaluate(state.params, arrays, 10)
    logits = arrays["features"].astype(np.float64) @ params["w"]
    np.testing.assert_array_equal(np.asarray(rows), logits.argmax(-1))
    expected = -log_softmax(logits)[np.arange(10), arrays["labels"]].mean()
    assert means["tokens"] == 10  # padded rows weigh 0
    assert means["loss"] == pytest.approx(expected, rel=1e-5)  # float32 vs float64
    _, plain = make_steps(loss_fn, MODEL, params, layout, training_args, training_plan(training_args, None))
    assert plain.evaluate(state.params, arrays, 10) == (means, None)


def run_to_the_end(training_args, train_data, evaluate_at=None):
    """The loop every script writes; returns the run."""
    layout = DataParallel()
    plan = training_plan(training_args, train_data and train_data.size)
    state, steps = make_steps(loss_fn, MODEL, init_params(), layout, training_args, plan, train_data)
    arrays = examples(10, seed=3)

    def evaluate(params):
        return steps.evaluate(params, arrays, 10)[0]

    run = TrainingRun(training_args, (training_args,), TASK, plan, layout, train_data, is_main=True)
    state = run.start(state, None, MODEL.config, MODEL, None)
    if training_args.do_train:
        for step, batch in run.train_batches(1):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params))
            run.save_if_due(step, state)
        run.end_training(state)
    final_eval = run.final_eval_due()
    if final_eval:
        run.report("eval", evaluate(state.params))
    run.finish()
    return run, final_eval


def test_a_run_evaluates_saves_and_writes_its_results_when_due(tmp_path, monkeypatch):
    for module in (run_directory, saving):  # run_main's list, which nothing here drains
        monkeypatch.setattr(module, "at_exit", lambda callback: None)
    # 16 examples, global batch 8: 2 steps per epoch, 3 epochs; eval at epoch ends, saves every 4 steps and at the end
    training_args = args(tmp_path, do_eval=True, num_train_epochs=3, save_steps=4, logging_steps=1)
    run, final_eval = run_to_the_end(training_args, InMemoryData(examples(), EXAMPLES))
    out = training_args.output_dir
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [line["step"] for line in lines if line["split"] == "eval"] == [2, 4, 6]
    assert [line["step"] for line in lines if line["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert sorted(int(name) for name in os.listdir(os.path.join(out, "checkpoints")) if name.isdigit()) == [4, 6]
    assert run.step == 6 and not final_eval  # step 6 was evaluated in the loop
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["train_samples"] == EXAMPLES and "eval_loss" in results and results["train_runtime"] >= 0

    # Evaluation only, of the same directory: nothing in a loop, so the final evaluation at step 0.
    eval_args = args(tmp_path, do_train=False, do_eval=True)
    run, final_eval = run_to_the_end(eval_args, None)
    assert run.step == 0 and final_eval
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [(line["split"], line["step"]) for line in lines if line["split"] == "eval"][-1] == ("eval", 0)


def test_progress_seconds_reaches_the_loop_and_its_lines_the_log(tmp_path, monkeypatch, caplog):
    """--progress_seconds 0: every step between logged ones shows a progress line; metrics.jsonl still
    has the logged steps only."""
    for module in (run_directory, saving):  # run_main's list, which nothing here drains
        monkeypatch.setattr(module, "at_exit", lambda callback: None)
    caplog.set_level(logging.INFO)
    training_args = args(tmp_path, num_train_epochs=3, save_steps=100, logging_steps=4, progress_seconds=0)
    run_to_the_end(training_args, InMemoryData(examples(), EXAMPLES))
    shown = [record.getMessage().split(":")[0] for record in caplog.records if record.getMessage().startswith("step ")]
    assert shown == [f"step {step}/6" for step in range(1, 7)]  # 4 and 6 logged, the others progress lines
    lines = [json.loads(line) for line in open(os.path.join(training_args.output_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines if line["split"] == "train"] == [4, 6]
