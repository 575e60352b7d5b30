"""Run logging: Python logging set-up, TensorBoard + JSON-lines metrics, progress, throughput and MFU.

Only process 0 writes anything; every other process gets quiet logging and no-op metric writers, so
scripts call the same methods everywhere without `if is_main_process` around each one.

Progress is a live bar only where stderr is a terminal. Into a file or a CI log a bar would write
carriage-return redraws that pile up on one line, with log lines glued to them; there the training
progress is a plain log line at each logged step and at least every --progress_seconds between them
(`utils.run.loop.TrainLoop`), and the libraries' own bars are off.
"""

import json
import logging as pylogging
import os
import re
import sys
import textwrap
import time

import datetime

import jax
import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar, text
from tqdm.auto import tqdm

_LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# Libraries that log routine chatter at INFO (absl also carries orbax's messages).
_QUIET_LIBRARIES = ("transformers", "datasets", "absl", "orbax", "jax", "huggingface_hub", "httpx")
# (library, start of a message) never shown: warnings every run would print that say nothing about
# the run. transformers 4.x announces that v5 drops its Flax classes, which is why the requirements
# pin transformers < 5 (README, Quickstart).
_HIDDEN_MESSAGES = (
    ("transformers", "TensorFlow and JAX classes are deprecated and will be removed in Transformers v5"),
)


logger = pylogging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------
# Python logging
# ---------------------------------------------------------------------------------------------------


def stderr_is_a_terminal():
    """Whether progress bars can redraw in place (looked up now: tests and callers swap sys.stderr)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _disable_library_progress_bars():
    """The tqdm bars of datasets (map, filter: "grouping into blocks"), transformers (loading
    checkpoint shards) and huggingface_hub (downloads, uploads)."""
    import datasets
    import huggingface_hub.utils
    from transformers.utils import logging as transformers_logging

    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


class _TqdmHandler(pylogging.Handler):
    """Prints through tqdm, so log lines appear above the progress bar instead of breaking it."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=sys.stderr)  # sys.stderr looked up now: capture-friendly
        except Exception:
            self.handleError(record)


def _not_hidden(record):
    """A handler filter: False for the records of `_HIDDEN_MESSAGES`."""
    return not any((record.name == library or record.name.startswith(library + "."))
                   and record.getMessage().startswith(start) for library, start in _HIDDEN_MESSAGES)


def hide_notices_in_transformers_handlers():
    """Keep the `_HIDDEN_MESSAGES` off transformers' own stderr handler, as `setup_logging` keeps them
    off the scripts' handler: for a process that never calls `setup_logging` (the demo's Streamlit
    server, whose models print transformers' Flax deprecation notice otherwise). Safe to call again
    (Streamlit runs the page once per request)."""
    from transformers.utils import logging as transformers_logging

    for handler in transformers_logging.get_logger().handlers:
        if _not_hidden not in handler.filters:
            handler.addFilter(_not_hidden)


class _NoTracebackFormatter(pylogging.Formatter):
    """Library errors logged with a traceback (orbax's failed background saves) print as one line;
    the script's own error line says what to do, and --debug shows the traceback."""

    def format(self, record):
        return super().format(pylogging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                                       "stack_info": None}))


def _route_hf_logging(level):
    """transformers and datasets install their own stderr handler and reset their level when imported.

    Configuring them after importing them makes the result independent of import order; their
    records then go through our handler only, in our format.
    """
    import datasets.utils.logging  # noqa: F401  (importing it resets the "datasets" logger)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity(level)
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    datasets_logger = pylogging.getLogger("datasets")
    datasets_logger.setLevel(level)
    datasets_logger.handlers.clear()
    datasets_logger.propagate = True


