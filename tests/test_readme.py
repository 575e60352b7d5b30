"""The README and its pages in docs/ tell the truth: every argument of every script with the default the code
has, no unfilled placeholder, every figure of a results table the value of the JSON file it comes from, every
command of the README runnable as printed, and every page reachable from the README by links that lead
somewhere."""

import dataclasses
import json
import os
import re
import shlex

import pytest

import run_clm_flax
import run_flax_glue
import run_flax_ner
import run_hybrid_clip
import run_image_captioning_flax
import run_image_classification
import run_qa
import run_speech_recognition_seq2seq
import run_wav2vec2_pretrain_flax
import run_mlm_flax
import run_summarization_flax
import run_t5_mlm_flax
import run_bart_dlm_flax
import demo
import train_tokenizer
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments, input_paths
from utils.base.parsing import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGUMENTS = os.path.join("docs", "arguments.md")
# The sections (`## <title>`) of the arguments page that every script takes its arguments from.
COMMON = ("Model", "Training (all scripts)", "Data (every script)")
# Each script and the sections of its own data arguments, the most specific first: an argument two
# scripts share by name (`max_seq_length`: None for mlm, 512 for t5 mlm) is read from the first that has it.
SCRIPTS = {
    "summarization": (run_summarization_flax, ("Data (summarization)",)),
    "glue": (run_flax_glue, ("Data (glue)",)),
    "ner": (run_flax_ner, ("Data (ner)",)),
    "image": (run_image_classification, ("Data (image classification)",)),
    "hybrid clip": (run_hybrid_clip, ("Model (hybrid clip)", "Data (hybrid clip)")),
    "captioning": (run_image_captioning_flax, ("Model and data (image captioning)",)),
    "speech": (run_speech_recognition_seq2seq, ("Data (speech recognition)",)),
    "wav2vec2": (run_wav2vec2_pretrain_flax, ("Model and data (wav2vec2 pretraining)",)),
    "qa": (run_qa, ("Data (question answering)",)),
    "clm": (run_clm_flax, ("Data (clm only)", "Data (clm, mlm, t5 mlm and bart dlm)")),
    "mlm": (run_mlm_flax, ("Data (mlm only)", "Data (clm, mlm, t5 mlm and bart dlm)")),
    "t5 mlm": (run_t5_mlm_flax, ("Data (t5 mlm only)", "Data (clm, mlm, t5 mlm and bart dlm)")),
    "bart dlm": (run_bart_dlm_flax, ("Data (bart dlm only)", "Data (clm, mlm, t5 mlm and bart dlm)")),
}


def documented_defaults(sections):
    """{argument: default as written} from the `| `name` | default | meaning |` rows of the arguments
    page's `sections`, the first section that documents an argument winning."""
    parts = re.split(r"^## (.+)$", read(ARGUMENTS), flags=re.M)
    bodies = dict(zip(parts[1::2], parts[2::2]))
    defaults = {}
    for section in sections:
        assert section in bodies, f"{ARGUMENTS} has no section '## {section}'"
        for name, default in re.findall(r"^\| `(\w+)` \| (\(required\)|`[^|]*`) \|", bodies[section], re.M):
            defaults.setdefault(name, default)
    return defaults


def arguments_of(script, base):
    """The script's own arguments of that kind (GLUE's model arguments add --use_slow_tokenizer): the
    most derived subclass of `base` it defines or imports."""
    return max((value for value in vars(script).values() if isinstance(value, type) and issubclass(value, base)),
               key=lambda c: len(c.__mro__))


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_argument_is_documented_with_its_default(name):
    script, sections = SCRIPTS[name]
    documented = documented_defaults(sections + COMMON)
    for dataclass in (arguments_of(script, ModelArguments), TrainingArguments, arguments_of(script, BaseDataArguments)):
        for field in dataclasses.fields(dataclass):
            if field.default is not dataclasses.MISSING:
                expected = f"`{field.default!r}`"
            elif field.default_factory is not dataclasses.MISSING:  # a list
                expected = f"`{field.default_factory()!r}`"
            else:
                expected = "(required)"
            assert documented.get(field.name) == expected, f"{name}: --{field.name} (default {expected})"


def test_every_train_tokenizer_argument_is_documented_with_its_default():
    required = {"kind": "bpe", "vocab_size": "100", "output_dir": "out"}
    parsed = vars(train_tokenizer.parse_args([word for name, value in required.items()
                                              for word in (f"--{name}", value)]))
    expected = {name: "(required)" if name in required else f"`{value!r}`" for name, value in parsed.items()}
    assert documented_defaults(("train_tokenizer.py",)) == expected


# ----------------------------------------------------------------------------------------------
# No unfilled placeholders
# ----------------------------------------------------------------------------------------------

