import ctypes
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from script_runner import ROOT, script_env
from utils.layout import layouts
from utils.layout.layouts import AXIS, DataParallel
from utils.run import perf


def test_compile_count_sees_each_new_program_once():
    double = jax.jit(lambda x: 2 * x)
    three, five = np.ones(3), np.ones(5)
    before = perf.compile_count()
    double(three)
    double(three)
    assert perf.compiled_since(before) == ["jit(<lambda>)"]
    middle = perf.compile_count()
    double(five)  # a new shape is a new program
    assert perf.compiled_since(middle) == ["jit(<lambda>)"]


def test_recorder_tells_which_calls_compiled_and_forgets_donated_inputs():
    dp = DataParallel()
    original = layouts.step_wrapper
    recorder = perf.StepRecorder(keep_inputs=2)
    with recorder.active():
        step = layouts.step_wrapper("add_step", lambda: jax.pmap(lambda state, batch: state + batch.sum(), AXIS,
                                                                 donate_argnums=(0,)), donated=(0,))
    assert layouts.step_wrapper is original
    state = dp.place_batch(np.zeros(jax.local_device_count(), np.float32))  # as the scripts place it
    for rows in (2, 2, 3, 2):
        state = step(state, dp.place_batch(np.ones(jax.local_device_count() * rows, np.float32)))
    recorded = recorder.steps["add_step"]
    assert recorded.calls == 4 and recorded.calls_that_compiled() == [1, 3]
    assert len(recorded.inputs) == 2 and all(args[0] is None for args in recorded.inputs)
    assert recorded.inputs[-1][1].shape == (jax.local_device_count(), 2)
    np.testing.assert_allclose(recorded.outputs, 9.0)  # small integers: exact in float32
    forgetful = perf.RecordedStep(step.function, "add_step", keep_inputs=0)
    forgetful(recorder.steps["add_step"].outputs, dp.place_batch(np.ones(jax.local_device_count() * 2, np.float32)))
    assert forgetful.calls == 1 and forgetful.inputs == []  # keeps no batch alive
    report = perf.step_report(recorder)["add_step"]
    assert (report["calls"], report["calls_that_compiled"]) == (4, [1, 3])
    # One program each time: jax's name for a pmap's ("jit(_fun)" in jax 0.10, "jit(call_wrapped)" before).
    assert [len(programs) for programs in report["compiled"]] == [1, 1]


def test_a_step_compiled_ahead_of_time_counts_its_compile_for_the_first_call():
    """The train step compiles before the loop (its memory is checked first): that is its first
    call's compile, and later calls compile nothing."""
    recorder = perf.StepRecorder()
    double = jax.jit(lambda x: 2 * x)
    with recorder.active():
        step = layouts.step_wrapper("train_step", lambda: double.lower(np.ones(3)).compile())
    for _ in range(3):
        step(np.ones(3))
    assert recorder.steps["train_step"].calls_that_compiled() == [1]


SCRIPT = '''
import sys
import jax
import numpy as np

from utils.layout import layouts as layout

def main():
    double = layout.DataParallel().compile_step("double", lambda x: x * 2)
    for rows in map(int, sys.argv[1:]):
        double(np.ones((jax.local_device_count(), rows)))
'''


def test_module_entry_point_writes_the_report_of_a_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    report = tmp_path / "steps.json"
    result = subprocess.run([sys.executable, "-m", "utils.run.perf", str(report), str(script), "1", "1", "2"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    steps = json.loads(report.read_text())
    assert steps["double"]["calls"] == 3 and steps["double"]["calls_that_compiled"] == [1, 3]


def test_module_entry_point_without_arguments_says_how_to_use_it():
    result = subprocess.run([sys.executable, "-m", "utils.run.perf"], cwd=ROOT, env=script_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().startswith("usage: python -m utils.run.perf")


def test_memory_figures():
    assert 50 * 2**20 < perf.peak_host_memory() < 64 * 2**30  # jax alone takes well over 50 MiB
    assert perf.peak_device_memory() is None  # CPU devices keep no statistics
    assert perf.memory_report().startswith("peak memory: host ") and "device" not in perf.memory_report()


def test_memory_report_says_what_the_runtime_holds_and_what_a_tpu_leaves_out(monkeypatch):
    """On a TPU VM the runtime holds ~13 GiB of host memory from the start, and the device's own peak
    counts buffers, not a compiled step's working memory: the line says both, so neither reads as the run's."""
    monkeypatch.setattr(perf, "_host_memory_at_devices", None)
    allocated = np.ones(64 * 2**20 // 8)  # 64 MiB the process holds from "the start" on
    perf.note_devices_opened()
    held = perf._host_memory_at_devices
    assert held >= allocated.nbytes and abs(held - perf.current_host_memory()) < 64 * 2**20
    line = perf.memory_report()
    assert f"({held / 2**30:.2f} GiB of it held from the start: runtime and libraries)" in line

    class TPU:
        platform = "tpu"

    monkeypatch.setattr(perf, "peak_device_memory", lambda: 1.93 * 2**30)
    monkeypatch.setattr(perf.jax, "local_devices", lambda: [TPU()])
    monkeypatch.setattr(perf.jax, "local_device_count", lambda: 1)
    assert perf.memory_report(train_step_bytes=8.99 * 2**30).endswith(
        ", device 1.93 GiB (largest of 1) in buffers, which leaves out a program's working memory: the train "
        "step's plan is 8.99 GiB")
    TPU.platform = "gpu"  # a GPU's allocator counts a program's temporaries in its peak
    assert perf.memory_report(train_step_bytes=8.99 * 2**30).endswith(", device 1.93 GiB (largest of 1)")


def test_seconds_since_start_counts_from_the_first_import_of_utils_not_the_launcher():
    """A launcher that `exec`s Python after 3 s of its own work: the process (as Linux counts it)
    started before those 3 s, the script after them. What the script does after its first line
    (a 1 s sleep, the jax import) counts; the launcher's 3 s do not."""
    code = ("import time; first_line = time.monotonic(); import utils; time.sleep(1); from utils.run import perf; "
            "print(perf.seconds_since_start(), time.monotonic() - first_line)")
    result = subprocess.run(["sh", "-c", f'sleep 3; exec "{sys.executable}" -c "{code}"'], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    since_start, since_first_line = map(float, result.stdout.split())
    # The script's own clock is the reference; 0.5 s is room for importing the 10-line package
    # (milliseconds) on a loaded machine, far below the launcher's 3 s.
    assert since_first_line >= 1.0 and abs(since_start - since_first_line) < 0.5


def test_freed_host_memory_goes_back_to_the_system():
    """Memory freed in the middle of glibc's heap (as a compile's working memory is) stays resident until
    `release_freed_host_memory` hands it back."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc: nothing to release")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(3200)]  # 200 MiB of blocks below glibc's mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:  # the last stays: the heap cannot shrink from its top
        libc.free(block)
    before = perf.current_host_memory()
    perf.release_freed_host_memory().join()
    released = before - perf.current_host_memory()
    libc.free(blocks[-1])
    assert released > 150 << 20, f"{released / 2**20:.0f} MiB released"