def setup_logging(is_main_process: bool, debug: bool = False) -> pylogging.Logger:
    """Configure logging for a script and return the "flaxtune" logger.

    Process 0 logs at INFO, the others only errors (N hosts would otherwise print N copies of every
    line); `debug` turns DEBUG on for every process, to chase per-host problems. Chatty libraries are
    held at WARNING (ERROR off process 0). Calling it again replaces the previous configuration.
    """
    if debug:
        level = pylogging.DEBUG
    else:
        level = pylogging.INFO if is_main_process else pylogging.ERROR
    library_level = pylogging.WARNING if is_main_process else pylogging.ERROR

    root = pylogging.getLogger()
    # Ours from an earlier call, and plain stderr handlers a library's `basicConfig` left behind
    # (they would print every line twice, unformatted).
    for handler in [h for h in root.handlers if type(h) in (_TqdmHandler, pylogging.StreamHandler)]:
        root.removeHandler(handler)
    handler = _TqdmHandler()
    handler.setFormatter((pylogging.Formatter if debug else _NoTracebackFormatter)(_LOG_FORMAT, _DATE_FORMAT))
    # On the handler, not a logger: a logger's filters miss the records its children propagate, and
    # every library record ends up here (see `_route_hf_logging`).
    handler.addFilter(_not_hidden)
    root.addHandler(handler)
    root.setLevel(level)

    for name in _QUIET_LIBRARIES:  # before the imports below, whose import-time messages they hold back
        pylogging.getLogger(name).setLevel(library_level)
    _route_hf_logging(library_level)
    # Bars, not log records: every host would draw its own, and off a terminal they are `\r` redraws.
    if not is_main_process or not stderr_is_a_terminal():
        _disable_library_progress_bars()
    return pylogging.getLogger("flaxtune")


# ---------------------------------------------------------------------------------------------------
# Metrics: TensorBoard, metrics.jsonl, progress bar
# ---------------------------------------------------------------------------------------------------

_RESERVED_KEYS = ("step", "split", "time")
# (metric key, label, format) for the train metrics shown after the bar or in the progress line.
_POSTFIX_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("learning_rate", "lr", "{:.2e}"),
    ("tokens_per_second", "tok/s", "{:,.0f}"),
)


def _to_python(name, value):
    """A numpy/JAX scalar or one-element array (bfloat16 included) as a plain int or float."""
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"metric {name!r} has shape {array.shape}; log a scalar (reduce or unreplicate first)")
    scalar = array.reshape(())
    return int(scalar) if array.dtype.kind in "biu" else float(scalar)


