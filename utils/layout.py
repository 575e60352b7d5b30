"""Where the train state lives and how a step runs: the two layouts, `--sharding dp|fsdp`.

- `DataParallel` ("dp", the default): `jax.pmap` over this process's devices. Every device holds
  the whole state and its own dropout key; a batch is `[local devices, rows per device, ...]`; the
  steps sum loss sums, token counts and gradients over devices with an explicit `psum`.
- `FullySharded` ("fsdp"): `jax.jit` over a `Mesh` of all devices of all processes, shaped
  (devices / fsdp_size) x fsdp_size with axes ("data", "fsdp"). Each parameter (and the optimizer
  state that follows it) is split along one dimension over the "fsdp" axis (`leaf_spec`), so a
  device holds 1/fsdp_size of the state; the batch is one global array split over all devices,
  and sums over it are global sums without any collective in the step's code.

The scripts define each step once, for both: `layout.batch_sum` is the one collective they name,
and `utils.steps.token_weighted_grads` asks the layout how to cut micro-batches. Everything else
that differs lives here: making and placing the state (fresh weights initialised straight into
their sharding; pretrained ones placed leaf by leaf from host memory), compiling the steps (the
train step ahead of time, so its per-device memory is known and checked before any step runs;
on the CPU backend, at most `CPU_STEPS_IN_FLIGHT` steps dispatched ahead),
placing batches, gathering outputs, the dropout key, the state as checkpoints store it (global
arrays, so a run can move between layouts and device counts), and the parameters on the host for
the Hugging Face export. Given a TPU slice (`utils.tpu_plan`, `--compile_only`), a layout holds
shapes placed on its compile-only devices instead of values, and compiles the train step without
running it: the TPU compiler's memory plan.
"""

import collections
import contextlib
import itertools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from utils import tpu_plan
from utils.errors import UsageError
from utils.layers import each_layer
from utils.state import TrainState

logger = logging.getLogger(__name__)

AXIS = "batch"  # the pmap axis of "dp"
MESH_AXES = ("data", "fsdp")
# Leaves smaller than this stay whole on every device under "fsdp" (biases, norm scales, scalars):
# splitting them saves nothing and costs a gather each.
MIN_SHARDED_ELEMENTS = 2**14
PREFETCH = 2  # batches placed on the devices ahead of the running step
# Why the CPU backend caps the steps in flight: XLA's CPU client lets each device queue 32
# executions; the launch of a 33rd waits for that limit on one of the client's worker threads,
# of which there are max(cores, devices): 8 with 8 virtual devices on a small machine. A step
# with a collective (the psum of "dp", the global sums of "fsdp") needs a worker thread for every
# device at once, so one launch parked on a worker leaves its all-reduce a participant short: XLA
# aborts after 40 s ("Expected 8 threads to join the rendezvous"). A host that dispatches fast
# steps without waiting (the loop fetches metrics every --logging_steps) gets 32 steps ahead
# easily. Four in flight keep the devices as busy; TPU and GPU run collectives on the devices,
# not on host worker threads, and keep their own dispatch.
CPU_STEPS_IN_FLIGHT = 4


def make_layout(training_args):
    """The layout `--sharding` names, for this run's devices (after `utils.run.set_up`); with
    `--compile_only TPU`, over that slice's compile-only devices (`utils.tpu_plan`)."""
    plan = tpu_plan.load(training_args.compile_only) if training_args.compile_only else None
    if training_args.sharding == "dp":
        layout = DataParallel(plan)
    else:
        fsdp_size = training_args.fsdp_size or jax.device_count()
        if jax.device_count() % fsdp_size:
            raise UsageError(f"--fsdp_size {fsdp_size} does not divide the {jax.device_count()} devices: use a "
                             "divisor (the mesh is devices / fsdp_size x fsdp_size)")
        layout = FullySharded(fsdp_size, plan)
    logger.info("layout: %s", layout.describe())
    return layout


