"""The arguments every script shares: their dataclasses, names and defaults (those of the classic Hugging Face
Flax example scripts, so their flags and JSON configs keep working), the checks of their values, and what a run
reads from the paths they name. Each script adds its own data dataclass (subclassing `BaseDataArguments`);
`utils.base.parsing` reads them from a JSON config and the command line."""

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from utils.base.errors import UsageError

SECRET_FIELDS = ("hub_token", "token")


DTYPES = ("float32", "float16", "bfloat16")


PARAM_DTYPES = ("float32", "bfloat16")


SCHEDULES = ("linear", "cosine", "constant")


# The LoRA flags beside --lora_rank, and their values when LoRA is off.
LORA_DEFAULTS = {"lora_alpha": None, "lora_dropout": 0.0, "lora_target": "attention", "lora_base_dtype": None}


LORA_TARGET_NAMES = ("attention", "all-linear")  # --lora_target's named rules (`utils.models.lora.TARGET_RULES`)


LAYOUTS = ("dp", "fsdp")


DROPOUT_GENERATORS = ("auto", "threefry", "rbg", "chip")


ATTENTION = ("auto", "splash", "xla")


SCAN_LAYERS = ("auto", "yes", "no")


CHECKPOINTING_POLICIES = ("nothing", "kernels")  # what --gradient_checkpointing keeps: utils.models.remat


# `--compile_only`: the TPU slices of one host (a TPU VM), by the names Cloud TPU rents them under,
# and the topology (chips per dimension) the TPU compiler knows them by (`utils.layout.tpu_plan`). v2 / v3 /
# v4 / v5p names count cores, v5e / v6e chips.
TPU_SLICES = {"v2-8": "v2:2x2", "v3-8": "v3:2x2", "v4-8": "v4:2x2x1", "v5p-8": "v5p:2x2x1", "v5e-4": "v5e:2x2",
              "v5e-8": "v5e:2x4", "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4"}


# The sections of --help, in this order (the options most runs set first): {key: title}. A field is
# listed under its `group` metadata, else under its dataclass's HELP_GROUP.
HELP_GROUPS = {
    "model": "Model",
    "data": "Data",
    "training": "Training",
    "output": "Output, logging and checkpoints",
    "memory": "Precision, layout and memory",
    "lora": "LoRA (low-rank adapters)",
    "tpu": "TPU kernels and compilation",
    "multihost": "Multi-host",
    "hub": "Hugging Face hub",
}


# Field metadata: what a run reads from the local path its flag names (a model, a tokenizer, ...):
# `input_paths` finds every such flag by it, and the run refuses to write where it reads
# (`utils.run.preflight.check_output_apart`).
READS = "reads"


# Field metadata of ours, which HfArgumentParser must not hand to `add_argument` as it does the rest: the
# field's --help section, what --no_X does for a boolean X that defaults to true (a --no_X without it
# still works but is not listed: --X false says the same), and READS.
OWN_METADATA = ("group", "negated_help", READS)


# How a help text says its own default, when the field's value does not (None: computed at run time).
# The help adds "(default: value)" to the texts that do not.
OWN_DEFAULT = "(default:"


def _help(text, default=dataclasses.MISSING, **metadata):
    """A field with its help text and other metadata (`group`, `negated_help`, `reads`, argparse's `metavar`)."""
    return field(default=default, metadata={"help": text, **metadata})


