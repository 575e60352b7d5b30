"""A step's device memory: what XLA's plan says it needs, whether that fits, and what to say when not.

`utils.layout.layouts` compiles the train step ahead of time and checks it here before any step runs;
`utils.run.spine.report_plan` writes a TPU plan (`--compile_only`) with the same figures and levers.
"""

import math

import jax
import numpy as np

from utils.base.errors import UsageError


def memory_line(stats):
    """A compiled step's `memory_stats` as one log line."""
    parts = ", ".join(f"{name} {readable(stats[name])}" for name in ("arguments", "temporaries", "outputs", "aliased"))
    return f"{readable(stats['total'])} per device ({parts})"


def readable(n):
    """Bytes in the unit that reads best: 512 KiB, 3.4 MiB, 12.25 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


def memory_stats(compiled):
    """Per-device bytes of a compiled step from XLA's memory analysis; `total` counts an output that
    reuses a donated input once."""
    analysis = compiled.memory_analysis()
    stats = {"arguments": analysis.argument_size_in_bytes, "outputs": analysis.output_size_in_bytes,
             "temporaries": analysis.temp_size_in_bytes, "aliased": analysis.alias_size_in_bytes}
    stats["total"] = stats["arguments"] + stats["outputs"] + stats["temporaries"] - stats["aliased"]
    return stats


def per_device_bytes(tree):
    """Bytes of one device's share of the placed shapes `tree` (`jax.ShapeDtypeStruct`s with a sharding)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def device_memory_limit():
    """Bytes one device may allocate, where the backend says (TPU, GPU); None on CPUs."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory statistics raise rather than return None
        return None
    return (stats or {}).get("bytes_limit")


def does_not_fit(stats, limit, gradient_accumulation_steps, layout_name, device="a device", checkpointing=False):
    """What to say when a train step of `stats` cannot fit `limit` bytes per device: the need, and
    the levers that lower it (those not pulled yet)."""
    return (f"the train step needs {readable(stats['total'])} per device but {device} has {readable(limit)}: "
            f"{train_levers(gradient_accumulation_steps, layout_name, checkpointing)}")


def train_levers(gradient_accumulation_steps, layout_name, checkpointing):
    """"use ...": what lowers a train step's memory, of the levers not pulled yet. `checkpointing`: False,
    or --gradient_checkpointing's policy (`utils.run.spine.checkpointing`)."""
    split = "--sharding fsdp, " if layout_name == "dp" else ""
    if not checkpointing:
        last = ", or --gradient_checkpointing"
    elif checkpointing == "kernels":
        last = ", or --gradient_checkpointing_policy nothing (each layer keeps its kernels' outputs now)"
    else:
        last = " (--gradient_checkpointing is on)"
    return (f"use {split}a smaller --per_device_train_batch_size with more --gradient_accumulation_steps (now "
            f"{gradient_accumulation_steps}), --dtype bfloat16{last}")


def compile_or_refuse(lowered):
    """(compiled step, None), or (None, the compiler's reason) when it refuses: the TPU compiler does
    not compile a step whose temporaries alone exceed the device's HBM (RESOURCE_EXHAUSTED)."""
    try:
        return lowered.compile(), None
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return None, str(error).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0].rstrip(".")


def eval_levers(per_device_eval_batch_size, layout_name):
    """"use ...": what lowers an eval, predict or generate step's memory."""
    split = "--sharding fsdp, " if layout_name == "dp" else ""
    return f"use {split}a smaller --per_device_eval_batch_size (now {per_device_eval_batch_size}) or --dtype bfloat16"


def plan_memory(lowered):
    """(`memory_stats`, None) of a step lowered for a TPU plan, or (None, why the compiler refused it)."""
    compiled, refused = compile_or_refuse(lowered)
    return (memory_stats(compiled) if compiled else None), refused


def check_fits(stats, gradient_accumulation_steps, layout_name, checkpointing=False):
    """Stop before training when the train step cannot fit the device (where its limit is known)."""
    limit = device_memory_limit()
    if limit is not None and stats["total"] > limit:
        raise UsageError(does_not_fit(stats, limit, gradient_accumulation_steps, layout_name,
                                      checkpointing=checkpointing))
