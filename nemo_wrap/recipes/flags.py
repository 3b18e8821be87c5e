"""Every recipe key as a command-line flag, grouped by the recipe's sections in ``--help``.

A flag is given under its dotted key (``--distributed.tp_size``) and, where the command line had a
name before recipes existed, under that shorter one (``--tp-size``): ``--help`` shows both on one
line, the short one first, with one metavar and the schema's default. Flags default to *unset*
(``argparse.SUPPRESS``), so one given on the command line overrides the ``--config`` file and one
not given leaves the file's value; the default shown is the schema's, which applies when neither
sets the key.
"""

from __future__ import annotations

import argparse
import textwrap
import typing
from collections.abc import Iterable
from typing import Any

from nemo_wrap.recipes.config_file import FieldSpec, recipe_fields, recipe_sections

# The keys at the top of a recipe (not in a section) and the flags every command has.
JOB_GROUP = "job"
_WIDTH = 78  # the section descriptions, wrapped as argparse wraps the flags' help
_METAVARS = {int: "N", float: "X", bool: "BOOL", str: "TEXT"}


class RecipeHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--tp-size, --distributed.tp_size N`` rather than each name followed by its own metavar."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, action.dest.upper())  # [BOOL] for a switch
        return f"{', '.join(short_name_first(action.option_strings))} {metavar}"


def short_name_first(names: Iterable[str]) -> list[str]:
    """A flag's names as help shows them: ``--tp-size`` before ``--distributed.tp_size``."""
    return sorted(names, key=lambda name: ("." in name, name))


def add_job_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The group of the recipe's top-level keys; the command adds its own flags (``--config``) to it."""
    return parser.add_argument_group(JOB_GROUP, "The checkpoint, the recipe file and where the results go.")


def add_recipe_flags(
    parser: argparse.ArgumentParser, job: argparse._ArgumentGroup, sections: tuple[str, ...] | None
) -> None:
    """The recipe's keys as flags of ``parser``, one argument group per section (the top-level keys
    in ``job``); ``sections`` limits them to those sections (``None``: all)."""
    groups = {JOB_GROUP: job}
    for name, description in recipe_sections():
        if sections is None or name in sections:
            groups[name] = parser.add_argument_group(name, textwrap.fill(description, _WIDTH))
    for spec in recipe_fields().values():
        section = spec.section or JOB_GROUP
        if spec.key != "model" and section in groups:
            groups[section].add_argument(*_names(spec), **_flag_options(spec))


def _names(spec: FieldSpec) -> list[str]:
    dotted = f"--{spec.key}"
    return [dotted] + ([spec.flag] if spec.flag and spec.flag != dotted else [])


def _flag_options(spec: FieldSpec) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dest": spec.key,
        "default": argparse.SUPPRESS,
        "metavar": _metavar(spec.annotation),
        "help": spec.help if "default" in spec.help else f"{spec.help} (default: {_shown(spec.default)})",
    }
    if spec.annotation is bool:  # --pack, or --data.pack false
        options.update(nargs="?", const="true")
    return options


def _metavar(annotation: Any) -> str:
    """N, X, BOOL or TEXT by the key's type (``int | None`` is N); lists and maps are TEXT."""
    arguments = [argument for argument in typing.get_args(annotation) if argument is not type(None)]
    plain = arguments[0] if len(arguments) == 1 else annotation
    return _METAVARS.get(plain, "TEXT")


def _shown(default: Any) -> str:
    """A default as a user would type it in a recipe file: ``none``, ``true``, ``a,b``."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or "none"
    if isinstance(default, dict):
        return ",".join(f"{key}={value}" for key, value in default.items()) or "none"
    return str(default)
