"""Every training script on one tiny config, run in each layout the cross-layout tests compare:
`dp` and `fsdp` on 1 process x 8 virtual devices (tests/test_fsdp.py), and `dp` on 2 processes x 4
devices (tests/test_multihost.py). Each run starts when a test first asks for it, so `-k` runs only
what it selects, and is shared by every test module of the session (the `layout_runs` fixture),
and by every xdist worker: the first to ask runs it while the others wait on its lock.

Dropout is off: dp draws one dropout key per device, fsdp one for the global batch, so with dropout
on the layouts would differ by design.
"""

import os
import sys

from filelock import FileLock

from script_runner import ROOT, free_port, run_processes, script_env

COMMON = ["--do_train", "--do_eval", "--max_steps", 10, "--logging_steps", 1, "--save_steps", 5,
          "--learning_rate", 3e-3, "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 2,
          "--compilation_cache_dir", "none"]
SCRIPTS = {
    "summarization": ("run_summarization_flax.py", [
        "--model_type", "t5", "--tokenizer_name", "data/summarization/tokenizer", "--config_overrides",
        "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0",
        "--train_file", "data/summarization/train.jsonl", "--validation_file", "data/summarization/validation.jsonl",
        "--test_file", "data/summarization/test.jsonl", "--max_train_samples", 160, "--max_eval_samples", 21,
        "--max_predict_samples", 21, "--max_source_length", 48, "--max_target_length", 12, "--do_predict",
        "--predict_with_generate", "--num_beams", 2]),
    "clm": ("run_clm_flax.py", [
        "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "n_embd=64,n_layer=2,n_head=4,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--block_size", 32,
        "--max_train_samples", 640, "--max_eval_samples", 40]),
    "mlm": ("run_mlm_flax.py", [
        "--model_type", "roberta", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,max_position_embeddings=34,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", 32,
        "--max_train_samples", 640, "--max_eval_samples", 40]),
    # d_model 128: the 405-token shared embedding is then large enough to split (utils/layout/layouts.py).
    "t5 mlm": ("run_t5_mlm_flax.py", [
        "--model_type", "t5", "--tokenizer_name", "data/lm/t5_tokenizer", "--config_overrides",
        "d_model=128,d_ff=32,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", 32,
        "--max_train_samples", 320, "--max_eval_samples", 40]),
    # BART denoising: d_model 128, so the attention kernels split too; random tokens and permutation on.
    "bart dlm": ("run_bart_dlm_flax.py", [
        "--model_type", "bart", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "d_model=128,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
        "encoder_ffn_dim=32,decoder_ffn_dim=32,max_position_embeddings=32,dropout=0.0,attention_dropout=0.0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", 32,
        "--random_token_ratio", 0.1, "--max_train_samples", 320, "--max_eval_samples", 40]),
    # intermediate_size 256: the 64 x 256 feed-forward kernels are large enough to split as well.
    "glue": ("run_flax_glue.py", [
        "--model_type", "bert", "--tokenizer_name", "data/glue/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,max_position_embeddings=16,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--task_name", "cola", "--train_file", "data/glue/cola/train.csv", "--validation_file",
        "data/glue/cola/validation.csv", "--test_file", "data/glue/cola/test.csv", "--max_seq_length", 16,
        "--max_train_samples", 160, "--max_eval_samples", 40, "--max_predict_samples", 21, "--do_predict"]),
    "ner": ("run_flax_ner.py", [
        "--model_type", "bert", "--tokenizer_name", "data/ner/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=128,max_position_embeddings=32,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/ner/train.jsonl", "--validation_file", "data/ner/validation.jsonl",
        "--test_file", "data/ner/test.jsonl", "--max_seq_length", 32, "--max_train_samples", 160,
        "--max_eval_samples", 37, "--max_predict_samples", 21, "--do_predict"]),
    "image": ("run_image_classification.py", [
        "--model_type", "vit", "--config_overrides",
        "image_size=16,patch_size=4,hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_dir", "data/images/train", "--validation_dir", "data/images/validation", "--test_dir",
        "data/images/validation", "--max_train_samples", 160, "--max_eval_samples", 40, "--max_predict_samples", 21,
        "--do_predict"]),
    "qa": ("run_qa.py", [
        "--model_type", "bert", "--tokenizer_name", "data/qa/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,max_position_embeddings=64,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/qa/train_v2.json.gz", "--validation_file", "data/qa/validation_v2.json",
        "--test_file", "data/qa/test.jsonl", "--version_2_with_negative", "--max_seq_length", 64, "--doc_stride", 16,
        "--max_train_samples", 60, "--max_eval_samples", 21, "--max_predict_samples", 13, "--do_predict"]),
    # Long documents in windows with the category head; full attention: block-sparse attention draws its
    # random blocks from the dropout key, which the layouts draw differently by design.
    "long qa": ("run_qa.py", [
        "--model_type", "big_bird", "--tokenizer_name", "data/long_qa/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=128,max_position_embeddings=128,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/long_qa/train.jsonl.gz", "--validation_file", "data/long_qa/validation.jsonl.gz",
        "--test_file", "data/long_qa/test.jsonl.gz", "--answer_categories", "--attention_type", "original_full",
        "--max_seq_length", 64, "--doc_stride", 32, "--max_train_samples", 40, "--max_eval_samples", 6,
        "--max_predict_samples", 4, "--do_predict"]),
    # Chat rows (run_clm_flax.py): the loss on the answers, sampled answers to the held-out prompts (each row
    # draws from its own key: every layout and process count draws the same answers).
    "chat": ("run_clm_flax.py", [
        "--model_type", "llama", "--tokenizer_name", "data/chat/tokenizer", "--config_overrides",
        "hidden_size=64,intermediate_size=256,num_hidden_layers=1,num_attention_heads=4,num_key_value_heads=2,"
        "max_position_embeddings=64,rope_theta=500000.0",
        "--train_file", "data/chat/train.jsonl", "--validation_file", "data/chat/validation.jsonl",
        "--test_file", "data/chat/test.jsonl", "--block_size", 64, "--max_train_samples", 160,
        "--max_eval_samples", 21, "--max_predict_samples", 13, "--do_predict", "--predict_with_generate",
        "--max_new_tokens", 4, "--do_sample", "--top_p", 0.9]),
    # Clips read, resampled and featurised by threads ahead of the step; transcripts generated.
    "speech": ("run_speech_recognition_seq2seq.py", [
        "--model_type", "whisper", "--tokenizer_name", "data/speech/tokenizer", "--feature_extractor_name",
        "data/speech/tokenizer", "--config_overrides",
        "d_model=64,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
        "encoder_ffn_dim=256,decoder_ffn_dim=256,max_target_positions=16,dropout=0.0",
        "--train_file", "data/speech/train.csv", "--validation_file", "data/speech/validation.csv",
        "--test_file", "data/speech/test.csv", "--language", "english", "--max_duration_in_seconds", 2,
        "--max_label_length", 12, "--max_train_samples", 48, "--max_eval_samples", 16, "--max_predict_samples", 8,
        "--do_predict", "--predict_with_generate"]),
    "captioning": ("run_image_captioning_flax.py", [
        "--encoder_model_type", "vit", "--encoder_config_overrides",
        "image_size=32,patch_size=8,hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--decoder_model_type", "gpt2", "--decoder_config_overrides",
        "n_embd=64,n_layer=1,n_head=2,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        "--tokenizer_name", "data/image_text/tokenizer", "--train_file", "data/image_text/train_dataset.json",
        "--validation_file", "data/image_text/valid_dataset.json", "--test_file", "data/image_text/test_dataset.json",
        "--max_target_length", 20, "--max_train_samples", 160, "--max_eval_samples", 24, "--max_predict_samples", 16,
        "--do_predict", "--predict_with_generate", "--num_beams", 2]),
}
# What each script predicts, one line per example: the same lines in every layout (long QA's predictions carry
# float scores, which differ in their last digits between layouts: its results are compared instead).
PREDICTIONS = {"summarization": "generated_predictions.txt", "glue": "predict_results_cola.txt",
               "ner": "predictions.txt", "image": "predict_results.txt", "qa": "predict_predictions.json",
               "chat": "generated_predictions.txt", "speech": "generated_predictions.txt",
               "captioning": "generated_predictions.txt"}


