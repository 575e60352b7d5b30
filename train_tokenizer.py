"""Train a small tokenizer from local text files (or a dataset) and save it for `AutoTokenizer`.

Three kinds, each wired the way its model family expects:

- "bpe": byte-level BPE (GPT-2 / RoBERTa). `<s>`=0 `<pad>`=1 `</s>`=2 `<unk>`=3 `<mask>`=4,
  inputs become `<s> A </s>`.
- "wordpiece": BERT. `[PAD]`=0 `[UNK]` `[CLS]` `[SEP]` `[MASK]`, inputs become `[CLS] A [SEP]`.
- "unigram": T5. `<pad>`=0 `</s>`=1 `<unk>`=2, inputs become `A </s>`. The pieces are learnt by
  sentencepiece (see `_train_unigram` for why) and served by a `tokenizers` Unigram model.

`--extra_ids N` adds T5's sentinel tokens for span corruption, `<extra_id_0>` ... `<extra_id_{N-1}>`,
after the learnt vocabulary and counting down as T5's do: `<extra_id_0>` has the highest id.

A freshly trained `tokenizers.Tokenizer` has no post-processor, so without the templates set here
the encoded inputs and labels would silently lack their BOS/EOS.

    python train_tokenizer.py --kind unigram --train_files train.jsonl --text_column document \
        --vocab_size 2000 --output_dir my_tokenizer
    python train_tokenizer.py --kind unigram --train_files data/lm/train.txt --vocab_size 2000 \
        --extra_ids 100 --output_dir t5_tokenizer   # T5-style, 100 sentinels
"""

import argparse
import collections
import io
import itertools
import os
import sys
import tempfile

import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from utils.base.errors import UsageError  # a problem with the user's arguments or files: one line, exit code 2
from utils.data import file_formats

KINDS = ("bpe", "wordpiece", "unigram")
SENTINEL = "<extra_id_{}>"
FILE_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _train_bpe(texts, vocab_size, min_frequency, lowercase):
    # The mask token swallows the space before it, as RoBERTa's does, so "a <mask> b" masks " word".
    mask = AddedToken("<mask>", lstrip=True, special=True)
    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", mask],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: <unk> never used
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, dict(
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", cls_token="<s>",
        sep_token="</s>", mask_token=mask, model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,  # the ByteLevel decoder already restores the exact text
    )


def _train_wordpiece(texts, vocab_size, min_frequency, lowercase):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, dict(
        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        # Punctuation is split into its own words; BERT's clean-up rejoins "don ' t" and " ,".
        clean_up_tokenization_spaces=True,
    )


def _unigram_seeds(words, min_frequency, max_piece_length=16, limit=1_000_000):
    """Every substring of the words seen min_frequency times, scored frequency x length like spm's."""
    counts = collections.Counter()
    for word, n in words.items():
        if n < min_frequency:
            continue
        for i in range(len(word)):
            for j in range(i + 2, min(len(word), i + max_piece_length) + 1):
                counts[word[i:j]] += n
    scored = sorted(((piece, n * len(piece)) for piece, n in counts.items()), key=lambda x: (-x[1], x[0]))
    return scored[:limit]


def _train_unigram(texts, vocab_size, min_frequency, lowercase):
    """SentencePiece unigram EM on our own seed pieces, loaded into a `tokenizers` Unigram model.

    Both `tokenizers`' UnigramTrainer and sentencepiece's default seeding take candidate pieces from
    a suffix array, which only proposes substrings followed by two different characters. A word
    always followed by a space ("The", "was", "weather") is then never a candidate, and on a small
    templated corpus it ends up split into fragments. Seeding with every substring of the counted
    words fixes that; the EM and pruning stay sentencepiece's.
    """
    normalizer = normalizers.Sequence([normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else []))
    # Whitespace runs (newlines, tabs) collapse to the single word boundary the Metaspace marks.
    sentences = [" ".join(normalizer.normalize_str(t).split()) for t in texts]
    words = collections.Counter("▁" + w for s in sentences for w in s.split())
    with tempfile.TemporaryDirectory() as tmp:
        seed_file = os.path.join(tmp, "seeds.tsv")
        with open(seed_file, "w", encoding="utf-8") as f:
            f.writelines(f"{piece}\t{score}\n" for piece, score in _unigram_seeds(words, min_frequency))
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=model, seed_sentencepieces_file=seed_file,
                model_type="unigram", vocab_size=vocab_size, hard_vocab_limit=False, character_coverage=1.0,
                pad_id=0, eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name="identity",
                max_sentence_length=1 << 24, num_threads=1, minloglevel=2,  # one thread: reproducible scores
            )
        except RuntimeError as err:  # e.g. a vocab_size below the number of distinct characters
            raise ValueError(f"unigram training failed: {err}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=False))
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok, dict(
        eos_token="</s>", unk_token="<unk>", pad_token="<pad>", model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,  # Metaspace already restores the (normalised) spacing
    )


def _post_processor(kind, tok):
    if kind == "bpe":
        # sep and cls by position: tokenizers 0.23 refuses cls= as a keyword
        return processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")),
                                            add_prefix_space=False)
    if kind == "wordpiece":
        return processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    return processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )


def _non_empty(texts):
    texts = (t for t in texts if t and t.strip())
    first = next(texts, None)
    if first is None:
        raise ValueError("no non-empty texts to train on")
    return itertools.chain([first], texts)


