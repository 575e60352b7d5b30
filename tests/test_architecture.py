"""The layering of docs/architecture.md, read off the import graph (parsed with `ast`, nothing imported).

scripts -> tasks/ -> utils/: `utils/` imports neither `tasks/` nor a script, and `tasks/` no script. A task
module (one declaring `TASK`) imports no other task module but those it declares it is built on (`BUILDS_ON`);
what tasks share lives in rooms, the modules of `tasks/` that declare no task (images, audio, lm, ...). The engine,
`utils/`, is in wings, each a package on a floor of its own (`WINGS`): a module imports from the wings on lower
floors, and inside its own wing from the modules on lower floors of that wing (`FLOORS`). The package
`utils` itself (the start-up clock) is the ground every module may stand on. Imports inside functions count as
much as those at the top of a file.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("run_*.py")) + [ROOT / "demo.py", ROOT / "train_tokenizer.py"]

# Each wing's floor. A wing imports only wings below it; two wings on one floor know nothing of each other.
WINGS = {"base": 0, "data": 1, "kernels": 1, "layout": 2, "scoring": 2, "models": 3, "checkpoints": 4, "run": 5}
# Each module's floor inside its wing. Place a new module on the floor above the highest one of its own wing
# that it imports, and list it in docs/architecture.md too.
FLOORS = {
    "base": {"errors": 0, "hub_probe": 0, "arguments": 1, "parsing": 2},
    "data": {"file_formats": 0, "arrow_columns": 0, "batch_order": 0, "loaders": 1, "text_sources": 1, "stream": 2,
             "stream_head": 2},
    "kernels": {"hooks": 0, "flash_attention": 0, "lm_head": 0, "chip_dropout": 1, "model_attention": 1},
    "layout": {"devices": 0, "memory": 0, "tpu_plan": 0, "gradients": 0, "layouts": 1},
    "scoring": {"losses": 0, "metrics": 0},
    "models": {"rotary": 0, "hub_checkpoint": 0, "remat": 0, "weights": 0, "lora": 0, "flax_msgpack": 0,
               "decoder_positions": 1, "decoders": 1, "layer_scan": 1, "compat": 2, "family_model": 2, "loading": 3},
    "checkpoints": {"store": 0, "preemption": 0, "resume": 1, "saving": 1},
    "run": {"perf": 0, "logs": 0, "optim": 0, "hub_push": 0, "model_card": 0, "stream_feed": 0, "threaded_feed": 0,
            "loop": 1, "run_directory": 1, "setup": 1, "compile_plan": 1, "preflight": 2, "spine": 2},
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
    """("utils", wing, module) (the wing's package: module "__init__"; the package utils: wing None),
    ("tasks", module), ("script", name), or None (outside the project)."""
    parts = module.split(".")
    if parts[0] == "utils":
        wing = parts[1] if len(parts) > 1 else None
        return "utils", wing, parts[2] if len(parts) > 2 else "__init__"
    if parts[0] == "tasks":
        return "tasks", parts[1] if len(parts) > 1 else "__init__"
    if parts[0] in {script.stem for script in SCRIPTS}:
        return "script", parts[0]
    return None


def floor_of(wing, module):
    """(wing floor, module floor) or None when either has no floor; a wing's package is below its modules."""
    if wing not in WINGS or (module != "__init__" and module not in FLOORS.get(wing, {})):
        return None
    return WINGS[wing], -1 if module == "__init__" else FLOORS[wing][module]


def broken_rules(paths):
    """One line per import that breaks a rule: 'file:line: what'."""
    broken = []
    for path in paths:
        relative = path.relative_to(ROOT)
        where = relative.parts[0]
        for line, module in imported_modules(path):
            target = kind(module)
            if target is None or where not in ("utils", "tasks"):
                continue
            at = f"{relative}:{line}"
            if target[0] == "script" or (where == "utils" and target[0] == "tasks"):
                broken.append(f"{at}: {where}/ imports {module} ({'a script' if target[0] == 'script' else 'tasks/'})")
            elif where == "utils" and target[0] == "utils" and target[1] is not None:
                own = (relative.parts[1], path.stem) if len(relative.parts) == 3 else None
                mine, theirs = own and floor_of(*own), floor_of(*target[1:])
                if mine is None or theirs is None:
                    broken.append(f"{at}: {'.'.join(relative.with_suffix('').parts)} or {module} has no floor "
                                  "(WINGS, FLOORS)")
                elif theirs[0] > mine[0] or (theirs[0] == mine[0] and own[0] != target[1]):
                    broken.append(f"{at}: wing {own[0]} (floor {mine[0]}) imports {module}, of wing {target[1]} "
                                  f"(floor {theirs[0]}): a wing imports only from the wings below it")
                elif own[0] == target[1] and theirs[1] >= mine[1]:
                    broken.append(f"{at}: {own[1]} (floor {mine[1]} of wing {own[0]}) imports {module} (floor "
                                  f"{theirs[1]}): inside a wing, a module imports only from lower floors")
    return broken


def declared(path, name):
    """The value of the top-level assignment `name = ...` in `path` (a literal), or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value) if name != "TASK" else True
    return None


def broken_task_rules(paths):
    """One line per task module importing another task module it does not declare in `BUILDS_ON`, or declaring
    one it does not import."""
    tasks = {path.stem for path in paths if declared(path, "TASK")}
    broken = []
    for path in paths:
        if path.stem not in tasks:
            continue
        builds_on = set(declared(path, "BUILDS_ON") or ())
        imported = set()
        for line, module in imported_modules(path):
            target = kind(module)
            if target and target[0] == "tasks" and target[1] in tasks and target[1] != path.stem:
                imported.add(target[1])
                if target[1] not in builds_on:
                    broken.append(f"tasks/{path.name}:{line}: task module {path.stem} imports task module {target[1]}: "
                                  "move what they share into a room (a module of tasks/ without TASK), or declare "
                                  "it in BUILDS_ON")
        broken += [f"tasks/{path.name}: BUILDS_ON names {name}, which it does not import"
                   for name in sorted(builds_on - imported)]
    return broken


def engine_modules():
    return sorted(path for path in (ROOT / "utils").rglob("*.py") if path.name != "__init__.py" or
                  path.parent != ROOT / "utils")


def test_every_engine_module_is_in_a_wing_with_a_floor():
    wings = {path.name for path in (ROOT / "utils").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert wings == set(WINGS) == set(FLOORS), "each folder of utils/ is a wing in WINGS and FLOORS"
    assert sorted(path.name for path in (ROOT / "utils").glob("*.py")) == ["__init__.py"], "modules live in wings"
    for wing in WINGS:
        modules = {path.stem for path in (ROOT / "utils" / wing).glob("*.py")} - {"__init__"}
        assert modules == set(FLOORS[wing]), f"wing {wing}: place these in FLOORS (and docs/architecture.md): " \
                                             f"{modules ^ set(FLOORS[wing])}"
        assert ast.get_docstring(ast.parse((ROOT / "utils" / wing / "__init__.py").read_text())), \
            f"utils/{wing}/__init__.py says what the wing owns and may import"


def test_imports_follow_the_layering():
    paths = engine_modules() + sorted((ROOT / "tasks").glob("*.py")) + SCRIPTS
    assert broken_rules(paths) == []


def test_a_task_module_imports_only_rooms_and_what_it_builds_on():
    assert broken_task_rules(sorted((ROOT / "tasks").glob("*.py"))) == []


def test_the_task_check_names_an_undeclared_task_import_and_a_stale_declaration(tmp_path, monkeypatch):
    (tmp_path / "tasks").mkdir()
    files = {
        "tasks/__init__.py": "class Task: pass\n",
        "tasks/images.py": "from tasks import Task\n",  # a room: no TASK
        "tasks/qa.py": "from tasks import Task, images\nTASK = Task()\n",
        "tasks/long.py": "from tasks import Task, qa\nTASK = Task()\nBUILDS_ON = ('qa',)\n",  # declared: allowed
        "tasks/caption.py": "from tasks import Task\nTASK = Task()\nBUILDS_ON = ('long',)\ndef f():\n"
                            "    from tasks.qa import x\n",  # an undeclared import, a stale declaration
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = broken_task_rules([tmp_path / name for name in files])
    assert found == [
        "tasks/caption.py:5: task module caption imports task module qa: move what they share into a room (a module "
        "of tasks/ without TASK), or declare it in BUILDS_ON",
        "tasks/caption.py: BUILDS_ON names long, which it does not import"]


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """The checker itself, on a made-up tree: each kind of broken rule is found, the allowed imports are not."""
    for folder in ("utils/base", "utils/layout", "utils/run", "tasks"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "run_x.py").write_text("")
    files = {
        "utils/__init__.py": "",
        "utils/base/errors.py": "def f():\n    from utils.layout import layouts\n",  # a wing above, in a function
        "utils/base/arguments.py": "from . import errors\nimport utils.base.errors\nimport utils\n",  # allowed
        "utils/layout/devices.py": "from utils.layout import layouts\n",  # its own wing, a floor above
        # tasks/, a script, a module of the same floor of its wing, a wing below (allowed)
        "utils/layout/layouts.py": "from tasks import lm\nimport run_x\nfrom utils.layout import memory\n"
                                   "from utils.base import errors\n",
        "utils/layout/memory.py": "",
        "utils/run/spine.py": "from utils.run import stray\n",  # a module with no floor
        "utils/run/stray.py": "",
        "tasks/lm.py": "from utils.run import spine\ndef g():\n    import run_x\n",  # engine: allowed; script: not
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SCRIPTS", [tmp_path / "run_x.py"])
    monkeypatch.setitem(globals(), "WINGS", {"base": 0, "layout": 2, "run": 5})
    monkeypatch.setitem(globals(), "FLOORS", {"base": {"errors": 0, "arguments": 1},
                                               "layout": {"devices": 0, "memory": 1, "layouts": 1},
                                               "run": {"spine": 2}})
    found = broken_rules([tmp_path / name for name in files])
    assert [line.split(": ", 1)[0] for line in found] == [
        "utils/base/errors.py:2", "utils/layout/devices.py:1", "utils/layout/layouts.py:1",
        "utils/layout/layouts.py:2", "utils/layout/layouts.py:3", "utils/run/spine.py:1", "tasks/lm.py:3"]
    assert "a wing imports only from the wings below it" in found[0]
    assert "inside a wing, a module imports only from lower floors" in found[1]


def declared_checks():
    """The names of the functions the task modules declare as their checks (`Task(check_arguments=...,
    check_data=...)`, `lm.INPUTS`): the preflight's to call."""
    def name(value):
        if isinstance(value, ast.Call):  # partial(check, ...), or a maker of checks (column_check(resolve))
            return name(value.args[0] if name(value.func) == "partial" else value.func)
        return getattr(value, "attr", getattr(value, "id", None))

    return {name(node.value) for path in (ROOT / "tasks").glob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.keyword) and node.arg in ("check_arguments", "check_data")}


