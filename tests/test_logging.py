"""Tests for utils/run/logs.py: event files, metrics.jsonl, progress bar, throughput/MFU, FLOP counts."""

import io
import json
import logging as pylogging
import sys
import time
from types import SimpleNamespace

import datasets
import huggingface_hub.utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from utils.run.logs import (MetricsLogger, Throughput, _QUIET_LIBRARIES, _TqdmHandler, flops_per_token,
                            hide_notices_in_transformers_handlers, peak_flops_per_device, setup_logging)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# --- MetricsLogger ---------------------------------------------------------------------------------


def test_tensorboard_events_readable(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=4, progress=False)
    metrics.log(1, {"loss": 2.5, "learning_rate": 1e-3})
    metrics.log(2, {"loss": 2.0, "learning_rate": 2e-3})
    metrics.log(2, {"loss": 1.75}, split="eval")
    metrics.hparams({"learning_rate": 1e-3, "model_name_or_path": "t5-small"})
    metrics.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 1.75)]
    assert events.Scalars("train/learning_rate")[1].value == pytest.approx(2e-3)  # stored as float32: rel 6e-8 off
    assert any("hparams" in tag for tag in events.Tags()["tensors"])


def test_jsonl_lines_converted_and_appended_on_resume(tmp_path):
    before = time.time()
    metrics = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    metrics.log(np.int64(1), {"loss": np.float32(0.5), "tokens": np.int64(7), "grad_norm": jnp.asarray(1.5)})
    metrics.log(1, {"loss": jnp.bfloat16(0.25), "accuracy": jnp.asarray([0.75])}, split="eval")
    metrics.close()
    metrics.close()  # idempotent

    resumed = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    resumed.log(2, {"loss": 0.125}, split="test")
    resumed.close()

    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(line["step"], line["split"]) for line in lines] == [(1, "train"), (1, "eval"), (2, "test")]
    assert lines[0] == {"step": 1, "split": "train", "time": lines[0]["time"], "loss": 0.5, "tokens": 7, "grad_norm": 1.5}
    assert type(lines[0]["tokens"]) is int and type(lines[0]["loss"]) is float
    assert lines[1]["loss"] == 0.25 and lines[1]["accuracy"] == 0.75
    assert before <= lines[0]["time"] <= lines[2]["time"] <= time.time()
    assert not list(tmp_path.glob("events.*"))


def test_lines_are_on_disk_before_close(tmp_path):
    metrics = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    metrics.log(3, {"loss": 1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["step"] == 3  # a killed run keeps this line
    metrics.close()


def test_events_are_on_disk_before_close(tmp_path):
    """A run killed right after its checkpoint of step 2 keeps the events of steps 1 and 2: its resumed run
    starts at step 3 and never writes them again."""
    metrics = MetricsLogger(tmp_path, progress=False)
    metrics.hparams({"learning_rate": 1e-3})
    for step in (1, 2):
        metrics.log(step, {"loss": float(step)})
    events = EventAccumulator(str(tmp_path))  # read before close: a kill -9 never closes
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0)]
    assert any("hparams" in tag for tag in events.Tags()["tensors"])
    metrics.close()


def test_rewind_makes_a_resumed_run_read_like_an_uninterrupted_one(tmp_path):
    killed = MetricsLogger(tmp_path, progress=False)
    for step in range(1, 7):
        killed.log(step, {"loss": float(step)})
    killed.log(4, {"loss": 0.4}, split="eval")
    killed.close()
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 7, "split": "tr')  # the torn last line of a kill -9

    time.sleep(1.1)  # event files are named by the second: a restart within the same one would reuse the name
    resumed = MetricsLogger(tmp_path, progress=False)
    resumed.rewind(4)
    assert [(r["step"], r["split"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "eval")]
    resumed.log(4, {"loss": 0.5}, split="eval")  # an evaluation the resumed run repeats replaces the old line
    resumed.log(5, {"loss": 50.0})
    resumed.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["split"], r["loss"]) for r in rows] == [
        (1, "train", 1.0), (2, "train", 2.0), (3, "train", 3.0), (4, "train", 4.0), (4, "eval", 0.5), (5, "train", 50.0)]

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50)]


def test_rejects_non_scalar_and_reserved_names(tmp_path):
    metrics = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    with pytest.raises(ValueError, match="shape"):
        metrics.log(1, {"loss": np.ones(8)})
    with pytest.raises(ValueError, match="reserved"):
        metrics.log(1, {"step": 1})
    metrics.close()


