"""The layering of docs/architecture.md, read off the import graph (parsed with `ast`, nothing imported).

scripts -> tasks/ -> utils/: `utils/` imports neither `tasks/` nor a script, `tasks/` no script, and an
engine module imports only modules on lower floors than its own (`FLOORS`). Imports inside functions
count as much as those at the top of a file.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("run_*.py")) + [ROOT / "demo.py", ROOT / "train_tokenizer.py"]

# Each engine module's floor (utils/__init__.py is "__init__"). Place a new module on the floor above
# the highest one it imports, and list it in docs/architecture.md too.
FLOORS = {
    # 0: errors, the package
    "__init__": 0, "errors": 0,
    # 1: arguments, the rotary decoders' positions, the dropout attention kernel, the chunked LM loss, the model hooks
    "args": 1, "decoder_positions": 1, "dropout_attention": 1, "lm_head": 1, "layers": 1,
    # 2: pieces that need only arguments and errors; the version shims
    "compat": 2, "chip_dropout": 2, "remat": 2, "devices": 2, "tpu_plan": 2, "attention": 2, "memory": 2, "steps": 2, "metrics": 2, "optim": 2, "weights": 2,
    "flax_msgpack": 2,
    "logging": 2, "preemption": 2, "lora": 2, "hub_access": 2, "file_formats": 2, "arrow_columns": 2, "batch_order": 2,
    # 3: data readers, layouts, checkpoints, scanned layer stacks
    "dataset_loading": 3, "stream_sources": 3, "layout": 3, "checkpoint": 3, "layer_scan": 3, "model_card": 3,
    # 4: built on those: models, resume, saving, pushing, instruments, the stream
    "models": 4, "resume": 4, "saving": 4, "hub": 4, "perf": 4, "stream": 4, "stream_examples": 4,
    # 5: the loop and the data it takes
    "loop": 5, "streamed_data": 5,
    # 6: the run directory
    "rundir": 6,
    # 7: the run set-up and the spine
    "run": 7, "training": 7,
}


def imported_modules(path):
    """(line, dotted name) of every module `path` imports; `from package import name` counts as the
    module package.name where that is a file of this project, else as the package."""
    package = path.parent.relative_to(ROOT).parts
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                is_file = (ROOT / (submodule.replace(".", "/") + ".py")).exists()
                found.append((node.lineno, submodule if is_file else module))
    return list(dict.fromkeys(found))


def kind(module):
    """("utils", engine module), ("tasks", module), ("script", name) or None (outside the project)."""
    top, _, rest = module.partition(".")
    if top in ("utils", "tasks"):
        return top, rest.split(".")[0] or "__init__"
    if top in {script.stem for script in SCRIPTS}:
        return "script", top
    return None


def broken_rules(paths):
    """One line per import that breaks a rule: 'file:line: what'."""
    broken = []
    for path in paths:
        where, name = path.relative_to(ROOT).parts[0], path.stem
        for line, module in imported_modules(path):
            target = kind(module)
            if target is None or where not in ("utils", "tasks"):
                continue
            at = f"{path.relative_to(ROOT)}:{line}"
            if target[0] == "script" or (where == "utils" and target[0] == "tasks"):
                broken.append(f"{at}: {where}/ imports {module} ({'a script' if target[0] == 'script' else 'tasks/'})")
            elif where == "utils" and target[0] == "utils":
                floor, other = FLOORS.get(name), FLOORS.get(target[1])
                if floor is None or other is None:
                    broken.append(f"{at}: utils.{name} or utils.{target[1]} has no floor in FLOORS")
                elif other >= floor:
                    broken.append(f"{at}: utils.{name} (floor {floor}) imports utils.{target[1]} (floor {other}): "
                                  "an engine module imports only from lower floors")
    return broken


def test_every_engine_module_has_a_floor():
    modules = {path.stem for path in (ROOT / "utils").glob("*.py")}
    assert not modules - set(FLOORS), f"place these in FLOORS (and docs/architecture.md): {modules - set(FLOORS)}"
    assert not set(FLOORS) - modules, f"FLOORS names modules that are gone: {set(FLOORS) - modules}"


def test_imports_follow_the_layering():
    paths = sorted((ROOT / "utils").glob("*.py")) + sorted((ROOT / "tasks").glob("*.py")) + SCRIPTS
    assert broken_rules(paths) == []


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """The checker itself, on a made-up tree: each kind of broken rule is found, the allowed imports are not."""
    for folder in ("utils", "tasks"):
        (tmp_path / folder).mkdir()
    (tmp_path / "run_x.py").write_text("")
    files = {
        "utils/errors.py": "def f():\n    from utils import layout\n",  # up, inside a function
        "utils/args.py": "from . import errors\nimport utils.errors\n",  # down: allowed
        # tasks/, a script, a module of the same floor
        "utils/layout.py": "from tasks import lm\nimport run_x\nfrom utils import checkpoint\n",
        "utils/checkpoint.py": "",
        "tasks/lm.py": "from utils import layout\ndef g():\n    import run_x\n",  # engine: allowed; script: not
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SCRIPTS", [tmp_path / "run_x.py"])
    found = broken_rules([tmp_path / name for name in files])
    assert [line.split(": ", 1)[0] for line in found] == [
        "utils/errors.py:2", "utils/layout.py:1", "utils/layout.py:2", "utils/layout.py:3", "tasks/lm.py:3"]