def _parse_line(line):
    """A metrics.jsonl row, or None for a blank line or the torn last line of a killed run."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class EventFile:
    """A TensorBoard event file in `logdir` that holds every event once `flush()` returns.

    Not tensorboardX's `SummaryWriter`: it hands events to a thread, and its flush() writes only those the
    thread got to, so the last logged step's events reached the disk at the next log. A run killed after
    its checkpoint of that step lost them for good: its resumed run starts after that step.
    """

    def __init__(self, logdir):
        self._writer = EventsWriter(os.path.join(logdir, "events"))  # events.out.tfevents.<time>.<host>

    def add(self, step, **fields):
        """One event at `step` with `fields` (summary=, session_log=)."""
        self._writer.write_event(Event(wall_time=time.time(), step=step, **fields))

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


class MetricsLogger:
    """Writes each metrics dict to TensorBoard (tags `"{split}/{key}"`) and to `metrics.jsonl`.

    `metrics.jsonl` gets one JSON object per `log` call, `{"step", "split", "time", **metrics}`; both files
    are flushed before `log` returns, so a run killed after a checkpoint keeps all it logged up to it
    (its resumed run starts after it). A resumed run calls `rewind(step)` first, so both files
    read like one uninterrupted run. On a process other than the main one every method is a no-op and
    nothing is created.

    With `progress`, training shows a live bar (`advance`) where stderr is a terminal; elsewhere each
    train `log`, and each `progress` between logs, also logs one line: step, loss, learning rate,
    tokens/s, time left.
    """

    def __init__(self, output_dir, is_main_process=True, total_steps=None, tensorboard=True, progress=True):
        self._closed = not is_main_process
        self._total_steps = total_steps
        self._progress = progress
        self._events = None
        self._file = None
        self._bar = None
        self._live = progress and stderr_is_a_terminal()
        self._first_advance = None  # (step, time) of the first step: the time-left estimate starts there
        self._postfix = {}
        self._replaceable = set()
        if self._closed:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self._path, "a", encoding="utf-8")
        if tensorboard:
            self._events = EventFile(str(output_dir))

    def log(self, step: int, metrics: dict, split: str = "train"):
        """Record `metrics` (scalars: Python, numpy or JAX) at `step` for `split` ("train"/"eval"/"test")."""
        if self._closed:
            return
        clashes = [key for key in _RESERVED_KEYS if key in metrics]
        if clashes:
            raise ValueError(f"metric names {clashes} are reserved in metrics.jsonl")
        values = {key: _to_python(key, value) for key, value in metrics.items()}
        step = int(step)
        if (split, step) in self._replaceable:
            self._replaceable.discard((split, step))
            self._rewrite(lambda row: (row["split"], row["step"]) != (split, step))
        self._file.write(json.dumps({"step": step, "split": split, "time": time.time(), **values}) + "\n")
        self._file.flush()
        if self._events is not None:
            for key, value in values.items():
                self._events.add(step, summary=scalar(f"{split}/{key}", value))
            self._events.flush()
        if split == "train":
            self._update_postfix(values)
            if self._progress and not self._live:
                logger.info(self._progress_line(step))

    def progress(self, step: int, metrics: dict):
        """Show the training metrics so far at `step`, between logged steps: on the bar where it is
        live, else as a progress line. Nothing is recorded."""
        if self._closed or not self._progress:
            return
        self._update_postfix({key: _to_python(key, value) for key, value in metrics.items()})
        if not self._live:
            logger.info(self._progress_line(step))

    def rewind(self, step: int):
        """Continue a run resumed from its checkpoint at `step`: forget what was logged after it.

        metrics.jsonl keeps only its lines up to `step`; TensorBoard hides the events after it (a
        SessionLog START at `step + 1`, as `SummaryWriter(purge_step=...)` writes). An eval or test
        line at `step` itself is replaced if the resumed run logs it again (e.g. the final evaluation
        of a run resumed from its last checkpoint).
        """
        if self._closed:
            return
        kept = self._rewrite(lambda row: row["step"] <= step)
        self._replaceable = {(row["split"], step) for row in kept if row["step"] == step and row["split"] != "train"}
        if self._events is not None:
            self._events.add(step + 1, session_log=SessionLog(status=SessionLog.START))
            self._events.flush()

    def _rewrite(self, keep):
        """Keep only the lines of metrics.jsonl whose row satisfies `keep`; returns those rows."""
        self._file.close()
        with open(self._path, encoding="utf-8") as f:
            rows = [row for row in map(_parse_line, f) if row is not None]
        kept = [row for row in rows if keep(row)]
        # Written beside and renamed over: a kill mid-write leaves the old file, never half of one.
        with open(self._path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(self._path + ".tmp", self._path)
        self._file = open(self._path, "a", encoding="utf-8")
        return kept

    def _update_postfix(self, values):
        for key, label, fmt in _POSTFIX_FIELDS:
            if key in values:
                self._postfix[label] = fmt.format(values[key])
        if self._bar is not None:
            self._bar.set_postfix(self._postfix)

    def _progress_line(self, step):
        """ "step 20/100: loss 2.3456, lr 1.00e-03, tok/s 12,345, eta 0:01:23" (eta once a step was timed)."""
        line = f"step {step}/{self._total_steps}" if self._total_steps else f"step {step}"
        fields = [f"{label} {value}" for label, value in self._postfix.items()]
        if self._total_steps and self._first_advance and step > self._first_advance[0]:
            first_step, first_time = self._first_advance
            seconds_per_step = (time.monotonic() - first_time) / (step - first_step)
            left = round(seconds_per_step * (self._total_steps - step))
            fields.append(f"eta {datetime.timedelta(seconds=left)}")
        return f"{line}: {', '.join(fields)}" if fields else line

    def advance(self, step: int):
        """Move the progress to `step` (the number of optimizer steps done)."""
        if self._closed or not self._progress:
            return
        if self._first_advance is None:
            # Timed from the first step on: a resumed run's rate leaves out the jump, and every run's
            # leaves out the first (compiling) step.
            self._first_advance = (step, time.monotonic())
        if not self._live:
            return
        if self._bar is None:
            # Created at the first step, starting there, for the same reasons.
            self._bar = tqdm(total=self._total_steps, initial=step, unit="step", dynamic_ncols=True)
            self._bar.set_postfix(self._postfix)
        elif step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def hparams(self, params: dict):
        """Record the run's arguments as a TensorBoard text summary. Strip secrets before calling."""
        if self._closed or self._events is None:
            return
        arguments = json.dumps(params, indent=2, sort_keys=True, default=str)
        # Indented lines render as a code block in TensorBoard's markdown text view.
        self._events.add(0, summary=text("hparams", textwrap.indent(arguments, "    ")))
        self._events.flush()

    def close(self):
        """Flush and close the bar, the event file and metrics.jsonl. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._events is not None:
            self._events.close()
        self._file.close()


# ---------------------------------------------------------------------------------------------------
# Throughput and MFU
# ---------------------------------------------------------------------------------------------------


class Throughput:
    """Steady-state speed over windows between log points.

    Call `start()` after the first (compiling) step has finished, `update()` after every step, and
    `rates()` at each log point; `rates()` also opens the next window.

    JAX dispatches asynchronously: block on the device (e.g. `jax.block_until_ready` on the step's
    outputs, or fetch the loss to the host) before calling `rates()`, or the window measures only how
    fast steps were queued. `tokens` and `peak_flops` must cover the same devices: this process's
    tokens with `peak_flops_per_device(d) * jax.local_device_count()`, or global tokens with
    `* jax.device_count()`. "mfu" is returned only when both `flops_per_token` and `peak_flops` are known.
    """

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._window_start = None
        self._tokens = 0
        self._examples = 0

    def start(self):
        self._open_window(time.perf_counter())

    def _open_window(self, now):
        self._window_start = now
        self._tokens = 0
        self._examples = 0

    def update(self, tokens: int, examples: int):
        self._tokens += tokens
        self._examples += examples

    def rates(self) -> dict:
        if self._window_start is None:
            raise RuntimeError("Throughput.rates() called before start()")
        now = time.perf_counter()
        elapsed = now - self._window_start
        rates = {
            "tokens_per_second": self._tokens / elapsed,
            "examples_per_second": self._examples / elapsed,
        }
        if self.flops_per_token and self.peak_flops:
            rates["mfu"] = rates["tokens_per_second"] * self.flops_per_token / self.peak_flops
        self._open_window(now)
        return rates


def _first_int(config, *names):
    """The first of `names` that `config` sets to an int: HF configs spell one idea many ways."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


