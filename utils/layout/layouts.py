"""Where the train state lives and how a step runs: the two layouts, `--sharding dp|fsdp`.

- `DataParallel` ("dp", the default): `jax.pmap` over this process's devices. Every device holds
  the whole state; a batch is `[local devices, rows per device, ...]`; the steps sum loss sums,
  token counts and gradients over devices with an explicit `psum`.
- `FullySharded` ("fsdp"): `jax.jit` over a `Mesh` of all devices of all processes, shaped
  (devices / fsdp_size) x fsdp_size with axes ("data", "fsdp"). Each parameter (and the optimizer
  state that follows it) is split along one dimension over the "fsdp" axis (`leaf_spec`), so a
  device holds 1/fsdp_size of the state; the batch is one global array split over all devices,
  and sums over it are global sums without any collective in the step's code.

The scripts define each step once, for both: `layout.batch_sum` and `layout.all_rows` (a loss over
the pairs of the global batch's rows, such as a contrastive one) are the collectives they name, and
`utils.layout.gradients.token_weighted_grads` asks the layout how to cut micro-batches. Everything else
that differs lives here: making and placing the state (fresh weights initialised straight into
their sharding or, on one host, on a background thread while the train step compiles: `Pending`;
pretrained ones placed leaf by leaf from host memory), compiling the steps (the
train step ahead of time, so its per-device memory (`utils.layout.memory`) is known and checked before
any step runs; on the CPU backend, at most `CPU_STEPS_IN_FLIGHT` steps dispatched ahead),
placing batches, gathering outputs, the dropout key of a step (`dropout_key`: no state, a function
of the seed and the step, and under "dp" of the device), the state as checkpoints store it (global
arrays, so a run can move between layouts and device counts), and the parameters on the host for
the Hugging Face export. Given a TPU slice (`utils.layout.tpu_plan`, `--compile_only`), a layout holds
shapes placed on its compile-only devices instead of values, and compiles the train step without
running it: the TPU compiler's memory plan.
"""

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
from functools import partial

import jax
import numpy as np
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from utils.base.errors import UsageError
from utils.kernels.hooks import each_layer
from utils.layout import devices, tpu_plan
from utils.layout.memory import (check_fits, compile_or_refuse, memory_line, memory_stats, plan_memory, readable,
                                 train_levers)

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


def make_layout(sharding, fsdp_size=None, compile_only=None):
    """The layout `--sharding` names (`--fsdp_size`: None for all devices), for this run's devices
    (after `utils.run.setup.set_up`); with `--compile_only TPU`, over that slice's compile-only devices
    (`utils.layout.tpu_plan`)."""
    plan = tpu_plan.load(compile_only) if compile_only else None
    if sharding == "dp":
        layout = DataParallel(plan)
    else:
        fsdp_size = fsdp_size or jax.device_count()
        if jax.device_count() % fsdp_size:
            raise UsageError(f"--fsdp_size {fsdp_size} does not divide the {jax.device_count()} devices: use a "
                             "divisor (the mesh is devices / fsdp_size x fsdp_size)")
        layout = FullySharded(fsdp_size, plan)
    logger.info("layout: %s", layout.describe())
    return layout


def leaf_spec(shape, fsdp_size):
    """How `utils.layout.layouts.FullySharded` splits one array: along its largest dimension that `fsdp_size`
    divides; whole (replicated) when it is small or no dimension divides (GPT-2's 50257-token
    vocabulary is split along the width instead)."""
    if fsdp_size == 1 or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp_size == 0:
            return PartitionSpec(*(MESH_AXES[1] if d == dim else None for d in range(len(shape))))
    return PartitionSpec()


def _root_key(seed, generator):
    """The key of `seed` that a run's dropout keys fold their step into: threefry's raw key, or a typed rbg key."""
    return jax.random.PRNGKey(seed) if generator == "threefry" else jax.random.key(seed, impl="rbg")


def step_wrapper(name, build, donated=()):
    """The callable a layout hands out for a step: `build()` itself (`donated`: the positions of the
    arguments the step consumes). `utils.run.perf.StepRecorder` puts its own wrapper here to count each
    step's calls and compilations."""
    return build()


