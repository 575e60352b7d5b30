"""utils/sharding.py: replicate / shard / pad-shard-unpad, per-device keys, process slices, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils

from utils import sharding
from utils.errors import RunError, UsageError
from utils.state import create_train_state

N = 8


def test_eight_virtual_devices():
    assert jax.local_device_count() == N


def test_replicate_unreplicate_round_trip():
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(1.5), "n": np.int32(3)}
    replicated = sharding.replicate(tree)
    assert replicated["w"].shape == (N, 2, 3) and replicated["b"].shape == (N,)
    assert len(replicated["w"].sharding.device_set) == N
    back = sharding.unreplicate(replicated)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert back["b"] == 1.5 and back["n"] == 3 and isinstance(back["w"], np.ndarray)


def test_replicate_state_gives_distinct_dropout_keys():
    params = {"w": jnp.ones((3,))}
    state = sharding.replicate_state(create_train_state(lambda *a: None, params, optax.sgd(0.1), seed=0))
    assert state.step.shape == (N,) and state.params["w"].shape == (N, 3)
    keys = np.asarray(state.dropout_rng)
    assert keys.shape == (N, 2)
    assert len({k.tobytes() for k in keys}) == N


def test_replicate_state_keeps_restored_per_device_keys():
    """A restored state carries one saved key per device: they must not be re-derived (exact resume)."""
    params = {"w": jnp.ones((3,))}
    saved = np.arange(N * 2, dtype=np.uint32).reshape(N, 2)
    state = create_train_state(lambda *a: None, params, optax.sgd(0.1), seed=0).replace(dropout_rng=saved)
    np.testing.assert_array_equal(np.asarray(sharding.replicate_state(state).dropout_rng), saved)
    with pytest.raises(ValueError, match="dropout keys for 4 devices, this process has 8"):
        sharding.replicate_state(state.replace(dropout_rng=saved[:4]))


def test_per_device_keys_deterministic():
    a, b = sharding.per_device_keys(3), sharding.per_device_keys(3)
    np.testing.assert_array_equal(a, b)
    assert len({np.asarray(k).tobytes() for k in a}) == N
    assert not np.array_equal(a, sharding.per_device_keys(4))


def test_shard_and_unshard():
    batch = {"x": np.arange(16 * 3).reshape(16, 3), "y": np.arange(16)}
    sharded = sharding.shard(batch)
    assert sharded["x"].shape == (N, 2, 3) and sharded["y"].shape == (N, 2)
    np.testing.assert_array_equal(np.asarray(sharded["x"][1]), batch["x"][2:4])  # device 1 gets rows 2, 3
    np.testing.assert_array_equal(sharding.unshard(sharded["x"]), batch["x"])


def test_shard_indivisible_batch():
    with pytest.raises(ValueError, match="batch of 12 does not split over 8 devices"):
        sharding.shard({"x": np.zeros((12, 2))})


def test_prefetch_yields_every_batch_in_order():
    batches = [{"x": np.full((8, 2), i)} for i in range(5)]
    out = [int(np.asarray(b["x"])[0, 0, 0]) for b in sharding.prefetch(iter(batches), size=2)]
    assert out == [0, 1, 2, 3, 4]
    assert list(sharding.prefetch(iter([]))) == []
    assert len(list(sharding.prefetch(iter(batches[:1]), size=3))) == 1


def test_pad_to_and_example_mask():
    batch, valid = sharding.pad_to({"x": np.array([[1, 2], [3, 4], [5, 6]])}, 8)
    assert valid == 3 and batch["x"].shape == (8, 2)
    np.testing.assert_array_equal(batch["x"][3:], np.tile([1, 2], (5, 1)))
    np.testing.assert_array_equal(sharding.example_mask(valid, 8), [1, 1, 1, 0, 0, 0, 0, 0])
    full = {"x": np.arange(8)}
    assert sharding.pad_to(full, 8) == (full, 8)


def test_pad_shard_unpad_covers_every_example_once():
    ids = np.arange(21)
    p_double = jax.pmap(lambda b: {"ids": b["ids"] * 2, "w": b["w"]}, sharding.AXIS)
    seen, weight = [], 0.0
    for start in range(0, len(ids), 8):
        batch, valid = sharding.pad_to({"ids": ids[start:start + 8]}, 8)
        batch["w"] = sharding.example_mask(valid, 8)
        out = p_double(sharding.shard(batch))
        seen.extend(sharding.unshard(out["ids"])[:valid] // 2)
        weight += sharding.unshard(out["w"]).sum()
    assert seen == list(ids) and weight == 21


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_process_slice_partitions_global_batch(monkeypatch, processes):
    global_batch = 64
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    rows = []
    for index in range(processes):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        rows.extend(range(global_batch)[sharding.process_slice(global_batch)])
    assert rows == list(range(global_batch))


def test_global_batch_size_and_dtype():
    assert sharding.global_batch_size(4) == 32 and sharding.global_batch_size(4, accumulation=3) == 96
    assert sharding.to_dtype("bfloat16") == jnp.bfloat16


def test_device_get_scalars():
    out = sharding.device_get_scalars({"loss": sharding.replicate(np.float32(2.5)), "n": 3})
    assert out == {"loss": 2.5, "n": 3.0}


class CompileCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_no_recompile_at_step_two():
    """Step outputs must carry the same sharding as `replicate` / `replicate_state` inputs."""
    params = {"w": jnp.ones((4,))}
    state = sharding.replicate_state(create_train_state(lambda *a: None, params, optax.adam(0.1), seed=0))

    def step(state, batch):
        rng, state = state.next_dropout_rng()
        noise = jax.random.uniform(rng, ())
        grads = jax.lax.pmean(jax.grad(lambda p: jnp.sum((p["w"] * batch["x"]) ** 2) * noise)(state.params),
                              sharding.AXIS)
        return state.apply_gradients(grads=grads)

    p_step = jax.pmap(step, sharding.AXIS)
    batch = sharding.shard({"x": np.ones((16, 4), np.float32)})
    with CompileCounter() as compiles:
        state = p_step(state, batch)
        first = compiles.count
        state = p_step(state, batch)
        state = p_step(state, batch)
    assert first >= 1 and compiles.count == first
    assert int(sharding.unreplicate(state.step)) == 3

    # The counter does see the recompile that flax's default replication causes.
    with CompileCounter() as compiles:
        p_step(jax_utils.replicate(sharding.unreplicate(state)), batch)
    assert compiles.count >= 1


# --- multi-host start-up (jax.distributed itself is exercised end to end by test_multihost.py) ---------


@pytest.fixture
def fake_initialize(monkeypatch):
    """Record `jax.distributed.initialize` calls instead of joining a cluster."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(sharding, "_on_cloud_tpu_vm", lambda: False)
    return calls