BENCHMARKS = os.path.join("benchmarks", "README.md")
PAGES = sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
DOCS = ("README.md", BENCHMARKS, *PAGES)
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")
# Shell variables of other tools that the docs use (the SLURM task count and rank, libtpu's flags).
OTHER_TOOLS_VARIABLES = {"SLURM_NTASKS", "SLURM_PROCID", "TPU_NAME", "LIBTPU_INIT_ARGS"}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def real_names():
    """Every ALL_CAPS_WITH_UNDERSCORES word of the project's Python code (constants, the environment
    variables it reads: XLA_FLAGS, JAX_PROCESS_ID, HF_ENDPOINT, ...), and the metavariables of the
    arguments (OUTPUT_DIR for --output_dir)."""
    names = set(OTHER_TOOLS_VARIABLES) | set(PLACEHOLDER.findall(read("tests/script_launcher.py")))  # its switch
    for folder, _, files in os.walk(ROOT):
        if os.path.relpath(folder, ROOT).split(os.sep)[0] in ("tests", ".git"):
            continue  # a test may name a placeholder on purpose
        for name in files:
            if name.endswith(".py"):
                names |= set(PLACEHOLDER.findall(read(os.path.relpath(os.path.join(folder, name), ROOT))))
    for dataclass in (ModelArguments, TrainingArguments, *(arguments_of(script, BaseDataArguments)
                                                            for script, _ in SCRIPTS.values())):
        names |= {field.name.upper() for field in dataclasses.fields(dataclass)}
    return names


@pytest.mark.parametrize("path", DOCS)
def test_no_unfilled_placeholder(path):
    unknown = sorted(set(PLACEHOLDER.findall(read(path))) - real_names())
    assert not unknown, f"{path}: placeholders, or names the code does not have: {unknown}"


def test_a_placeholder_is_caught():
    assert PLACEHOLDER.findall("trains at FSDP_SPEED under fsdp") == ["FSDP_SPEED"]
    assert "FSDP_SPEED" not in real_names() and {"XLA_FLAGS", "JAX_PROCESS_ID", "OUTPUT_DIR"} <= real_names()


# ----------------------------------------------------------------------------------------------
# Every figure of a results table is its JSON's value, as rounded in the table
# ----------------------------------------------------------------------------------------------

GIB, MIB = 2**30, 2**20
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def json_file(name):
    return json.loads(read(os.path.join("benchmarks", name)))


def table(path, header, several=False):
    """The rows (lists of cells) of the markdown table in `path` whose header line starts with `header`;
    `several`: of all such tables, in order (the README gives each script's results a table of its own)."""
    lines = read(path).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1 or several and starts, f"{path}: {len(starts)} tables start with {header!r}"
    rows = []
    for start in starts:
        for line in lines[start + 2:]:
            if not line.startswith("|"):
                break
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return rows


def assert_shows(cell, values, where):
    """The numbers written in `cell`, in order, are `values` rounded as written (a % sign: value x 100;
    None: no number at all, as in "-")."""
    written = NUMBER.findall(re.sub(r"`[^`]*`", "", cell))
    values = [v for v in values if v is not None]
    assert len(written) == len(values), f"{where}: {cell!r} should show {values}"
    for text, value in zip(written, values):
        if text + "%" in cell:
            value *= 100
        decimals = len(text.split(".")[1]) if "." in text else 0
        assert f"{value:.{decimals}f}" == text.replace(",", ""), f"{where}: {cell!r} shows {text}, the JSON has {value}"


def check_table(path, header, records, columns, key_cells=1):
    """`records`: {the row's first `key_cells` cells, joined by a space: its JSON record}; `columns`:
    for each further cell, record -> the values it shows."""
    rows = table(path, header)
    assert sorted(" ".join(row[:key_cells]) for row in rows) == sorted(records), f"{path}: rows of {header!r}"
    for row in rows:
        key = " ".join(row[:key_cells])
        assert len(row) == key_cells + len(columns), f"{path}: {key} has {len(row)} cells"
        for cell, values in zip(row[key_cells:], columns):
            assert_shows(cell, values(records[key]), f"{path}, {key}")


def speed_records():
    return {f"{record['task']} {record['size']}": record for record in json_file("results_cpu.json")}


def tokens(r):
    return [r["script_tokens_per_second"]]


def of_limit(r):
    return [r["script_vs_limit"]]


def evals(r):
    return [r["eval_examples_per_second"]]


def generates(r):  # summarization only: the other rows show "-"
    return [r.get("generate_beams1_examples_per_second"), r.get("generate_beams4_examples_per_second")]


def rss(r):
    return [r["peak_host_memory_gib"]]


PERFORMANCE, LAYOUTS, TPU_PLAN, LARGE_DATA, TASKS, LORA = (os.path.join("docs", f"{name}.md") for name in (
    "performance", "layouts", "tpu-plan", "large-data", "tasks", "lora"))


def test_performance_speed_table_is_results_cpu_json():
    check_table(PERFORMANCE, "| script | size | tokens/s |", speed_records(), [
        tokens, of_limit, lambda r: [r["startup_cold_seconds"], r["startup_compile_cache_seconds"]], evals, generates,
        rss], key_cells=2)


def test_performance_tpu_table_is_results_tpu_json():
    check_table(PERFORMANCE, "| row | tokens/s | MFU |", {r["row"]: r for r in json_file("results_tpu.json")}, [
        tokens, lambda r: [r["script_mfu"]],
        lambda r: [r["script_tokens_per_second"] / r["limit_tokens_per_second"] if "limit_tokens_per_second" in r
                   else None],
        lambda r: [r.get("classic_tokens_per_second")], lambda r: [r.get("vs_classic")],
        lambda r: [r.get("first_step_cold_seconds")], lambda r: [r.get("first_step_warm_seconds")],
        lambda r: [r["planned_device_memory_gib"]],
        lambda r: [r["peak_device_memory_gib"]], rss, lambda r: [r["host_memory_held_from_start_gib"]]])
    for row in table(PERFORMANCE, "| row | tokens/s | MFU |"):  # a classic run that failed says why
        failed = {r["row"]: r for r in json_file("results_tpu.json")}[row[0]].get("classic_failed", "")
        assert (row[4] == "out of memory") == ("RESOURCE_EXHAUSTED" in failed), row


