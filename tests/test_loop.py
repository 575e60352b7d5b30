"""utils/run/loop.py: when to evaluate / save, token-weighted host means, non-finite loss, eval batches."""


from types import SimpleNamespace

import jax
import numpy as np
import pytest

from utils.base.errors import RunError
from utils.checkpoints.saving import SavePolicy
from utils.layout.layouts import DataParallel
from utils.run.logs import Throughput
from utils.run.loop import TrainLoop, eval_batches, host_means, train_batches
from utils.run.optim import learning_rate_schedule

N = 8
DP = DataParallel()


class Writer:
    def __init__(self):
        self.logged, self.advanced, self.progressed = [], [], []

    def log(self, step, metrics):
        self.logged.append((step, metrics))

    def advance(self, step):
        self.advanced.append(step)

    def progress(self, step, metrics):
        self.progressed.append((step, metrics))


def make_loop(total=10, per_epoch=4, start=0, schedule=lambda step: 0.1 * step, **args):
    defaults = dict(do_eval=True, eval_steps=None, save_steps=3, logging_steps=2, save_on_epoch_end=False)
    args = {**defaults, **args}
    extra = {name: args[name] for name in ("progress_seconds", "kept_checkpoints", "clock") if name in args}
    return TrainLoop(per_epoch, total, start, schedule=schedule, writer=Writer(), throughput=Throughput(),
                     tokens_per_step=100, examples_per_step=4, logging_steps=args["logging_steps"],
                     save_policy=SavePolicy(args["save_steps"], args["save_on_epoch_end"], per_epoch, total),
                     evaluates=args["do_eval"], eval_steps=args["eval_steps"], **extra)


def test_a_constant_schedule_gives_every_step_its_rate():
    """--lr_scheduler_type constant --warmup_steps 0: the peak at every step (float32's 3e-4)."""
    loop = make_loop(schedule=learning_rate_schedule("constant", 3e-4, 0, 10))
    assert loop.learning_rates.shape == (10,) and set(loop.learning_rates) == {float(np.float32(3e-4))}


def due(loop, method, total=10):
    return [step for step in range(1, total + 1) if getattr(loop, method)(step)]


def test_save_reason_names_the_policy_reason():
    loop = make_loop(save_on_epoch_end=True)
    assert [loop.save_reason(step) for step in (1, 3, 4, 10)] == [None, "save_steps", "end of epoch", "last step"]


def test_eval_at_epoch_ends_and_last_step():
    assert due(make_loop(), "eval_due") == [4, 8, 10]


def test_eval_every_eval_steps_and_last_step():
    assert due(make_loop(eval_steps=3), "eval_due") == [3, 6, 9, 10]
    assert due(make_loop(eval_steps=5), "eval_due") == [5, 10]


def test_no_eval_without_do_eval():
    assert due(make_loop(do_eval=False), "eval_due") == []


def test_save_reason():
    assert due(make_loop(), "save_reason") == [3, 6, 9, 10]
    assert due(make_loop(save_steps=100), "save_reason") == [10]
    assert due(make_loop(save_steps=100, save_on_epoch_end=True), "save_reason") == [4, 8, 10]


def test_save_reason_on_a_stop_request(monkeypatch):
    from utils.checkpoints import preemption

    loop = make_loop(save_steps=100)
    monkeypatch.setattr(preemption, "stop_due", lambda step: step == 5)
    assert due(loop, "save_reason") == [5, 10]


def test_save_refused_after_a_non_finite_loss():
    """A save step checks the steps since the last log: a state reached through a nan is never saved."""
    loop = make_loop(logging_steps=100, save_steps=3)
    for step, loss in enumerate([1.0, np.nan, 1.0], start=1):
        loop.after_step(step, device_sums(loss, 1))
    with pytest.raises(RunError, match="training loss became nan at step 2"):
        loop.save_reason(3)


def device_sums(loss, tokens):
    """psum'd step sums as a pmap returns them: the same value on every device."""
    return {"loss": DP.place_batch(np.full(N, loss, np.float32)), "tokens": DP.place_batch(np.full(N, tokens, np.float32))}


