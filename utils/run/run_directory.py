"""The run directory: every file a run writes into --output_dir (process 0 only), and nothing else.

It is opened once every check has passed, so a run that stops on a bad input leaves --output_dir
byte for byte as it was. A training run that starts afresh where an earlier run wrote its outputs
(--overwrite_output_dir, or --resume_from_checkpoint latest before the first checkpoint) first
removes all of them: no old TensorBoard curve, result file or export can pass for the new run's. A
directory that holds anything a run does not write (source code, data) is never emptied.
"""

import fnmatch
import json
import logging
import os
import shutil
import tempfile

import safetensors.numpy

from utils.base.arguments import public_args, save_args
from utils.base.errors import UsageError, at_exit
from utils.checkpoints.store import CHECKPOINT_SUBDIR, disk_full_is_fatal
from utils.layout import devices
from utils.models import flax_msgpack, hub_checkpoint, lora
from utils.models.family_model import FamilyModel
from utils.run import model_card
from utils.run.hub_push import HubPusher
from utils.run.logs import MetricsLogger
from utils.run.perf import memory_report

logger = logging.getLogger(__name__)

# The Hugging Face export's weights: one file, or shards with their index; Flax's, or the decoder family's
# PyTorch-named safetensors.
WEIGHT_FILES = ("flax_model.msgpack", "flax_model-*.msgpack", "flax_model.msgpack.index.json", hub_checkpoint.WEIGHTS,
                "model-*-of-*.safetensors", hub_checkpoint.INDEX)
# Names (glob patterns) of what every run writes into its output directory; a task declares the rest
# (`tasks.Task.outputs`: its prediction files).
RUN_OUTPUTS = (
    CHECKPOINT_SUBDIR, "run_args.json", "metrics.jsonl", "metrics.jsonl.tmp", "events.out.tfevents.*",
    "*_results.json", ".export-*",
    # The Hugging Face export: model, tokenizer or image processor.
    "config.json", "generation_config.json", *WEIGHT_FILES, "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.*", "vocab.*", "merges.txt", "*.model", "*.spm", "preprocessor_config.json",
    model_card.CARD,
    # LoRA's adapters in PEFT's layout, beside the merged model
    "adapter_config.json", "adapter_model.safetensors",
)
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_run_output(name, task_outputs=()):
    """Whether a run of a task declaring `task_outputs` writes a file called `name`."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in (*RUN_OUTPUTS, *task_outputs))


def foreign_files(output_dir, task_outputs=()):
    """The entries of `output_dir` that no run of a task declaring `task_outputs` writes, sorted."""
    return sorted(name for name in os.listdir(output_dir) if not is_run_output(name, task_outputs))


def check_replaceable(output_dir, task_outputs=()):
    """A new training run here removes the previous run's outputs: refuse if it would remove more."""
    if not os.path.isdir(output_dir):
        return
    foreign = foreign_files(output_dir, task_outputs)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UsageError(f"a new run in {output_dir} first removes the previous run's outputs, but the directory "
                         f"also holds files no run of this script writes ({shown}): move them away or choose "
                         "another --output_dir")


def remove_run_outputs(output_dir, task_outputs=()):
    """Delete everything an earlier run of the task wrote into `output_dir`."""
    for name in set(os.listdir(output_dir)) - set(foreign_files(output_dir, task_outputs)):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def one_line(text):
    """`text` as one line of a result file: inner whitespace collapsed (a generated newline would
    split a row in two)."""
    return " ".join(text.split())