def leaf_spec(shape, fsdp_size):
    """How `utils.layout.FullySharded` splits one array: along its largest dimension that `fsdp_size`
    divides; whole (replicated) when it is small or no dimension divides (GPT-2's 50257-token
    vocabulary is split along the width instead)."""
    if fsdp_size == 1 or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp_size == 0:
            return PartitionSpec(*(MESH_AXES[1] if d == dim else None for d in range(len(shape))))
    return PartitionSpec()


def _memory_line(stats):
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
    """"use ...": what lowers a train step's memory, of the levers not pulled yet."""
    split = "--sharding fsdp, " if layout_name == "dp" else ""
    last = ", or --gradient_checkpointing" if not checkpointing else " (--gradient_checkpointing is on)"
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


def step_wrapper(name, build, donated=()):
    """The callable a layout hands out for a step: `build()` itself (`donated`: the positions of the
    arguments the step consumes). `utils.perf.StepRecorder` puts its own wrapper here to count each
    step's calls and compilations."""
    return build()


class InFlightLimit:
    """At most `limit` step executions dispatched and not finished, over every step it wraps
    (None: no limit). See `CPU_STEPS_IN_FLIGHT`."""

    def __init__(self, limit):
        self.limit = limit
        self._unfinished = collections.deque()  # the outputs that mark each dispatched step done

    def wrap(self, step, done=lambda outputs: outputs):
        """`step` that first waits for the oldest unfinished step while `limit` are in flight;
        `done(outputs)`: the outputs to wait on (never a donated one: the next step deletes it)."""
        if self.limit is None:
            return step

        def limited(*args):
            while len(self._unfinished) >= self.limit:
                jax.block_until_ready(self._unfinished.popleft())
            outputs = step(*args)
            self._unfinished.append(done(outputs))
            return outputs

        return limited


class Layout:
    """What both layouts share; see `DataParallel` and `FullySharded`."""

    name = None
    train_step_memory = None  # per-device bytes of the compiled train step (`memory_stats`), once compiled
    train_step_refused = None  # planning for a TPU: why its compiler would not compile the train step

    def __init__(self, plan=None):
        # A `utils.tpu_plan.Topology`: the layout places shapes on its compile-only devices, and
        # compiles the train step without ever running it.
        self.plan = plan
        self.planned_steps = {}  # name -> jitted step without state, planned by `utils.training.report_plan`
        self.local_devices = plan.devices if plan else jax.local_devices()
        on_cpu = self.local_devices[0].platform == "cpu"
        # One limit for all steps: XLA's queue of executions is per device, whichever program they run.
        self._in_flight = InFlightLimit(CPU_STEPS_IN_FLIGHT if on_cpu else None)

    def prefetch(self, batches):
        """Place host batches on the devices `PREFETCH` steps ahead, so transfers overlap the running step."""
        queue = collections.deque(self.place_batch(batch) for batch in itertools.islice(batches, PREFETCH))
        batches = iter(batches)
        while queue:
            yield queue.popleft()
            queue.extend(self.place_batch(batch) for batch in itertools.islice(batches, 1))

    def compile_train_step(self, train_step, state, example_batch, gradient_accumulation_steps, checkpointing=False):
        """`train_step(state, batch) -> (state, sums)` compiled ahead of time for `state` and batches
        like `example_batch` (host rows of this process); its per-device memory is logged, kept in
        `train_step_memory`, and checked against the device's limit before any step runs. Planning
        for a TPU (`plan`), nothing is checked and nothing can run: None is returned."""
        if self.plan:
            batch = self.abstract_batch(example_batch)
            self.train_step_memory, self.train_step_refused = plan_memory(
                self._jit_train_step(train_step, state).lower(state, batch))
            logger.info("train step (%s) on %s: %s", self.name, self.plan.describe(),
                        self.train_step_refused or _memory_line(self.train_step_memory))
            return None

        def build():
            jitted = self._jit_train_step(train_step, state)
            compiled, refused = compile_or_refuse(jitted.lower(state, self.place_batch(example_batch)))
            if refused:
                raise UsageError(f"the train step does not fit a device (the compiler: {refused}): "
                                 f"{train_levers(gradient_accumulation_steps, self.name, checkpointing)}")
            self.train_step_memory = memory_stats(compiled)
            # Wait on the sums: the state goes into the next step, which deletes it.
            return self._in_flight.wrap(self._callable(jitted, compiled), done=lambda outputs: outputs[1])

        step = step_wrapper("train_step", build, donated=(0,))
        logger.info("train step (%s): %s", self.name, _memory_line(self.train_step_memory))
        check_fits(self.train_step_memory, gradient_accumulation_steps, self.name, checkpointing)
        return step

    def compile_step(self, name, step):
        """A step without state: `step(params, batch)` (eval, predict, generate), compiled at its first
        call. Planning for a TPU (`plan`), it is kept in `planned_steps` for `utils.training` to plan
        with the batches the run would give it, and None is returned."""
        if self.plan:
            self.planned_steps[name] = self._jit_step(step)
            return None
        return step_wrapper(name, lambda: self._in_flight.wrap(self._jit_step(step)))

    def abstract_batch(self, host_rows):
        """The shapes `place_batch` would give `host_rows`, placed the same way, without a transfer."""
        def shape(x):
            x = np.asarray(x)
            return jax.ShapeDtypeStruct(self._batch_shape(x.shape), x.dtype, sharding=self._batch_sharding)

        return jax.tree_util.tree_map(shape, host_rows)

    def _abstract_state(self, apply_fn, params, tx, seed):
        """What `create_state` would make of the parameter shapes `params`, placed (`abstract_state`)."""

        def create(params):
            return TrainState.create(apply_fn=apply_fn, params=params, tx=tx, dropout_rng=jax.random.PRNGKey(seed))

        return self.abstract_state(jax.eval_shape(create, params))