def test_host_means_weights_by_tokens():
    # Sums of small integers are exact in float32; only the final division rounds: approx's default rel 1e-6.
    means = host_means([device_sums(10.0, 2), device_sums(30.0, 8)])
    assert means == {"loss": pytest.approx(4.0)}  # 40 / 10 tokens, not the mean of 5 and 3.75
    assert host_means([device_sums(10.0, 2), device_sums(30.0, 8)], keep_tokens=True) == {
        "loss": pytest.approx(4.0), "tokens": 10}


def test_after_step_logs_window_means():
    loop = make_loop(total=5, logging_steps=2)
    for step, (loss, tokens) in enumerate([(4, 2), (9, 3), (1, 1), (3, 3), (8, 2)], start=1):
        loop.after_step(step, device_sums(loss, tokens))
    assert [step for step, _ in loop.writer.logged] == [2, 4, 5]
    assert loop.writer.advanced == [1, 2, 3, 4, 5]
    metrics = [m for _, m in loop.writer.logged]
    # Integer sums, one division each; learning rates from a float32 schedule (6e-8 relative): default rel.
    assert metrics[0]["loss"] == pytest.approx(13 / 5) and metrics[1]["loss"] == pytest.approx(1.0)
    assert metrics[2]["loss"] == pytest.approx(4.0)
    assert metrics[0]["learning_rate"] == pytest.approx(0.1) and metrics[2]["learning_rate"] == pytest.approx(0.4)
    assert all(m["tokens_per_second"] > 0 for m in metrics)  # timed from the end of step 1


def test_first_step_log_has_no_throughput():
    loop = make_loop(logging_steps=1)
    loop.after_step(1, device_sums(2.0, 4))
    assert loop.writer.logged == [(1, {"loss": pytest.approx(0.5), "learning_rate": pytest.approx(0.0)})]  # exact


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_loss_raises_naming_the_first_bad_step(bad):
    loop = make_loop(logging_steps=4)
    loop.after_step(1, device_sums(1.0, 1))
    loop.after_step(2, device_sums(bad, 1))
    loop.after_step(3, device_sums(bad, 1))
    with pytest.raises(RunError, match=rf"training loss became {bad} at step 2: .*--learning_rate"):
        loop.after_step(4, device_sums(1.0, 1))


def test_non_finite_loss_says_which_checkpoints_are_kept():
    """The message ends on what the run leaves (`Saver.kept`), never on a claim of its own."""
    loop = make_loop(logging_steps=2, kept_checkpoints=lambda: "no checkpoint was saved before that step: start again")
    loop.after_step(1, device_sums(1.0, 1))
    with pytest.raises(RunError, match=r"became nan at step 2: lower --learning_rate or use --dtype float32; no "
                                       r"checkpoint was saved before that step: start again$"):
        loop.after_step(2, device_sums(np.nan, 1))


def test_a_slow_run_shows_progress_between_logged_steps():
    """Steps of 12 s each (each one moves a fake clock on, as a slow step would) and --logging_steps 8:
    a progress line comes after the first step that ends 30 s or more after the last line (the first
    step, compilation included, starts the count), with the loss of the steps since the last log, the
    learning rate and the throughput; the logged steps keep their whole window."""
    clock = SimpleNamespace(now=0.0)
    loop = make_loop(total=10, logging_steps=8, progress_seconds=30, clock=lambda: clock.now)
    for step in range(1, 11):
        clock.now += 12.0  # the step's time
        loop.after_step(step, device_sums(float(step), 1))
    # Lines at 12 s (step 1), then 48 (step 4), 84 (7), 96 (logged step 8), 120 (logged step 10).
    assert [step for step, _ in loop.writer.progressed] == [4, 7]
    assert [step for step, _ in loop.writer.logged] == [8, 10]
    (_, at_4), (_, at_7) = loop.writer.progressed
    assert at_4["loss"] == pytest.approx((1 + 2 + 3 + 4) / 4) and at_4["learning_rate"] == pytest.approx(0.3)
    assert at_7["loss"] == pytest.approx(sum(range(1, 8)) / 7)  # the window since the last log, not since step 4
    assert at_4["tokens_per_second"] > 0 and at_4["examples_per_second"] > 0
    assert loop.writer.logged[0][1]["loss"] == pytest.approx(sum(range(1, 9)) / 8)