def test_single_host_by_default(fake_initialize):
    sharding.initialize_processes(environ={})
    sharding.initialize_processes(num_processes=1, environ={})
    assert fake_initialize == []


def test_explicit_settings_start_jax_distributed(fake_initialize):
    sharding.initialize_processes("10.0.0.1:1234", 2, 1, environ={})
    assert fake_initialize == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}]


def test_environment_fills_in_missing_flags(fake_initialize):
    environ = {"JAX_COORDINATOR_ADDRESS": "head:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    sharding.initialize_processes(process_id=2, environ=environ)  # a flag beats its variable
    assert fake_initialize == [{"coordinator_address": "head:99", "num_processes": 4, "process_id": 2}]
    with pytest.raises(UsageError, match=r"\$JAX_PROCESS_ID must be a non-negative integer"):
        sharding.initialize_processes(environ={**environ, "JAX_PROCESS_ID": "one"})
    with pytest.raises(UsageError, match="--process_id must be in"):
        sharding.initialize_processes(environ={**environ, "JAX_PROCESS_ID": "4"})


def test_incomplete_settings_name_the_missing_ones(fake_initialize):
    with pytest.raises(UsageError, match=r"also pass --num_processes \(\$JAX_NUM_PROCESSES\), --process_id"):
        sharding.initialize_processes("10.0.0.1:1234", environ={})
    assert fake_initialize == []


def test_cloud_tpu_vm_lets_jax_find_the_pod(fake_initialize, monkeypatch):
    monkeypatch.setattr(sharding, "_on_cloud_tpu_vm", lambda: True)
    sharding.initialize_processes(environ={})
    sharding.initialize_processes(process_id=0, environ={})
    assert fake_initialize == [{}, {"process_id": 0}]
    sharding.initialize_processes(num_processes=1, environ={})  # opting out
    assert len(fake_initialize) == 2


def test_failure_to_join_is_a_run_error(monkeypatch):
    def refuse(**kwargs):
        raise RuntimeError("DEADLINE_EXCEEDED: barrier timed out")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(RunError, match="could not join the other processes via 10.0.0.1:1234: DEADLINE"):
        sharding.initialize_processes("10.0.0.1:1234", 2, 0, environ={})


def test_not_a_cloud_tpu_vm_here():
    assert sharding._on_cloud_tpu_vm() is False


# --- a busy TPU: JAX falls back to the CPU ----------------------------------------------------------------
BUSY_TPU = (r"^this is a Cloud TPU VM, but JAX opened the CPU instead of the TPU{}: another process probably holds "
            r"the TPU; find it with `sudo lsof -w /dev/accel\* /dev/vfio/\*` or `ps aux \| grep python` and stop it, "
            r"or set JAX_PLATFORMS=cpu to run on the CPU on purpose$")


@pytest.fixture
def tpu_vm(monkeypatch):
    """This CPU machine passes for a Cloud TPU VM whose TPU JAX could not open (its backend is the CPU)."""
    from jax._src import xla_bridge

    monkeypatch.setattr(sharding, "_on_cloud_tpu_vm", lambda: True)
    errors = {}
    monkeypatch.setattr(xla_bridge, "_backend_errors", errors)
    return errors


def test_cpu_fallback_on_a_cloud_tpu_vm_is_refused(tpu_vm, jax_platforms):
    jax_platforms(None)  # JAX chose the platform
    with pytest.raises(UsageError, match=BUSY_TPU.format("")):
        sharding.check_tpu_backend()
    tpu_vm["tpu"] = "TPU initialization failed: The TPU is already in use by process with pid 4242.\nmore"
    with pytest.raises(UsageError, match=BUSY_TPU.format(r" \(TPU initialization failed: The TPU is already in use "
                                                         r"by process with pid 4242\.\)")):
        sharding.check_tpu_backend()


def test_cpu_on_a_cloud_tpu_vm_on_purpose(tpu_vm, jax_platforms):
    jax_platforms("cpu")  # JAX_PLATFORMS=cpu
    sharding.check_tpu_backend()


def test_tpu_backend_on_a_cloud_tpu_vm(tpu_vm, jax_platforms, monkeypatch):
    jax_platforms(None)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    sharding.check_tpu_backend()


def test_cpu_elsewhere_is_fine(jax_platforms):
    jax_platforms(None)  # no JAX_PLATFORMS, and not a Cloud TPU VM: a CPU machine (or a GPU one without GPUs)
    sharding.check_tpu_backend()
