"""`--compile_only TPU`: the TPU compiler's own memory plan of a run's train step, on any machine.

JAX compiles for a TPU topology without a TPU when the `libtpu` wheel (the TPU compiler) is
installed: `jax.experimental.topologies` gives compile-only devices of the named slice, a layout
built over them places shapes (never values) there, and `memory_analysis()` of the compiled step is
what the TPU would allocate. XLA's plan for CPU devices is not that plan: it keeps gathered
weights and gradients whole where the TPU compiler frees them early.

The run keeps its arithmetic (global batch, mesh) on as many CPU devices as the slice has
(`use_cpu_devices`, before any JAX computation), so every figure is the one the TPU run will use.
"""

import importlib.metadata
import math
import os
import re
from typing import NamedTuple

import jax

from utils.base.arguments import TPU_SLICES
from utils.base.errors import UsageError

GIB = 2**30
# A v4 chip's two cores run as one JAX device ("megacore"), as on a real v4 VM; the compile-only
# client splits them unless told.
TOPOLOGY_OPTIONS = {"v4": {"chip_config_name": "megacore"}}
# Cloud TPU's accelerator type where it differs from the slice's name (`TPU_SLICES`).
ACCELERATOR_TYPES = {name: name.replace("v5e", "v5litepod") for name in TPU_SLICES if name.startswith("v5e")}
# High-bandwidth memory per chip (Cloud TPU's system architecture pages); a chip of two cores that
# JAX shows as two devices gives each half.
HBM_PER_CHIP = {"v2": 16 * GIB, "v3": 32 * GIB, "v4": 32 * GIB, "v5p": 95 * GIB, "v5e": 16 * GIB, "v6e": 32 * GIB}
LIBTPU_FILE = "requirements-tpu.txt"


class Topology(NamedTuple):
    name: str  # as given: "v3-8"
    devices: list  # compile-only devices, in the order a mesh takes them
    device_bytes: int  # HBM of one device

    def describe(self):
        return (f"TPU {self.name} ({len(self.devices)} x {self.devices[0].device_kind}, "
                f"{self.device_bytes / GIB:.0f} GiB HBM each)")


def pinned_libtpu():
    """The libtpu requirement of the installed jax's `tpu` extra ("libtpu==0.0.42.*"), or None."""
    for requirement in importlib.metadata.requires("jax") or ():
        spec, _, marker = requirement.partition(";")
        if spec.replace(" ", "").startswith("libtpu") and "tpu" in marker:
            return spec.replace(" ", "")
    return None


def _install_hint():
    pin = pinned_libtpu() or "libtpu"
    return f"pip install -r {LIBTPU_FILE} (or pip install '{pin}', the TPU compiler jax {jax.__version__} pins)"


def check_libtpu():
    """The usage error when libtpu is missing or not the version the installed jax pins."""
    try:
        installed = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(f"--compile_only needs the TPU compiler, which is not installed: {_install_hint()}") from None
    pin = pinned_libtpu()
    wanted = pin.split("==", 1)[1] if pin and "==" in pin else None
    if wanted and not re.fullmatch(re.escape(wanted).replace(r"\*", ".*"), installed):
        raise UsageError(f"--compile_only: libtpu {installed} is installed but jax {jax.__version__} needs "
                         f"{pin}: {_install_hint()}")


def use_cpu_devices(count):
    """Run on `count` CPU devices (the TPU slice's count, so batch and mesh arithmetic is the TPU run's).
    Must come before the first JAX computation; later, the devices JAX already has must match."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")  # a TPU VM's chips stay free for a run that trains
        jax.config.update("jax_num_cpu_devices", count)
    if jax.device_count() != count:
        raise UsageError(f"--compile_only plans for {count} devices but JAX already has {jax.device_count()} "
                         f"(set before this run: XLA_FLAGS=--xla_force_host_platform_device_count or "
                         f"jax_num_cpu_devices); unset it, or use a slice of {jax.device_count()} devices")


_loaded = {}


def load(name):
    """The `Topology` of the TPU slice `name` (`utils.base.arguments.TPU_SLICES`), compile-only devices from libtpu (it
    opens no JAX backend, so `use_cpu_devices` can follow)."""
    if name not in _loaded:
        check_libtpu()
        # libtpu takes a machine-wide lock for the chips; compiling needs none, so plans may run
        # beside each other and beside a training run on a TPU VM.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        # Nor does it need a TPU VM: what libtpu would look up in the VM's metadata server (and warn
        # about at length when it cannot) is this one machine and the slice named.
        for variable, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                                ("TPU_ACCELERATOR_TYPE", ACCELERATOR_TYPES.get(name, name))):
            os.environ.setdefault(variable, value)
        from jax.experimental import topologies

        topology = TPU_SLICES[name]
        generation, dims = topology.split(":")
        try:
            devices = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                   **TOPOLOGY_OPTIONS.get(generation, {})).devices
        except Exception as error:  # noqa: BLE001 - libtpu's errors are of many kinds; all mean the same here
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"--compile_only {name}: the installed libtpu could not describe {topology} ({first}): "
                             f"{_install_hint()}") from None
        chips = math.prod(int(d) for d in dims.split("x"))
        _loaded[name] = Topology(name, list(devices), HBM_PER_CHIP[generation] * chips // len(devices))
    return _loaded[name]