@dataclass
class ModelArguments:
    HELP_GROUP = "model"

    model_name_or_path: Optional[str] = _help("Pretrained model name or path; omit to train from scratch.",
                                              reads="its model", default=None)
    model_type: Optional[str] = _help("Model type when training from scratch (e.g. t5, bart, gpt2).", default=None)
    config_name: Optional[str] = _help("Config name or path if not the same as model_name_or_path.",
                                       reads="its config", default=None)
    config_overrides: Optional[str] = _help(
        "Override config values when training from scratch, e.g. 'n_embd=64,n_layer=2'.", default=None
    )
    tokenizer_name: Optional[str] = _help("Tokenizer name or path if not the same as the model.",
                                          reads="its tokenizer", default=None)
    cache_dir: Optional[str] = _help("Where to store downloaded models and datasets.", default=None)
    use_fast_tokenizer: bool = _help("Use a fast (Rust) tokenizer.", negated_help="Use the slow (Python) tokenizer.",
                                     default=True)
    dtype: str = _help(
        "Compute dtype: float32, float16 or bfloat16. Parameters stay float32 (master weights) unless --param_dtype.",
        group="memory", default="float32",
    )
    param_dtype: str = _help(
        "Storage dtype of parameters and optimizer state: float32, or bfloat16 to halve their memory "
        "(updates smaller than bf16's precision are lost).",
        group="memory", default="float32",
    )
    token: Optional[str] = _help("Hugging Face token for private models (never logged or saved).", group="hub",
                                 default=None)
    trust_remote_code: bool = _help("Allow custom code from the hub (read it first).", group="hub", default=False)
    lora_rank: int = _help(
        "LoRA: rank of the low-rank adapters trained beside the frozen model (0: off, the whole model trains). "
        "Only the adapters and a new task head (classification, tagging, QA) are trained.", group="lora", default=0)
    lora_alpha: Optional[float] = _help("LoRA scale numerator: the adapters add (alpha / rank) x A B "
                                        "(default: 2 x rank).", group="lora", default=None)
    lora_dropout: float = _help("LoRA: dropout on the adapters' input while training.", group="lora", default=0.0)
    lora_target: str = _help(
        "LoRA: the layers that get adapters. 'attention' (each family's attention projections: GPT-2 c_attn / "
        "c_proj, T5 q / k / v / o, BERT-likes, ViT and BigBird query / key / value and the attention output "
        "dense, BART, Whisper, wav2vec2, CLIP, Llama and Mistral q_proj / k_proj / v_proj / o_proj / out_proj), "
        "'all-linear' (every dense layer but the output head), or a regex searched in module paths such as "
        "'transformer/h/0/attn/c_attn'.", group="lora", default="attention")
    lora_base_dtype: Optional[str] = _help(
        "LoRA: storage dtype of the frozen base weights, float32 or bfloat16 (default: --param_dtype); the "
        "adapters stay float32.", group="lora", default=None)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise UsageError(f"--param_dtype {self.param_dtype!r} is not supported: use one of {', '.join(PARAM_DTYPES)}")
        self._check_lora()

    def _check_lora(self):
        if self.lora_rank < 0:
            raise UsageError(f"--lora_rank must be positive (or 0 to train the whole model), got {self.lora_rank}")
        if not self.lora_rank:
            adapter = _peft_adapter_config(self.model_name_or_path)
            if adapter is not None:
                raise UsageError(f"--model_name_or_path {self.model_name_or_path} is a PEFT adapter of rank "
                                 f"{adapter.get('r')}: continue it with --lora_rank {adapter.get('r')}, or pass its "
                                 "base model to train the whole model")
            given = [name for name, default in LORA_DEFAULTS.items() if getattr(self, name) != default]
            if given:
                raise UsageError(f"--{given[0]} applies to LoRA only: pass --lora_rank R (e.g. 8) too, or drop it")
            return
        if self.lora_alpha is not None and not 0 < self.lora_alpha < math.inf:
            raise UsageError(f"--lora_alpha must be a positive number, got {self.lora_alpha}")
        self._check_lora_target()
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_base_dtype is not None and self.lora_base_dtype not in PARAM_DTYPES:
            raise UsageError(f"--lora_base_dtype {self.lora_base_dtype!r} is not supported: use one of "
                             f"{', '.join(PARAM_DTYPES)}")
        self._continue_peft_adapter()

    def _check_lora_target(self):
        rule, fix = self.lora_target, ("use 'attention', 'all-linear' or a regex searched in module paths such as "
                                       "encoder/layer/0/attention/self/query")
        if not rule:
            raise UsageError(f"--lora_target is empty: {fix}")
        if rule not in LORA_TARGET_NAMES:
            try:
                re.compile(rule)
            except re.error as error:
                raise UsageError(f"--lora_target {rule!r} is not a valid regular expression ({error}): {fix}")

    def _continue_peft_adapter(self):
        """--model_name_or_path naming a PEFT adapter (adapter_config.json, no model of its own): the run
        continues that adapter on the base its config names (`utils.models.lora.load_peft_weights`, which
        matches its tensors to the model); its config and the header of its weights are checked now."""
        path = self.model_name_or_path
        self.lora_adapter_dir = None
        config = _peft_adapter_config(path)
        if config is None:
            return
        config_file = os.path.join(path, "adapter_config.json")
        if config.get("peft_type") != "LORA" or not config.get("base_model_name_or_path"):
            raise UsageError(f"{config_file} is not a LoRA adapter naming its base model (peft_type LORA, "
                             "base_model_name_or_path): pass the base model as --model_name_or_path instead")
        rank, alpha = config.get("r"), config.get("lora_alpha", 2 * self.lora_rank)
        if type(rank) is not int or rank < 1 or type(alpha) not in (int, float) or not 0 < alpha < math.inf:
            raise UsageError(f"{config_file} gives r {rank!r} and lora_alpha {alpha!r}: a LoRA adapter's rank is a "
                             "positive integer and its alpha a positive number; fix the file or export the adapter "
                             "again")
        if rank != self.lora_rank:
            raise UsageError(f"the adapter in {path} has rank {rank}, this run --lora_rank "
                             f"{self.lora_rank}: continue it with --lora_rank {rank}")
        _check_safetensors_header(os.path.join(path, "adapter_model.safetensors"))
        self.lora_adapter_dir = path
        self.model_name_or_path = config["base_model_name_or_path"]
        if self.lora_alpha is None:
            self.lora_alpha = float(alpha)