def clear_call_settings(tokenizer):
    """Drop the padding and truncation that the last call of a fast tokenizer (`tokenizer`, or a processor's
    `.tokenizer`) left on its Rust backend."""
    # tokenizer.json saves the backend as it stands: a user of `tokenizers.Tokenizer.from_file` would pad and
    # truncate every input as the run's last call did. transformers sets both anew on each call, so the run's
    # later calls encode as before.
    backend = getattr(getattr(tokenizer, "tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is not None:
        backend.no_padding()
        backend.no_truncation()


def export_pretrained(model, params, tokenizer, output_dir: str, is_main_process: bool = True):
    """Write what `from_pretrained(output_dir)` loads: config, weights (`params`, host arrays), and
    the tokenizer (or processor) if given, its tokenizer.json without padding or truncation; for the project's
    decoder family, what PyTorch transformers loads."""
    if not is_main_process:
        return
    # Written beside and then moved into place, so a failed write (a full disk) leaves the previous
    # export whole: each file is replaced by a rename, which needs no space.
    staging = tempfile.mkdtemp(prefix=".export-", dir=output_dir)
    adapters = lora.adapters_of(model)
    try:
        if adapters:  # the merged model, which loads like any other, and the adapters alone in PEFT's layout
            write_peft_adapter(staging, params, adapters)
            params = lora.merged(params, adapters)
        if isinstance(model, FamilyModel):  # a hub checkpoint PyTorch transformers loads
            model.save_pretrained(staging, params)
        else:
            flax_msgpack.save_pretrained(model, staging, params)  # transformers' files, the weights streamed
        if tokenizer is not None:
            clear_call_settings(tokenizer)
            tokenizer.save_pretrained(staging)
        written = os.listdir(staging)
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        # An earlier export's weight files that this one did not write (one file then and shards now, or other
        # shards): left beside it, a lone flax_model.msgpack is what from_pretrained would load.
        for name in set(os.listdir(output_dir)) - set(written):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in WEIGHT_FILES):
                os.remove(os.path.join(output_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Exported model to %s", output_dir)


def write_peft_adapter(directory, params, adapters):
    """adapter_config.json and adapter_model.safetensors (`utils.models.lora.peft_files`) into `directory`."""
    config, tensors = lora.peft_files(params, adapters)
    with open(os.path.join(directory, PEFT_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    safetensors.numpy.save_file(tensors, os.path.join(directory, PEFT_WEIGHTS), metadata={"format": "pt"})


def write_results(output_dir, prefix, metrics, is_main_process):
    """`{prefix}_results.json` with prefixed keys (`eval_loss`, `test_rouge1`, ...); returns them."""
    results = {f"{prefix}_{key}": round(float(value), 4) for key, value in metrics.items()}
    if is_main_process:
        with open(os.path.join(output_dir, f"{prefix}_results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


class RunDirectory:
    """What a run leaves in --output_dir: its arguments, metrics (metrics.jsonl, TensorBoard), result
    files, texts, the Hugging Face export, and hub pushes of all of it.

    `task` is the script's `tasks.Task` declaration: the files it may write beside the engine's, and its
    model card's pipeline tag and widget. `resume` is the `utils.checkpoints.resume.ResumePoint` the run continues (a
    resumed training run drops the metrics logged after its step, so the files read like one uninterrupted
    run); a training run that is not resumed starts from an empty directory. `train_step_memory`
    (`utils.layout.layouts`) is recorded as `train_step_device_bytes`. Every process makes one; only process 0
    writes.
    """

    def __init__(self, training_args, all_args, task, model, tokenizer, is_main, total_steps=None, resume=None,
                 train_step_memory=None):
        out = self.output_dir = training_args.output_dir
        self.task = task
        self.model, self.tokenizer, self.is_main = model, tokenizer, is_main
        self.public_args = public_args(*all_args)
        self.pusher = None
        if training_args.push_to_hub and is_main:  # first: a bad token or name leaves the output dir as it was
            repo_id = training_args.hub_model_id or os.path.basename(os.path.abspath(out))
            try:
                self.pusher = HubPusher(repo_id, training_args.hub_token, out)
            except OSError as e:  # requests' HTTP and connection errors
                raise UsageError(f"could not create the hub repository {repo_id!r}: {e}; check --hub_token "
                                 "(it needs write access) and --hub_model_id") from e
        if training_args.do_train and resume is None:
            if training_args.resume_from_checkpoint:
                logger.warning("no checkpoint to resume from in %s yet: starting from scratch", out)
            if is_main and os.path.isdir(out):
                remove_run_outputs(out, task.outputs)
        # No process may look at the checkpoints before process 0 has removed an earlier run's.
        devices.sync_processes("flaxtune: output_dir ready")
        os.makedirs(out, exist_ok=True)
        if is_main:
            save_args(out, *all_args)
        self._metrics = MetricsLogger(out, is_main_process=is_main, total_steps=total_steps)
        self._metrics.hparams(self.public_args)
        if training_args.do_train and resume is not None:
            self._metrics.rewind(resume.step)
        self._results = {}
        self._train_step_bytes = train_step_memory["total"] if train_step_memory else None
        if train_step_memory:  # known before the first step (`utils.layout.layouts`): logged at the start step
            memory = {f"train_step_device_bytes{'' if key == 'total' else '_' + key}": value
                      for key, value in train_step_memory.items()}
            self.log(resume.step if resume else 0, memory, split="memory")
            self.add_results(train_step_device_bytes=train_step_memory["total"])
        at_exit(self.close)

    def log(self, step, metrics, split="train"):
        with disk_full_is_fatal(self.output_dir):
            self._metrics.log(step, metrics, split=split)

    def advance(self, step):
        """Move the progress bar to `step`."""
        self._metrics.advance(step)

    def progress(self, step, metrics):
        """Show the training metrics so far between logged steps (`MetricsLogger.progress`)."""
        self._metrics.progress(step, metrics)

    def report(self, prefix, metrics, step):
        """Log `metrics` at `step` and write `{prefix}_results.json`; they also go into all_results.json."""
        self.log(step, metrics, split=prefix)
        with disk_full_is_fatal(self.output_dir):
            results = write_results(self.output_dir, prefix, metrics, self.is_main)
        self._results.update(results)
        logger.info("%s", results)
        return results

    def add_results(self, **values):
        """Entries of all_results.json that no results file holds (train_runtime, train_samples)."""
        self._results.update(values)

    def _declared(self, name):
        """`name`, a file the task declares (a rerun must know it as its own to replace it)."""
        if not is_run_output(name, self.task.outputs):
            raise ValueError(f"{name} is not among the files task {self.task.name!r} declares (tasks.Task.outputs)")
        return name

    def write_text(self, name, lines, collapse_whitespace=True):
        """One line per item, inner whitespace collapsed (generated texts may hold newlines) unless
        `collapse_whitespace` is False (tab-separated tables)."""
        self._declared(name)
        if self.is_main:
            with disk_full_is_fatal(self.output_dir), open(os.path.join(self.output_dir, name), "w",
                                                           encoding="utf-8") as f:
                f.writelines((one_line(line) if collapse_whitespace else line) + "\n" for line in lines)

    def write_json(self, name, value):
        """`value` as indented JSON (prediction files)."""
        self._declared(name)
        if self.is_main:
            with disk_full_is_fatal(self.output_dir), open(os.path.join(self.output_dir, name), "w",
                                                           encoding="utf-8") as f:
                json.dump(value, f, indent=2, ensure_ascii=False)

    def export(self, params, commit_message):
        """The Hugging Face export of `params` (host arrays; a full disk keeps the previous export),
        then a hub push."""
        export_pretrained(self.model, params, self.tokenizer, self.output_dir, is_main_process=self.is_main)
        if self.pusher:
            self.pusher.push(commit_message)

    def close(self):
        """Flush and close the metrics files. Safe to call more than once."""
        with disk_full_is_fatal(self.output_dir):
            self._metrics.close()

    def finish(self):
        """all_results.json, the model card beside an export (`utils.run.model_card`), the last hub push
        (waited for), and the peak memory in the log."""
        if self.is_main:
            with disk_full_is_fatal(self.output_dir):
                with open(os.path.join(self.output_dir, "all_results.json"), "w", encoding="utf-8") as f:
                    json.dump(self._results, f, indent=2)
                if os.path.exists(os.path.join(self.output_dir, "config.json")):
                    model_card.write_model_card(self.output_dir, self.task, self.public_args,
                                                self._results, getattr(self.tokenizer, "mask_token", None))
        self.close()
        if self.pusher:
            self.pusher.push("end of training")
            self.pusher.wait()
        logger.info("%s", memory_report(self._train_step_bytes))