def test_the_readme_tpu_sentence_is_the_tpu_results():
    rows = {r["row"]: r for r in json_file("results_tpu.json")}
    gpt2, llama = rows["gpt2_small"], rows["llama_0.6b"]
    readme = " ".join(read("README.md").split())
    assert (f"at {gpt2['script_tokens_per_second']:,.0f} tokens/s, MFU {gpt2['script_mfu']:.3f}: "
            f"{gpt2['vs_classic']:.2f}x the classic script's {gpt2['classic_tokens_per_second']:,.0f} "
            "tokens/s") in readme
    assert (f"a {llama['parameters'] / 1e6:.0f}M-parameter Llama-style decoder at "
            f"{llama['script_tokens_per_second']:,.0f} tokens/s, MFU {llama['script_mfu']:.3f}") in readme
    assert "RESOURCE_EXHAUSTED" in llama["classic_failed"]
    assert "the classic script runs out of the chip's memory" in readme
    t5, roberta = rows["t5_small"], rows["bert_base"]
    assert (f"t5-small summarization reaches MFU {t5['script_mfu']:.3f} and RoBERTa-base MLM "
            f"{roberta['script_mfu']:.3f}: {t5['vs_classic']:.2f}x and {roberta['vs_classic']:.2f}x their classic "
            "scripts") in readme


def test_the_chunked_loss_figures_are_its_plan_json():
    plans = {row["chunked_loss"]: row for row in json_file("results_chunked_loss_plan.json")["plans"]}
    gib = lambda row, part: f"{row[f'train_step_device_bytes{part}'] / 2**30:.2f}"  # noqa: E731
    chunked, whole = plans["true"], plans["false"]
    assert (f"{gib(chunked, '')} GiB per device instead of {gib(whole, '')} (temporaries "
            f"{gib(chunked, '_temporaries')} instead of {gib(whole, '_temporaries')} GiB)") in \
        " ".join(read(os.path.join("docs", "performance.md")).split())


def test_the_checkpointing_policy_figures_are_its_plan_json():
    plans = {(row["model"], row["policy"]): row
             for row in json_file("results_checkpointing_policy_plan.json")["plans"]}
    gib = {key: f"{row['train_step_device_bytes'] / 2**30:.2f}" for key, row in plans.items()}
    llama, gpt2 = ([gib[(model, policy)] for policy in ("kernels", "nothing", None)]
                   for model in ("llama_0.6b", "gpt2_small"))
    assert (f"the Llama-style row (8 x 1024 tokens) {llama[0]} GiB a device against {llama[1]} keeping nothing and "
            f"{llama[2]} without checkpointing; GPT-2 small (16 x 1024 tokens), whose dropouts run through the "
            f"chip's kernel too and are kept with it, {gpt2[0]} against {gpt2[1]} and {gpt2[2]}"
            ) in " ".join(read(os.path.join("docs", "performance.md")).split())


def test_the_checkpointing_policy_chip_figures_are_the_levers_json():
    runs = {row["run"]: row for row in json_file("results_tpu_levers.json")}
    performance = " ".join(read(os.path.join("docs", "performance.md")).split())

    def pair(row, form):  # `kernels`, then `nothing`
        return [form(runs[f"{row}:splash_checkpointing{policy}"]) for policy in ("_kernels", "")]

    tokens = lambda run: f"{run['tokens_per_second']:,.0f}"  # noqa: E731
    mfu = lambda run: f"{run['mfu']:.3f}"  # noqa: E731
    plan = lambda run: f"{run['planned_device_memory_gib']:.2f}"  # noqa: E731
    llama, gpt2 = ([*pair(row, tokens), *pair(row, mfu), *pair(row, plan)] for row in ("llama_0.6b", "gpt2_small"))
    assert (f"the Llama row {llama[0]} tokens/s against {llama[1]} keeping nothing (MFU {llama[2]} against "
            f"{llama[3]}), its train step planned at {llama[4]} GiB against {llama[5]}; GPT-2 small {gpt2[0]} tokens/s "
            f"against {gpt2[1]} (MFU {gpt2[2]} against {gpt2[3]}), {gpt2[4]} GiB against {gpt2[5]}") in performance


def test_the_scan_layers_figures_are_its_plan_json():
    """The scanned plan (`auto`, which scans when planning for a TPU) against the loop's, in docs/performance.md."""
    plans = {(row["scan_layers"], row["gradient_checkpointing"]): row
             for row in json_file("results_scan_layers_plan.json")["plans"]}
    assert plans[("auto", False)]["scanned"] and plans[("auto", True)]["scanned"]

    def figures(key, form):  # scanned, loop; then the same with gradient checkpointing
        return [form(plans[(scan, checkpointing)][key]) for checkpointing in (False, True) for scan in ("auto", "no")]

    seconds = figures("train_step_seconds", str)
    gib = figures("train_step_device_bytes", lambda value: f"{value / 2**30:.2f}")
    assert (f"takes {seconds[0]} s instead of {seconds[1]} ({seconds[2]} instead of {seconds[3]} with gradient "
            f"checkpointing), and the plan needs {gib[0]} GiB per device instead of {gib[1]} ({gib[2]} instead of "
            f"{gib[3]} with gradient checkpointing)") in " ".join(read(os.path.join("docs", "performance.md")).split())