def test_non_main_process_writes_nothing(tmp_path):
    output_dir = tmp_path / "run"
    metrics = MetricsLogger(output_dir, is_main_process=False, total_steps=10)
    metrics.hparams({"seed": 0})
    metrics.log(1, {"loss": 1.0})
    metrics.advance(1)
    metrics.close()
    assert not output_dir.exists()


class FakeTerminal(io.StringIO):
    """What a terminal looks like to tqdm and to us: a stream whose isatty() is True."""

    def isatty(self):
        return True


def test_on_a_terminal_the_progress_is_a_live_bar(tmp_path, monkeypatch, caplog):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    caplog.set_level(pylogging.INFO)
    metrics = MetricsLogger(tmp_path, total_steps=10, tensorboard=False)
    metrics.log(4, {"loss": 1.25, "learning_rate": 3e-4, "tokens_per_second": 12345.6})
    metrics.log(4, {"loss": 9.0}, split="eval")  # not a train loss: the bar keeps 1.25
    metrics.advance(4)  # a resumed run's first step
    metrics.advance(6)
    metrics.close()
    err = terminal.getvalue()
    assert "\r" in err and "6/10" in err  # redrawn in place
    assert "loss=1.2500" in err and "lr=3.00e-04" in err and "tok/s=12,346" in err
    assert "loss=9.0000" not in err
    assert not [record for record in caplog.records if record.getMessage().startswith("step ")]  # the bar says it


