"""Extractive question answering: context windows, from their start / end logits to answers, and the SQuAD scores.

A long context is cut into overlapping windows (features, `cut_windows`: what run_qa.py trains and
predicts on, and what the demo feeds the model); `best_answers` gathers the best spans
of every window of an example and picks its answer, as the classic `utils_qa.py` of Hugging Face's
examples does, without its failure modes (no index past the candidates, no "empty" placeholder
text). The metrics are the official SQuAD v1.1 and v2.0 evaluation scripts' definitions, offline
and in their scale: percentages, 0 to 100.
"""

import collections
import inspect
import re
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text,
                        show_answer)
from utils.models import max_positions

TASK = Task("question-answering", "question-answering",
            outputs=("*_predictions.json", "*_nbest_predictions.json", "*_null_odds.json"))

NO_CONTEXT = -1  # the offsets of a token outside the context (question, special tokens, padding)


# ----------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------
class Window(NamedTuple):
    """One window of a (question, context) pair: `pair` its index among the pairs, `context_mask`
    [tokens] where the context's tokens are, `offsets` [tokens, 2] their character offsets into the
    context (NO_CONTEXT elsewhere), `null` the token that stands for "no answer"."""
    pair: int
    context_mask: np.ndarray
    offsets: np.ndarray
    null: int


def null_index(input_ids, attention_mask, cls_token_id):
    """The token that stands for "no answer": the CLS token, else the first real token (a tokenizer without CLS)."""
    if cls_token_id is not None:
        hits = np.flatnonzero(np.asarray(input_ids) == cls_token_id)
        if len(hits):
            return int(hits[0])
    return int(np.flatnonzero(np.asarray(attention_mask))[0])


def cut_windows(tokenizer, questions, contexts, seq_length, doc_stride):
    """(model inputs, windows) of (question, context) pairs: each window holds the whole question
    and a part of the context, consecutive parts sharing `doc_stride` tokens, padded to
    `seq_length`. The inputs are the tokenizer's columns (input_ids, attention_mask, ...: one row
    per window), `windows` a `Window` per row. A fast tokenizer (offsets) is needed."""
    pad_on_right = tokenizer.padding_side == "right"
    first, second = (questions, contexts) if pad_on_right else (contexts, questions)
    encoded = tokenizer(first, second, truncation="only_second" if pad_on_right else "only_first",
                        max_length=seq_length, stride=doc_stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, padding="max_length")
    pairs = encoded.pop("overflow_to_sample_mapping")
    offset_mapping = encoded.pop("offset_mapping")
    context_id = 1 if pad_on_right else 0
    windows = []
    for row, pair in enumerate(pairs):
        context_mask = np.array([s == context_id for s in encoded.sequence_ids(row)])
        offsets = np.array(offset_mapping[row], np.int64)
        offsets[~context_mask] = NO_CONTEXT
        null = null_index(encoded["input_ids"][row], encoded["attention_mask"][row], tokenizer.cls_token_id)
        windows.append(Window(pair, context_mask, offsets, null))
    return encoded, windows


# ----------------------------------------------------------------------------------------------
# Post-processing
# ----------------------------------------------------------------------------------------------
def window_spans(start_logits, end_logits, offsets, n_best_size, max_answer_length):
    """The candidate spans of one window: [(score, start logit, end logit, start char, end char)],
    of the `n_best_size` best start and end tokens; both tokens in the context (offsets not
    NO_CONTEXT), end not before start, at most `max_answer_length` tokens."""
    starts = np.argsort(start_logits, kind="stable")[::-1][:n_best_size]
    ends = np.argsort(end_logits, kind="stable")[::-1][:n_best_size]
    in_context = offsets[:, 0] != NO_CONTEXT
    s, e = np.meshgrid(starts, ends, indexing="ij")
    valid = in_context[s] & in_context[e] & (e >= s) & (e - s + 1 <= max_answer_length)
    s, e = s[valid], e[valid]
    return [(float(start_logits[i] + end_logits[j]), float(start_logits[i]), float(end_logits[j]),
             int(offsets[i, 0]), int(offsets[j, 1])) for i, j in zip(s, e)]