def command(name, output_dir, *extra):
    script, args = SCRIPTS[name]
    return [os.path.join(ROOT, script), *map(str, args + COMMON + ["--output_dir", output_dir, *extra])]


class LayoutRuns(dict):
    """{(script, layout): output dir}; layout "dp" or "fsdp" (run as a pair, side by side: two cores,
    two runs), or "2x4": (process 0's output dir, process 1's), each process with a disk of its own."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)

    def __missing__(self, key):
        name, layout = key
        if layout == "2x4":
            outs, port = (self.tmp / f"{name}_2x4_host0", self.tmp / f"{name}_2x4_host1"), free_port()
            runs, done = {key: outs}, self.tmp / f"{name}_2x4.done"
            commands = [command(name, str(out), "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", 2,
                                "--process_id", i) for i, out in enumerate(outs)]
            env = script_env(devices=4)
        else:
            runs = {(name, sharding): self.tmp / f"{name}_{sharding}" for sharding in ("dp", "fsdp")}
            outs, done = list(runs.values()), self.tmp / f"{name}_dp_fsdp.done"
            commands = [command(name, str(out), "--sharding", sharding) for (_, sharding), out in runs.items()]
            env = script_env()
        with FileLock(f"{done}.lock"):
            if not done.exists():  # a failed run leaves no mark: it fails again in each test that asks for it
                run_processes([[sys.executable, *argv] for argv in commands],
                              [out.parent / f"{out.name}.log" for out in outs], [env] * len(commands))
                done.touch()
        self.update(runs)
        return self[key]