def test_off_a_terminal_the_progress_is_a_log_line_per_logged_step(tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(pylogging.INFO)
    clock = iter([100.0, 130.0])  # the first step, then the step logged 3 steps later: 10 s a step
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    metrics = MetricsLogger(tmp_path, total_steps=10, tensorboard=False)
    metrics.advance(1)
    metrics.advance(2)
    metrics.advance(3)
    metrics.advance(4)
    metrics.log(4, {"loss": 1.25, "learning_rate": 3e-4, "tokens_per_second": 12345.6})
    metrics.log(4, {"loss": 9.0}, split="eval")
    metrics.close()
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["step 4/10: loss 1.2500, lr 3.00e-04, tok/s 12,346, eta 0:01:00"]  # 6 steps x 10 s
    out = capsys.readouterr()
    assert "\r" not in out.err + out.out and "%|" not in out.err  # no bar at all


def test_off_a_terminal_progress_between_logs_is_a_line_and_no_record(tmp_path, monkeypatch, caplog):
    """`progress` (a slow run between its logged steps) shows the metrics so far; metrics.jsonl and
    TensorBoard record the logged steps only."""
    caplog.set_level(pylogging.INFO)
    clock = iter([100.0, 140.0])  # the first step, then step 5: 10 s a step
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    metrics = MetricsLogger(tmp_path, total_steps=10, tensorboard=False)
    metrics.advance(1)
    metrics.progress(5, {"loss": 2.5, "learning_rate": 1e-3, "tokens_per_second": 512.0})
    metrics.close()
    assert [record.getMessage() for record in caplog.records] == [
        "step 5/10: loss 2.5000, lr 1.00e-03, tok/s 512, eta 0:00:50"]
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


# --- setup_logging ---------------------------------------------------------------------------------


def library_bars_enabled():
    return (datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled(),
            not huggingface_hub.utils.are_progress_bars_disabled())


@pytest.fixture
def restore_logging():
    """setup_logging changes process-wide loggers; put them back for the other tests."""
    root = pylogging.getLogger()
    loggers = [root] + [pylogging.getLogger(name) for name in ("flaxtune", *_QUIET_LIBRARIES)]
    saved = [(logger, logger.level, list(logger.handlers), logger.propagate) for logger in loggers]
    bars = library_bars_enabled()
    yield
    if bars[0]:
        datasets.enable_progress_bars()
    if bars[1]:
        transformers.utils.logging.enable_progress_bar()
    if bars[2]:
        huggingface_hub.utils.enable_progress_bars()
    for logger, level, handlers, propagate in saved:
        logger.setLevel(level)  # setLevel, not .level =, so the loggers' level cache is cleared
        logger.propagate = propagate
        if logger is not root:  # pytest swaps its own handlers on root between test phases
            logger.handlers[:] = handlers
    for handler in [h for h in root.handlers if isinstance(h, _TqdmHandler)]:
        root.removeHandler(handler)


def test_setup_logging_main_process(restore_logging, capsys):
    logger = setup_logging(is_main_process=True)
    setup_logging(is_main_process=True)  # a second call must not duplicate lines
    assert logger.name == "flaxtune"
    logger.info("hello %d", 1)
    logger.debug("hidden")
    transformers.utils.logging.get_logger("transformers.modeling_utils").info("chatter")
    pylogging.getLogger("absl").info("orbax chatter")
    err = capsys.readouterr().err
    assert err.count("INFO hello 1") == 1
    assert "hidden" not in err and "chatter" not in err
    assert pylogging.getLogger("transformers").level == pylogging.WARNING


def test_setup_logging_other_process(restore_logging, capsys):
    logger = setup_logging(is_main_process=False)
    logger.info("hello")
    logger.warning("careful")
    logger.error("boom")
    transformers.utils.logging.get_logger("transformers.modeling_utils").warning("hf warning")
    err = capsys.readouterr().err
    assert "ERROR boom" in err
    assert "hello" not in err and "careful" not in err and "hf warning" not in err
    assert not datasets.is_progress_bar_enabled()


def test_library_progress_bars_only_on_a_terminal(restore_logging, monkeypatch):
    """datasets' "grouping into blocks" bars and the like are `\r` redraws: off a terminal they are off."""
    datasets.enable_progress_bars()  # the libraries' defaults (an earlier test may have changed them)
    transformers.utils.logging.enable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    setup_logging(is_main_process=True)
    assert library_bars_enabled() == (True, True, True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    setup_logging(is_main_process=True)
    assert library_bars_enabled() == (False, False, False)


def test_setup_logging_debug(restore_logging, capsys):
    setup_logging(is_main_process=False, debug=True).debug("details")
    assert "DEBUG details" in capsys.readouterr().err


def test_transformers_flax_deprecation_warning_hidden(restore_logging, capsys, caplog):
    """transformers 4.x warns that v5 drops its Flax classes (we pin < 5) when a Flax model is built:
    that one message is not shown; the library's other warnings are."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    setup_logging(is_main_process=True)
    transformers.utils.logging.warning_once.cache_clear()  # said once per process: have it said again here
    FlaxGPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    transformers.utils.logging.get_logger("transformers.modeling_flax_utils").warning("another warning")
    deprecation = "TensorFlow and JAX classes are deprecated and will be removed in Transformers v5"
    assert any(record.getMessage().startswith(deprecation) for record in caplog.records)  # it was logged
    err = capsys.readouterr().err
    assert deprecation not in err and "WARNING another warning" in err


def test_demo_hides_the_notice_in_transformers_own_handler(restore_logging, capsys):
    """The demo's server never calls setup_logging: transformers prints through its own stderr
    handler, which gets the scripts' filter; its other warnings still show."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    hf_logging = transformers.utils.logging
    handler = pylogging.StreamHandler(sys.stderr)  # where transformers' own handler writes
    library = hf_logging.get_logger()  # the "transformers" logger, where its own handler sits
    library.addHandler(handler)
    hf_logging.set_verbosity_warning()
    try:
        hide_notices_in_transformers_handlers()
        hide_notices_in_transformers_handlers()  # Streamlit runs the page per request: the filter once
        hf_logging.warning_once.cache_clear()
        FlaxGPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
        hf_logging.get_logger("transformers.modeling_flax_utils").warning("another warning")
    finally:
        library.removeHandler(handler)
    err = capsys.readouterr().err
    assert "TensorFlow and JAX classes are deprecated" not in err and "another warning" in err
    assert len(handler.filters) == 1


# --- Throughput ------------------------------------------------------------------------------------


@pytest.fixture
def fake_clock(monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    return clock


def test_throughput_rates_and_windows(fake_clock):
    throughput = Throughput()
    throughput.update(999, 9)  # the compiling step, before start(): not counted
    throughput.start()
    throughput.update(1000, 4)
    throughput.update(1000, 4)
    fake_clock.now += 4.0
    assert throughput.rates() == {"tokens_per_second": 500.0, "examples_per_second": 2.0}

    throughput.update(300, 3)  # the next window starts where the last one ended
    fake_clock.now += 1.5
    assert throughput.rates() == {"tokens_per_second": 200.0, "examples_per_second": 2.0}


def test_throughput_mfu(fake_clock):
    throughput = Throughput(flops_per_token=6e6, peak_flops=1e10)
    throughput.start()
    throughput.update(2000, 2)
    fake_clock.now += 4.0
    rates = throughput.rates()
    # 500 tokens/s * 6e6 FLOPs/token = 3e9 FLOP/s of a 1e10 peak; float64 divisions: default rel 1e-6.
    assert rates["mfu"] == pytest.approx(0.3)


def test_throughput_without_peak_has_no_mfu(fake_clock):
    throughput = Throughput(flops_per_token=6e6, peak_flops=None)
    throughput.start()
    fake_clock.now += 1.0
    assert "mfu" not in throughput.rates()


def test_throughput_requires_start():
    with pytest.raises(RuntimeError, match="start"):
        Throughput().rates()


# --- flops_per_token -------------------------------------------------------------------------------
# Every count below is an integer held in float64 (exact) but for one division by the sequence
# length: approx's default rel 1e-6 is far above that rounding (1e-16) and far below any missing term.


def test_flops_t5_encoder_decoder():
    config = transformers.T5Config(
        vocab_size=100, d_model=16, d_kv=4, num_heads=2, d_ff=32, num_layers=2, num_decoder_layers=3
    )
    a = 2 * 4  # attention width 8, narrower than d_model
    attention_block = 4 * 16 * a  # q, k, v, o
    ffn = 2 * 16 * 32
    n_enc = 2 * (attention_block + ffn)
    n_dec = 3 * (2 * attention_block + ffn)  # self- and cross-attention
    s, s_dec = 64, 16
    per_example = 6 * n_enc * s + 6 * n_dec * s_dec + 12 * a * (2 * s * s + 3 * s_dec * (s_dec + s))
    assert flops_per_token(config, s, s_dec) == pytest.approx(per_example / s)
    # Equal lengths: 6N + 12 a S (L_enc + 2 L_dec).
    assert flops_per_token(config, s) == pytest.approx(6 * (n_enc + n_dec) + 12 * a * s * (2 + 2 * 3))


def test_flops_gated_t5():
    plain = transformers.T5Config(d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1, num_decoder_layers=1)
    gated = transformers.T5Config(
        d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1, num_decoder_layers=1, feed_forward_proj="gated-gelu"
    )
    # One extra 16x32 matrix per layer in 2 layers.
    assert flops_per_token(gated, 8) - flops_per_token(plain, 8) == pytest.approx(6 * 2 * 16 * 32)


def test_flops_bart():
    config = transformers.BartConfig(
        d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=48,
    )
    n = 1 * (4 * 16 * 16 + 2 * 16 * 32) + 2 * (8 * 16 * 16 + 2 * 16 * 48)
    assert flops_per_token(config, 10) == pytest.approx(6 * n + 12 * 16 * 10 * (1 + 2 * 2))


def test_flops_gpt2_and_equivalents():
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=None)
    n = 2 * (4 * 32 * 32 + 2 * 32 * (4 * 32))  # n_inner None means 4 d
    expected = 6 * n + 12 * 2 * 32 * 128
    assert flops_per_token(gpt2, 128) == pytest.approx(expected)
    neo = transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]])
    opt = transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128)
    assert flops_per_token(neo, 128) == pytest.approx(expected)
    assert flops_per_token(opt, 128) == pytest.approx(expected)


