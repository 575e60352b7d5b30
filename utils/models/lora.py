"""Low-rank adapters (LoRA, `--lora_rank`): a frozen base model, small trained matrices beside it.

A targeted layer (a module with a 2-D `kernel`: `nn.Dense`, GPT-2's `Conv1D`) computes
`y = x W + (alpha / rank) (x A) B`: `A` (in x rank) and `B` (rank x out) live in the model's own
parameter tree beside the kernel, as `lora_A` and `lora_B`, so every step a script compiles with its
params (train, eval, predict, generate) runs the adapted model without knowing it. `B` starts at
zero: step 0 is the base model exactly. The adapters are applied at the layer's call by a method
interceptor (`attach`), never by materialising `W + (alpha / rank) A B`: a step holds no second copy of
the weights.

Only the adapters and a task's new head (classification, tagging, QA: `head_modules`) are trained; the
base is frozen: `FrozenBaseState` differentiates and keeps optimizer state for the trainable leaves
alone, and checkpoints hold only those (`checkpointed`, `restored`). The export folds the adapters in
(`merged`: a normal checkpoint) and also writes them in PEFT's layout (`peft_files`).
"""

import os
import re
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from flax.training.train_state import TrainState
from flax.traverse_util import flatten_dict, unflatten_dict

from utils.base.arguments import LORA_TARGET_NAMES
from utils.base.errors import UsageError
from utils.kernels.hooks import intercept_calls

ADAPTER_LEAVES = ("lora_A", "lora_B")
# `--lora_target attention` (the default): each family's attention projections, by module path.
ATTENTION_TARGETS = "|".join((
    r"(^|/)attn/c_(attn|proj)$",  # GPT-2 (its MLP's c_proj is mlp/c_proj: not matched)
    r"(^|/)crossattention/(c_attn|q_attn|c_proj)$",  # GPT-2 as a decoder: keys and values, queries, output
    r"(^|/)(SelfAttention|EncDecAttention)/[qkvo]$",  # T5, mT5, LongT5
    r"(^|/)attention/(self|attention)/(query|key|value)$|(^|/)attention/output/dense$",  # BERT-likes, ViT, BigBird
    r"(^|/)attention/(query|key|value|dense)$",  # ALBERT
    r"(^|/)attention/(q_lin|k_lin|v_lin|out_lin)$",  # DistilBERT
    # BART, mBART, Pegasus, Marian, Whisper, wav2vec2, CLIP, Llama, Mistral, Gemma, OPT, GPT-Neo; the project's
    # decoder family (Qwen, Gemma 2 / 3, and Phi-3, whose queries, keys and values are one qkv_proj)
    r"(^|/)(self_attn|encoder_attn|attention)/(q_proj|k_proj|v_proj|qkv_proj|o_proj|out_proj)$",
    r"(^|/)self_attention/(query_key_value|dense)$",  # BLOOM
))
TARGET_RULES = dict(zip(LORA_TARGET_NAMES, (ATTENTION_TARGETS, ".*")))  # --lora_target attention, all-linear
# The Auto classes whose head a checkpoint of the base model lacks: it is new, so it trains in full.
# PEFT's task types, by the end of the Auto class's name (none for the others: masked LM, images).
PEFT_TASK_TYPES = {"SequenceClassification": "SEQ_CLS", "TokenClassification": "TOKEN_CLS",
                   "QuestionAnswering": "QUESTION_ANS", "CausalLM": "CAUSAL_LM", "Seq2SeqLM": "SEQ_2_SEQ_LM",
                   "SpeechSeq2Seq": "SEQ_2_SEQ_LM"}
TASK_HEAD_CLASSES = ("SequenceClassification", "TokenClassification", "QuestionAnswering", "ImageClassification",
                     "MultipleChoice")
TWO_TOWERS = {"text_model", "vision_model"}


@dataclass(frozen=True)
class Adapters:
    """What `--lora_*` made of a model: `targets` maps each adapted module's path to (in, out,
    transposed: its kernel stored out x in, as GPT-2's Conv1D); `heads` are the top-level parameter
    groups trained in full."""

    rank: int
    alpha: float
    dropout: float
    target_rule: str
    targets: dict
    heads: tuple
    base_model: str | None
    base_dtype: str
    task_type: str | None  # PEFT's name for the task (`PEFT_TASK_TYPES`)

    @property
    def scale(self):
        return self.alpha / self.rank

    def describe(self):
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "target": self.target_rule,
                "base dtype": self.base_dtype}