class DataParallel(Layout):
    """`jax.pmap` over this process's devices; the state replicated, one dropout key per device."""

    name = "dp"
    batch_shards = 1  # a device's micro-batches are cut from its own rows
    writes_shards = False  # checkpoints hold host copies, written by process 0

    def __init__(self, plan=None):
        super().__init__(plan)
        # pmap outputs carry a NamedSharding over AXIS; inputs placed the same way reuse step 1's program.
        self._placement = self._batch_sharding = NamedSharding(Mesh(np.array(self.local_devices), (AXIS,)),
                                                               PartitionSpec(AXIS))

    def describe(self):
        where = f" of {self.plan.describe()}" if self.plan else ""
        return f"dp: jax.pmap over {len(self.local_devices)} local devices{where} ({jax.device_count()} in all)"

    # -- the state ----------------------------------------------------------------------------------
    def init_params(self, init):
        """Fresh weights `init()` from one compiled program (on the default device)."""
        if self.plan:  # shapes only: the state is placed by `create_state`
            return jax.eval_shape(init)
        return jax.jit(init)()

    def place_params(self, host_params):
        return host_params

    def create_state(self, apply_fn, params, tx, seed):
        """The state on every device, with one dropout key per device of the run."""
        if self.plan:
            return self._abstract_state(apply_fn, params, tx, seed)
        state = TrainState.create(apply_fn=apply_fn, params=params, tx=tx, dropout_rng=jax.random.PRNGKey(seed))
        return self._replicate(state, _device_keys(state.dropout_rng, jax.device_count())[self._local_rows()])

    def _local_rows(self):
        start = jax.process_index() * jax.local_device_count()
        return slice(start, start + jax.local_device_count())

    def _replicate(self, state, local_keys):
        n = jax.local_device_count()

        def put(x):
            # Every device's slice of a broadcast view is `x` itself: one transfer per device, no n-fold host copy.
            x = np.asarray(x)
            return jax.device_put(np.broadcast_to(x, (n,) + x.shape), self._placement)

        placed = jax.tree_util.tree_map(put, state.replace(dropout_rng=None))
        return placed.replace(dropout_rng=jax.device_put(np.asarray(local_keys), self._placement))

    def dropout_key_count(self):
        return jax.device_count()

    def abstract_state(self, shapes):
        """The state `shapes` (`jax.eval_shape` of a TrainState) as this layout places it, without
        values: what sizes a train step (`compile_train_step`) of a model too big to build here."""
        n = len(self.local_devices)
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype, sharding=self._placement),
                                      shapes.replace(dropout_rng=jax.ShapeDtypeStruct((2,), shapes.dropout_rng.dtype)))

    def checkpoint_tree(self, state):
        """The state as a checkpoint stores it: host copies of the (identical) replicas, and the
        dropout keys of every device of the run, one row each."""
        # `tiled` concatenates each process's local keys: one row per device of the whole run.
        keys = multihost_utils.process_allgather(state.dropout_rng, tiled=True)
        # Copies are made now, not by the background writer: the next step donates the device buffers.
        return jax.tree_util.tree_map(_first_replica, state.replace(dropout_rng=None)).replace(dropout_rng=keys)

    def checkpoint_target(self, state):
        """What a checkpoint restores into: the global shapes of `state`; no sharding, so every leaf
        comes back as a host array (`from_checkpoint` replicates it)."""
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                        state.replace(dropout_rng=None))
        return target.replace(dropout_rng=jax.ShapeDtypeStruct((jax.device_count(), 2), state.dropout_rng.dtype))

    def from_checkpoint(self, restored):
        """The restored host state on the devices, each with its own saved dropout key."""
        return self._replicate(restored, np.asarray(restored.dropout_rng)[self._local_rows()])

    def params_to_host(self, params):
        return jax.tree_util.tree_map(_first_replica, params)

    # -- steps ----------------------------------------------------------------------------------------
    def batch_sum(self, tree):
        return jax.lax.psum(tree, AXIS)

    def keep_batch_split(self, rows):
        return contextlib.nullcontext()  # each device computes on its own rows already

    def split_layer_gradients(self):
        return contextlib.nullcontext()  # the state is whole: gradients are summed whole (`batch_sum`)

    def _jit_train_step(self, train_step, state):
        return jax.pmap(train_step, AXIS, donate_argnums=(0,), devices=self.plan and self.local_devices)

    @staticmethod
    def _callable(jitted, compiled):
        # A compiled pmap takes the global shapes on several hosts, where each process holds its own
        # devices' rows: there the pmap itself runs the step (it compiles again, or finds the
        # program in the compilation cache).
        return compiled if jax.process_count() == 1 else jitted

    def _jit_step(self, step):
        return jax.pmap(step, AXIS, devices=self.plan and self.local_devices)

    # -- data -----------------------------------------------------------------------------------------
    def _batch_shape(self, shape):
        return (len(self.local_devices), shape[0] // len(self.local_devices)) + shape[1:]

    def place_batch(self, host_rows):
        """This process's rows `[rows, ...]` -> `[local devices, rows / devices, ...]` on the devices."""
        n = jax.local_device_count()

        def put(x):
            x = np.asarray(x)
            if x.shape[0] % n:
                raise ValueError(f"batch of {x.shape[0]} does not split over {n} devices")
            return jax.device_put(x.reshape((n, -1) + x.shape[1:]), self._placement)

        return jax.tree_util.tree_map(put, host_rows)

    def rows_to_host(self, device_rows):
        """A step's per-row output -> every row of the global batch on the host, in order."""
        x = np.asarray(jax.device_get(device_rows))
        x = x.reshape((-1,) + x.shape[2:])
        if jax.process_count() == 1:
            return x
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class FullySharded(Layout):
    """`jax.jit` over a (data, fsdp) mesh of all devices: parameters, gradients and optimizer state
    split over "fsdp", the batch over all devices, one dropout key for the whole global batch."""

    name = "fsdp"
    writes_shards = True  # every process writes its shards of each checkpoint

    def __init__(self, fsdp_size, plan=None):
        super().__init__(plan)
        self.fsdp_size = fsdp_size
        devices = np.array(plan.devices if plan else jax.devices())
        self.mesh = Mesh(devices.reshape(devices.size // fsdp_size, fsdp_size), MESH_AXES)
        self.batch_shards = devices.size
        self._rows = self._batch_sharding = NamedSharding(self.mesh, PartitionSpec(MESH_AXES))
        self._whole = NamedSharding(self.mesh, PartitionSpec())

    def describe(self):
        return (f"fsdp: jax.jit over a {self.mesh.shape['data']} x {self.fsdp_size} (data x fsdp) mesh of "
                f"{self.mesh.size} devices{f' of {self.plan.describe()}' if self.plan else ''}")

    def sharding_of(self, shape):
        return NamedSharding(self.mesh, leaf_spec(shape, self.fsdp_size))

    def _shardings(self, tree):
        return jax.tree_util.tree_map(lambda x: self.sharding_of(x.shape), tree)

    # -- the state ----------------------------------------------------------------------------------
    def init_params(self, init):
        """Fresh weights `init()` computed straight into their shards: no device ever holds them all."""
        if self.plan:  # shapes only: the state is placed by `create_state`
            return jax.eval_shape(init)
        return jax.jit(init, out_shardings=self._shardings(jax.eval_shape(init)))()

    def place_params(self, host_params):
        """Pretrained weights from host memory, each leaf sent in shards to the devices that hold them."""
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, self.sharding_of(np.shape(x))), host_params)

    def create_state(self, apply_fn, params, tx, seed):
        """The optimizer state made next to its (sharded) parameter, inside one compiled program."""
        if self.plan:
            state = self._abstract_state(apply_fn, params, tx, seed)
            self._log_split(state)
            return state

        def create(params):
            return TrainState.create(apply_fn=apply_fn, params=params, tx=tx, dropout_rng=jax.random.PRNGKey(seed))

        shardings = self._state_shardings(jax.eval_shape(create, params))
        # Donated: the parameters move into the state instead of being held twice.
        state = jax.jit(create, out_shardings=shardings, donate_argnums=0)(params)
        self._log_split(state)
        return state

    def _state_shardings(self, abstract_state):
        shardings = self._shardings(abstract_state.replace(dropout_rng=None))
        return shardings.replace(dropout_rng=self._whole)

    def _log_split(self, state):
        sharded = replicated = 0
        for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state)):
            nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
            if leaf_spec(leaf.shape, self.fsdp_size) == PartitionSpec():
                replicated += nbytes
            else:
                sharded += nbytes // self.fsdp_size
        logger.info("fsdp: parameters and optimizer state take %s per device split %d ways + %s whole on every device",
                    readable(sharded), self.fsdp_size, readable(replicated))

    def dropout_key_count(self):
        return 1

    def abstract_state(self, shapes):
        """The state `shapes` as this layout places it, without values (see `DataParallel.abstract_state`)."""
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding_of(x.shape))  # noqa: E731
        sharded = jax.tree_util.tree_map(place, shapes.replace(dropout_rng=None))
        return sharded.replace(dropout_rng=jax.ShapeDtypeStruct(shapes.dropout_rng.shape, shapes.dropout_rng.dtype,
                                                                sharding=self._whole))

    def checkpoint_tree(self, state):
        """The global arrays as they are (each process writes its shards); the one key as one row."""
        return state.replace(dropout_rng=np.asarray(state.dropout_rng.addressable_data(0))[None])

    def checkpoint_target(self, state):
        """What a checkpoint restores into: every leaf straight into its shards (no host copy of the
        whole state), the key as a host row."""
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        state.replace(dropout_rng=None))
        return target.replace(dropout_rng=jax.ShapeDtypeStruct((1, 2), state.dropout_rng.dtype))

    def from_checkpoint(self, restored):
        return restored.replace(dropout_rng=jax.device_put(np.asarray(restored.dropout_rng)[0], self._whole))

    def params_to_host(self, params):
        """Leaf by leaf, so host memory holds one full copy of the parameters, never a device."""
        if jax.process_count() == 1:
            return jax.tree_util.tree_map(np.asarray, params)
        return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                                      params)

    # -- steps ----------------------------------------------------------------------------------------
    def batch_sum(self, tree):
        return tree  # the step sees the whole global batch: its sums are already global

    @contextlib.contextmanager
    def keep_batch_split(self, rows):
        """While a step is traced, every output of the model's modules whose leading axis is the
        batch (`rows` long) stays split over the devices by rows. Left free, XLA may move the
        activations to meet a weight's split (a whole-batch copy per device) instead of bringing the
        weight to the data: the point of fsdp is the reverse."""

        def keep(x):
            if isinstance(x, jax.Array) and x.ndim >= 3 and x.shape[0] == rows:
                return jax.lax.with_sharding_constraint(x, self._rows)
            return x

        def interceptor(method, args, kwargs, context):
            return jax.tree_util.tree_map(keep, method(*args, **kwargs))

        with nn.intercept_methods(interceptor):
            yield

    @contextlib.contextmanager
    def split_layer_gradients(self):
        """While a train step is differentiated, each layer of the model's stacks (`utils.layers`)
        hands its parameters' gradients on already split over "fsdp", and the backward pass of the
        layers below waits for that split. Left free, the TPU compiler sums every layer's gradients
        whole in one combined all-reduce at the end of the backward pass: each device then holds the
        whole bfloat16 gradients of all layers at once (benchmarks/README.md, the TPU plan)."""
        with nn.intercept_methods(each_layer(self._with_split_gradients)):
            yield

    def _with_split_gradients(self, layer):
        def forward(module, *arrays):
            return nn.vjp(layer, module, *arrays)

        def backward(vjp_fn, output_grads):
            param_grads, *input_grads = vjp_fn(output_grads)
            param_grads = jax.tree_util.tree_map(
                lambda g: jax.lax.with_sharding_constraint(g, self.sharding_of(g.shape)), param_grads)
            # The barrier makes the gradients flowing to the layers below depend on the split ones.
            param_grads, input_grads = jax.lax.optimization_barrier((param_grads, input_grads))
            return (param_grads, *input_grads)

        return nn.custom_vjp(layer, forward, backward)

    @staticmethod
    def _callable(jitted, compiled):
        return compiled

    def _jit_train_step(self, train_step, state):
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
        return jax.jit(train_step, in_shardings=(shardings, self._rows), out_shardings=(shardings, self._whole),
                       donate_argnums=(0,))

    def _jit_step(self, step):
        def split_step(params, batch):
            with self.keep_batch_split(len(jax.tree_util.tree_leaves(batch)[0])):
                return step(params, batch)

        return jax.jit(split_step)

    # -- data -----------------------------------------------------------------------------------------
    def _batch_shape(self, shape):
        return (shape[0] * jax.process_count(),) + shape[1:]

    def place_batch(self, host_rows):
        """This process's rows of the global batch -> one global array split over all devices."""

        def put(x):
            x = np.asarray(x)
            global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
            return jax.make_array_from_process_local_data(self._rows, x, global_shape)

        return jax.tree_util.tree_map(put, host_rows)

    def rows_to_host(self, device_rows):
        if jax.process_count() == 1:
            return np.asarray(jax.device_get(device_rows))
        return np.asarray(multihost_utils.process_allgather(device_rows, tiled=True))


def _first_replica(x):
    """Device 0's copy of a pmap-replicated array, on the host; a host array as it is."""
    if isinstance(x, jax.Array) and not isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
        return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])
    return np.asarray(x)


def _device_keys(key, count):
    """`count` distinct dropout keys from one: all devices of the run, so a process takes its own rows
    and the run's randomness does not depend on how devices are spread over hosts."""
    return np.asarray(jax.random.split(key, count))


def resized_keys(saved_keys, count):
    """Dropout keys for `count` devices from a checkpoint saved with another number of them."""
    return _device_keys(jnp.asarray(saved_keys[0]), count) if count > 1 else np.asarray(saved_keys[:1])
