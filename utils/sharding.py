"""Devices and data placement for `jax.pmap` loops, single host or pod.

Conventions: the pmap axis is `AXIS`; a *global* batch is what all devices of all processes
consume in one step; each process loads only its own contiguous slice of it.
"""

import collections
import os
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from utils.args import check_distributed
from utils.errors import RunError, UsageError

AXIS = "batch"
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


def _mesh_sharding():
    # pmap outputs carry a NamedSharding over AXIS; putting inputs on the same sharding avoids a
    # second compilation at step 2.
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))


def replicate(tree):
    """Copy a host pytree to every local device (leading device axis), placed as the steps' outputs are."""
    n, placement = jax.local_device_count(), _mesh_sharding()

    def put(x):
        # Every device's slice of a broadcast view is `x` itself: one transfer per device and no
        # n-fold copy on the host (5-30x faster than flax's replicate for a model's state on CPU).
        x = np.asarray(x)
        return jax.device_put(np.broadcast_to(x, (n,) + x.shape), placement)

    return jax.tree_util.tree_map(put, tree)


def unreplicate(tree):
    """Device 0's copy of a replicated pytree, fetched to the host."""
    return jax.device_get(jax.tree_util.tree_map(lambda x: x[0], tree))


def per_device_keys(seed_or_key, num_devices=None):
    """Distinct RNG keys for this process's devices, stacked on the device axis.

    Keys are split for all devices of all processes and each process takes its own, so a run's
    randomness does not depend on how devices are spread over hosts.
    """
    key = jax.random.PRNGKey(seed_or_key) if isinstance(seed_or_key, int) else seed_or_key
    keys = jax.random.split(key, jax.device_count())
    start = jax.process_index() * jax.local_device_count()
    return keys[start: start + (num_devices or jax.local_device_count())]


def replicate_state(state):
    """Replicate a host TrainState, giving each device its own dropout key.

    A fresh state carries one key (`[2]`), split here into one per device of the run. A restored
    state carries the saved keys of this process's devices (`[local devices, 2]`, from
    `Checkpointer.restore`); they are used as they are, or the resumed run would draw different
    dropout masks than the uninterrupted one.
    """
    key = np.asarray(state.dropout_rng)
    if key.ndim == 1:
        keys = per_device_keys(state.dropout_rng)
    elif key.shape[0] == jax.local_device_count():
        keys = key
    else:
        raise ValueError(f"dropout keys for {key.shape[0]} devices, this process has {jax.local_device_count()}")
    return replicate(state.replace(dropout_rng=None)).replace(dropout_rng=jax.device_put(keys, _mesh_sharding()))


def process_slice(global_batch_size):
    """The slice of a global batch this process loads."""
    local = global_batch_size // jax.process_count()
    start = jax.process_index() * local
    return slice(start, start + local)


def shard(batch):
    """Host arrays `[local_batch, ...]` -> device arrays `[local_devices, local_batch / devices, ...]`."""
    n = jax.local_device_count()
    sharding = _mesh_sharding()

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % n:
            raise ValueError(f"batch of {x.shape[0]} does not split over {n} devices")
        return jax.device_put(x.reshape((n, -1) + x.shape[1:]), sharding)

    return jax.tree_util.tree_map(put, batch)


def prefetch(batches, size=2):
    """Shard batches onto the devices `size` steps ahead, so transfers overlap the running step."""
    queue = collections.deque()
    batches = iter(batches)
    for batch in itertools.islice(batches, size):
        queue.append(shard(batch))
    while queue:
        yield queue.popleft()
        for batch in itertools.islice(batches, 1):
            queue.append(shard(batch))


def unshard(x):
    """Device output `[local_devices, per_device, ...]` -> host `[local_batch, ...]`."""
    x = np.asarray(jax.device_get(x))
    return x.reshape((-1,) + x.shape[2:])


def gather_from_processes(x):
    """Concatenate each process's host rows in process order (identity on a single host)."""
    if jax.process_count() == 1:
        return x
    gathered = multihost_utils.process_allgather(x, tiled=False)
    return np.asarray(gathered).reshape((-1,) + np.shape(x)[1:])


def sum_over_processes(tree):
    """Sum host scalars/arrays over processes (identity on a single host)."""
    if jax.process_count() == 1:
        return tree
    return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x)).sum(0), tree)


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


def device_get_scalars(tree):
    """Fetch (possibly per-device) metrics to host floats, taking device 0 of replicated values."""
    host = jax.device_get(tree)
    return {k: float(np.asarray(v).reshape(-1)[0]) for k, v in host.items()}


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