def _kernel_modules(model):
    """{module path: (in, out, transposed)} of every module of `model` with a 2-D kernel, from a
    shapes-only trace of its init (nothing computed, nothing allocated)."""
    found = {}

    def record(next_fun, args, kwargs, context):
        outputs = next_fun(*args, **kwargs)
        module = context.module
        # A module applied on its own (GPT-2's tied output layer, path ()) is no layer of the model's tree.
        if (context.method_name == "__call__" and module.path and args and hasattr(args[0], "shape")
                and hasattr(outputs, "shape") and module.has_variable("params", "kernel")):
            kernel_shape = module.get_variable("params", "kernel").shape
            size_in, size_out = args[0].shape[-1], outputs.shape[-1]
            if len(kernel_shape) == 2 and isinstance(module, nn.Dense):
                found[tuple(module.path)] = (size_in, size_out, False)
            elif tuple(kernel_shape) == (size_out, size_in):  # GPT-2's Conv1D keeps PyTorch's out x in
                found[tuple(module.path)] = (size_in, size_out, True)
        return outputs

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), model.input_shape))
    return found


def head_modules(model, auto_class_name):
    """The top-level parameter groups of a task head (`TASK_HEAD_CLASSES`): all but the base model's;
    of a two-tower model (CLIP, a dual encoder), all but the towers: the projections and the temperature."""
    top = {path[0] for path in flatten_dict(model.params_shape_tree)}
    if TWO_TOWERS <= top:
        return tuple(sorted(top - TWO_TOWERS))
    if not any(name in auto_class_name for name in TASK_HEAD_CLASSES):
        return ()
    return tuple(sorted(top - {model.base_model_prefix})) if model.base_model_prefix in top else ()


def plan(model, model_args, auto_class_name, added_groups=()):
    """The `Adapters` of `--lora_*` for `model`, checked: the target rule must match at least one
    module outside the heads, and the rank fit every matched module's dimensions. `added_groups`: the
    top-level parameter groups of a head a task adds beside the model's parameters (outside the stock
    model), trained in full with the model's own heads."""
    rule = model_args.lora_target
    pattern = re.compile(TARGET_RULES.get(rule, rule))  # a valid regex: `ModelArguments` checked it
    heads = tuple(sorted(set(head_modules(model, auto_class_name)) | set(added_groups)))
    modules = _kernel_modules(model)
    targets = {path: dims for path, dims in modules.items()
               if path[0] not in heads and "lm_head" not in path and pattern.search("/".join(path))}
    if not targets:
        examples = ", ".join("/".join(path) for path in list(modules)[:3])
        raise UsageError(f"--lora_target {rule!r} matches no layer of this {model.config.model_type} model (its "
                         f"layers have paths like {examples}): use 'attention', 'all-linear' or a regex that matches")
    narrowest = min(targets, key=lambda path: min(targets[path][:2]))
    if model_args.lora_rank > min(targets[narrowest][:2]):
        size_in, size_out, _ = targets[narrowest]
        raise UsageError(f"--lora_rank {model_args.lora_rank} is larger than layer {'/'.join(narrowest)} "
                         f"({size_in} -> {size_out}): use a rank of at most {min(size_in, size_out)}")
    alpha = model_args.lora_alpha if model_args.lora_alpha is not None else 2.0 * model_args.lora_rank
    task_type = next((kind for suffix, kind in PEFT_TASK_TYPES.items() if auto_class_name.endswith(suffix)), None)
    return Adapters(model_args.lora_rank, float(alpha), model_args.lora_dropout, rule, targets, heads,
                    model_args.model_name_or_path, model_args.lora_base_dtype or model_args.param_dtype, task_type)