def test_the_tpu_step_figures_are_their_json():
    """docs/performance.md's scanned-layer and encoder-attention figures: benchmarks/results_tpu_steps.json."""
    steps = {(row["row"], " ".join(row["flags"]), row["code"]): row for row in json_file("results_tpu_steps.json")}
    loop, scanned = steps[("gpt2_small", "", "3dfd742")], steps[("gpt2_small", "--scan_layers yes", "bee410c")]
    splash = steps[("bert_base", "--attention splash", "bee410c")]
    stock = steps[("bert_base", "--attention xla", "bee410c")]
    ms = lambda row: f"{row['seconds_per_step'] * 1000:.1f}"  # noqa: E731
    performance = " ".join(read(os.path.join("docs", "performance.md")).split())
    assert (f"{ms(scanned)} ms a step against the loop's {ms(loop)} ({scanned['tokens_per_second']:,} tokens/s "
            f"against {loop['tokens_per_second']:,};") in performance
    assert (f"a plan of {scanned['train_step_plan_gib']:.2f} GiB against {loop['train_step_plan_gib']:.2f}"
            in performance)
    assert (f"{ms(splash)} ms a step against the stock attention's {ms(stock)} ({splash['tokens_per_second']:,} "
            f"tokens/s against {stock['tokens_per_second']:,}), a plan of {splash['train_step_plan_gib']:.2f} GiB "
            f"against {stock['train_step_plan_gib']:.2f}") in performance


def test_the_tpu_startup_figures_are_their_json():
    """docs/performance.md's start-up figures of the loop and the scan, cold, warm and rerun with other numbers,
    and of the cache's compression: benchmarks/results_tpu_startup.json."""
    runs = {(" ".join(row["flags"][4:]), row["cache_compression"]): row
            for row in json_file("results_tpu_startup.json")}
    zlib, loop, scanned = runs[("", "zlib")], runs[("", "zstandard")], runs[("--scan_layers yes", "zstandard")]
    first = lambda row, state: f"{row[state]['first_step_seconds']:.1f}"  # noqa: E731
    coding = lambda row, state: f"{row[state]['largest_cache_entry']['seconds']:.2f}"  # noqa: E731
    performance = " ".join(read(os.path.join("docs", "performance.md")).split())
    assert (f"{first(loop, 'cold')} s after a cold start, {first(loop, 'warm')} s with the compilation cache filled, "
            f"and {first(loop, 'rerun')} s for a rerun with another learning rate, warmup, seed and step count"
            ) in performance
    cold, warm = first(scanned, "cold"), first(scanned, "warm")
    assert f"first step {cold} s cold and {warm} s warm against the loop's {first(loop, 'cold')} and " \
        f"{first(loop, 'warm')}" in performance
    assert f"the first step {cold} s after a cold start and {warm} s warm against {first(loop, 'cold')} and " \
        f"{first(loop, 'warm')}" in performance
    assert f"The train step's program is {zlib['cold']['largest_cache_entry']['bytes'] / 1e6:.1f} MB" in performance
    fsdp = runs[("--sharding fsdp", "zstandard")]
    seconds = {(state, program["program"]): f"{program['seconds']:.1f}"
               for state in ("cold", "warm") for program in fsdp[state]["slowest_programs"]}
    assert (f"first step {first(fsdp, 'cold')} s cold, {first(fsdp, 'warm')} s warm and {first(fsdp, 'rerun')} s "
            f"for a rerun with other numbers; their program's TPU compile ({seconds[('cold', 'jit__lambda')]} s "
            f"cold, read back in {seconds[('warm', 'jit__lambda')]} s warm) now runs beside the train step's "
            f"({seconds[('cold', 'jit_train_step')]} s, read back in {seconds[('warm', 'jit_train_step')]} s)"
            ) in performance
    assert (f"{coding(zlib, 'cold')} s to write that program after its compile, {coding(zlib, 'warm')} s to "
            f"decompress it when read; with `zstandard` (now a requirement) {coding(loop, 'cold')} s and "
            f"{coding(loop, 'warm')} s") in performance


def test_benchmarks_speed_table_is_results_cpu_json():
    check_table(BENCHMARKS, "| script | size | limit tok/s |", speed_records(), [
        lambda r: [r["limit_tokens_per_second"]], tokens, of_limit, lambda r: [r["startup_cold_seconds"]],
        lambda r: [r["startup_compile_cache_seconds"]], lambda r: [r["startup_warm_vs_cold"]], evals, generates, rss],
        key_cells=2)


def size_row(memory, model, layout, checkpointing=False):
    """The row of `model` under `layout` (with or without gradient checkpointing) in a memory benchmark's JSON."""
    return next(row for row in memory["sizes"] if row["model"] == model and row["layout"] == layout
                and row["gradient_checkpointing"] == checkpointing)