def test_flops_bert_and_roberta():
    kwargs = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
    n = 3 * (4 * 32 * 32 + 2 * 32 * 64)
    expected = 6 * n + 12 * 3 * 32 * 16
    assert flops_per_token(transformers.BertConfig(**kwargs), 16) == pytest.approx(expected)
    assert flops_per_token(transformers.RobertaConfig(**kwargs), 16) == pytest.approx(expected)


def test_flops_llama_gated_ffn_and_grouped_query_attention():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    attention = 2 * 32 * 32 + 2 * 32 * (2 * 8)  # q, o full width; k, v for 2 heads of 8
    n = 2 * (attention + 3 * 32 * 64)
    assert flops_per_token(config, 20) == pytest.approx(6 * n + 12 * 2 * 32 * 20)


def test_flops_unreadable_config():
    assert flops_per_token(object(), 128) is None
    assert flops_per_token(transformers.PretrainedConfig(), 128) is None


# --- peak_flops_per_device -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("TPU v2", 22.5e12),
        ("TPU v3", 61.5e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5e", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("TPU v6e", 918e12),
        ("tpu_v6e", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("cpu", None),
        ("TPU v4 lite", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_peak_flops_table(kind, expected):
    assert peak_flops_per_device(SimpleNamespace(device_kind=kind)) == expected


def test_peak_flops_real_cpu_device_and_missing_kind():
    assert peak_flops_per_device(jax.devices()[0]) is None
    assert peak_flops_per_device(object()) is None