def test_eval_batches_fixed_shapes_and_weights():
    num, batch_size = 21, 16
    arrays = {"input_ids": np.arange(num * 3).reshape(num, 3), "labels": np.arange(num)}
    seen, weight, valids = [], 0.0, []
    for batch, valid in eval_batches(arrays, num, batch_size, DP):
        assert batch["input_ids"].shape == (N, 2, 3) and batch["example_weight"].shape == (N, 2)
        weights = DP.rows_to_host(batch["example_weight"])
        seen.extend(DP.rows_to_host(batch["labels"])[weights > 0])
        weight += weights.sum()
        valids.append(valid)
    assert valids == [16, 5] and weight == num and seen == list(range(num))


def test_eval_batches_transform_sees_step_0_and_the_first_example_index():
    arrays = {"x": np.arange(10)}
    calls = []

    def transform(batch, step, row_ids):
        calls.append((step, row_ids.tolist()))
        return {"x": batch["x"] + 100}

    out = [DP.rows_to_host(b["x"])[:valid] for b, valid in eval_batches(arrays, 10, 8, DP, transform)]
    assert calls == [(0, list(range(8))), (0, [8, 9])] and np.concatenate(out).tolist() == list(range(100, 110))


def test_train_batches_transform_sees_the_step_and_this_process_rows(monkeypatch):
    calls = []

    def transform(batch, step, row_ids):
        calls.append((step, row_ids.tolist(), len(batch["x"])))
        return batch

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    host_rows = type("HostRows", (), {"prefetch": staticmethod(list)})()  # a layout that places nothing
    train_batches({"x": np.arange(40)}, 40, 16, seed=1, steps_per_epoch=2, start_step=1, total_steps=3,
                  layout=host_rows, transform=transform)
    assert calls == [(1, list(range(8, 16)), 8), (2, list(range(8, 16)), 8)]  # process 1 holds rows 8..15


def test_train_batches_follow_seeded_order_and_resume():
    from utils.data import batch_order

    arrays = {"x": np.arange(40)}
    run = [DP.rows_to_host(b["x"]) for b in train_batches(arrays, 40, 16, seed=1, steps_per_epoch=2, start_step=0,
                                                           total_steps=5, layout=DP)]
    assert len(run) == 5
    np.testing.assert_array_equal(run[2], batch_order.train_batch_indices(40, 16, 1, epoch=1, step_in_epoch=0))
    resumed = [DP.rows_to_host(b["x"])
               for b in train_batches(arrays, 40, 16, 1, 2, start_step=3, total_steps=5, layout=DP)]
    np.testing.assert_array_equal(np.stack(resumed), np.stack(run[3:]))


def test_host_train_batches_read_dataset_columns_by_the_seeded_order():
    """The host side of `train_batches` on columns read in place from a dataset: this process's rows of
    each batch of the seeded order, transformed with their step, and a resumed run's batches are the rest."""
    import datasets

    from utils.data import arrow_columns, batch_order
    from utils.run import loop

    ds = datasets.Dataset.from_dict({"input_ids": [[i, -i] for i in range(40)]})
    arrays = arrow_columns.to_arrays(ds, ["input_ids"])
    rows = slice(4, 8)  # the second of two processes
    def transform(batch, step, row_ids):
        assert row_ids.tolist() == list(range(rows.start, rows.stop))  # this process's rows of the global batch
        return {"input_ids": batch["input_ids"] * 100 + step}

    run = list(loop.host_train_batches(arrays, 40, 8, 3, 5, 0, 12, rows, transform))
    assert len(run) == 12
    for step, batch in enumerate(run):
        indices = batch_order.train_batch_indices(40, 8, 3, *divmod(step, 5))[rows]
        np.testing.assert_array_equal(batch["input_ids"], np.stack([indices, -indices], 1) * 100 + step)
    resumed = list(loop.host_train_batches(arrays, 40, 8, 3, 5, 7, 12, rows, transform))
    np.testing.assert_array_equal(np.stack([b["input_ids"] for b in resumed]),
                                  np.stack([b["input_ids"] for b in run[7:]]))
