"""Processes and devices: joining a multi-host run, the busy-TPU check, the compilation cache,
and the geometry of a global batch.

A *global* batch is what all devices of all processes consume in one step; each process loads
only its own contiguous slice of it (`process_slice`). Where the state and the batches then live
on the devices is the layout's business (`utils.layout`).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from utils.args import check_distributed
from utils.errors import RunError, UsageError

# Where the multi-host settings come from when their flags are not given.
DISTRIBUTED_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                   "process_id": "JAX_PROCESS_ID"}


def _on_cloud_tpu_vm():
    # JAX's own test, made when jax was imported: libtpu installed and TPU chips on the PCI bus.
    try:
        from jax._src import cloud_tpu_init
    except ImportError:
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _tpu_backend_error():
    """Why JAX could not open the TPU (the first line of its error), or None."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    error = getattr(xla_bridge, "_backend_errors", {}).get("tpu")
    return error.strip().splitlines()[0][:300] if error and error.strip() else None


def check_tpu_backend():
    """On a Cloud TPU VM, refuse to run on the CPU unless `JAX_PLATFORMS` asks for it.

    Only one process at a time may hold a TPU VM's chips: a second one gets "libtpu.so already in
    use by another process", and JAX carries on with the CPU, so a "TPU run" would train on the host
    for hours. An explicit platform list (JAX_PLATFORMS=cpu) is a choice, and fails loudly in JAX
    itself when it names a TPU that cannot be opened.
    """
    if not _on_cloud_tpu_vm() or jax.default_backend() != "cpu" or jax.config.jax_platforms:
        return
    reason = _tpu_backend_error()
    raise UsageError(f"this is a Cloud TPU VM, but JAX opened the CPU instead of the TPU"
                     f"{f' ({reason})' if reason else ''}: another process probably holds the TPU; find it with "
                     "`sudo lsof -w /dev/accel* /dev/vfio/*` or `ps aux | grep python` and stop it, or set "
                     "JAX_PLATFORMS=cpu to run on the CPU on purpose")


def _distributed_settings(coordinator_address=None, num_processes=None, process_id=None, environ=None):
    """{name: value} of the multi-host settings given by flags or, failing those, `JAX_*` variables."""
    environ = os.environ if environ is None else environ
    settings = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for name, variable in DISTRIBUTED_ENV.items():
        if settings[name] is None and environ.get(variable):
            value = environ[variable]
            if name != "coordinator_address":
                if not value.strip().isdigit():
                    raise UsageError(f"${variable} must be a non-negative integer, got {value!r}")
                value = int(value)
            settings[name] = value
    check_distributed(**settings)
    return settings


def initialize_processes(coordinator_address=None, num_processes=None, process_id=None, environ=None):
    """Join the other processes of a multi-host run; must come before any JAX computation.

    Explicit settings (flags or `JAX_*` variables, all three) start `jax.distributed`; on a Cloud TPU
    VM the missing ones are found by JAX from the TPU metadata, so a pod slice needs none. Anywhere
    else, and with `num_processes` 1, the run stays single-process.
    """
    settings = _distributed_settings(coordinator_address, num_processes, process_id, environ)
    if settings["num_processes"] == 1:
        return
    missing = [name for name, value in settings.items() if value is None]
    if missing and not _on_cloud_tpu_vm():
        if len(missing) == len(settings):
            return
        flags = ", ".join(f"--{name} (${DISTRIBUTED_ENV[name]})" for name in missing)
        raise UsageError(f"a multi-host run needs --coordinator_address, --num_processes and --process_id: "
                         f"also pass {flags}")
    if jax.distributed.is_initialized():  # by a launcher that wraps the script
        return
    try:
        jax.distributed.initialize(**{name: value for name, value in settings.items() if value is not None})
    except (RuntimeError, ValueError) as error:
        where = settings["coordinator_address"] or "the coordinator"
        raise RunError(f"could not join the other processes via {where}: {error} (check that every process got "
                       "the same address and process count, and distinct process ids; --num_processes 1 runs "
                       "this host alone)") from error


def sync_processes(name):
    """Wait until every process gets here (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def fetch_replicated(tree):
    """A pytree of replicated device values on the host. A value that spans other processes' devices
    (a step's sums under "fsdp" on several hosts) cannot be fetched whole, and need not be: every
    local copy holds it."""

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(fetch, tree)


def gather_rows(x):
    """Every process's host array `x` stacked in process order: `[processes, *x.shape]`."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def gather_json(value):
    """Every process's JSON-able `value`, in process order (as bytes: an allgather moves arrays only)."""
    if jax.process_count() == 1:
        return [value]
    raw = np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)
    lengths = gather_rows(np.int64(len(raw)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(raw)] = raw
    return [json.loads(bytes(row[:n]).decode("utf-8")) for row, n in zip(gather_rows(padded), lengths)]


def process_slice(global_batch_size):
    """The slice of a global batch this process loads."""
    local = global_batch_size // jax.process_count()
    start = jax.process_index() * local
    return slice(start, start + local)


def pad_to(batch, size):
    """Pad host arrays along axis 0 to `size` rows by repeating row 0; returns (batch, valid rows).

    Fixed shapes mean no recompilation for the last eval/predict batch; padded rows are dropped
    (their loss weight is zeroed by the caller via the returned count).
    """
    n = len(next(iter(batch.values())))
    if n == size:
        return batch, n
    pad = lambda x: np.concatenate([x, np.repeat(x[:1], size - n, axis=0)])  # noqa: E731
    return {k: pad(np.asarray(v)) for k, v in batch.items()}, n


def example_mask(valid, size):
    return (np.arange(size) < valid).astype(np.float32)


def global_batch_size(per_device, accumulation=1):
    return per_device * jax.device_count() * accumulation


def to_dtype(name):
    return {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}[name]


def enable_compilation_cache(path):
    """JAX's persistent compilation cache: a rerun skips recompiling unchanged steps."""
    if not path or path.lower() == "none":
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache even quick compiles: a script's steps are few and all of them are on the start-up path.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