def test_memory_tables_are_memory_tpu_json_and_memory_cpu_json():
    labels = {"GPT-2 medium (24 x 1024)": "GPT-2 medium", "T5-large (24 x 1024, d_ff 4096)": "T5-large",
              "Llama-style 1.1B (22 x 2048)": "Llama-style 1.1B"}
    ratio = lambda memory, m, checkpointing: (size_row(memory, m, "fsdp", checkpointing)["bytes"]  # noqa: E731
                                             / size_row(memory, m, "dp")["bytes"])
    for name, header, with_checkpointing in (("memory_tpu.json", "| model | parameters | `dp` | `fsdp` |", True),
                                             ("memory_cpu.json", "| model | parameters | `dp` per device |", False)):
        memory = json_file(name)
        measured = {(row["model"], row["layout"], row["gradient_checkpointing"]) for row in memory["sizes"]}
        needed = [("dp", False), ("fsdp", False)] + [("fsdp", True)] * with_checkpointing
        # A model's row is in the table once each of its columns is measured, and only then.
        models = {label: m for label, m in labels.items() if all((m, *key) in measured for key in needed)}
        columns = [lambda m: [size_row(memory, m, "dp")["parameters"] / 1e6],
                   lambda m: [size_row(memory, m, "dp")["bytes"] / GIB],
                   lambda m: [size_row(memory, m, "fsdp")["bytes"] / GIB],
                   lambda m: [ratio(memory, m, False)]]
        if with_checkpointing:
            columns += [lambda m: [size_row(memory, m, "fsdp", True)["bytes"] / GIB],
                        lambda m: [ratio(memory, m, True)]]
        check_table(TPU_PLAN, header, models, columns)

    largest = json_file("memory_tpu.json")["largest"]

    def ladder(key):  # "40 x 4096, 8.27B, 15.68 GiB (48 x 5120, 15.4B: 30.32)"; "not measured"
        if key not in largest:
            return []
        fit = largest[key]["largest"]
        over = min((row for row in largest[key]["tried"] if not row["fits"]), key=lambda row: row["parameters"],
                   default=None)
        # A rung the TPU compiler refused to compile shows "refused" for its bytes.
        return [value for row in (fit, over) if row for value in
                (*row["shape"][:2], row["parameters"] / 1e9, row["bytes"] and row["bytes"] / GIB)]

    families = {"GPT-2-style (50257 tokens)": "gpt2 {} adamw", "Llama-style (MLP 2.7 x, 32000 tokens)": "llama {} adamw",
                "T5-style (d_ff 4 x width, 32128 tokens)": "t5 {} adamw", "T5-style with Adafactor": "t5 {} adafactor"}
    check_table(TPU_PLAN, "| family | `dp`, no checkpointing |", families,
                [lambda f, setting=setting: ladder(f.format(setting))
                 for setting in ("dp remat off", "fsdp remat off", "fsdp remat on")])
    check = largest["llama fsdp remat on adamw"]["largest"]["check"]
    assert (f"compiled at {check['layers']} layers came out {-check['residual'] / MIB:.0f} MiB below its fit"
            in " ".join(read(TPU_PLAN).split()))

    memory = json_file("memory_cpu.json")

    def rung(key):  # "24 x 1024: 0.35B (8.64 GiB)"
        fit = memory["largest"][f"{key} remat off adamw"]["largest"]
        return [*fit["shape"], fit["parameters"] / 1e9, fit["bytes"] / GIB]

    families = {"GPT-2 (50257 vocabulary)": "gpt2", "T5 (d_ff 4 x width)": "t5"}
    check_table(TPU_PLAN, "| family | `dp` | `fsdp` on 8 devices |", families,
                [lambda f: rung(f + " dp"), lambda f: rung(f + " fsdp")])
    # The next rungs (columns 2 and 4) are printed by the benchmark, not kept in its JSON.
    for row in table(BENCHMARKS, "| family | `dp` fits |"):
        family = families[row[0]]
        assert_shows(row[1], rung(family + " dp"), f"{BENCHMARKS}, {row[0]}")
        assert_shows(row[3], rung(family + " fsdp"), f"{BENCHMARKS}, {row[0]}")
    ratios = [memory["largest"][f"{f} fsdp remat off adamw"]["largest"]["parameters"]
              / memory["largest"][f"{f} dp remat off adamw"]["largest"]["parameters"] for f in ("gpt2", "t5")]
    assert f"about {ratios[0]:.1f}x (GPT-2) and {ratios[1]:.1f}x (T5)" in read(TPU_PLAN)
    speed = f"{memory['speed']['fsdp']:,.0f} tokens/s under `fsdp` vs {memory['speed']['dp']:,.0f} under `dp`"
    assert speed in read(LAYOUTS)
    assert f"{memory['speed']['fsdp']:,.0f} under `fsdp` vs {memory['speed']['dp']:,.0f} under `dp`" in read(BENCHMARKS)


def test_data_tables_are_results_data_cpu_json():
    sizes = {f"10^{len(str(row['blocks'])) - 1}": row for row in json_file("results_data_cpu.json")["memory"]}

    def blocks(row):  # "10^7 (4.8 GiB cache)": the cache's size where given
        return [row["file_bytes"] / GIB] if row["blocks"] == 10**7 else []

    def growth(row):
        return [(row["anon_peak"] - row["anon_start"]) / MIB]

    for path, header, columns in (
            (LARGE_DATA, "| blocks of 128 tokens | host time per step |",
             [lambda r: [r["step_s"] * 1e6], growth]),
            (BENCHMARKS, "| blocks of 128 tokens | host time per step (cold pages) |",
             [lambda r: [r["step_s"] * 1e6], lambda r: [r["mapped_step_s"] * 1e6], lambda r: [r["old_step_s"] * 1e3],
              growth])):
        rows = table(path, header)
        assert sorted(row[0].split()[0] for row in rows) == sorted(sizes), f"{path}: every size"
        for row in rows:
            record = sizes[row[0].split()[0]]
            assert_shows(row[0].split(" ", 1)[1] if " " in row[0] else "", blocks(record), f"{path}, {row[0]}")
            for cell, values in zip(row[1:], columns):
                assert_shows(cell, values(record), f"{path}, {row[0]}")


