"""Script processes for the tests, started without paying for their imports every time.

Importing jax, flax, transformers and datasets costs a new Python process about 3 CPU seconds, more
than many of the tests' tiny runs take to train; the suite starts a few hundred of them. So a server
process imports those libraries once, and each script process is forked from it: a fresh process
(its own pid, environment, working directory, stdin/stdout/stderr, exit status and signals) that
runs the script as `python script.py ...` or `python -m module ...` would, as `__main__`, exiting
the way the interpreter does. The project's own modules are never imported before the fork.

What the libraries read from the environment when they are imported (JAX_*, HF_*, TRANSFORMERS_*,
PYTHON*, ...) is fixed in the server, so a launch whose environment differs there from the server's
starts an ordinary subprocess instead; XLA_FLAGS is read only when the devices are first used, so
it may differ. FLAXTUNE_TESTS_PRELOAD=0 turns the server off (every launch an ordinary subprocess).
"""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# And what the scripts import after them that costs a run most (`python -X importtime`: 0.4 to 1.2 s a
# run): every run's checkpoints, logs, kernels and model base class; ROUGE (nltk, scikit-learn and scipy
# come with it) for the generating scripts; scipy.signal for the audio ones. None of them starts a thread
# or opens a JAX backend when imported, so forking after them is safe.
PRELOADED = ("jax", "jax.numpy", "flax", "flax.serialization", "optax", "datasets", "transformers",
             "transformers.modeling_flax_utils", "transformers.generation.flax_logits_process", "orbax.checkpoint",
             "tensorboardX", "jax.experimental.pallas", "jax.experimental.pallas.tpu", "rouge_score.rouge_scorer",
             "scipy.signal", "PIL.Image")
PRELOADED_NAMES = ("FlaxAutoModelForCausalLM", "FlaxAutoModelForMaskedLM", "FlaxAutoModelForSeq2SeqLM",
                   "FlaxAutoModelForSequenceClassification", "FlaxAutoModelForTokenClassification")
# Environment variables read when those libraries are imported (or by Python at start-up).
IMPORT_TIME_PREFIXES = ("JAX_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "PYTHON", "TF_",
                        "USE_", "CUDA_", "OMP_", "OPENBLAS_", "MKL_", "TQDM_", "NLTK_", "SCIPY_")


def _import_time_env(env):
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME_PREFIXES)}


# ----------------------------------------------------------------------------------------------
# The server: imports the libraries, then forks one child per request
# ----------------------------------------------------------------------------------------------
def _serve(socket_path):
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for name in PRELOADED_NAMES:
        getattr(transformers, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    children = {}  # pid -> the connection that waits for its exit status
    session = os.getppid()
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            connection, _ = listener.accept()
            request, fds = _receive(connection)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                connection.close()
                _run_child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # nobody waits for it any more
                connection.close()
        if os.getppid() != session:  # the test session is gone
            return


def _receive(connection):
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not message.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            raise ConnectionError("the request was cut short")
        message += more
    return json.loads(message), fds


def _run_child(request, fds):
    """Become the script process: its stdio, directory, environment and argv; run it as __main__."""
    import runpy

    stdin = os.open(os.devnull, os.O_RDONLY)
    for target, fd in zip((0, 1, 2), (stdin, *fds)):
        os.dup2(fd, target)
    for fd in {stdin, *fds}:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: B036  as the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    # What the interpreter does on exit: wait for non-daemon threads, run the exit handlers, flush.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


# ----------------------------------------------------------------------------------------------
# The client side: a Popen-like handle on a forked script process
# ----------------------------------------------------------------------------------------------
class ForkedProcess:
    """The subprocess.Popen calls the tests use (pid, poll, wait, send_signal, kill, returncode)."""

    def __init__(self, connection):
        self._connection = connection
        self._reader = connection.makefile("rb")
        self.pid = json.loads(self._reader.readline())["pid"]
        self.returncode = None

    def poll(self):
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_returncode()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            self._read_returncode()
        return self.returncode

    def _read_returncode(self):
        line = self._reader.readline()
        if not line:
            raise RuntimeError(f"the script launcher lost process {self.pid}")
        self.returncode = json.loads(line)["returncode"]
        self._reader.close()
        self._connection.close()

    def send_signal(self, signum):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


class _Server:
    def __init__(self, env):
        self.directory = tempfile.mkdtemp(prefix="flaxtune-launcher-")
        self.socket_path = os.path.join(self.directory, "socket")
        self.import_time_env = _import_time_env(env)
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.socket_path], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the script launcher did not start")
        atexit.register(self.close)

    def launch(self, args, cwd, env, stdout, stderr):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.socket_path)
        request = json.dumps({"args": list(args), "cwd": os.fspath(cwd), "env": env}).encode() + b"\n"
        socket.send_fds(connection, [request], [stdout, stderr])
        return ForkedProcess(connection)

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        try:
            os.unlink(self.socket_path)
            os.rmdir(self.directory)
        except OSError:
            pass


_server = None
_server_lock = threading.Lock()


def _server_for(env):
    """The server when one can start this launch (started on first use), else None."""
    global _server
    if os.environ.get("FLAXTUNE_TESTS_PRELOAD", "1") == "0":
        return None
    with _server_lock:
        if _server is None:
            from script_runner import script_env  # the environment nearly every launch has

            _server = _Server(script_env())
    return _server if _import_time_env(env) == _server.import_time_env else None


def _forkable_args(command):
    """The script's argv (`script.py ...` or `-m module ...`) when `command` runs one with this
    Python and no interpreter options, else None."""
    command = [os.fspath(part) for part in command]
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m":
        return command[1:] if len(command) > 2 else None
    return None if command[1].startswith("-") else command[1:]


def popen(command, cwd, env=None, stdout=None, stderr=None):
    """subprocess.Popen(command, cwd=, env=, stdout=, stderr=) with stdin from /dev/null, forked from
    the server when it can be. stdout / stderr: None (this process's), DEVNULL, STDOUT (stderr only),
    a file descriptor or a file."""
    env = dict(os.environ if env is None else env)
    args = _forkable_args(command)
    server = _server_for(env) if args else None
    if server is None:
        return subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    devnull = os.open(os.devnull, os.O_WRONLY)

    def fd(stream, inherited):
        if stream is None:
            return inherited
        if stream == subprocess.DEVNULL:
            return devnull
        return stream if isinstance(stream, int) else stream.fileno()

    try:
        out = fd(stdout, 1)
        return server.launch(args, cwd, env, out, out if stderr == subprocess.STDOUT else fd(stderr, 2))
    finally:
        os.close(devnull)


def run(command, cwd, env=None, timeout=None):
    """subprocess.run(command, cwd=, env=, capture_output=True, text=True, timeout=) for a script command."""
    read_out, write_out = os.pipe()
    read_err, write_err = os.pipe()
    try:
        process = popen(command, cwd, env, write_out, write_err)
    finally:
        os.close(write_out)
        os.close(write_err)
    captured = {}

    def drain(name, fd):
        with os.fdopen(fd, "rb") as f:
            captured[name] = f.read().decode("utf-8", errors="replace")

    readers = [threading.Thread(target=drain, args=(name, fd), daemon=True)
               for name, fd in (("stdout", read_out), ("stderr", read_err))]
    for reader in readers:
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise subprocess.TimeoutExpired(command, timeout)
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(command, process.returncode, captured["stdout"], captured["stderr"])


if __name__ == "__main__":
    _serve(sys.argv[1])
