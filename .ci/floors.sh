#!/usr/bin/env bash
# The suite at the declared floors: every direct dependency of pyproject.toml (its dependencies and its test
# extra, which tests/test_requirements.py holds equal to requirements.txt and requirements-test.txt) at the
# lowest version it allows, pinned by .ci/floors.txt, in a venv of its own; the fast tier and one script end to
# end run there. The demo (requirements-demo.txt) and the TPU compiler (libtpu, pinned to the newest jax) stay
# out. Usage: bash .ci/floors.sh (about 20 s to build the venv; uv's cache makes it seconds the second time).
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="$work/venv"

# uv resolves and installs the venv in seconds (pip's resolver takes minutes here).
python -m pip install -q uv
python -m uv venv -q --python "$(command -v python)" "$venv"
python - "$work/declared.txt" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
open(sys.argv[1], "w").write("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]) + "\n")
EOF
python -m uv pip install -q --python "$venv/bin/python" -r "$work/declared.txt" -c .ci/floors.txt
python -m uv pip list -q --python "$venv/bin/python" 2>/dev/null > "$work/installed.txt"
echo "floors: $(grep -i -E '^(jax|jaxlib|flax|optax|orbax-checkpoint|transformers|numpy) ' "$work/installed.txt" | awk '{print $1, $2}' | paste -sd, -)"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The fast tier; the demo's tests need Streamlit, which the floors leave out.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" --ignore=tests/test_demo.py
# One script end to end: data, tokenizer, T5, a checkpoint (orbax), TensorBoard logs, ROUGE (nltk), generation.
"$venv/bin/python" run_summarization_flax.py configs/summarization_tiny.json --output_dir "$work/run" \
    --max_steps 20 --save_steps 10 --eval_steps 20 --max_eval_samples 32 --max_predict_samples 16
test -d "$work/run/checkpoints/20" && test -s "$work/run/all_results.json"
echo "floors: the script ran end to end"