def _peft_adapter_config(path):
    """The adapter_config.json of `path` when it is a PEFT adapter directory (that file, no model's
    config.json), else None; a UsageError when that file is no JSON object."""
    config_file = os.path.join(path, "adapter_config.json") if path else ""
    if not (path and os.path.isfile(config_file) and not os.path.isfile(os.path.join(path, "config.json"))):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise UsageError(f"{config_file} is not a readable JSON file ({error}): point --model_name_or_path at a "
                         "PEFT adapter directory or a model")
    if not isinstance(config, dict):
        raise UsageError(f"{config_file} holds a JSON {type(config).__name__}, not an adapter's settings: point "
                         "--model_name_or_path at a PEFT adapter directory or a model")
    return config


def _check_safetensors_header(path):
    """Read the header of the safetensors file `path` (its tensors' names, shapes and extents, a few
    kB): a missing, truncated or foreign file is a UsageError now, before any model is built."""
    import safetensors

    try:
        with safetensors.safe_open(path, "numpy"):
            pass
    except (OSError, safetensors.SafetensorError) as error:
        raise UsageError(f"cannot read {path} ({error}): export the adapter again, or pass its base model with "
                         "--model_name_or_path to start a new one")


@dataclass
class BaseDataArguments:
    HELP_GROUP = "data"

    dataset_name: Optional[str] = _help("Dataset name on the hub (see datasets).", default=None)
    dataset_config_name: Optional[str] = _help("Dataset configuration name.", default=None)
    train_file: Optional[str] = _help("Local training file (json, jsonl, csv; txt for language modeling), "
                                      "also compressed (.gz, .bz2, .xz).", default=None)
    validation_file: Optional[str] = _help("Local validation file.", default=None)
    max_train_samples: Optional[int] = _help("Truncate the training set (smoke tests).", default=None)
    max_eval_samples: Optional[int] = _help("Truncate the validation set.", default=None)
    preprocessing_num_workers: Optional[int] = _help("Processes for tokenization.", default=None)
    overwrite_cache: bool = _help("Recompute cached preprocessing.", default=False)

    def __post_init__(self):
        for name in ("max_train_samples", "max_eval_samples", "max_predict_samples"):
            value = getattr(self, name, None)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be a positive number of examples, got {value}; omit it to use all")
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise UsageError(f"--preprocessing_num_workers must be >= 1, got {self.preprocessing_num_workers}")


