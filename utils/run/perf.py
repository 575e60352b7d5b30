"""Performance instruments: which programs JAX compiles and when, what each pmap'd step costs, peak memory.

The scripts log with `seconds_since_start` and `memory_report`. `StepRecorder` is for tests, benchmarks
and anyone chasing a slow run: it watches every step a script's layout builds, without changing the script:

    python -m utils.run.perf steps.json run_clm_flax.py config.json   # which steps compiled on which call
"""

import contextlib
import ctypes
import json
import os
import resource
import runpy
import sys
import threading
import time

import jax

import utils
from utils.base.errors import run_main
from utils.layout import layouts

# Emitted once per program JAX lowers (a trace-cache miss), whether or not the persistent
# compilation cache then spares the backend compile: one event per "compilation" in the sense
# that matters for a training loop.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_compiled = []  # names of the programs lowered so far in this process
_lock = threading.Lock()
_listening = False


def _on_event(event, duration, **kwargs):
    if event == _LOWERING_EVENT:
        with _lock:
            _compiled.append(kwargs.get("fun_name", "?"))


def compile_count():
    """Programs lowered so far in this process (counting starts at the first call of this function)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listening = True
    return len(_compiled)


def compiled_since(count):
    """Names of the programs lowered since `compile_count()` returned `count`."""
    with _lock:
        return list(_compiled[count:])


class RecordedStep:
    """A step that remembers its calls: the programs lowered during each (those lowered while it was
    built, ahead of time, count for its first call), its last inputs (donated arguments left out:
    the call deletes them) and its last outputs."""

    def __init__(self, function, name, donated=(), keep_inputs=4, compiled_when_built=()):
        self.function, self.name, self.donated, self.keep_inputs = function, name, donated, keep_inputs
        self.compiled_when_built = list(compiled_when_built)
        self.compiles = []  # per call: names of the programs lowered during that call
        self.inputs = []
        self.outputs = None

    def __call__(self, *args):
        before = compile_count()
        self.outputs = self.function(*args)
        early = self.compiled_when_built if not self.compiles else []
        self.compiles.append(early + compiled_since(before))
        if self.keep_inputs:
            kept = tuple(None if i in self.donated else arg for i, arg in enumerate(args))
            self.inputs = (self.inputs + [kept])[-self.keep_inputs:]
        return self.outputs

    @property
    def calls(self):
        return len(self.compiles)

    def calls_that_compiled(self):
        """1-based numbers of the calls that lowered a program."""
        return [number for number, names in enumerate(self.compiles, start=1) if names]


class StepRecorder:
    """While `active()`, every step a layout hands out (`utils.layout.layouts.step_wrapper`) is a
    `RecordedStep`, kept in `steps` by name."""

    def __init__(self, keep_inputs=4):
        self.keep_inputs = keep_inputs
        self.steps = {}

    @contextlib.contextmanager
    def active(self):
        original = layouts.step_wrapper

        def recording(name, build, donated=()):
            before = compile_count()
            function = build()
            self.steps[name] = RecordedStep(function, name, donated, self.keep_inputs, compiled_since(before))
            return self.steps[name]

        compile_count()
        layouts.step_wrapper = recording
        try:
            yield self
        finally:
            layouts.step_wrapper = original


def seconds_since_start():
    """Seconds since this process first imported `utils` (the scripts do that first of all).

    Not from the process's start as Linux records it (/proc/self/stat): that is the fork, so a launcher
    that `exec`s Python after its own work (`sh -c "setup; exec python ..."`) would count that work
    too, and Linux keeps no time of the exec. What is left out is the interpreter's own start before
    the script's first line, a few tens of milliseconds.
    """
    return time.monotonic() - utils.IMPORTED_AT


def peak_host_memory():
    """Peak resident memory of this process in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_device_memory():
    """Largest peak bytes in use over the local devices, or None where the backend does not say (CPU)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # backends without memory statistics raise rather than return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def current_host_memory():
    """Resident memory of this process now, in bytes (Linux; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_host_memory()


def release_freed_host_memory():
    """Hand the host memory the process has freed back to the system, on a thread of its own (returned, to
    wait for; None where the C library cannot). glibc keeps freed memory in its heaps: after the Llama row's
    train step compiled on a v5e host, 6.6 GiB that nothing used any more stayed resident, and the checkpoint
    and export at the end came on top of it. Returning it took ~3 s, so it runs beside the first steps."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent from macOS and musl
    if trim is None:
        return None
    thread = threading.Thread(target=trim, args=(0,), name="release-freed-memory", daemon=True)
    thread.start()
    return thread


_host_memory_at_devices = None


def note_devices_opened():
    """Call once the devices are open: what the process holds then is the accelerator runtime's and the
    libraries' (a TPU runtime maps over 13 GiB of host memory on a v5e), not the run's."""
    global _host_memory_at_devices
    _host_memory_at_devices = current_host_memory()


def memory_report(train_step_bytes=None):
    """One line for the log: peak host memory (and what of it was held once the devices opened) and,
    where known, peak device memory. A TPU runtime's peak counts buffers (parameters, optimizer state,
    batches) but not a compiled program's working memory, so the train step's planned bytes
    (`train_step_bytes`) stand beside it there."""
    line = f"peak memory: host {peak_host_memory() / 2**30:.2f} GiB"
    if _host_memory_at_devices is not None:
        line += f" ({_host_memory_at_devices / 2**30:.2f} GiB of it held from the start: runtime and libraries)"
    device = peak_device_memory()
    if device is not None:
        line += f", device {device / 2**30:.2f} GiB (largest of {jax.local_device_count()})"
        if train_step_bytes and jax.local_devices()[0].platform == "tpu":
            line += (f" in buffers, which leaves out a program's working memory: the train step's plan is "
                     f"{train_step_bytes / 2**30:.2f} GiB")
    return line


def run_script(path, argv, recorder):
    """Run the script at `path` with `argv` in this process, `recorder` active; returns its exit code."""
    main = runpy.run_path(path, run_name="flaxtune_script")["main"]
    sys.argv = [path, *map(str, argv)]
    with recorder.active():
        return run_main(main)


def step_report(recorder):
    """{step name: calls, the calls that compiled, and what they compiled} as plain JSON data."""
    return {name: {"calls": step.calls, "calls_that_compiled": step.calls_that_compiled(),
                   "compiled": [names for names in step.compiles if names]}
            for name, step in recorder.steps.items()}


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m utils.run.perf REPORT.json SCRIPT [ARGS...]")
    report_path, script, *script_args = sys.argv[1:]
    recorder = StepRecorder(keep_inputs=0)
    code = run_script(script, script_args, recorder)
    with open(report_path, "w", encoding="utf-8") as f:
        json.dump(step_report(recorder), f, indent=2)
    sys.exit(code)