_GATED_FFN_MODEL_TYPES = {"llama", "mistral", "gemma", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}


def _layer_params(d, ffn_dim, attention_dim, kv_dim, gated, attention_blocks):
    """Weight-matrix parameters of one layer (biases and norms are negligible and left out)."""
    attention = 2 * d * attention_dim + 2 * d * kv_dim  # query and output; key and value
    ffn = (3 if gated else 2) * d * ffn_dim  # a gated FFN has two input projections
    return attention_blocks * attention + ffn


def flops_per_token(config, seq_len: int, decoder_seq_len: int | None = None) -> float | None:
    """Training FLOPs (forward + backward) per input token, PaLM appendix B convention.

    Decoder-only and encoder-only models: `6 N + 12 L a T`, where N counts the weight matrices of the
    L transformer layers (no embeddings, no output head, no biases or norms), a = heads * head_dim is
    the attention width (usually d_model) and T = `seq_len` is the context each token attends to.

    Encoder-decoder models (N = encoder + decoder layers, decoder layers with a cross-attention block):
    the FLOPs of one example, with S = `seq_len` source and S_d = `decoder_seq_len` (default S)
    target positions, divided by S, so the count is per *source* token (count `input_ids` tokens):
        [6 N_enc S + 6 N_dec S_d + 12 a (L_enc S S + L_dec S_d (S_d + S))] / S
    which is `6 N + 12 a S (L_enc + 2 L_dec)` when S_d = S.

    Pass padded lengths: padding costs compute too. Causal masking is not discounted (the convention).
    FFN width defaults to 4 d; llama/mistral/gemma and gated T5 (v1.1, mT5) have 3 FFN matrices,
    grouped-query attention has narrower key/value projections. Returns None when the config lacks
    the sizes it needs.
    """
    d = _first_int(config, "d_model", "hidden_size", "n_embd")
    heads = _first_int(config, "encoder_attention_heads", "num_heads", "num_attention_heads", "n_head")
    if d is None or not heads:
        return None
    head_dim = _first_int(config, "d_kv", "head_dim") or d // heads
    kv_heads = _first_int(config, "num_key_value_heads") or heads
    attention_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    gated = getattr(config, "model_type", None) in _GATED_FFN_MODEL_TYPES or getattr(config, "is_gated_act", False)

    # (layers, ffn width, attention blocks per layer, positions, keys each position attends to)
    if getattr(config, "is_encoder_decoder", False):
        decoder_seq_len = decoder_seq_len or seq_len
        stacks = [
            (_first_int(config, "encoder_layers", "num_layers"), _first_int(config, "encoder_ffn_dim", "d_ff"),
             1, seq_len, seq_len),
            (_first_int(config, "decoder_layers", "num_decoder_layers"), _first_int(config, "decoder_ffn_dim", "d_ff"),
             2, decoder_seq_len, decoder_seq_len + seq_len),
        ]
    else:
        layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
        ffn_dim = _first_int(config, "intermediate_size", "ffn_dim", "n_inner", "d_ff") or 4 * d
        stacks = [(layers, ffn_dim, 1, seq_len, seq_len)]

    flops_per_example = 0
    for layers, ffn_dim, attention_blocks, positions, context in stacks:
        if layers is None or ffn_dim is None:
            return None
        params = layers * _layer_params(d, ffn_dim, attention_dim, kv_dim, gated, attention_blocks)
        flops_per_example += 6 * params * positions + 12 * layers * attention_dim * positions * context
    return flops_per_example / seq_len