@dataclass
class EncoderDecoderModelArguments(ModelArguments):
    """A model joined from an encoder and a decoder with cross-attention (image captioning, speech
    recognition): each part pretrained or from its config (`utils.models.loading.join_configs`)."""
    encoder_model_name_or_path: Optional[str] = _help(
        "Pretrained encoder (name or path, any checkpoint format), e.g. google/vit-base-patch16-224-in21k or "
        "facebook/wav2vec2-base.", reads="its encoder", default=None)
    encoder_config_name: Optional[str] = _help("Config (name or path) of a new encoder, trained from scratch.",
                                               reads="its encoder's config", default=None)
    encoder_model_type: Optional[str] = _help("Model type of a new encoder, from its family's default config.",
                                              default=None)
    encoder_config_overrides: Optional[str] = _help(
        "Override config values of a new encoder, e.g. 'hidden_size=64,num_hidden_layers=2'.", default=None)
    decoder_model_name_or_path: Optional[str] = _help(
        "Pretrained decoder (name or path, any checkpoint format), e.g. gpt2.", reads="its decoder", default=None)
    decoder_config_name: Optional[str] = _help("Config (name or path) of a new decoder, trained from scratch.",
                                               reads="its decoder's config", default=None)
    decoder_model_type: Optional[str] = _help("Model type of a new decoder, from its family's default config.",
                                              default=None)
    decoder_config_overrides: Optional[str] = _help(
        "Override config values of a new decoder, e.g. 'hidden_size=64,num_hidden_layers=2'.", default=None)