class Pending:
    """Values a background thread makes while the caller goes on: their shapes now (`shapes`:
    `jax.ShapeDtypeStruct`s; a state's placed as its layout places it), the values at `finished`.
    Fresh weights and the state made of them are made this way while the train step is traced and
    compiled, which needs their shapes only: on a v5e host their program took 6-7 s to compile, or to
    read back from the compilation cache, on the host's CPU, about as long as the train step's trace.
    One thread makes every `Pending`, in order, so a state starts after the weights it is made of."""

    _thread = None

    def __init__(self, shapes, make):
        if Pending._thread is None:
            Pending._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="background-state")
        self.shapes = shapes
        self._future = Pending._thread.submit(make)


def shapes_of(value):
    """A `Pending`'s shapes; anything else as it is."""
    return value.shapes if isinstance(value, Pending) else value


def finished(value):
    """A `Pending`'s values, once made (its thread's exception, if it failed); anything else as it is."""
    if not isinstance(value, Pending):
        return value
    if value._future is None:
        raise RuntimeError("this Pending's values were handed over (`taken`): use what was made of them")
    return value._future.result()


def taken(value):
    """`finished(value)`, and a `Pending` lets go of its values: then what is made of them is all that keeps
    them alive. A script's variable holding fresh weights' `Pending` kept their host copy for the whole
    run: 1.7 GiB of host memory for the Llama row's 455M parameters."""
    values = finished(value)
    if isinstance(value, Pending):
        value._future = None
    return values


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
    mesh = None  # the mesh a jitted step splits the batch over (fsdp's); under pmap a step sees one device's rows
    train_step_memory = None  # per-device bytes of the compiled train step (`memory_stats`), once compiled
    train_step_refused = None  # planning for a TPU: why its compiler would not compile the train step

    def __init__(self, plan=None):
        # A `utils.layout.tpu_plan.Topology`: the layout places shapes on its compile-only devices, and
        # compiles the train step without ever running it.
        self.plan = plan
        self.planned_steps = {}  # name -> jitted step without state, planned by `utils.run.spine.report_plan`
        self.local_devices = plan.devices if plan else jax.local_devices()
        self.platform = self.local_devices[0].platform  # "tpu" when planning for a slice
        on_cpu = self.platform == "cpu"
        # One limit for all steps: XLA's queue of executions is per device, whichever program they run.
        self._in_flight = InFlightLimit(CPU_STEPS_IN_FLIGHT if on_cpu else None)

    def prefetch(self, batches):
        """Place host batches on the devices `PREFETCH` steps ahead, so transfers overlap the running step."""
        queue = collections.deque(self.place_batch(batch) for batch in itertools.islice(batches, PREFETCH))
        batches = iter(batches)
        while queue:
            yield queue.popleft()
            queue.extend(self.place_batch(batch) for batch in itertools.islice(batches, 1))

    def compile_train_step(self, train_step, state, example_batch, gradient_accumulation_steps, checkpointing=False,
                           settings=None):
        """`train_step(state, batch) -> (state, sums)` compiled ahead of time for `state` and batches
        like `example_batch` (host rows of this process); its per-device memory is logged, kept in
        `train_step_memory`, and checked against the device's limit before any step runs. Planning
        for a TPU (`plan`), nothing is checked and nothing can run: None is returned.
        With `settings` (numbers: numpy leaves), `train_step(state, batch, settings)` gets them as an
        argument, placed on every device once, not as constants of its program: the compilation
        cache then serves the program to runs with other numbers. The step handed out takes
        (state, batch)."""
        settings = () if settings is None else (self.replicated(settings),)
        if self.plan:
            batch = self.abstract_batch(example_batch)
            self.train_step_memory, self.train_step_refused = plan_memory(
                self._jit_train_step(train_step, state, bool(settings)).lower(state, batch, *settings))
            logger.info("train step (%s) on %s: %s", self.name, self.plan.describe(),
                        self.train_step_refused or memory_line(self.train_step_memory))
            return None

        def build():
            jitted = self._jit_train_step(train_step, state, bool(settings))
            compiled, refused = compile_or_refuse(jitted.lower(state, self.place_batch(example_batch), *settings))
            if refused:
                raise UsageError(f"the train step does not fit a device (the compiler: {refused}): "
                                 f"{train_levers(gradient_accumulation_steps, self.name, checkpointing)}")
            self.train_step_memory = memory_stats(compiled)
            run = self._callable(jitted, compiled)
            # Wait on the sums: the state goes into the next step, which deletes it.
            return self._in_flight.wrap(lambda state, batch: run(state, batch, *settings),
                                        done=lambda outputs: outputs[1])

        step = step_wrapper("train_step", build, donated=(0,))
        logger.info("train step (%s): %s", self.name, memory_line(self.train_step_memory))
        check_fits(self.train_step_memory, gradient_accumulation_steps, self.name, checkpointing)
        return step

    def compile_step(self, name, step):
        """A step without state: `step(params, batch)` (eval, predict, generate), compiled at its first
        call. Planning for a TPU (`plan`), it is kept in `planned_steps` for `utils.run.spine` to plan
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

    def _abstract_state(self, apply_fn, params, tx, create):
        """What `create_state` would make of the parameter shapes `params`, placed (`abstract_state`)."""
        return self.abstract_state(jax.eval_shape(partial(create, apply_fn=apply_fn, tx=tx), params=params))

    def init_params_in_background(self, init, *args):
        """`init_params`, its values perhaps made on a background thread (`Pending`); here, at once."""
        return self.init_params(init, *args)

    @staticmethod
    def seed_key(seed, generator="threefry"):
        """`seed`'s key for `dropout_key` (its data, a numpy array, made on the host's CPU): what the train step
        takes in place of --seed, so its program holds no seed."""
        with jax.default_device(devices.host_cpu()):
            return np.asarray(jax.random.key_data(_root_key(seed, generator)))

    def dropout_key(self, seed, step, generator="threefry"):
        """The dropout key of the train step that `state.step` is `step` in, traced inside that step: a
        function of (seed, step) alone, so a resumed run draws the masks the uninterrupted one would
        have; no state carries it. `seed`: an int, or its `seed_key`. `generator` (`dropout_generator`)
        draws its bits: "threefry" gives the same masks on any device count, "rbg" the same for one
        layout and device count ("chip" draws its keys with rbg, its masks in `utils.kernels.chip_dropout`'s kernel)."""
        if isinstance(seed, (int, np.integer)):
            key = _root_key(seed, generator)
        else:
            key = seed if generator == "threefry" else jax.random.wrap_key_data(seed, impl="rbg")
        return jax.random.fold_in(key, step)

    def dropout_generator(self, choice, attention_kernels=False):
        """`--dropout_rng`'s generator of dropout bits. "auto" on TPUs: chip under dp where the attention runs
        through the kernels (`attention_kernels`: their dropout drawn inside; the other masks drawn inside a
        Pallas kernel too, never written out), rbg otherwise: under fsdp, where `utils.kernels.chip_dropout`'s kernel
        would need shard_map's per-device view, and where the stock attention drops its probabilities, which XLA fuses
        with rbg's bits but the chip's kernel takes apart (t5-small on a v5e chip: 512,317 tokens/s with rbg,
        487,555 with chip; RoBERTa-base through the kernels 161,117 with chip, 161,648 with rbg). rbg, not
        threefry, on TPUs: threefry's bits cost more than the attention they mask (a GPT-2 layer at 1024 tokens
        on a v5e chip: 13.1 ms forward and backward with threefry's masks, 9.3 with rbg's, 5.9 without
        dropout); threefry elsewhere. A `UsageError` for chip under fsdp."""
        if choice == "auto":
            if self.platform != "tpu":
                return "threefry"
            return "chip" if self.name == "dp" and attention_kernels else "rbg"
        if choice == "chip" and self.name != "dp":
            raise UsageError("--dropout_rng chip runs under --sharding dp: use --dropout_rng auto or rbg with fsdp")
        return choice


class DataParallel(Layout):
    """`jax.pmap` over this process's devices; the state replicated, each device its own dropout key."""

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
    def init_params(self, init, *args):
        """Fresh weights `init(*args)` from one compiled program on the host's CPU, where `create_state`
        copies them to every device from. An accelerator gains nothing on a program run once, and a
        TPU compiles it slowly: 27 s for GPT-2 small on a v5e host, against 6 s on its CPU. `args` (the
        seed's key) are the program's arguments, not its constants: the compilation cache serves it to a
        run with another seed."""
        if self.plan:  # shapes only: the state is placed by `create_state`
            return jax.eval_shape(init, *args)
        return self._on_host(init)(*args)

    def init_params_in_background(self, init, *args):
        """`init_params` as a `Pending`: traced now, so it sees the model as it is now (the train step's
        set-up then changes the model's calls), compiled and run on the background thread. Not on several
        hosts: their pmap is compiled from arrays, whose global shapes the `Pending`'s local ones are not."""
        if self.plan or jax.process_count() > 1:
            return self.init_params(init, *args)
        lowered = self._on_host(init).lower(*args)
        shapes = jax.tree_util.tree_map(lambda out: jax.ShapeDtypeStruct(out.shape, out.dtype), lowered.out_info)
        return Pending(shapes, lambda: lowered.compile()(*args))

    @staticmethod
    def _on_host(init):
        return jax.jit(init, out_shardings=SingleDeviceSharding(devices.host_cpu()))

    def place_params(self, host_params):
        return host_params

    def create_state(self, apply_fn, params, tx, create=TrainState.create):
        """The state on every device (`create`: how a state is made of them, e.g.
        `utils.models.lora.FrozenBaseState`'s); a `Pending` of it for `Pending` parameters."""
        if self.plan:
            return self._abstract_state(apply_fn, params, tx, create)

        def make(params):
            with jax.default_device(devices.host_cpu()):  # the optimizer state made beside the weights, then copied
                return self._replicate(create(apply_fn=apply_fn, params=params, tx=tx))

        if isinstance(params, Pending):
            return Pending(self._abstract_state(apply_fn, params.shapes, tx, create), lambda: make(taken(params)))
        return make(params)

    def _replicate(self, state):
        n = jax.local_device_count()

        def put(x):
            # Every device's slice of a broadcast view is `x` itself: one transfer per device, no n-fold host copy.
            x = np.asarray(x)
            return jax.device_put(np.broadcast_to(x, (n,) + x.shape), self._placement)

        return jax.tree_util.tree_map(put, state)

    def abstract_state(self, shapes):
        """The state `shapes` (`jax.eval_shape` of a TrainState) as this layout places it, without
        values: what sizes a train step (`compile_train_step`) of a model too big to build here."""
        n = len(self.local_devices)
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype, sharding=self._placement),
                                      shapes)

    def dropout_key(self, seed, step, generator="threefry"):
        """(seed, step)'s key folded with the device's index among all devices of the run (the pmap
        axis spans every process's devices): each device masks its rows with its own key."""
        return jax.random.fold_in(super().dropout_key(seed, step, generator), jax.lax.axis_index(AXIS))

    def checkpoint_tree(self, state):
        """The state as a checkpoint stores it: host copies of the (identical) replicas."""
        # Copies are made now, not by the background writer: the next step donates the device buffers.
        return jax.tree_util.tree_map(_first_replica, state)

    def checkpoint_target(self, state):
        """What a checkpoint restores into: the global shapes of `state`; no sharding, so every leaf
        comes back as a host array (`from_checkpoint` replicates it)."""
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state)

    def from_checkpoint(self, restored):
        """The restored host state on the devices."""
        return self._replicate(restored)

    def params_to_host(self, params):
        return jax.tree_util.tree_map(_first_replica, params)

    # -- steps ----------------------------------------------------------------------------------------
    def batch_sum(self, tree):
        # On one device in all the sum is the tree: no all-reduce is left for the TPU compiler to keep.
        devices = len(self.plan.devices) if self.plan else jax.device_count()
        return tree if devices == 1 else jax.lax.psum(tree, AXIS)

    def all_rows(self, x):
        """(every device's rows of `x` in global batch order, the index of this device's first row
        among them); its gradient flows back to the device each row came from."""
        return jax.lax.all_gather(x, AXIS, tiled=True), jax.lax.axis_index(AXIS) * x.shape[0]

    def keep_batch_split(self, rows):
        return contextlib.nullcontext()  # each device computes on its own rows already

    def split_layer_gradients(self):
        return contextlib.nullcontext()  # the state is whole: gradients are summed whole (`batch_sum`)

    def _jit_train_step(self, train_step, state, takes_settings):
        return jax.pmap(train_step, AXIS, donate_argnums=(0,), devices=self.plan and self.local_devices)

    def replicated(self, values):
        """`values` (numpy leaves) on every device, as the state is (`abstract_state`'s shapes when planning)."""
        return self.abstract_state(values) if self.plan else self._replicate(values)

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
    split over "fsdp", the batch over all devices, one dropout key for the whole global batch
    (`Layout.dropout_key`)."""

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
    def init_params(self, init, *args):
        """Fresh weights `init(*args)` computed straight into their shards: no device ever holds them all."""
        if self.plan:  # shapes only: the state is placed by `create_state`
            return jax.eval_shape(init, *args)
        return self._sharded(init, jax.eval_shape(init, *args))(*args)

    def init_params_in_background(self, init, *args):
        """`init_params` as a `Pending` (as `DataParallel.init_params_in_background`): traced now, compiled and
        run into its shards on the background thread while the train step compiles. The TPU compiles such a
        program slowly: 26 s for GPT-2 small's on a v5e host, which under fsdp came before the train step's."""
        if self.plan or jax.process_count() > 1:
            return self.init_params(init, *args)
        shapes = jax.eval_shape(init, *args)
        lowered = self._sharded(init, shapes).lower(*args)
        return Pending(self.abstract_state(shapes), lambda: lowered.compile()(*args))

    def _sharded(self, init, shapes):
        """`init` compiled to write its outputs (of `shapes`) straight into their shards."""
        return jax.jit(init, out_shardings=self._shardings(shapes))

    def place_params(self, host_params):
        """Pretrained weights from host memory, each leaf sent in shards to the devices that hold them."""
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, self.sharding_of(np.shape(x))), host_params)

    def create_state(self, apply_fn, params, tx, create=TrainState.create):
        """The optimizer state made next to its (sharded) parameter, inside one compiled program; a `Pending`
        of it for `Pending` parameters."""
        shapes = self._abstract_state(apply_fn, shapes_of(params), tx, create)
        self._log_split(shapes)
        if self.plan:
            return shapes

        def create_placed(params):
            return create(apply_fn=apply_fn, params=params, tx=tx)

        def make(params):
            # Donated: the parameters move into the state instead of being held twice.
            return jax.jit(create_placed, out_shardings=self._shardings(shapes), donate_argnums=0)(params)

        if isinstance(params, Pending):
            return Pending(shapes, lambda: make(taken(params)))
        return make(params)

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

    def abstract_state(self, shapes):
        """The state `shapes` as this layout places it, without values (see `DataParallel.abstract_state`)."""
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding_of(x.shape))  # noqa: E731
        return jax.tree_util.tree_map(place, shapes)

    def checkpoint_tree(self, state):
        """The global arrays as they are (each process writes its shards)."""
        return state

    def checkpoint_target(self, state):
        """What a checkpoint restores into: every leaf straight into its shards (no host copy of the
        whole state)."""
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

    def from_checkpoint(self, restored):
        return restored

    def params_to_host(self, params):
        """Leaf by leaf, so host memory holds one full copy of the parameters, never a device."""
        if jax.process_count() == 1:
            return jax.tree_util.tree_map(np.asarray, params)
        return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                                      params)

    # -- steps ----------------------------------------------------------------------------------------
    def batch_sum(self, tree):
        return tree  # the step sees the whole global batch: its sums are already global

    def all_rows(self, x):
        return x, 0  # the step sees every row of the global batch already

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
        """While a train step is differentiated, each layer of the model's stacks (`utils.kernels.hooks`)
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

    def _jit_train_step(self, train_step, state, takes_settings):
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
        return jax.jit(train_step, in_shardings=(shardings, self._rows) + (self._whole,) * takes_settings,
                       out_shardings=(shardings, self._whole), donate_argnums=(0,))

    def replicated(self, values):
        """`values` (numpy leaves) whole on every device (their shapes so placed when planning)."""
        def place(x):
            x = np.asarray(x)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._whole) if self.plan else jax.device_put(
                x, self._whole)

        return jax.tree_util.tree_map(place, values)

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

