"""utils/layout/devices.py: processes and devices: multi-host start-up, the busy-TPU check, process slices, padding."""

import http.server
import importlib.util
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from utils.base.errors import RunError, UsageError
from utils.layout import devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

N = 8


def test_eight_virtual_devices():
    assert jax.local_device_count() == N


def test_pad_to_and_example_mask():
    batch, valid = devices.pad_to({"x": np.array([[1, 2], [3, 4], [5, 6]])}, 8)
    assert valid == 3 and batch["x"].shape == (8, 2)
    np.testing.assert_array_equal(batch["x"][3:], np.tile([1, 2], (5, 1)))
    np.testing.assert_array_equal(devices.example_mask(valid, 8), [1, 1, 1, 0, 0, 0, 0, 0])
    full = {"x": np.arange(8)}
    assert devices.pad_to(full, 8) == (full, 8)


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_process_slice_partitions_global_batch(monkeypatch, processes):
    global_batch = 64
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    rows = []
    for index in range(processes):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        rows.extend(range(global_batch)[devices.process_slice(global_batch)])
    assert rows == list(range(global_batch))


def test_global_batch_size_and_dtype():
    assert devices.global_batch_size(4) == 32 and devices.global_batch_size(4, accumulation=3) == 96
    assert devices.to_dtype("bfloat16") == jnp.bfloat16


# --- multi-host start-up (jax.distributed itself is exercised end to end by test_multihost.py) ---------