@dataclass
class TrainingArguments:
    HELP_GROUP = "training"

    output_dir: str = _help("Where model, checkpoints, logs and results are written.", group="output", metavar="DIR")
    overwrite_output_dir: bool = _help("Allow writing into a non-empty output directory.", group="output",
                                       default=False)
    do_train: bool = _help("Run training.", default=False)
    do_eval: bool = _help("Evaluate on the validation set.", default=False)
    do_predict: bool = _help("Predict on the test set.", default=False)
    per_device_train_batch_size: int = _help(
        "Batch size per device (core) for training (--total_train_batch_size, when set, fixes the global batch "
        "instead).",
        default=8)
    total_train_batch_size: Optional[int] = _help(
        "Examples per optimizer step over all devices of all hosts; when set, the per-device batch is this / "
        "(devices x gradient_accumulation_steps), so a config trains the same way on any number of devices.",
        default=None,
    )
    per_device_eval_batch_size: int = _help("Batch size per device (core) for evaluation.", default=8)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer step.", default=1)
    learning_rate: float = _help("Peak learning rate.", default=5e-5)
    weight_decay: float = _help("AdamW weight decay (not applied to biases and norm scales).", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    adafactor: bool = _help("Use Adafactor instead of AdamW.", default=False)
    label_smoothing_factor: float = _help("Label smoothing epsilon (0 = none).", default=0.0)
    num_train_epochs: float = _help("Number of training epochs.", default=3.0)
    max_steps: int = _help("If > 0: total optimizer steps, overriding num_train_epochs.", default=-1)
    warmup_steps: int = _help("Linear warmup steps.", default=0)
    lr_scheduler_type: str = _help("Schedule after warmup: linear, cosine or constant.", default="linear")
    logging_steps: int = _help("Log training metrics every X steps.", group="output", default=500)
    progress_seconds: float = _help(
        "Where the log is no terminal (a file, CI): a progress line (step, loss, lr, tokens/s, eta) at least every "
        "X seconds of training (0: after every step), besides each logged step.", group="output", default=30.0)
    save_steps: int = _help("Save a checkpoint every X steps.", group="output", default=500)
    eval_steps: Optional[int] = _help("Evaluate every X steps (default: at the end of each epoch).", default=None)
    save_on_epoch_end: bool = _help("Also save a checkpoint at the end of every epoch.", group="output", default=False)
    save_total_limit: Optional[int] = _help("Keep at most this many checkpoints (oldest deleted).", group="output",
                                            default=2)
    resume_from_checkpoint: Optional[str] = _help(
        "Resume training exactly: 'latest' (the newest checkpoint in output_dir; a fresh start if there is none), "
        "a step number, a step directory (OUTPUT_DIR/checkpoints/120), a checkpoints directory or an output "
        "directory.", group="output", reads="its checkpoint", default=None
    )
    seed: int = _help("Random seed for initialization, shuffling and dropout.", default=42)
    dropout_rng: str = _help(
        "What draws the dropout masks: 'threefry' (JAX's default: the same masks on any layout and device count), "
        "'rbg' (XLA's bit generator, far cheaper on TPUs; the masks depend on the layout and device count), 'chip' "
        "(under --sharding dp: each mask drawn by the TPU's own generator inside a Pallas kernel, never written out; "
        "elsewhere Pallas' interpreter, slow), or 'auto': on TPUs chip under dp where the attention runs through the "
        "kernels (--attention), rbg otherwise; threefry elsewhere.", group="tpu", default="auto")
    push_to_hub: bool = _help("Upload the model to the Hugging Face hub at each save.", group="hub", default=False)
    hub_model_id: Optional[str] = _help("Repository name on the hub (default: output_dir's name).", group="hub",
                                        default=None)
    hub_token: Optional[str] = _help("Token for pushing to the hub (never logged or saved).", group="hub",
                                     default=None)
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", group="memory",
                                         default=False)
    gradient_checkpointing_policy: str = _help(
        "With --gradient_checkpointing, what each layer keeps of its forward pass for the backward one: 'nothing' "
        "(all is recomputed: the least memory) or 'kernels' (the outputs of its Pallas kernels, the attention's on "
        "TPUs above all, whose forward then runs once; a little more memory).", group="memory", default="nothing")
    attention: str = _help(
        "The self-attention kernel of GPT-2, Llama, BERT and RoBERTa models: 'splash' (Pallas' TPU kernels, which "
        "never write the score matrix out: a flash kernel that draws any attention dropout mask on the chip, for "
        "GPT-2 and the encoders always, for Llama while training with attention dropout, and JAX's splash kernel "
        "otherwise; for generation, a sliding window or lengths not a multiple of 128 the stock attention runs), "
        "'xla' (the stock attention), or 'auto': splash on TPUs. Under --sharding fsdp each device runs the kernels "
        "on its rows.", group="tpu", default="auto")
    scan_layers: str = _help(
        "Run the layer stack of GPT-2, Llama, Mistral and Gemma models under jax.lax.scan, one layer traced and "
        "compiled instead of each: a faster start for slower steps and more memory (docs/performance.md); the "
        "parameters and checkpoints stay as they are. 'yes', 'no' (transformers' loop over the layers), or 'auto': yes on TPUs under "
        "--sharding dp. The arithmetic is the loop's, the dropout masks are not: layer i draws its masks from one key "
        "folded with i. Generation, and calls asking for every layer's hidden states or attention weights, run the "
        "loop.", group="tpu", default="no")
    sharding: str = _help(
        "Where the train state lives: 'dp' (jax.pmap; every device holds the whole model, its gradients and "
        "optimizer state) or 'fsdp' (jax.jit over a mesh of all devices; parameters, gradients and optimizer "
        "state split over the devices, for models larger than one device).", group="memory", default="dp")
    fsdp_size: Optional[int] = _help(
        "With --sharding fsdp: devices each parameter is split over (default: all); the mesh is "
        "(devices / fsdp_size) x fsdp_size, data parallel across the groups.", group="memory", default=None)
    compile_only: Optional[str] = _help(
        f"Will it fit? Build the run as it would train, compile its train step (and its eval, predict or "
        f"generate steps) for this TPU slice ("
        f"{', '.join(TPU_SLICES)}) with the TPU compiler (libtpu, requirements-tpu.txt; no TPU needed, no weights "
        "read), report its memory per device against the slice's HBM in all_results.json and metrics.jsonl, "
        "and exit without training (status 1 when it does not fit).", group="tpu", default=None)
    compilation_cache_dir: Optional[str] = _help(
        "JAX persistent compilation cache directory; 'none' turns it off.", group="tpu",
        default="~/.cache/flaxtune/jax"
    )
    debug: bool = _help("Show full tracebacks on errors.", group="output", default=False)
    coordinator_address: Optional[str] = _help(
        "Multi-host: host:port of process 0, the same on every process (default: $JAX_COORDINATOR_ADDRESS; "
        "found automatically on TPU pods).", group="multihost", default=None
    )
    num_processes: Optional[int] = _help(
        "Multi-host: number of processes (default: $JAX_NUM_PROCESSES; 1 turns multi-host set-up off).",
        group="multihost", default=None
    )
    process_id: Optional[int] = _help("Multi-host: this process's index, 0 to num_processes - 1 "
                                      "(default: $JAX_PROCESS_ID).", group="multihost", default=None)

    def __post_init__(self):
        positive = ("per_device_train_batch_size", "total_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "logging_steps", "save_steps", "eval_steps", "save_total_limit")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive, got {value}")
        if self.progress_seconds < 0:
            raise UsageError(f"--progress_seconds must be 0 (a line after every step) or more, got "
                             f"{self.progress_seconds}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be an integer from 0 to 2**32 - 1, got {self.seed}")
        if self.learning_rate <= 0:
            raise UsageError(f"--learning_rate must be positive, got {self.learning_rate}")
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise UsageError(f"--num_train_epochs must be positive, got {self.num_train_epochs} (or set --max_steps)")
        if self.warmup_steps < 0 or self.weight_decay < 0 or not 0 <= self.label_smoothing_factor < 1:
            raise UsageError("--warmup_steps and --weight_decay must be >= 0 and --label_smoothing_factor in [0, 1)")
        if self.dropout_rng not in DROPOUT_GENERATORS:
            raise UsageError(f"--dropout_rng {self.dropout_rng!r} is unknown: use one of {', '.join(DROPOUT_GENERATORS)}")
        if self.attention not in ATTENTION:
            raise UsageError(f"--attention {self.attention!r} is unknown: use one of {', '.join(ATTENTION)}")
        if self.scan_layers not in SCAN_LAYERS:
            raise UsageError(f"--scan_layers {self.scan_layers!r} is unknown: use one of {', '.join(SCAN_LAYERS)}")
        if self.gradient_checkpointing_policy not in CHECKPOINTING_POLICIES:
            raise UsageError(f"--gradient_checkpointing_policy {self.gradient_checkpointing_policy!r} is unknown: use "
                             f"one of {', '.join(CHECKPOINTING_POLICIES)}")
        if self.gradient_checkpointing_policy != "nothing" and not self.gradient_checkpointing:
            raise UsageError(f"--gradient_checkpointing_policy {self.gradient_checkpointing_policy} says what "
                             "--gradient_checkpointing keeps, and it is off: add --gradient_checkpointing")
        if self.sharding not in LAYOUTS:
            raise UsageError(f"--sharding {self.sharding!r} is unknown: use one of {', '.join(LAYOUTS)}")
        if self.fsdp_size is not None and (self.sharding != "fsdp" or self.fsdp_size <= 0):
            raise UsageError(f"--fsdp_size {self.fsdp_size}: it must be positive, and it applies only with "
                             "--sharding fsdp")
        if self.lr_scheduler_type not in SCHEDULES:
            raise UsageError(f"--lr_scheduler_type {self.lr_scheduler_type!r} is unknown: use one of {', '.join(SCHEDULES)}")
        if self.compile_only is not None:
            if self.compile_only not in TPU_SLICES:
                raise UsageError(f"--compile_only {self.compile_only!r} is not a TPU slice this check knows: use one "
                                 f"of {', '.join(TPU_SLICES)}")
            if not self.do_train:
                raise UsageError(f"--compile_only {self.compile_only} plans the train step: pass --do_train")
            if self.push_to_hub:
                raise UsageError("--compile_only trains nothing, so there is nothing to push: drop --push_to_hub")
        self.output_dir = os.path.expanduser(self.output_dir)
        check_distributed(self.coordinator_address, self.num_processes, self.process_id)