def new_weights(adapters, seed, shapes_only=False):
    """{module path: {"lora_A", "lora_B"}} in float32 on the host: A as PEFT draws it (Kaiming-uniform,
    bound 1 / sqrt(in)), B zeros; or their shapes (`jax.ShapeDtypeStruct`) only."""
    rng = np.random.default_rng(seed)
    weights = {}
    for path, (size_in, size_out, _) in sorted(adapters.targets.items()):
        shapes = {"lora_A": (size_in, adapters.rank), "lora_B": (adapters.rank, size_out)}
        if shapes_only:
            weights[path] = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
        else:
            bound = 1.0 / np.sqrt(size_in)
            weights[path] = {"lora_A": rng.uniform(-bound, bound, shapes["lora_A"]).astype(np.float32),
                             "lora_B": np.zeros(shapes["lora_B"], np.float32)}
    return unflatten_dict({path + (name,): value for path, leaves in weights.items() for name, value in leaves.items()})


def load_peft_weights(directory, adapters, params):
    """{flat path: float32 host array} of the adapters (and heads) of the PEFT adapter in `directory`,
    for the model whose parameters (adapters included, any placement) are `params`; an adapter made
    for another base (layers or shapes this model lacks) is a UsageError naming the first difference."""
    import safetensors.numpy  # only a run that continues an adapter reads one

    try:
        tensors = safetensors.numpy.load_file(os.path.join(directory, "adapter_model.safetensors"))
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {directory}/adapter_model.safetensors ({error}): is it a PEFT adapter?")
    flat = flatten_dict(params)
    by_name = {"base_model.model." + ".".join(path[:-1] + (TORCH_NAMES.get(path[-1], path[-1]),)): path
               for path in flat if path[-1] not in ADAPTER_LEAVES}
    by_name.update({f"base_model.model.{'.'.join(path[:-1])}.{path[-1]}.weight": path
                    for path in flat if path[-1] in ADAPTER_LEAVES})
    loaded = {}
    for key, value in tensors.items():
        path = by_name.get(key)
        value = np.asarray(value, np.float32)
        value = value.T if path and (path[-1] in ADAPTER_LEAVES or path[-1] == "kernel") else value
        if path is None or (path[-1] not in ADAPTER_LEAVES and path[0] not in adapters.heads):
            raise UsageError(f"the adapter in {directory} does not match this base model: it holds {key}, which is no "
                             f"adapted layer or head of it (other --lora_target, or another base model)")
        if value.shape != tuple(flat[path].shape):
            raise UsageError(f"the adapter in {directory} does not match this base model: {key} has shape "
                             f"{value.shape[::-1] if path[-1] in ADAPTER_LEAVES else value.shape} where the model "
                             "needs another (another base model or --lora_target)")
        loaded[path] = value
    missing = [path for path in flat if path[-1] in ADAPTER_LEAVES and path not in loaded]
    if missing:
        raise UsageError(f"the adapter in {directory} does not match this run: it has no adapter for "
                         f"{'/'.join(missing[0][:-1])} (pass the --lora_target it was trained with)")
    return loaded


def _adapted(adapters, next_fun, args, kwargs, context):
    """The interceptor: a module that holds adapters adds `scale (x A) B` to its output."""
    outputs = next_fun(*args, **kwargs)
    module = context.module
    if context.method_name != "__call__" or not module.has_variable("params", "lora_A"):
        return outputs
    inputs = args[0] if args else kwargs["inputs"]
    if adapters.dropout and module.has_rng("dropout"):  # training: transformers passes a dropout key then
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - adapters.dropout, inputs.shape)
        inputs = jnp.where(keep, inputs / (1.0 - adapters.dropout), 0)
    dtype = outputs.dtype
    low = inputs.astype(dtype) @ module.get_variable("params", "lora_A").astype(dtype)
    delta = low @ module.get_variable("params", "lora_B").astype(dtype)
    return outputs + (adapters.scale * delta).astype(dtype)


def attach(model, adapters):
    """Make every call of `model` apply the adapters its parameters hold (see the module's docstring)."""
    intercept_calls(model, partial(_adapted, adapters))
    model.lora_adapters = adapters


def adapters_of(model):
    """The `Adapters` attached to `model`, or None."""
    return getattr(model, "lora_adapters", None)


def trainable_paths(params, adapters):
    """The flat paths of the leaves trained with `adapters`: theirs and the heads'."""
    return tuple(sorted(path for path in flatten_dict(params)
                        if path[-1] in ADAPTER_LEAVES or path[0] in adapters.heads))


def split(params, trainable):
    """(the leaves at `trainable` paths, the others), each a nested dict."""
    flat = flatten_dict(params)
    chosen = set(trainable)
    return (unflatten_dict({k: v for k, v in flat.items() if k in chosen}),
            unflatten_dict({k: v for k, v in flat.items() if k not in chosen}))


