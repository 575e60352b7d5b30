"""Run a flaxtune script and interrupt it at an exact point, as a preemption or a crash would.

    python tests/interrupted_run.py sigterm-after-step STEP SCRIPT ARGS...
    python tests/interrupted_run.py sigkill-during-save STEP SCRIPT ARGS...

sigterm-after-step: the process sends itself SIGTERM once training step STEP has run; the script's
own handler then deals with it, exactly as with a SIGTERM from outside arriving during that step.
sigkill-during-save: SIGKILL as soon as the checkpoint of STEP is being written (orbax has created
its `*.orbax-checkpoint-tmp*` directory and writes the files in the background). Exits 3 instead
when that directory is not there, so a test cannot pass without really killing a save.
"""

import glob
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    mode, step, script, *args = sys.argv[1:]
    step = int(step)
    sys.path.insert(0, ROOT)
    from utils.checkpoints import store
    from utils.run import loop

    if mode == "sigterm-after-step":
        after_step = loop.TrainLoop.after_step

        def after_step_then_sigterm(self, current, sums):
            after_step(self, current, sums)
            if current == step:
                os.kill(os.getpid(), signal.SIGTERM)

        loop.TrainLoop.after_step = after_step_then_sigterm
    elif mode == "sigkill-during-save":
        save = store.Checkpointer.save

        def save_then_sigkill(self, current, *rest, **kwargs):
            saved = save(self, current, *rest, **kwargs)
            if current == step:
                if not glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
            return saved

        store.Checkpointer.save = save_then_sigkill
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