def what_the_spine_does_in(path, checks):
    """One line per place where script `path` does the spine's work itself: a call of a task's declared check
    (`checks`), a preflight count other than one (`check_before_work` runs every check), or `--compile_only`."""
    tree, found = ast.parse(path.read_text(encoding="utf-8")), []
    called = [(node.lineno, getattr(node.func, "attr", getattr(node.func, "id", "")))
              for node in ast.walk(tree) if isinstance(node, ast.Call)]
    preflights = [line for line, name in called if name == "check_before_work"]
    if len(preflights) != 1:
        found.append(f"{path.name}: {len(preflights)} calls of check_before_work: one runs every check")
    found += [f"{path.name}:{line}: calls {name}: a task's declared check, which the preflight runs"
              for line, name in called if name in checks]
    found += [f"{path.name}:{node.lineno}: mentions compile_only: the spine plans and ends such a run"
              for node in ast.walk(tree)
              if "compile_only" in {getattr(node, "attr", None), getattr(node, "id", None), getattr(node, "arg", None)}]
    return found


def test_a_script_leaves_checks_and_compile_only_to_the_spine(tmp_path):
    checks = declared_checks()
    assert {"check_data_given", "check_folders", "check_columns", "check_arguments"} <= checks
    assert [line for path in sorted(ROOT.glob("run_*.py")) for line in what_the_spine_does_in(path, checks)] == []
    # Broken on purpose: a declared check called, no preflight, the flag read.
    script = tmp_path / "run_x.py"
    script.write_text("def main(data_args, training_args):\n    images.check_folders(None, None, data_args, training_args)\n"
                      "    if training_args.compile_only:\n        return\n")
    assert what_the_spine_does_in(script, checks) == [
        "run_x.py: 0 calls of check_before_work: one runs every check",
        "run_x.py:2: calls check_folders: a task's declared check, which the preflight runs",
        "run_x.py:3: mentions compile_only: the spine plans and ends such a run"]