@pytest.fixture
def fake_initialize(monkeypatch):
    """Record `jax.distributed.initialize` calls instead of joining a cluster."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: False)
    return calls


def test_single_host_by_default(fake_initialize):
    devices.initialize_processes(environ={})
    devices.initialize_processes(num_processes=1, environ={})
    assert fake_initialize == []


def test_explicit_settings_start_jax_distributed(fake_initialize):
    devices.initialize_processes("10.0.0.1:1234", 2, 1, environ={})
    assert fake_initialize == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}]


def test_environment_fills_in_missing_flags(fake_initialize):
    environ = {"JAX_COORDINATOR_ADDRESS": "head:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    devices.initialize_processes(process_id=2, environ=environ)  # a flag beats its variable
    assert fake_initialize == [{"coordinator_address": "head:99", "num_processes": 4, "process_id": 2}]
    with pytest.raises(UsageError, match=r"\$JAX_PROCESS_ID must be a non-negative integer"):
        devices.initialize_processes(environ={**environ, "JAX_PROCESS_ID": "one"})
    with pytest.raises(UsageError, match="--process_id must be in"):
        devices.initialize_processes(environ={**environ, "JAX_PROCESS_ID": "4"})


def test_incomplete_settings_name_the_missing_ones(fake_initialize):
    with pytest.raises(UsageError, match=r"also pass --num_processes \(\$JAX_NUM_PROCESSES\), --process_id"):
        devices.initialize_processes("10.0.0.1:1234", environ={})
    assert fake_initialize == []


@pytest.fixture
def metadata_server():
    """A stand-in for a Cloud TPU VM's metadata service on loopback, listing the workers it is given
    (only to requests that carry the header the real one demands)."""
    workers = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            known = self.path == "/computeMetadata/v1/instance/attributes/worker-network-endpoints"
            if not known or self.headers.get("Metadata-Flavor") != "Google":
                self.send_error(403 if known else 404)
                return
            body = ",".join(workers).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield workers, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def unused_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_cloud_tpu_vm_without_metadata_runs_alone(fake_initialize, monkeypatch):
    """A sandboxed TPU host: no worker variables and no metadata service. Jax's own cluster detection
    would end on a ConnectionError after retries; one host needs no jax.distributed at all."""
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    how = devices.initialize_processes(environ={"GCE_METADATA_IP": f"127.0.0.1:{unused_port()}"})
    assert how.startswith("one process: neither TPU worker variables nor the TPU metadata service name other hosts")
    assert "--coordinator_address, --num_processes and --process_id" in how
    assert devices.initialize_processes(environ={"TPU_SKIP_MDS_QUERY": "1"}) == how
    assert fake_initialize == []


def test_cloud_tpu_vm_counts_hosts_from_worker_variables(fake_initialize, monkeypatch):
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    alone = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}
    assert devices.initialize_processes(
        environ=alone) == "one process: one host in the slice (from the TPU runtime's worker variables)"
    assert fake_initialize == []
    pod = {"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"}
    assert "(4 hosts listed by the TPU runtime's worker variables)" in devices.initialize_processes(environ=pod)
    devices.initialize_processes(process_id=0, environ={"TPU_PROCESS_ADDRESSES": "a:8476,b:8476",
                                                        "MEGASCALE_NUM_SLICES": "2"})
    assert fake_initialize == [{}, {"process_id": 0}]  # JAX finds the rest of the settings itself
    devices.initialize_processes(num_processes=1, environ=pod)  # opting out
    assert len(fake_initialize) == 2


def test_cloud_tpu_vm_counts_hosts_from_metadata(fake_initialize, monkeypatch, metadata_server):
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    workers, address = metadata_server
    workers[:] = ["t1v-n-0:0:10.130.0.2"]
    assert devices.initialize_processes(environ={"GCE_METADATA_IP": address}) == \
        "one process: one host in the slice (from the TPU metadata service)"
    assert fake_initialize == []
    workers[:] = ["t1v-n-0:0:10.130.0.2", "t1v-n-1:1:10.130.0.3"]
    assert "(2 hosts listed by the TPU metadata service)" in devices.initialize_processes(
        environ={"GCE_METADATA_IP": address})
    assert fake_initialize == [{}]


def test_failure_to_find_the_pod_names_both_fixes(monkeypatch):
    def unreachable(**kwargs):
        raise ConnectionError("HTTPConnectionPool(host='metadata.google.internal', port=80): Max retries exceeded")

    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    monkeypatch.setattr(jax.distributed, "initialize", unreachable)
    with pytest.raises(RunError, match=r"could not join the other processes via the coordinator \(2 hosts listed by "
                                       r"the TPU runtime's worker variables\): ConnectionError: HTTPConnectionPool.*"
                                       r"on one host pass --num_processes 1; on a pod slice pass --coordinator_address"):
        devices.initialize_processes(environ={"TPU_WORKER_HOSTNAMES": "t-0,t-1"})


def test_failure_to_join_is_a_run_error(monkeypatch):
    def refuse(**kwargs):
        raise RuntimeError("DEADLINE_EXCEEDED: barrier timed out")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(RunError, match=r"could not join the other processes via 10.0.0.1:1234 \(the multi-host settings "
                                       r"given\): RuntimeError: DEADLINE_EXCEEDED"):
        devices.initialize_processes("10.0.0.1:1234", 2, 0, environ={})


def test_not_a_cloud_tpu_vm_here():
    assert devices._on_cloud_tpu_vm() is False


# --- a busy TPU: JAX falls back to the CPU ----------------------------------------------------------------
BUSY_TPU = (r"^this is a Cloud TPU VM, but JAX opened the CPU instead of the TPU{}: another process probably holds "
            r"the TPU; find it with `sudo lsof -w /dev/accel\* /dev/vfio/\*` or `ps aux \| grep python` and stop it, "
            r"or set JAX_PLATFORMS=cpu to run on the CPU on purpose$")


@pytest.fixture
def tpu_vm(monkeypatch):
    """This CPU machine passes for a Cloud TPU VM whose TPU JAX could not open (its backend is the CPU)."""
    from jax._src import xla_bridge

    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    errors = {}
    monkeypatch.setattr(xla_bridge, "_backend_errors", errors)
    return errors


def test_cpu_fallback_on_a_cloud_tpu_vm_is_refused(tpu_vm, jax_platforms):
    jax_platforms(None)  # JAX chose the platform
    with pytest.raises(UsageError, match=BUSY_TPU.format("")):
        devices.check_tpu_backend()
    tpu_vm["tpu"] = "TPU initialization failed: The TPU is already in use by process with pid 4242.\nmore"
    with pytest.raises(UsageError, match=BUSY_TPU.format(r" \(TPU initialization failed: The TPU is already in use "
                                                         r"by process with pid 4242\.\)")):
        devices.check_tpu_backend()


def test_cpu_on_a_cloud_tpu_vm_on_purpose(tpu_vm, jax_platforms):
    jax_platforms("cpu")  # JAX_PLATFORMS=cpu
    devices.check_tpu_backend()


def test_tpu_backend_on_a_cloud_tpu_vm(tpu_vm, jax_platforms, monkeypatch):
    jax_platforms(None)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    devices.check_tpu_backend()


def test_cpu_elsewhere_is_fine(jax_platforms):
    jax_platforms(None)  # no JAX_PLATFORMS, and not a Cloud TPU VM: a CPU machine (or a GPU one without GPUs)
    devices.check_tpu_backend()


# --- a machine without a TPU: libtpu (installed as the TPU compiler) stays unopened ------------------------
LIBTPU_NOISE = ("TPU_WORKER_HOSTNAMES", "could not determine TPU accelerator type")


def devices_seen_by_a_fresh_process(leave_absent_tpu_alone):
    """(stdout, stderr) of a process that opens JAX's backends as a script does, JAX_PLATFORMS unset."""
    environ = {name: value for name, value in os.environ.items() if name not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("from utils.layout import devices\n"
            + ("devices.leave_absent_tpu_alone()\n" if leave_absent_tpu_alone else "")
            + "import jax\nprint(jax.default_backend())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the noise comes from an installed libtpu")
def test_no_libtpu_noise_without_a_tpu():
    backend, noise = devices_seen_by_a_fresh_process(leave_absent_tpu_alone=False)
    if not any(line in noise for line in LIBTPU_NOISE):
        # libtpu's warnings come from its own threads and are sometimes not written before the process ends
        # (seen on a loaded machine): without them this run cannot tell whether the guard is needed.
        pytest.skip("libtpu kept quiet on its own this time: nothing for the guard to silence")
    backend, stderr = devices_seen_by_a_fresh_process(leave_absent_tpu_alone=True)
    assert backend == "cpu"
    assert not any(line in stderr for line in LIBTPU_NOISE), stderr


def test_tpu_staging_buffer_is_cut_where_huge_pages_are_missing(monkeypatch):
    """The TPU runtime pins 4 GiB to stage transfers unless told otherwise: 7 s of start-up on a host
    without transparent huge pages. There (and only on a TPU VM) 1 GiB is asked for; a size the user set stays."""
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: True)
    environ = {}
    line = devices.size_tpu_staging_buffer(environ, huge_pages=False)
    assert environ == {"TPU_PREMAPPED_BUFFER_SIZE": str(2**30)}
    assert line.startswith("1 GiB of pinned host memory stages transfers to the TPU")
    assert "TPU_PREMAPPED_BUFFER_SIZE" in line
    chosen = {"TPU_PREMAPPED_BUFFER_SIZE": "8589934592"}
    assert devices.size_tpu_staging_buffer(chosen, huge_pages=False) is None
    assert chosen == {"TPU_PREMAPPED_BUFFER_SIZE": "8589934592"}
    with_huge_pages = {}
    assert devices.size_tpu_staging_buffer(with_huge_pages, huge_pages=True) is None and with_huge_pages == {}
    monkeypatch.setattr(devices, "_on_cloud_tpu_vm", lambda: False)
    elsewhere = {}
    assert devices.size_tpu_staging_buffer(elsewhere, huge_pages=False) is None and elsewhere == {}