# Configs whose untrained figures the README gives but results_configs_cpu.json does not record.
UNTRAINED_UNRECORDED = {"configs/ner_tiny.json", "configs/qa_tiny.json", "configs/qa_v2_tiny.json",
                        "configs/image_tiny.json"}


def test_results_table_is_results_configs_cpu_json():
    results = json_file("results_configs_cpu.json")
    runs = {(run["config"], run["devices"]): run for run in results["runs"]}
    untrained = {config: figures for config, figures in results["untrained"].items() if config != "what"}
    # GLUE's untrained run is the LoRA table's first row.
    untrained["configs/glue_tiny.json"] = next(run["results"] for run in results["lora"]["runs"]
                                               if run["name"] == "glue untrained")
    rows = table("README.md", "| config | model | data |", several=True)
    assert sorted(row[0].strip("`") for row in rows) == sorted({config for config, _ in runs})
    assert {config for config, _ in runs} - set(untrained) == UNTRAINED_UNRECORDED
    for row in rows:
        config = row[0].strip("`")
        for devices, cell in ((1, row[4]), (8, row[5])):
            run = runs[(config, devices)]
            keys = re.findall(r"`(\w+)`", cell)
            assert sorted(keys) == sorted(run["results"]), f"{row[0]} on {devices} devices: {cell}"
            assert_shows(cell, [run["results"][key] for key in keys] + [run["seconds"]], f"{row[0]}, {devices}")
        if config in UNTRAINED_UNRECORDED:
            continue
        figures, cell = untrained[config], row[6]
        keys = re.findall(r"`(\w+)`", cell)
        assert keys, f"{row[0]}: no untrained figure in {cell!r}"
        shown = []
        for key in keys:  # "`test_rougeL` < 5" is the JSON's test_rougeL_below
            below = key not in figures
            shown.append(figures[f"{key}_below" if below else key])
            assert below == (f"`{key}` <" in cell), f"{row[0]}: {cell!r}"
        assert_shows(cell, shown, f"{row[0]}, untrained")


def test_the_range_a_working_install_gives_is_the_measured_one():
    results = json_file("results_configs_cpu.json")
    quickstart = results["quickstart"]
    # The Quickstart's fresh-clone runs, and the one reported on a slower machine, are summarization's.
    fresh = [{"config": "configs/summarization_tiny.json", "devices": 1, **run}
             for run in quickstart["runs"] + [quickstart["reported"]]]
    one_device = [run for run in results["runs"] + results["other_machines"]["runs"] + fresh if run["devices"] == 1]

    def span(config, key, decimals):
        values = [run["results"][key] for run in one_device if run["config"] == config and key in run["results"]]
        assert len(values) > 1, f"{config} {key}: measured on one machine only"
        return f"`{key}` {min(values):.{decimals}f}-{max(values):.{decimals}f}"

    readme, performance = (" ".join(read(path).split()) for path in ("README.md", PERFORMANCE))
    summarization = [span("configs/summarization_tiny.json", "test_rougeL", 1),
                     span("configs/summarization_tiny.json", "test_loss", 2)]
    for text in summarization:
        assert text in readme and text in performance, text
    assert span("configs/t5_mlm_tiny.json", "eval_accuracy", 3) in performance
    assert len(quickstart["runs"]) >= 3
    seconds = [run["seconds"] for run in quickstart["runs"]]
    assert max(seconds) - min(seconds) < 0.1 * min(seconds), "the three runs' times disagree: say their range"
    assert (f"{round(min(seconds))} s from a fresh clone on a 2-core Intel Xeon (three runs), "
            f"{quickstart['reported']['seconds']} s on a slower 2-core machine") in readme
    assert "Intel Xeon" in quickstart["machine"]


def test_the_results_prose_is_results_configs_cpu_json():
    results = json_file("results_configs_cpu.json")
    (plateau,) = results["variants"]
    readme, tasks = (" ".join(read(path).split()) for path in ("README.md", TASKS))
    assert (f"reaches perplexity {plateau['results']['eval_perplexity']} / accuracy "
            f"{plateau['results']['eval_accuracy']:.3f} in {plateau['seconds']} s") in tasks
    transfer = {run["from"]: run["results"]["eval_accuracy"] for run in results["transfer"]["runs"]}
    assert (f"export classifies {transfer['outputs/mlm_tiny']} of the validation sentences, the same model from "
            f"scratch {transfer['scratch']} (it can only guess at words it never saw; the most frequent kind is "
            f"{results['transfer']['most_frequent_label_share']})") in tasks
    assert (f"export classifies {transfer['outputs/mlm_tiny']} of the validation sentences of `data/lm/word_classes`, "
            f"the same model from scratch {transfer['scratch']}") in readme


