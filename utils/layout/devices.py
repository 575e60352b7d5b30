"""Processes and devices: joining a multi-host run, the busy-TPU check, the compilation cache,
and the geometry of a global batch.

A *global* batch is what all devices of all processes consume in one step; each process loads
only its own contiguous slice of it (`process_slice`). Where the state and the batches then live
on the devices is the layout's business (`utils.layout.layouts`).
"""

import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from utils.base.arguments import check_distributed
from utils.base.errors import RunError, UsageError

# Where the multi-host settings come from when their flags are not given.
DISTRIBUTED_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                   "process_id": "JAX_PROCESS_ID"}
# How long a Cloud TPU VM's metadata service may take to say how many hosts the slice has.
METADATA_TIMEOUT_S = 2.0


def host_cpu():
    """The host's CPU device, or the default device where JAX was told to open no CPU backend: where a
    program run once goes (fresh weights, the learning-rate table), since each program an accelerator runs
    is one more compile, or compilation cache read, before the first step (~0.3 s each on a v5e host)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def _on_cloud_tpu_vm():
    # JAX's own test, made when jax was imported: libtpu installed and TPU chips on the PCI bus.
    try:
        from jax._src import cloud_tpu_init
    except ImportError:
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _accelerator_plugins():
    """Names of the installed PJRT plugins other than the TPU's (jax_cuda12_plugin, ...)."""
    try:
        import jax_plugins
    except ImportError:
        names = set()
    else:
        names = {module.name for module in pkgutil.iter_modules(jax_plugins.__path__)}
    names |= {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
    return names


def leave_absent_tpu_alone():
    """On a machine without TPU chips, keep JAX from opening libtpu. Installed for --compile_only (it
    is the TPU compiler), libtpu otherwise prints a page of errors at start about the TPU VM it is
    not on. JAX_PLATFORMS, an accelerator plugin or backends already open leave the choice to JAX."""
    from jax._src import xla_bridge

    if (_on_cloud_tpu_vm() or jax.config.jax_platforms or xla_bridge.backends_are_initialized()
            or importlib.util.find_spec("libtpu") is None or _accelerator_plugins()):
        return
    jax.config.update("jax_platforms", "cpu")


# The TPU runtime pins a host buffer (TPU_PREMAPPED_BUFFER_SIZE, 4 GiB by default) that stages transfers to
# the chips. Without transparent huge pages the kernel maps it 4 KiB page by page: on a v5e host, opening
# the chip took 8.6 s with it, 4.0 s with 1 GiB and 2.3 s with 256 MiB. An array of half the buffer still
# moved at ~6 GB/s; one larger than the buffer bypasses it, at ~0.2 GB/s on that host.
STAGING_BYTES_WITHOUT_HUGE_PAGES = 1 << 30


def _huge_pages_always():
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(path, encoding="utf-8") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def size_tpu_staging_buffer(environ=None, huge_pages=None):
    """On a Cloud TPU VM without transparent huge pages, ask the TPU runtime for a 1 GiB staging buffer
    instead of its 4 GiB (`STAGING_BYTES_WITHOUT_HUGE_PAGES`: ~4.6 s sooner to the first step, and 3 GiB
    less host memory pinned); must come before the TPU opens. A `TPU_PREMAPPED_BUFFER_SIZE` already set
    is kept. Returns the log line saying so, or None where nothing changed."""
    environ = os.environ if environ is None else environ
    huge_pages = _huge_pages_always() if huge_pages is None else huge_pages
    if not _on_cloud_tpu_vm() or huge_pages or "TPU_PREMAPPED_BUFFER_SIZE" in environ:
        return None
    environ["TPU_PREMAPPED_BUFFER_SIZE"] = str(STAGING_BYTES_WITHOUT_HUGE_PAGES)
    return (f"{STAGING_BYTES_WITHOUT_HUGE_PAGES >> 30} GiB of pinned host memory stages transfers to the TPU, "
            "not the runtime's 4 GiB: without transparent huge pages those take ~7 s to map at start; an array "
            "larger than that moves at ~0.2 GB/s (set TPU_PREMAPPED_BUFFER_SIZE to choose)")


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


def _count_hosts(workers):
    """Hosts in a comma-separated worker list (the TPU runtime's variables and metadata both write one)."""
    return len([worker for worker in workers.split(",") if worker.strip()])


def _tpu_hosts_from_environment(environ):
    """How many hosts the TPU runtime's worker variables list (GKE and queued resources set them), or None."""
    workers = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
    if not workers:
        return None
    return _count_hosts(workers) * int(environ.get("MEGASCALE_NUM_SLICES") or 1)


def _tpu_hosts_from_metadata(environ, timeout=METADATA_TIMEOUT_S):
    """How many hosts the Cloud TPU VM's metadata service lists for this slice, or None when it does not
    answer (a sandboxed or containerised host, metadata concealment, no network). One short try: JAX's
    own query retries for a minute and ends on an exception nobody can act on."""
    if environ.get("TPU_SKIP_MDS_QUERY"):
        return None
    server = environ.get("GCE_METADATA_IP") or "metadata.google.internal"
    request = urllib.request.Request(f"http://{server}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            workers = response.read().decode()
    except (OSError, ValueError):  # URLError, timeouts and refused sockets are OSErrors
        return None
    return _count_hosts(workers) or None


def initialize_processes(coordinator_address=None, num_processes=None, process_id=None, environ=None):
    """Join the other processes of a multi-host run; must come before any JAX computation. Returns
    one line saying how this process runs and why.

    Explicit settings (flags or `JAX_*` variables, all three) start `jax.distributed`. On a Cloud TPU
    VM the TPU runtime's worker variables, else its metadata service, say how many hosts the slice
    has: with several, JAX finds the rest of the settings itself (a pod slice needs no flags); with
    one, or when nothing answers, the host runs alone, as a one-host TPU VM never needs
    `jax.distributed`. Anywhere else, and with `num_processes` 1, the run stays single-process.
    """
    environ = os.environ if environ is None else environ
    settings = _distributed_settings(coordinator_address, num_processes, process_id, environ)
    if settings["num_processes"] == 1:
        return "one process (--num_processes 1)"
    missing = [name for name, value in settings.items() if value is None]
    if missing and not _on_cloud_tpu_vm():
        if len(missing) == len(settings):
            return "one process (no multi-host settings)"
        flags = ", ".join(f"--{name} (${DISTRIBUTED_ENV[name]})" for name in missing)
        raise UsageError(f"a multi-host run needs --coordinator_address, --num_processes and --process_id: "
                         f"also pass {flags}")
    if jax.distributed.is_initialized():  # by a launcher that wraps the script
        return f"process {jax.process_index()} of {jax.process_count()} (joined by the launcher)"
    how = "the multi-host settings given"
    if missing:
        hosts, source = _tpu_hosts_from_environment(environ), "the TPU runtime's worker variables"
        if hosts is None:
            hosts, source = _tpu_hosts_from_metadata(environ), "the TPU metadata service"
        if hosts is None:
            return ("one process: neither TPU worker variables nor the TPU metadata service name other hosts "
                    "(on a pod slice, pass --coordinator_address, --num_processes and --process_id)")
        if hosts == 1:
            return f"one process: one host in the slice (from {source})"
        how = f"{hosts} hosts listed by {source}"
    try:
        jax.distributed.initialize(**{name: value for name, value in settings.items() if value is not None})
    except Exception as error:  # noqa: BLE001 - JAX's cluster detection raises whatever its transports raise
        where = settings["coordinator_address"] or "the coordinator"
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise RunError(f"could not join the other processes via {where} ({how}): {type(error).__name__}: {first} "
                       "(on one host pass --num_processes 1; on a pod slice pass --coordinator_address, "
                       "--num_processes and --process_id, the same address and count on every host and distinct "
                       "ids)") from error
    return f"process {jax.process_index()} of {jax.process_count()} ({how})"


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
