"""benchmarks/parity.py: its refusal without the classic scripts (which the project does not ship), the
SQuAD layout it gives both sides, and docs/parity.md's results table as benchmarks/parity_cpu.json has
it (every task of the JSON has its row, every row's figures are the JSON's, as rounded there)."""

import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = "| task | script | metric | classic | this project | classic, head from --seed | seeds |"


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def cell(side, digits):
    return f"{side['mean']:.{digits}f} ± {side['std']:.{digits}f}" if side else "-"


def expected_row(task, result):
    digits = 1 if result["ours"]["mean"] > 1 else 3  # SQuAD F1 in percent; accuracies and entity F1 in [0, 1]
    cells = [task, f"`{result['script']}`", f"`{result['metric']}`", cell(result["classic"], digits),
             cell(result["ours"], digits), cell(result.get("classic_seeded"), digits),
             ", ".join(map(str, result["seeds"]))]
    return "| " + " | ".join(cells) + " |"


def test_parity_table_is_parity_cpu_json():
    results = json.loads(read(os.path.join("benchmarks", "parity_cpu.json")))["tasks"]
    lines = read(os.path.join("docs", "parity.md")).splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert sorted(rows) == sorted(expected_row(task, result) for task, result in results.items())


BENCHMARK = os.path.join(ROOT, "benchmarks", "parity.py")


def run_benchmark(*args, env=None):
    return subprocess.run([sys.executable, BENCHMARK, *args], capture_output=True, text=True, timeout=60,
                          env=env or {k: v for k, v in os.environ.items() if k != "FLAXTUNE_CLASSIC_DIR"})


def test_without_the_classic_scripts_the_benchmark_refuses_in_one_line(tmp_path):
    unset = run_benchmark("--work", str(tmp_path / "work"))
    assert unset.returncode != 0 and unset.stderr.strip().splitlines() == [unset.stderr.strip()]
    assert unset.stderr.startswith("error: no classic scripts given") and "FLAXTUNE_CLASSIC_DIR" in unset.stderr
    (tmp_path / "classic" / "text-classification").mkdir(parents=True)
    (tmp_path / "classic" / "text-classification" / "run_flax_glue.py").write_text("")
    partial = run_benchmark("--classic", str(tmp_path / "classic"), "--work", str(tmp_path / "work"))
    assert partial.returncode != 0 and partial.stderr.startswith("error: ")
    assert "question-answering/run_qa.py" in partial.stderr and "run_classic.py" in partial.stderr
    assert "text-classification/run_flax_glue.py" not in partial.stderr  # there: not named missing
    assert not (tmp_path / "work").exists()  # refused before making anything


def test_squad_documents_become_the_classic_flat_rows(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("parity", BENCHMARK)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    document = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "Ana met Bo in Rome .", "qas": [
            {"id": "a", "question": "Who met Bo?", "answers": [{"text": "Ana", "answer_start": 0}]},
            {"id": "b", "question": "Where?", "answers": [{"text": "Rome", "answer_start": 14},
                                                          {"text": "in Rome", "answer_start": 11}]}]}]}]}
    with gzip.open(tmp_path / "train.json.gz", "wt", encoding="utf-8") as f:
        json.dump(document, f)
    parity.flat_squad(str(tmp_path / "train.json.gz"), str(tmp_path / "flat.json"))
    rows = json.loads((tmp_path / "flat.json").read_text())["data"]
    assert rows == [
        {"id": "a", "title": "t", "context": "Ana met Bo in Rome .", "question": "Who met Bo?",
         "answers": {"text": ["Ana"], "answer_start": [0]}},
        {"id": "b", "title": "t", "context": "Ana met Bo in Rome .", "question": "Where?",
         "answers": {"text": ["Rome", "in Rome"], "answer_start": [14, 11]}}]