def test_the_dual_encoder_prose_is_results_configs_cpu_json():
    results = json_file("results_configs_cpu.json")
    one, eight = ({**run["recall"], **run["results"]} for devices in (1, 8) for run in results["runs"]
                  if run["config"] == "configs/hybrid_clip_tiny.json" and run["devices"] == devices)
    untrained = results["untrained"]["configs/hybrid_clip_tiny.json"]
    to_text, to_image = "eval_image_to_text_recall@10", "eval_text_to_image_recall@10"
    assert (f"reaches `{to_text}` {one[to_text]:.3f} and `{to_image}` {one[to_image]:.3f} on 1 device (8 devices: "
            f"{eight[to_text]:.3f} and {eight[to_image]:.3f}), and `eval_zero_shot_accuracy` "
            f"{one['eval_zero_shot_accuracy']} over 24 classes. Untrained, the same model scores {untrained[to_text]}, "
            f"{untrained[to_image]:.3f} and {untrained['eval_zero_shot_accuracy']} (`eval_loss` "
            f"{untrained['eval_loss']} in eval batches of 8") in " ".join(read(TASKS).split())


def test_the_bart_denoising_prose_is_results_configs_cpu_json():
    results = json_file("results_configs_cpu.json")
    transfer = results["transfer_bart_dlm"]
    scores = {run["from"]: run["results"] for run in transfer["runs"]}
    readme = " ".join(read("README.md").split())
    exported, scratch = scores[transfer["export"]], scores["scratch"]
    assert (f"`test_rougeL` {exported['test_rougeL']} (`test_loss` {exported['test_loss']}) fine-tuned from the "
            f"export, {scratch['test_rougeL']} (`test_loss` {scratch['test_loss']}) from scratch") in readme
    assert exported["test_rougeL"] > scratch["test_rougeL"]
    benchmarks = " ".join(read(BENCHMARKS).split())
    for command in (transfer["tokenizer"], transfer["pretraining"], transfer["fine_tuning"]["export"],
                    transfer["fine_tuning"]["scratch"]):
        assert command in benchmarks


def test_the_wav2vec2_transfer_prose_is_results_configs_cpu_json():
    transfer = json_file("results_configs_cpu.json")["transfer_wav2vec2"]
    runs = {(run["from"], run["steps"], run["seed"]): run["results"] for run in transfer["runs"]}
    export = transfer["export"]
    first, scratch = runs[(export, 280, 42)], runs[("scratch", 280, 42)]
    readme = " ".join(read("README.md").split())
    assert (f"for 280 steps, reaches `test_wer` {first['test_wer']} (`test_cer` {first['test_cer']}) from the export, "
            f"{scratch['test_wer']} (`test_cer` {scratch['test_cer']}) from scratch; seed 43: "
            f"{runs[(export, 280, 43)]['test_wer']} against {runs[('scratch', 280, 43)]['test_wer']}; the config's "
            f"560 steps: {runs[(export, 560, 42)]['test_wer']} against {runs[('scratch', 560, 42)]['test_wer']}") in readme
    # Every pair shares its budget and seed; the README's claim holds for each of them.
    assert len(runs) == len(transfer["runs"]) == 6
    for (origin, steps, seed), results in runs.items():
        if origin == export:
            assert results["test_wer"] < runs[("scratch", steps, seed)]["test_wer"]
    benchmarks = " ".join(read(BENCHMARKS).split())
    for command in [transfer["pretraining"]] + [run["command"] for run in transfer["runs"]]:
        assert command in benchmarks
    for run in transfer["runs"]:  # the command says what the row says
        command = run["command"]
        assert (f"--encoder_model_name_or_path {export} " in command) == (run["from"] == export)
        assert ("--num_train_epochs 20 " in command) == (run["steps"] == 280)
        assert (f"--seed {run['seed']} " in command) == (run["seed"] != 42)
        row = (f"| {run['steps']} | {run['seed']} | "
               f"{'the `run_wav2vec2_pretrain_flax.py` export' if run['from'] == export else 'the same model from scratch'}"
               f" | {run['results']['test_wer']} | {run['results']['test_cer']} | {run['results']['test_loss']} |")
        assert row in benchmarks


def test_the_wav2vec2_prose_is_results_configs_cpu_json():
    untrained = json_file("results_configs_cpu.json")["untrained"]["configs/wav2vec2_pretrain_tiny.json"]
    assert (f"the same model scores `eval_contrastive_loss` {untrained['eval_contrastive_loss']} (guessing among the "
            f"21 candidates of a masked frame: ln 21 = 3.04) with `eval_codevector_perplexity` "
            f"{untrained['eval_codevector_perplexity']} of 64") in " ".join(read(TASKS).split())


def test_demo_latency_table_is_results_demo_cpu_json():
    records = {row["output_dir"]: row for row in json_file("results_demo_cpu.json")["rows"]}
    check_table(BENCHMARKS, "| model | model p50 / p95 (ms) |", records, [
        lambda r: [r["model"]["p50_ms"], r["model"]["p95_ms"]], lambda r: [r["page"]["p50_ms"], r["page"]["p95_ms"]],
        lambda r: [r["concurrent"]["requests_per_s"]],
        lambda r: [r["concurrent"]["p50_ms"], r["concurrent"]["p95_ms"]], lambda r: [r["concurrent"]["errors"]]])


# ----------------------------------------------------------------------------------------------
# Every page of docs/ is reachable from the README, and links lead where they say
# ----------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def links(path):
    """(target, anchor) of each link in the markdown file `path` to a file of the repository: the target's
    path from the repository root (`path` itself for a link to its own heading), the anchor or ""."""
    for link in LINK.findall(read(path)):
        if re.match(r"\w+:", link):
            continue  # https://..., mailto:...
        target, _, anchor = link.partition("#")
        yield (os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path), anchor