# Dense bf16 peak FLOP/s per JAX device, matched in order against the normalized `device_kind`.
# A TPU v2/v3 JAX device is one core, half a chip (chip: 45 / 123 TFLOP/s); later TPUs show one
# device per chip. JAX reports v5p as "TPU v5", v5e as "TPU v5 lite", v6e as "TPU v6 lite".
_PEAK_FLOPS = (
    (r"tpuv6(lite|e)", 918e12),
    (r"tpuv5(lite|e)", 197e12),
    (r"tpuv5p?$", 459e12),
    (r"tpuv4$", 275e12),
    (r"tpuv3", 61.5e12),
    (r"tpuv2", 22.5e12),
    (r"a100", 312e12),
    (r"h[12]00", 989e12),
)


def peak_flops_per_device(device) -> float | None:
    """Peak bf16 FLOP/s of one JAX device, or None for CPUs and kinds not in the table."""
    kind = re.sub(r"[\s_-]", "", str(getattr(device, "device_kind", "")).lower())
    for pattern, flops in _PEAK_FLOPS:
        if re.search(pattern, kind):
            return flops
    return None


def throughput_meter(config, seq_len, decoder_seq_len=None):
    """A `Throughput` for this run: FLOPs per token from the model config, peak over all devices."""
    peak = peak_flops_per_device(jax.devices()[0])
    return Throughput(flops_per_token(config, seq_len, decoder_seq_len), peak * jax.device_count() if peak else None)
