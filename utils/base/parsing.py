"""Reading a script's arguments: a JSON config file, flags after it overriding its values, and --help (the
options in sections, each default once); a mistake is one `UsageError` naming the key or flag."""

import argparse
import copy
import dataclasses
import difflib
import inspect
import json
import os
import shlex
import shutil
import sys
import textwrap
import types
import typing
from typing import Optional

from transformers import HfArgumentParser

from utils.base.arguments import HELP_GROUPS, OWN_DEFAULT, OWN_METADATA
from utils.base.errors import UsageError

CONFIG_HELP = ("CONFIG.json, when given, comes first: a JSON object of option names and values, such as "
               '{"output_dir": "out", "do_train": true} (configs/ holds examples); flags after it override its '
               "values. A boolean flag alone means true.")


METAVARS = {str: "STR", int: "INT", float: "FLOAT"}


class ArgumentParser(HfArgumentParser):
    """HfArgumentParser that raises `UsageError` instead of printing usage and exiting, and whose --help
    reads: the usage with a config file, the script's description, then its options in HELP_GROUPS,
    each with its default once.

    The script is the module that defines its own argument dataclasses: its file names the program, the
    first paragraph of its docstring describes it.
    """

    def __init__(self, dataclass_types):
        script = _script_module(dataclass_types)
        file, doc = getattr(script, "__file__", None), getattr(script, "__doc__", None)
        super().__init__(dataclass_types, allow_abbrev=False, formatter_class=_HelpFormatter,
                         prog=os.path.basename(file) if file else None,
                         usage="%(prog)s [CONFIG.json] [--flag value ...]",
                         description=inspect.cleandoc(doc).split("\n\n")[0] if doc else None)
        self._groups, self._required = {}, []
        fields = {}
        for dtype in self.dataclass_types:
            hints = typing.get_type_hints(dtype)
            for f in dataclasses.fields(dtype):
                self._groups[f.name] = _group(dtype, f)
                fields[f.name] = f, hints[f.name]
        for action in self._actions:
            if action.dest in fields:
                self._describe(action, *fields[action.dest])

    @staticmethod
    def _parse_dataclass_field(parser, field):
        # HfArgumentParser hands a field's metadata to `add_argument`: all of it but our own.
        argparse_field = copy.copy(field)
        argparse_field.metadata = types.MappingProxyType(
            {key: value for key, value in field.metadata.items() if key not in OWN_METADATA})
        HfArgumentParser._parse_dataclass_field(parser, argparse_field)

    def _describe(self, action, field, annotation):
        """What --help shows of `field`'s flag `action` (or of its --no_X)."""
        if action.option_strings[0] == f"--no_{field.name}":
            negated = field.metadata.get("negated_help")
            action.help = negated.replace("%", "%%") if negated else argparse.SUPPRESS
            return
        if action.metavar is None:
            action.metavar = "true|false" if annotation in (bool, Optional[bool]) else METAVARS.get(action.type)
        text = action.help or ""
        if action.required:  # a config file may give it: `parse_known_args` checks that one of the two did
            action.required = False
            self._required.append(action)
            text += " (no default: give it here or in CONFIG.json)"
        elif OWN_DEFAULT not in text and action.default is not None:
            text += f" (default: {_shown(action.default)})"
        action.help = text.strip().replace("%", "%%")  # argparse %-formats help texts ("80% of them")

    def format_help(self):
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        formatter.add_text(CONFIG_HELP)
        for group, title in HELP_GROUPS.items():
            formatter.start_section(title)
            formatter.add_arguments([action for action in self._actions if self._groups.get(action.dest) == group])
            formatter.end_section()
        return formatter.format_help()

    def parse_known_args(self, args=None, namespace=None):
        namespace, remaining = super().parse_known_args(args, namespace)
        for action in self._required:
            if getattr(namespace, action.dest, None) is None:
                flag = action.option_strings[0]
                value = action.metavar or action.dest.upper()
                raise UsageError(f"{flag} is required: pass {flag} {value}, or give \"{action.dest}\" in the JSON "
                                 "config file")
        return namespace, remaining

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


class _HelpFormatter(argparse.HelpFormatter):
    """Each option under its own name (the dashed spelling HfArgumentParser adds still parses), its help
    beside it where the flag is short; lines as wide as the terminal up to 100 characters, never broken
    inside a hyphenated word (span-corruption, google/vit-base-patch16-224)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=min(shutil.get_terminal_size().columns - 2, 100))

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _format_action_invocation(self, action):
        flag = action.option_strings[0]
        if action.nargs == 0:
            return flag
        return f"{flag} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


def _script_module(dataclass_types):
    """The module of the first of `dataclass_types` not defined in the engine (`utils`: the shared arguments),
    or __main__; None where that module is in no `sys.modules` (a script run by `runpy.run_path`, as
    `utils.run.perf` runs it): its help then has no description."""
    for dtype in dataclass_types:
        if dtype.__module__.split(".")[0] != "utils":
            return sys.modules.get(dtype.__module__)
    return sys.modules["__main__"]


def _group(dtype, field):
    group = field.metadata.get("group", getattr(dtype, "HELP_GROUP", None))
    if group not in HELP_GROUPS:
        raise ValueError(f"{dtype.__name__}.{field.name} has no --help section: give the field a group or the "
                         f"class a HELP_GROUP, one of {', '.join(HELP_GROUPS)}")
    return group


def _shown(value):
    """A default as one would type it on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(shlex.quote(str(item)) for item in value)
    return str(value)


def _closest(name, candidates):
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _load_json_config(path):
    if not os.path.isfile(path):
        raise UsageError(f"config file {path} not found: check the path")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"config file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text")
    if not isinstance(config, dict):
        raise UsageError(f"config file {path} must hold a JSON object of argument names to values")
    return config


def _accepts(annotation, value):
    """Whether a JSON value fits a dataclass field's type (argparse does not convert non-string defaults)."""
    if typing.get_origin(annotation) is typing.Union:
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    return isinstance(value, annotation)


def _check_config_values(config, dataclass_types, path):
    fields = {}
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        fields.update({f.name: hints[f.name] for f in dataclasses.fields(dtype)})
    for key, value in config.items():
        if key not in fields:
            raise UsageError(f"unknown key {key!r} in config file {path}{_closest(key, fields)}")
        if not _accepts(fields[key], value):
            expected = getattr(fields[key], "__name__", str(fields[key]).replace("typing.", ""))
            raise UsageError(f"{key!r} in config file {path} must be {expected}, got {json.dumps(value)}")


def parse_args(dataclass_types, argv):
    """Parse `argv` into one instance per dataclass.

    `config.json` alone, `config.json --flag value ...` (flags override the file) or plain flags.
    """
    parser = ArgumentParser(dataclass_types)
    config, config_path = {}, None
    if argv and argv[0].endswith(".json"):
        config_path, argv = argv[0], argv[1:]
        config = _load_json_config(config_path)
        _check_config_values(config, dataclass_types, config_path)
        parser.set_defaults(**config)
    *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flag = unknown[0]
        options = [opt for action in parser._actions for opt in action.option_strings]
        raise UsageError(f"unknown argument {flag}{_closest(flag, options)} (see --help)")
    return parsed