def anchors(path):
    """The anchors GitHub gives the headings of the markdown file `path`."""
    headings = re.findall(r"^#{1,6} (.+)$", read(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_anchors_are_githubs():
    assert anchors(TASKS) >= {"t5-span-corruption-run_t5_mlm_flaxpy", "the-length-rule"}
    assert "tpu-plan-benchmarksmemorypy---plan-tpu" in anchors(BENCHMARKS)


def test_every_page_the_readme_links_exists():
    missing = sorted({target for target, _ in links("README.md") if not os.path.exists(os.path.join(ROOT, target))})
    assert not missing, f"README.md links to {missing}, which do not exist"


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), ["README.md"]
    while todo:
        page = todo.pop()
        for target, _ in links(page):
            if target.endswith(".md") and target not in reached and os.path.isfile(os.path.join(ROOT, target)):
                reached.add(target)
                todo.append(target)
    orphans = sorted(set(PAGES) - reached)
    assert not orphans, f"no link from the README (or a page it links) reaches {orphans}"


@pytest.mark.parametrize("path", DOCS)
def test_every_link_to_a_heading_reaches_one(path):
    for target, anchor in links(path):
        if anchor and target.endswith(".md") and os.path.isfile(os.path.join(ROOT, target)):
            assert anchor in anchors(target), f"{path}: {target} has no heading #{anchor}"


def test_the_lora_table_is_results_configs_cpu_json():
    runs = {run["name"]: run for run in json_file("results_configs_cpu.json")["lora"]["runs"]}
    rows = table("README.md", "| LoRA run |")
    assert sorted(row[0] for row in rows) == sorted(runs)
    for name, command, trained, results in rows:
        run = runs[name]
        # the command as run, less its cold start
        assert command.strip("`") + " --compilation_cache_dir none" == run["command"], f"{name}: {command}"
        assert_shows(trained, [run["trainable_parameters"], run["total_parameters"]], name)
        keys = re.findall(r"`(\w+)`", results)
        assert sorted(keys) == sorted(run["results"]), f"{name}: {results}"
        assert_shows(results, [run["results"][key] for key in keys], name)
    share = runs["glue LoRA"]["trainable_parameters"] / runs["glue LoRA"]["total_parameters"]
    assert f"LoRA trains {share:.0%} of the parameters and comes close to full" in " ".join(read("README.md").split())
    assert f"With {share:.0%} of the parameters it comes close to full" in " ".join(read(LORA).split())


# ----------------------------------------------------------------------------------------------
# Every command of the README runs as printed, and no run writes where another reads
# ----------------------------------------------------------------------------------------------

def readme_commands():
    """Every `python <file>.py ...` command of the README, as its words after `python`: the lines of its bash
    blocks (continuations joined, comments dropped, what follows a `&&`) and the commands of its tables."""
    text = read("README.md")
    lines = [line for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
             for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    lines += re.findall(r"^\|[^|]*\| `(python [^`]+)` \|", text, re.M)
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        while "&&" in words:
            words = words[words.index("&&") + 1:]
        if words[:1] == ["python"] and words[1].endswith(".py"):
            commands.append(words[1:])
    return commands


def writes_and_reads(words):
    """The directory a README command writes (None: it writes nothing) and the paths it reads a model,
    tokenizer, config, ... from, as its script's own parser reads its arguments."""
    script, argv = words[0], words[1:]
    if script == "demo.py":
        return None, [demo.parse_args(argv).output_dir]
    if script == "train_tokenizer.py":
        return train_tokenizer.parse_args(argv).output_dir, []
    module = {f"{m.__name__}.py": m for m, _ in SCRIPTS.values()}[script]
    parsed = parse_args((arguments_of(module, ModelArguments), arguments_of(module, BaseDataArguments),
                         TrainingArguments), argv)
    return parsed[2].output_dir, [source.path for source in input_paths(*parsed)]


def apart(out, path):
    """Whether an --output_dir `out` neither is, holds nor lies inside `path` (utils.run.preflight.check_output_apart's
    rule, on the paths as written)."""
    out, path = os.path.normpath(out), os.path.normpath(path)
    return not (out == path or path.startswith(out + os.sep) or out.startswith(path + os.sep))


def test_every_readme_command_parses_and_writes_apart_from_what_any_reads(monkeypatch):
    """Each README command parses with its script's own parser (an unknown flag, a missing config fails) and
    has an --output_dir no other command writes; none writes where it reads, nor where it would hold or lie
    inside what another reads. One command reading another's output dir is how they chain."""
    monkeypatch.chdir(ROOT)  # the configs' paths are the checkout's
    commands = {" ".join(words): words for words in readme_commands()}  # a command the README repeats runs once
    assert len(commands) > 40 and "run_clm_flax.py configs/chat_tiny.json" in commands
    runs = {command: writes_and_reads(words) for command, words in commands.items()}
    writers = {}
    for command, (output_dir, inputs) in runs.items():
        if output_dir:
            writers.setdefault(os.path.normpath(output_dir), []).append(command)
            for path in inputs:
                assert apart(output_dir, path), f"{command}: writes where it reads {path}"
    shared = {out: commands for out, commands in writers.items() if len(commands) > 1}
    assert not shared, f"README commands that write the same --output_dir: {shared}"
    for out, (writer,) in writers.items():
        for command, (_, inputs) in runs.items():
            for path in inputs:
                assert out == os.path.normpath(path) or apart(out, path), \
                    f"{writer}: its --output_dir {out} holds or lies inside {path}, which {command} reads"
