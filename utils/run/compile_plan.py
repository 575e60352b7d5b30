"""--compile_only: what the TPU compiler's plan of a run's steps says (`plan_report`, a value), and how such a
run ends (`end_with_plan`: printed, written, stopped). `utils.run.spine.TrainingRun.start` calls both, so a
script never mentions the flag; the parameter counts every run reports are made here too."""

import json
import logging
import os
from typing import NamedTuple

import jax

from utils.base.errors import Done, RunError
from utils.layout.memory import does_not_fit, eval_levers, per_device_bytes, plan_memory, readable, train_levers
from utils.models import lora
from utils.run.logs import MetricsLogger

logger = logging.getLogger(__name__)


def checkpointing(training_args):
    """False, or what --gradient_checkpointing keeps of each layer (--gradient_checkpointing_policy)."""
    return training_args.gradient_checkpointing and training_args.gradient_checkpointing_policy


def parameter_counts(layout, state):
    """{"trainable_parameters", "total_parameters"} of `state` (its global shapes, in any layout), logged:
    with LoRA the adapters and heads (`utils.models.lora.checkpointed`) of the whole model, adapters included."""
    shapes = layout.checkpoint_target(state)
    trainable, total = lora.count(lora.checkpointed(shapes).params), lora.count(shapes.params)
    logger.info("parameters: %s trained of %s (%.3g%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    return {"trainable_parameters": trainable, "total_parameters": total}


class PlanReport(NamedTuple):
    """What a plan found: `figures` (the keys a training run records, each step's device bytes or the TPU
    compiler's refusal, the device's bytes), whether every step `fits`, one printed `line` per step, and
    the `problem` the run ends with (None when everything fits)."""
    device: str  # the slice's name, e.g. "v3-8"
    figures: dict
    fits: bool
    lines: list
    problem: str


def plan_report(training_args, layout, state, batches=None):
    """The `PlanReport` of the train step and of each step named in `batches` (eval, predict, generate:
    `layout.planned_steps`) on its first batch (host rows), against the slice's HBM. A step the TPU
    compiler refuses to compile (its temporaries alone exceed the HBM) does not fit: its reason stands
    where its bytes would.

    While another step runs, the training state beyond the parameters (optimizer moments, step
    counter) stays on the device: its bytes count in that step's need.
    """
    plan = layout.plan
    plans = {"train_step": (layout.train_step_memory, layout.train_step_refused)}
    if layout.train_step_memory and batches:  # a refused train step decides it: the others are moot
        for name, batch in batches.items():
            plans[name] = plan_memory(layout.planned_steps[name].lower(state.params, layout.abstract_batch(batch)))
    kept = per_device_bytes(state) - per_device_bytes(state.params) if len(plans) > 1 else 0
    figures, needs = parameter_counts(layout, state), {}
    for name, (memory, refused) in plans.items():
        if refused:
            figures[f"{name}_refused"] = refused
            continue
        needs[name] = memory["total"] + (kept if name != "train_step" else 0)
        figures[f"{name}_device_bytes"] = needs[name]
        figures.update({f"{name}_device_bytes_{key}": value for key, value in memory.items() if key != "total"})
    if len(plans) > 1:
        figures["training_state_kept_device_bytes"] = kept
    figures["device_bytes"] = plan.device_bytes
    fits = len(needs) == len(plans) and all(need <= plan.device_bytes for need in needs.values())

    where, lines = f"{plan.describe()}, --sharding {layout.name}: the", []
    for name, (memory, refused) in plans.items():
        step = name.replace("_", " ")
        if refused:
            lines.append(f"{where} {step} does not fit: the TPU compiler refuses it ({refused})")
            continue
        parts = ", ".join(f"{part} {readable(memory[part])}" for part in ("arguments", "outputs", "temporaries",
                                                                          "aliased"))
        if name != "train_step":
            parts += f", training state kept {readable(kept)}"
        lines.append(f"{where} {step} needs {readable(needs[name])} of {readable(plan.device_bytes)} per device "
                     f"({parts}): {'fits' if needs[name] <= plan.device_bytes else 'does not fit'}")
    return PlanReport(plan.name, figures, fits, lines, _problem(training_args, layout, plans, needs))


def _problem(training_args, layout, plans, needs):
    """What the first step that does not fit says, with the levers that make it fit; None when all fit."""
    plan, device = layout.plan, f"a TPU {layout.plan.name} device"
    accumulation, checkpointed = training_args.gradient_accumulation_steps, checkpointing(training_args)
    if layout.train_step_refused:
        return (f"the train step does not fit {device} (the TPU compiler: {layout.train_step_refused}): "
                f"{train_levers(accumulation, layout.name, checkpointed)}")
    if needs["train_step"] > plan.device_bytes:
        return does_not_fit(layout.train_step_memory, plan.device_bytes, accumulation, layout.name, device=device,
                            checkpointing=checkpointed)
    for name, (memory, refused) in plans.items():
        if refused or needs[name] > plan.device_bytes:
            need = (f"does not fit {device} (the TPU compiler: {refused})" if refused else
                    f"needs {readable(needs[name])} per device but {device} has {readable(plan.device_bytes)}")
            levers = eval_levers(training_args.per_device_eval_batch_size, layout.name)
            return f"the {name.replace('_', ' ')} {need}: {levers}"
    return None


def end_with_plan(report, output_dir):
    """The end of a --compile_only run: `report` written by the main process (metrics.jsonl, all_results.json:
    its figures, whether all fits), printed, then the run stops: `Done`, or its problem as the run's error."""
    if jax.process_index() == 0:
        metrics = MetricsLogger(output_dir, tensorboard=False, progress=False)
        metrics.log(0, {k: v for k, v in report.figures.items() if not k.endswith("_refused")}, split="memory")
        metrics.close()
        with open(os.path.join(output_dir, "all_results.json"), "w", encoding="utf-8") as f:
            json.dump({"compile_only": report.device, **report.figures, "fits": report.fits}, f, indent=2)
    for line in report.lines:
        print(line, flush=True)
    if report.problem:
        raise RunError(report.problem)
    raise Done()