def _add_sentinels(tok, extra_ids):
    """`<extra_id_0>` added last gets the highest id; matched in the raw text, as T5's are."""
    tok.add_special_tokens([AddedToken(SENTINEL.format(i), special=True, normalized=False)
                            for i in reversed(range(extra_ids))])
    return [SENTINEL.format(i) for i in range(extra_ids)]


def train_tokenizer(kind, texts, vocab_size, min_frequency=2, model_max_length=512, lowercase=False, extra_ids=0):
    """Train a `kind` tokenizer on an iterable of strings; return it wrapped for transformers.

    `vocab_size` is an upper bound: a small corpus may not support that many pieces. The
    `extra_ids` sentinel tokens come on top of it.
    """
    trainers_by_kind = {"bpe": _train_bpe, "wordpiece": _train_wordpiece, "unigram": _train_unigram}
    if kind not in trainers_by_kind:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
    tok, wrapper_kwargs = trainers_by_kind[kind](_non_empty(texts), vocab_size, min_frequency, lowercase)
    if extra_ids:
        wrapper_kwargs["additional_special_tokens"] = _add_sentinels(tok, extra_ids)
    tok.post_processor = _post_processor(kind, tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **wrapper_kwargs)


# ----------------------------------------------------------------------------- command line


def _pick_column(column_names, features, requested, source):
    if requested is not None:
        if requested not in column_names:
            raise UsageError(f"{source} has no column {requested!r} (columns: {', '.join(column_names)})")
        return requested
    if "text" in column_names:
        return "text"
    for name in column_names:
        if getattr(features[name], "dtype", None) in ("string", "large_string"):
            return name
    raise UsageError(f"{source} has no string column; pass --text_column")


def _load(loader, source):
    """Run a `datasets` loader quietly, turning its failures into a one-line usage error."""
    import datasets  # imported late: it is slow and only needed for non-txt inputs

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as our one line
    try:
        return loader(datasets)
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad input for this CLI
        while err.__cause__ is not None:  # the root cause names the real problem (e.g. a JSON parse error)
            err = err.__cause__
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UsageError(f"could not load {source}: {first_line}") from None


def _column_texts(ds, requested_column, source):
    column = _pick_column(ds.column_names, ds.features, requested_column, source)  # checked now, not lazily
    return (text for batch in ds.iter(batch_size=1000) for text in batch[column])


def _text_lines(path):
    with open(path, encoding="utf-8") as f:
        yield from (line.strip() for line in f if line.strip())


def check_inputs(args):
    """Fail before any loading when an argument, a file or an extension is wrong."""
    if not args.train_files and not args.dataset_name:
        raise UsageError("give --train_files and/or --dataset_name")
    for path in args.train_files or []:
        ext = os.path.splitext(path)[1].lower()
        if ext not in FILE_FORMATS:
            raise UsageError(f"{path}: unsupported extension {ext!r} (use {', '.join(FILE_FORMATS)})")
        if not os.path.isfile(path):
            raise UsageError(f"{path}: no such file")
        file_formats.check_file(path)  # empty, not UTF-8, JSON that does not parse, a CSV header without rows
    if args.vocab_size < 1:
        raise UsageError("--vocab_size must be positive")
    if args.extra_ids < 0:
        raise UsageError(f"--extra_ids must be 0 or more, got {args.extra_ids}")


def open_texts(args):
    """Open every input and resolve its column up front, so a bad one fails before training starts."""
    sources = []
    for path in args.train_files or []:
        fmt = FILE_FORMATS[os.path.splitext(path)[1].lower()]
        if fmt == "text":
            sources.append(_text_lines(path))
        else:
            ds = _load(lambda datasets: datasets.load_dataset(fmt, data_files=path, split="train"), path)
            sources.append(_column_texts(ds, args.text_column, path))
    if args.dataset_name:
        source = f"dataset {args.dataset_name}"
        name, config, split = args.dataset_name, args.dataset_config_name, args.dataset_split
        ds = _load(lambda datasets: datasets.load_dataset(name, config, split=split), source)
        sources.append(_column_texts(ds, args.text_column, source))
    return itertools.chain.from_iterable(sources)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--train_files", nargs="+", help=".txt (one text per line), .json, .jsonl or .csv")
    p.add_argument("--text_column", help='column to train on (default "text", else the first string column)')
    p.add_argument("--dataset_name", help="a `datasets` name or path, used in addition to --train_files")
    p.add_argument("--dataset_config_name")
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--vocab_size", type=int, required=True)
    p.add_argument("--min_frequency", type=int, default=2, help="bpe/wordpiece: min pair count to merge; "
                   "unigram: min word count to seed pieces")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--model_max_length", type=int, default=512)
    p.add_argument("--extra_ids", type=int, default=0, help="sentinel tokens <extra_id_0>.. for T5 span "
                   "corruption (T5 has 100), added after the learnt vocabulary, <extra_id_0> the highest id")
    p.add_argument("--output_dir", required=True)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        check_inputs(args)
        tokenizer = train_tokenizer(
            args.kind, open_texts(args), args.vocab_size, args.min_frequency, args.model_max_length, args.lowercase,
            args.extra_ids,
        )
    except (UsageError, ValueError) as err:
        print(f"train_tokenizer.py: error: {err}", file=sys.stderr)
        return 2
    tokenizer.save_pretrained(args.output_dir)
    print(f"trained {args.kind} tokenizer: vocab size {len(tokenizer)}, saved to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