def best_answers(examples, feature_examples, start_logits, end_logits, offsets, null_indices, n_best_size=20,
                 max_answer_length=30, with_negative=False, null_score_diff_threshold=0.0):
    """(answers, n-best lists, null odds) per example id, from the logits of all its windows.

    `examples` is a list of (id, context); `feature_examples[f]` the example index of window f,
    `start_logits` / `end_logits` `[windows, tokens]`, `offsets` `[windows, tokens, 2]` character
    offsets into the context (NO_CONTEXT outside it), `null_indices[f]` the token that stands for
    "no answer" in window f (its CLS token). An example's candidates are the spans of all its
    windows, its `n_best_size` best kept (score = start + end logit), with softmax probabilities
    over them; its answer is the best one's text. With `with_negative` (SQuAD v2.0), its null
    score is the lowest of its windows' (start + end logit at the null token); the answer is ""
    when the null score beats the best non-empty span's by more than `null_score_diff_threshold`,
    or when there is no non-empty span. Null odds (v2.0 only) are null score minus best span score
    (None without a span); an example without candidates (v1.1) answers "".
    """
    windows = collections.defaultdict(list)
    for feature, example in enumerate(feature_examples):
        windows[int(example)].append(feature)
    answers, nbest, null_odds = {}, {}, {}
    for index, (example_id, context) in enumerate(examples):
        candidates, null = [], None
        for f in windows[index]:
            candidates += window_spans(start_logits[f], end_logits[f], offsets[f], n_best_size, max_answer_length)
            k = int(null_indices[f])
            score = float(start_logits[f, k] + end_logits[f, k])
            if null is None or score < null[0]:
                null = (score, float(start_logits[f, k]), float(end_logits[f, k]), 0, 0)
        candidates.sort(key=lambda c: c[0], reverse=True)
        kept = candidates[:n_best_size]
        if with_negative and null is not None:
            kept = sorted(kept + [null], key=lambda c: c[0], reverse=True)
        entries = []
        if kept:
            scores = np.array([c[0] for c in kept])
            probabilities = np.exp(scores - scores.max())
            probabilities /= probabilities.sum()
            for (score, start, end, first, last), probability in zip(kept, probabilities):
                entries.append({"text": context[first:last], "score": score, "probability": float(probability),
                                "start_logit": start, "end_logit": end, "offsets": [first, last]})
        nbest[example_id] = entries
        spans = [entry for entry in entries if entry["text"]]
        if not with_negative:
            answers[example_id] = spans[0]["text"] if spans else ""
            continue
        if not spans or null is None:
            answers[example_id], null_odds[example_id] = "", None
            continue
        difference = null[0] - spans[0]["start_logit"] - spans[0]["end_logit"]
        null_odds[example_id] = difference
        answers[example_id] = "" if difference > null_score_diff_threshold else spans[0]["text"]
    return answers, nbest, null_odds


