"""The spine every training script (`run_*.py`) shares: its steps built from its loss, and the run's bookkeeping.

A script defines its loss and evaluate / predict functions and keeps its own loop; `make_steps`
turns the loss into the state and the compiled train and eval steps, and `TrainingRun` does the
rest in one order: resume (the last check), open the run directory and the checkpoints, feed the
training batches, decide when to log, evaluate and save, and write the results. The Training
section of any `run_*.py` shows the loop they serve.
"""

import logging
import time
from functools import partial

import jax
from flax.training.train_state import TrainState

from utils.base.errors import UsageError
from utils.checkpoints.resume import resume_or_start, run_fingerprint
from utils.checkpoints.saving import SavePolicy, Saver
from utils.kernels import chip_dropout, model_attention
from utils.layout import devices
from utils.layout.gradients import token_weighted_grads
from utils.layout.layouts import finished, shapes_of
from utils.models import layer_scan, lora
from utils.models.family_model import FamilyModel
from utils.models.loading import enable_gradient_checkpointing
from utils.run import perf
from utils.run.compile_plan import checkpointing, end_with_plan, parameter_counts, plan_report
from utils.run.logs import throughput_meter
from utils.run.loop import TrainLoop, eval_batches, host_eval_batches, host_means
from utils.run.optim import Schedule, create_optimizer
from utils.run.run_directory import RunDirectory

logger = logging.getLogger(__name__)


class Steps:
    """A script's compiled steps (see `make_steps`).

    `train(state, batch) -> (state, sums)`, None when not training; `eval(params, batch) -> sums`,
    or `(sums, rows)` with a `predict_fn`. Sums are over the global batch.
    """

    def __init__(self, train, eval, layout, eval_batch_size, predicts):
        self.train, self.eval, self.layout = train, eval, layout
        self.eval_batch_size, self.predicts = eval_batch_size, predicts

    def eval_batches(self, arrays, num_examples, transform=None):
        """(placed batch, valid rows) of every eval batch, the last one padded (`utils.run.loop.eval_batches`)."""
        return eval_batches(arrays, num_examples, self.eval_batch_size, self.layout, transform)

    def evaluate(self, params, arrays, num_examples, transform=None):
        """(token-weighted means of the eval sums over every example, "tokens" included; with a
        `predict_fn` the per-row outputs of the real rows, in order, on the host, else None)."""
        sums, rows = [], []
        for batch, valid in self.eval_batches(arrays, num_examples, transform):
            if self.predicts:
                batch_sums, batch_rows = self.eval(params, batch)
                rows.extend(self.layout.rows_to_host(batch_rows)[:valid])
            else:
                batch_sums = self.eval(params, batch)
            sums.append(batch_sums)
        return host_means(sums, keep_tokens=True), (rows if self.predicts else None)


def prepare_model(model, layout, training_args):
    """`model` made to train as the run's flags say, in place: `--gradient_checkpointing` recomputes its
    layers' activations, `--attention` routes its attention through a kernel (`utils.kernels.model_attention`),
    `--scan_layers` runs its layer stack under one scan (`utils.models.layer_scan`) and `--dropout_rng chip`
    draws its dropout masks inside the kernels (`utils.kernels.chip_dropout`). Returns (what checkpointing
    keeps, False without it; the dropout generator): what the steps are built for."""
    checkpointed = checkpointing(training_args)
    if checkpointed:
        enable_gradient_checkpointing(model, checkpointed)
    attention_kernels = model_attention.choose(training_args.attention, model, layout.platform, layout.name)
    if attention_kernels:
        # the interpreter: tests on CPUs
        model_attention.use_attention_kernels(model, interpret=layout.platform != "tpu", mesh=layout.mesh)
        logger.info("attention: Pallas kernels (flash, any dropout mask drawn in the kernel; splash for other "
                    "families' attention without dropout)")
    if layer_scan.choose(training_args.scan_layers, model, layout.platform, layout.name):
        layer_scan.scan_layers(model, checkpointed=checkpointed)
        logger.info("layers: the %d layers run under jax.lax.scan, one traced and compiled (--scan_layers)",
                    model.config.num_hidden_layers)
    generator = layout.dropout_generator(training_args.dropout_rng, attention_kernels)
    if generator == "chip" and isinstance(model, FamilyModel):
        raise UsageError(f"--dropout_rng chip draws dropout masks in a kernel, but the {model.config.model_type} model "
                         "of the project's decoder family has no dropout: use --dropout_rng auto")
    if generator == "chip":
        chip_dropout.use_chip_dropout(model, interpret=layout.platform != "tpu")
        logger.info("dropout: masks drawn inside Pallas kernels by the chip's generator (--dropout_rng chip)")
    return checkpointed, generator


