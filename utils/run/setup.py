"""A run's set-up once its checks have passed: processes, devices, version shims, the compilation cache,
logging; and the training plan (global batch, steps, schedule)."""

from typing import NamedTuple

import jax
import numpy as np

from utils.base.errors import UsageError
from utils.data import batch_order
from utils.layout import devices, tpu_plan
from utils.layout.layouts import make_layout
from utils.models import compat
from utils.run import perf
from utils.run.logs import setup_logging
from utils.run.optim import learning_rate_schedule


def set_up(training_args):
    """Multi-host start-up, version shims, compilation cache, logging; returns (logger, is_main_process, the
    `utils.layout.layouts` layout --sharding names). With --compile_only, the TPU slice's compile-only devices
    first, and as many CPU devices: the layout then plans its steps for that slice."""
    if training_args.compile_only:
        if training_args.num_processes not in (None, 1):
            raise UsageError("--compile_only plans one host's TPU slice: drop --num_processes")
        tpu_plan.use_cpu_devices(len(tpu_plan.load(training_args.compile_only).devices))
        processes, staging = "one process (--compile_only plans one host's slice)", None
    else:
        devices.leave_absent_tpu_alone()
        staging = devices.size_tpu_staging_buffer()
        processes = devices.initialize_processes(training_args.coordinator_address, training_args.num_processes,
                                                 training_args.process_id)
    devices.check_tpu_backend()
    compat.apply()
    devices.enable_compilation_cache(training_args.compilation_cache_dir)
    if training_args.do_train:
        train_batch_size(training_args)  # --total_train_batch_size must split over the devices: checked now
    is_main = jax.process_index() == 0
    logger = setup_logging(is_main, debug=training_args.debug)
    perf.note_devices_opened()
    logger.info("processes: %s", processes)
    if staging:
        logger.info("TPU transfers: %s", staging)
    logger.info("devices: %d local of %d in all (%s), process %d of %d", jax.local_device_count(),
                jax.device_count(), jax.devices()[0].device_kind, jax.process_index(), jax.process_count())
    return logger, is_main, make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)


def train_batch_size(training_args):
    """The global train batch over this run's devices, gradient accumulation included:
    `--total_train_batch_size` when given (it must split over the devices and accumulation steps),
    else `--per_device_train_batch_size` x devices x `--gradient_accumulation_steps`."""
    devices_, accumulation = jax.device_count(), training_args.gradient_accumulation_steps
    total = training_args.total_train_batch_size
    if total is None:
        return devices.global_batch_size(training_args.per_device_train_batch_size, accumulation)
    if total % (devices_ * accumulation):
        raise UsageError(f"--total_train_batch_size {total} does not split over {devices_} devices x "
                         f"{accumulation} gradient_accumulation_steps: use a multiple of {devices_ * accumulation}")
    return total


class TrainingPlan(NamedTuple):
    batch_size: int  # global, accumulation included
    steps_per_epoch: int
    total_steps: int  # optimizer steps
    schedule: object  # the learning rate at each optimizer step (`utils.run.optim.learning_rate_schedule`)


def training_plan(training_args, num_train_examples):
    """The `TrainingPlan`; no steps when not training (`num_train_examples` is then not looked at).
    A stream (`num_train_examples` None) has no epochs: one of `--max_steps`."""
    if not training_args.do_train:
        batch, steps_per_epoch, total = 0, 0, 0
    else:
        batch, steps_per_epoch, total = _train_steps(training_args, num_train_examples)
    schedule = learning_rate_schedule(training_args.lr_scheduler_type, training_args.learning_rate,
                                      training_args.warmup_steps, max(total, 1))
    return TrainingPlan(batch, steps_per_epoch, total, schedule)


def _train_steps(training_args, num_train_examples):
    """(global train batch, steps per epoch, total optimizer steps)."""
    batch = train_batch_size(training_args)
    if num_train_examples is None:
        return batch, training_args.max_steps, training_args.max_steps
    steps_per_epoch = batch_order.steps_per_epoch(num_train_examples, batch)
    if steps_per_epoch == 0:
        raise UsageError(
            f"{num_train_examples} training examples are fewer than one global batch of {batch} "
            f"(per_device_train_batch_size x {jax.device_count()} devices x gradient_accumulation_steps): "
            "lower the batch size or add data"
        )
    if training_args.max_steps > 0:
        total = training_args.max_steps
    else:
        total = int(np.ceil(training_args.num_train_epochs * steps_per_epoch))
    return batch, steps_per_epoch, total