# ----------------------------------------------------------------------------------------------
# SQuAD metrics (the official evaluation scripts' definitions)
# ----------------------------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text):
    """Lower case, punctuation removed, articles (a, an, the) removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction, truth):
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction, truth):
    """F1 of the normalised tokens in common. Two empty answers agree (v2.0's rule: v1.1 has no empty truth)."""
    predicted, true = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not predicted or not true:
        return float(predicted == true)
    common = sum((collections.Counter(predicted) & collections.Counter(true)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(true)
    return 2 * precision * recall / (precision + recall)


def squad_v1(predictions, references):
    """{"exact_match", "f1"} in percent: per question the best over its answers, averaged over
    `references` ({id: [answer texts]}, each with one at least); `predictions` {id: text}."""
    exact = f1 = 0.0
    for example_id, truths in references.items():
        prediction = predictions[example_id]
        exact += max(exact_match(prediction, truth) for truth in truths)
        # v1.1's F1 has no tokens in common when either side normalises to nothing ("The"), even both.
        f1 += max(token_f1(prediction, truth) if normalize_answer(prediction) and normalize_answer(truth) else 0.0
                  for truth in truths)
    return {"exact_match": 100.0 * exact / len(references), "f1": 100.0 * f1 / len(references)}


def squad_v2(predictions, references, no_answer_probabilities=None, no_answer_threshold=1.0):
    """The SQuAD v2.0 scores in percent: exact, f1, total; HasAns_* and NoAns_* over the questions
    with and without an answer (where there are any); best_exact / best_f1 and their thresholds.

    `references` {id: [answer texts]} ([] or only empty texts: no answer). A prediction counts as
    "no answer" where its `no_answer_probabilities` entry exceeds `no_answer_threshold`; without
    them every probability is 0, as the classic Hugging Face scripts pass, so the best_* entries
    are the best score of predicting "no answer" for the first questions in the references'
    order and the prediction for the rest.
    """
    probabilities = no_answer_probabilities or {example_id: 0.0 for example_id in references}
    exact, f1, has_answer = {}, {}, {}
    for example_id, truths in references.items():
        truths = [truth for truth in truths if normalize_answer(truth)] or [""]
        has_answer[example_id] = truths != [""]
        prediction = predictions[example_id]
        exact[example_id] = max(exact_match(prediction, truth) for truth in truths)
        f1[example_id] = max(token_f1(prediction, truth) for truth in truths)

    def thresholded(scores):
        return {example_id: float(not has_answer[example_id]) if probabilities[example_id] > no_answer_threshold
                else score for example_id, score in scores.items()}

    def mean(scores, ids):
        return 100.0 * sum(scores[i] for i in ids) / len(ids)

    exact, f1 = thresholded(exact), thresholded(f1)
    ids = list(references)
    results = {"exact": mean(exact, ids), "f1": mean(f1, ids), "total": len(ids)}
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        subset = [i for i in ids if has_answer[i] == wanted]
        if subset:
            results.update({f"{name}_exact": mean(exact, subset), f"{name}_f1": mean(f1, subset),
                            f"{name}_total": len(subset)})
    for name, scores in (("exact", exact), ("f1", f1)):
        results[f"best_{name}"], results[f"best_{name}_thresh"] = _best_threshold(
            predictions, scores, probabilities, has_answer)
    return results


def _best_threshold(predictions, scores, probabilities, has_answer):
    """(best score in percent, its threshold) of "no answer where the probability exceeds the
    threshold", over the thresholds the probabilities give, the official script's way: start from
    "no answer" everywhere and take the questions back one by one in order of probability."""
    current = best = sum(not has for has in has_answer.values())
    threshold = 0.0
    for example_id in sorted(scores, key=lambda i: probabilities[i]):
        if has_answer[example_id]:
            current += scores[example_id]
        elif predictions[example_id]:
            current -= 1
        if current > best:
            best, threshold = current, probabilities[example_id]
    return 100.0 * best / len(scores), threshold


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class QuestionAnswerer(Predictor):
    """run_qa.py's predict path for one question and its context: the same windows (`cut_windows`)
    and post-processing (`best_answers`) with the run's n-best size, answer length and SQuAD v2.0 settings. `details` is the n-best list (text, probability,
    score, character offsets into the context); the answer is "" when the model says the context
    does not answer the question (v2.0)."""

    auto_class = "FlaxAutoModelForQuestionAnswering"
    MAX_WINDOWS = 8  # windows read per request (a longer context is cut, and the page says so)

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        # As run_qa.py sizes its windows: the argument, at most the tokenizer's and the model's length.
        self.seq_length = min(run_args["max_seq_length"], self.tokenizer.model_max_length,
                              max_positions(self.config) or run_args["max_seq_length"])
        self.doc_stride = run_args["doc_stride"]
        self.settings = dict(n_best_size=run_args["n_best_size"], max_answer_length=run_args["max_answer_length"],
                             with_negative=run_args["version_2_with_negative"],
                             null_score_diff_threshold=run_args["null_score_diff_threshold"])
        self.window_buckets = buckets(self.MAX_WINDOWS, smallest=1)
        accepted = inspect.signature(self.model.__call__).parameters
        self.inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in accepted]

        def logits(params, inputs):
            outputs = self.model(**inputs, params=params)
            return jnp.stack([outputs.start_logits, outputs.end_logits], axis=-1).astype(jnp.float32)

        self._logits = jax.jit(logits)

    def predict(self, question, context):
        require_text(question, "question")
        require_text(context, "context")
        question = question.lstrip()  # as run_qa.py reads its questions
        question_tokens = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        room = self.seq_length - question_tokens - self.tokenizer.num_special_tokens_to_add(pair=True)
        if room <= self.doc_stride:
            raise BadInput(f"the question takes {question_tokens} tokens, leaving {max(room, 0)} of the model's "
                           f"{self.seq_length} for the context: ask a shorter question")
        answer = Answer()
        encoded, windows = cut_windows(self.tokenizer, [question], [context], self.seq_length, self.doc_stride)
        if len(windows) > self.MAX_WINDOWS:
            read = int(windows[self.MAX_WINDOWS - 1].offsets.max())
            answer.notes.append(f"the context needs {len(windows)} windows of {self.seq_length} tokens; the model "
                                f"reads the first {self.MAX_WINDOWS}, its first {read} characters")
            windows = windows[:self.MAX_WINDOWS]
        size = bucket_for(len(windows), self.window_buckets)
        inputs = {}
        for name in self.inputs:
            rows = np.zeros((size, self.seq_length), np.int32)
            rows[:len(windows)] = np.asarray(encoded[name][:len(windows)])
            inputs[name] = rows
        logits = np.asarray(self._logits(self.params, inputs))[:len(windows)]
        answers, nbest, _ = best_answers(
            [("request", context)], [0] * len(windows), logits[..., 0], logits[..., 1],
            np.stack([w.offsets for w in windows]), [w.null for w in windows], **self.settings)
        answer.text, answer.details = answers["request"], nbest["request"]
        return answer

    def warm_up(self):
        for size in self.window_buckets:
            ids = np.zeros((size, self.seq_length), np.int32)
            jax.block_until_ready(self._logits(self.params, {name: ids for name in self.inputs}))


PREDICTOR = QuestionAnswerer


def highlighted(context, first, last):
    """`context` as markdown with characters [first, last) (the answer) highlighted."""
    return (escape_markdown(context[:first]) + f":orange-background[{escape_markdown(context[first:last])}]"
            + escape_markdown(context[last:]))


def demo_form(st, predictor):
    with st.form("request"):
        question = st.text_input("Question", key="text")
        context = st.text_area("Context", height=150, key="context")
        submitted = st.form_submit_button("Answer")
    if submitted:
        def show():
            answer = predictor(question, context)
            show_answer(st, answer)
            with st.container(key="context_shown"):
                if answer.text:  # the best span with text (tasks.question_answering.best_answers)
                    st.markdown(highlighted(context, *next(e["offsets"] for e in answer.details if e["text"])))
                else:
                    st.markdown("The model finds no answer to this question in the context.")
            st.table({"answer": [escape_markdown(entry["text"]) or "(no answer)" for entry in answer.details],
                      "probability": [f"{entry['probability']:.3f}" for entry in answer.details],
                      "score": [f"{entry['score']:.3f}" for entry in answer.details]})
        return show