class InputPath(NamedTuple):
    flag: str  # the argument that names it, e.g. "model_name_or_path"
    path: str  # as given
    reader: str  # what reads it, for an error: "--model_name_or_path outputs/x reads its model from"


def input_paths(*instances):
    """An `InputPath` for every argument of `instances` (argument dataclasses; anything else is passed over)
    that names what the run reads a model, config, tokenizer, checkpoint, ... from (its field's `READS`),
    where given; a hub id among them is for the caller to tell from a local path. A PEFT adapter that
    --model_name_or_path names (`ModelArguments._continue_peft_adapter`) gives the adapter's directory and
    the base model it names."""
    found = []
    for instance in instances:
        if not dataclasses.is_dataclass(instance):
            continue
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            if READS not in f.metadata or not value:
                continue
            adapter = getattr(instance, "lora_adapter_dir", None) if f.name == "model_name_or_path" else None
            if adapter:
                found.append(InputPath(f.name, adapter, f"--{f.name} {adapter} reads its LoRA adapter from"))
                found.append(InputPath(f.name, value, f"{value} that the LoRA adapter --{f.name} {adapter} names as "
                                                      "its base model"))
            else:
                found.append(InputPath(f.name, value, f"--{f.name} {value} reads {f.metadata[READS]} from"))
    return found