def make_steps(loss_fn, model, params, layout, training_args, plan, train_data=None, transform=None,
               predict_fn=None):
    """(train state, `Steps`) for a script's loss, placed and compiled by `layout`, `model` first prepared for
    training as the flags say (`prepare_model`).

    `loss_fn(params, batch, dropout_rng, train, label_smoothing) -> (loss sum, sums)` with at least
    "loss" and "tokens" in `sums` (`utils.layout.gradients.token_weighted_grads`). What every script's steps
    need is applied here, so none can forget it: the train step gets `--label_smoothing_factor`
    (evaluation 0) and the dropout key of (`--seed`, its step) drawn by `--dropout_rng`'s generator
    (`Layout.dropout_key`). The optimizer follows `plan`'s learning-rate schedule; with LoRA (adapters
    attached by `utils.models.loading.load_model`) it trains the adapters and heads alone
    (`utils.models.lora.FrozenBaseState`). The schedule's numbers and the seed's key are the train step's
    argument, not constants of its program. When training, the train step is compiled now, for batches
    like `train_data`'s (after `transform`): its device memory is known, and checked, before anything is
    written. `predict_fn(params, batch) -> [rows, ...]` (class ids, logits, tags) makes the eval
    step return its per-row outputs beside the sums, in the same compiled step. With
    `--compile_only` the steps are planned, never run: `TrainingRun.start`.
    """
    checkpointed, generator = prepare_model(model, layout, training_args)
    # The run's numbers reach the train step as an argument (`Layout.compile_train_step`): its program, and so
    # its compilation-cache entry, serves a rerun with another learning rate, schedule length or seed. Adam's
    # stay constants: as Python floats they keep bfloat16 moments bfloat16.
    settings = {"schedule": plan.schedule.settings, "seed": layout.seed_key(training_args.seed, generator)}

    def optimizer_of(settings):
        return create_optimizer(Schedule(plan.schedule.kind, settings["schedule"]), training_args.adafactor,
                                training_args.adam_beta1, training_args.adam_beta2, training_args.adam_epsilon,
                                training_args.weight_decay)

    optimizer = optimizer_of(settings)
    adapters = lora.adapters_of(model)
    create = (partial(lora.FrozenBaseState.create, trainable=lora.trainable_paths(params, adapters)) if adapters
              else TrainState.create)
    state = layout.create_state(model.__call__, params, optimizer, create)  # fresh weights: a Pending, made meanwhile
    accumulation = training_args.gradient_accumulation_steps

    train_loss = partial(loss_fn, train=True, label_smoothing=training_args.label_smoothing_factor)

    def train_step(state, batch, settings):
        dropout_rng = layout.dropout_key(settings["seed"], state.step, generator)
        trained, frozen = lora.trained_and_frozen(state)  # the gradients of what trains, only

        def trained_loss(trained, batch, dropout_rng):
            return train_loss(lora.join(trained, frozen), batch, dropout_rng)

        grads, sums = token_weighted_grads(trained_loss, trained, batch, dropout_rng, accumulation, layout,
                                           split_layers=not frozen)
        # The step's own optimizer, of the settings it was given; the state keeps the one it was made with.
        return state.replace(tx=optimizer_of(settings)).apply_gradients(grads=grads).replace(tx=state.tx), sums

    def eval_step(params, batch):
        _, sums = loss_fn(params, batch, None, train=False, label_smoothing=0.0)
        if predict_fn is None:
            return layout.batch_sum(sums)
        return layout.batch_sum(sums), predict_fn(params, batch)

    p_train_step = None
    if training_args.do_train:
        p_train_step = layout.compile_train_step(train_step, shapes_of(state),
                                                 train_data.example_batch(plan.batch_size, transform), accumulation,
                                                 checkpointed, settings)
    p_eval_step = layout.compile_step("eval_step", eval_step)
    eval_batch_size = devices.global_batch_size(training_args.per_device_eval_batch_size)
    state = finished(state)
    if p_train_step is not None:
        perf.release_freed_host_memory()  # what the train step's compile worked in
    return state, Steps(p_train_step, p_eval_step, layout, eval_batch_size, predict_fn is not None)