def join(trainable, frozen):
    """The whole parameter tree again (`trainable` itself when nothing is frozen)."""
    if not frozen:
        return trainable
    return unflatten_dict({**flatten_dict(frozen), **flatten_dict(trainable)})


class FrozenBaseState(TrainState):
    """A TrainState whose optimizer sees only the `trainable` leaves of `params`: their gradients are
    the only ones `apply_gradients` takes, and the only optimizer state kept."""

    trainable: tuple = struct.field(pytree_node=False, default=())

    @classmethod
    def create(cls, *, apply_fn, params, tx, trainable, **kwargs):
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(split(params, trainable)[0]),
                   trainable=trainable, **kwargs)

    def apply_gradients(self, *, grads, **kwargs):
        trained, frozen = split(self.params, self.trainable)
        updates, opt_state = self.tx.update(grads, self.opt_state, trained)
        return self.replace(step=self.step + 1, params=join(optax.apply_updates(trained, updates), frozen),
                            opt_state=opt_state, **kwargs)


def trained_and_frozen(state):
    """(trainable params, frozen params) of a state; ({all}, {}) for a plain TrainState."""
    if isinstance(state, FrozenBaseState):
        return split(state.params, state.trainable)
    return state.params, {}


def checkpointed(state):
    """What a checkpoint of `state` holds: everything but a frozen base, which the model's own weights give back."""
    return state.replace(params=trained_and_frozen(state)[0])


def restored(state, from_checkpoint):
    """`state` with what a checkpoint restored (`checkpointed`'s part) in place of its own."""
    if not isinstance(state, FrozenBaseState):
        return from_checkpoint
    return from_checkpoint.replace(params=join(from_checkpoint.params, trained_and_frozen(state)[1]))


def count(tree):
    return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in jax.tree_util.tree_leaves(tree)))


def merged(params, adapters):
    """Host parameters with each adapter folded into its kernel, `W + scale A B` computed in float32
    (the kernel kept in float32 then), and the adapter leaves gone: a plain checkpoint of the model."""
    flat = flatten_dict(params)
    out = {path: value for path, value in flat.items() if path[-1] not in ADAPTER_LEAVES}
    for path, (_, _, transposed) in adapters.targets.items():
        a, b = (np.asarray(flat[path + (name,)], np.float32) for name in ADAPTER_LEAVES)
        delta = adapters.scale * (a @ b)
        kernel = np.asarray(out[path + ("kernel",)], np.float32)
        out[path + ("kernel",)] = kernel + (delta.T if transposed else delta)
    return unflatten_dict(out)


# Flax parameter names -> PyTorch's (a Dense kernel is stored in x out, a torch Linear weight out x in).
TORCH_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def peft_files(params, adapters):
    """(adapter_config.json's dict, adapter_model.safetensors' tensors) in PEFT's layout: keys
    `base_model.model.<module path>.lora_A.weight` ([rank, in]) and `.lora_B.weight` ([out, rank]), the
    PyTorch orientation whatever the kernel's (GPT-2's Conv1D: `fan_in_fan_out`); a head trained in full
    under its PyTorch name (`base_model.model.classifier.weight`)."""
    flat = flatten_dict(params)
    tensors = {}
    for path in sorted(adapters.targets):
        name = "base_model.model." + ".".join(path)
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(flat[path + ("lora_A",)], np.float32).T)
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(flat[path + ("lora_B",)], np.float32).T)
    for path, value in flat.items():  # the heads trained in full, PyTorch-named (PEFT's modules_to_save)
        if path[0] in adapters.heads:
            value = np.asarray(value, np.float32)
            tensors["base_model.model." + ".".join(path[:-1] + (TORCH_NAMES.get(path[-1], path[-1]),))] = (
                np.ascontiguousarray(value.T) if path[-1] == "kernel" else value)
    config = {
        "peft_type": "LORA", "task_type": adapters.task_type, "base_model_name_or_path": adapters.base_model,
        "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout, "bias": "none",
        "target_modules": sorted(".".join(path) for path in adapters.targets),
        "fan_in_fan_out": any(transposed for _, _, transposed in adapters.targets.values()),
        "modules_to_save": list(adapters.heads) or None, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False,
    }
    return config, tensors