def public_args(*instances) -> dict:
    """All arguments as one dict, with secrets removed, for logs and saved files."""
    merged = {}
    for instance in instances:
        merged.update(dataclasses.asdict(instance))
    for name in SECRET_FIELDS:
        merged.pop(name, None)
    return merged


def save_args(output_dir, *instances, filename="run_args.json"):
    with open(os.path.join(output_dir, filename), "w", encoding="utf-8") as f:
        json.dump(public_args(*instances), f, indent=2, sort_keys=True)


def check_output_dir(training_args, has_checkpoint: bool):
    """Refuse to clobber a finished run; called before anything heavy happens."""
    out = training_args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output_dir {out} is a file, not a directory: choose another path")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--output_dir {out} is not writable: choose a directory you can write to")
    if not training_args.do_train or training_args.overwrite_output_dir:
        return
    if training_args.resume_from_checkpoint:
        return
    if os.path.isdir(out) and os.listdir(out):
        hint = "--resume_from_checkpoint latest to continue it, or " if has_checkpoint else ""
        raise UsageError(
            f"output directory {out} already exists and is not empty: use {hint}--overwrite_output_dir to "
            "overwrite it, or choose another --output_dir"
        )


def check_distributed(coordinator_address, num_processes, process_id):
    """Check the multi-host settings given; `devices.initialize_processes` checks them again once the
    environment has filled in the missing ones."""
    if coordinator_address is not None:
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--coordinator_address {coordinator_address!r} must be host:port, e.g. 10.0.0.1:1234")
    if num_processes is not None and num_processes < 1:
        raise UsageError(f"--num_processes must be positive, got {num_processes}")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        raise UsageError(f"--process_id must be in 0..num_processes - 1, got {process_id}")


def tpu_lever(flag, choice, on, off, known, knows, platform, layout_name, layouts=("dp",)):
    """Whether a TPU lever's `auto | on | off` flag (`--attention`, `--scan_layers`) at `choice` turns it on:
    `off` never; `on` always, a `UsageError` where it cannot be had (a layout not in `layouts`; a model it
    does not know: `known` False, `knows` saying what it knows and of which model); "auto" on TPUs under
    `layouts` for the models it knows."""
    if choice == off:
        return False
    if layout_name not in layouts:
        if choice == on:
            raise UsageError(f"--{flag} {on} runs under --sharding {' or '.join(layouts)}: use --{flag} auto or "
                             f"{off} with {layout_name}")
        return False
    if not known:
        if choice == on:
            raise UsageError(f"--{flag} {on}: {knows}: use --{flag} auto or {off}")
        return False
    return choice == on or platform == "tpu"


def check_phases(training_args):
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        raise UsageError("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