class TrainingRun:
    """One run's bookkeeping from its last check to its result files, in the order every script
    follows: `start` (resume or start afresh, then open the run directory and the checkpoints),
    `train_batches` / `after_step` / `eval_due` / `report` / `save_if_due` in the script's loop,
    `end_training`, the final `report`s, `finish`.

    `task` is the script's `tasks.Task` declaration; `plan` the `utils.run.setup.TrainingPlan`; `train_data` the
    `utils.run.loop.InMemoryData` or `utils.run.stream_feed.StreamedData` (None when not training). `step` is the last
    step finished: the step results are reported at.
    """

    def __init__(self, training_args, all_args, task, plan, layout, train_data, is_main):
        self.args, self.all_args, self.task, self.plan, self.layout = training_args, all_args, task, plan, layout
        self.train_data, self.is_main = train_data, is_main
        self.step = None
        self._last_eval_step = None

    def start(self, state, resume, config, model, tokenizer, other_steps=None):
        """The state to train or evaluate from: the checkpoint `resume` names, restored after the last
        check (`utils.checkpoints.resume.resume_or_start`), or `state`. Only then are the run directory and,
        when training, the checkpoints opened: a run that stops on a check leaves --output_dir as it
        was.

        `other_steps` names each step besides training that the run calls (eval, predict, generate) with
        the data its first batch comes from, `(arrays, num_examples[, transform])`, or None where this run
        does not call it. A --compile_only run ends here: the TPU plan of the train step and of those
        steps on their first batch, printed and written (`utils.run.compile_plan`)."""
        args, plan, train_data = self.args, self.plan, self.train_data
        if self.layout.plan:
            eval_batch_size = devices.global_batch_size(args.per_device_eval_batch_size)
            batches = {name: next(host_eval_batches(data[0], data[1], eval_batch_size, *data[2:]))[0]
                       for name, data in (other_steps or {}).items() if data and data[0] is not None}
            end_with_plan(plan_report(args, self.layout, state, batches), args.output_dir)
        self.config = config
        fingerprint = run_fingerprint(config, train_data and (train_data.size or "streamed"), plan.batch_size,
                                      args.seed, args.adafactor, lora.adapters_of(model))
        counts = parameter_counts(self.layout, state)
        state, self.start_step = resume_or_start(resume, fingerprint, state, plan.total_steps, self.layout, train_data)
        self.step = self.start_step
        self.dir = RunDirectory(args, self.all_args, self.task, model, tokenizer, self.is_main, plan.total_steps,
                                resume, self.layout.train_step_memory)
        self.dir.add_results(**counts)
        if args.do_train:
            self.saver = Saver(args.output_dir, args.save_total_limit, self.dir, self.layout, train_data, fingerprint,
                               plan.steps_per_epoch, plan.total_steps, self.start_step, self.is_main)
        return state

    def train_batches(self, seq_length, decoder_seq_length=None, transform=None):
        """(step, batch placed on the devices) from the step after the start on; `transform(batch,
        step, row_ids)` runs on the host first (e.g. masking). Throughput counts `seq_length` tokens
        per example; FLOPs also the decoder's `decoder_seq_length`."""
        args, plan = self.args, self.plan
        accumulation = args.gradient_accumulation_steps
        logger.info("training: %d steps (%d per epoch), global batch %d = %d per device x %d devices x %d",
                    plan.total_steps, plan.steps_per_epoch, plan.batch_size,
                    plan.batch_size // (jax.device_count() * accumulation), jax.device_count(), accumulation)
        save_policy = SavePolicy(args.save_steps, args.save_on_epoch_end, plan.steps_per_epoch, plan.total_steps)
        self.loop = TrainLoop(plan.steps_per_epoch, plan.total_steps, self.start_step, plan.schedule, self.dir,
                              throughput_meter(self.config, seq_length, decoder_seq_length),
                              tokens_per_step=plan.batch_size * seq_length, examples_per_step=plan.batch_size,
                              logging_steps=args.logging_steps, save_policy=save_policy, evaluates=args.do_eval,
                              eval_steps=args.eval_steps, progress_seconds=args.progress_seconds,
                              kept_checkpoints=self.saver.kept)
        batches = self.train_data.batches(plan.batch_size, args.seed, plan.steps_per_epoch, self.start_step,
                                          plan.total_steps, self.layout, transform=transform)
        self._train_start = time.time()
        return enumerate(batches, start=self.start_step + 1)

    def after_step(self, step, sums):
        """Record a finished step (`utils.run.loop.TrainLoop.after_step`: logs when due)."""
        self.loop.after_step(step, sums)
        self.step = step

    def eval_due(self, step):
        return self.loop.eval_due(step)

    def save_if_due(self, step, state):
        """Save `state` if `step` is to be saved (`utils.checkpoints.saving.SavePolicy`). Call it after every step."""
        reason = self.loop.save_reason(step)
        if reason:
            self.saver.save(step, state, reason)

    def end_training(self, state):
        """After the loop: a stream that ended before the last step (`--max_stream_passes`) saves
        where it stopped; train_runtime and train_samples go into the results."""
        self.saver.save_if_the_data_ran_out(self.step, state)  # --max_stream_passes may end a stream early
        # A stream has no size: its examples are the steps'.
        self.dir.add_results(train_runtime=round(time.time() - self._train_start, 2),
                             train_samples=self.train_data.size or self.loop.examples_trained)

    def final_eval_due(self):
        """--do_eval and no evaluation yet at the last step."""
        return self.args.do_eval and self._last_eval_step != self.step

    def report(self, prefix, metrics):
        """Log `metrics` at the current step and write `{prefix}_results.json` (`RunDirectory.report`)."""
        if prefix == "eval":
            self._last_eval_step = self.step
        return self.dir.report(prefix, metrics, self.step)

    def write_text(self, name, lines, collapse_whitespace=True):
        self.dir.write_text(name, lines, collapse_whitespace)

    def write_json(self, name, value):
        self.dir.write_json(name, value)

    def finish(self):
        """The last checkpoint complete, then all_results.json and the last push (`RunDirectory.finish`)."""
        if self.args.do_train:
            self.saver.close()  # the last checkpoint is complete before the results say the run is done
        self.dir.finish()
