"""Recipes in and out: a YAML file and command-line overrides become one checked :class:`Recipe`.

A recipe is built from *settings* — (dotted key, value, where it was set) — applied in order, so
later ones win: the schema's defaults, then the file, then the flags. Every setting is checked
against :mod:`nemo_wrap.recipes.config` before anything is loaded, and an error names the key and
its origin (``recipe.yaml:12`` or ``--tp-size``): a misspelt key is never silently ignored, which
is the failure mode of recipe systems that merge free-form dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_wrap.errors import RecipeError
from nemo_wrap.recipes.config import Recipe, problem_with

_NONE_WORDS = ("null", "none", "~")


@dataclass(frozen=True)
class Setting:
    """One value for one dotted key (``distributed.tp_size``), and where it came from."""

    key: str
    value: Any
    origin: str


@dataclass(frozen=True)
class FieldSpec:
    """A leaf of the schema: its dotted key, type, default, help, legacy flag and check."""

    key: str
    annotation: Any
    default: Any
    help: str
    flag: str | None
    check: Any

    @property
    def section(self) -> str | None:
        """The recipe section the key is in (``distributed``); ``None`` for a top-level key."""
        return self.key.split(".", 1)[0] if "." in self.key else None


def _leaves(cls: type, prefix: str = "") -> Iterator[FieldSpec]:
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        annotation = hints[item.name]
        if dataclasses.is_dataclass(annotation):
            yield from _leaves(typing.cast(type, annotation), f"{prefix}{item.name}.")
            continue
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        meta = item.metadata
        yield FieldSpec(f"{prefix}{item.name}", annotation, default, meta["help"], meta["flag"], meta["check"])


@functools.cache
def recipe_fields() -> Mapping[str, FieldSpec]:
    """Every settable key of a recipe, in schema order (the schema is fixed: computed once)."""
    return types.MappingProxyType({spec.key: spec for spec in _leaves(Recipe)})


def recipe_sections() -> Iterator[tuple[str, str]]:
    """Each section of a recipe, in schema order, with the first line of its docstring (markup removed)."""
    hints = typing.get_type_hints(Recipe)
    for item in dataclasses.fields(Recipe):
        section = hints[item.name]
        if dataclasses.is_dataclass(section):
            yield item.name, (section.__doc__ or "").strip().splitlines()[0].replace("``", "")


def read_recipe_file(path: str | Path) -> list[Setting]:
    """The settings a YAML recipe file holds, each with its ``file:line``; duplicate keys are errors."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise RecipeError(f"{path}: cannot read the recipe ({error.strerror})") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: not valid YAML: {error}") from None
    if root is None:
        return []
    return list(_settings_of(root, path, ""))


def _settings_of(node: yaml.Node, path: Path, prefix: str) -> Iterator[Setting]:
    where = f"{path}:{node.start_mark.line + 1}"
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{where}: {prefix.rstrip('.') or 'the recipe'}: expected a mapping of keys")
    sections = {key.rsplit(".", 1)[0] for key in recipe_fields() if "." in key}
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        at = f"{path}:{key_node.start_mark.line + 1}"
        if key in seen:
            raise RecipeError(f"{at}: {key}: set twice in the same file")
        seen.add(key)
        if key in sections:
            yield from _settings_of(value_node, path, f"{key}.")
        else:
            yield Setting(key, yaml.SafeLoader("").construct_object(value_node, deep=True), at)


def build_recipe(settings: Iterable[Setting]) -> Recipe:
    """The recipe the schema defaults and ``settings`` (later ones win) describe; each checked."""
    fields = recipe_fields()
    values = {key: spec.default for key, spec in fields.items()}
    for setting in settings:
        spec = fields.get(setting.key)
        if spec is None:
            raise RecipeError(f"{setting.origin}: {setting.key}: unknown key{_suggestion(setting.key, fields)}")
        values[setting.key] = _checked(spec, setting)
    return _assemble(Recipe, values, "")


def _suggestion(key: str, fields: Mapping[str, FieldSpec]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _assemble(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    arguments = {}
    for item in dataclasses.fields(cls):
        annotation = hints[item.name]
        key = f"{prefix}{item.name}"
        is_section = dataclasses.is_dataclass(annotation)
        arguments[item.name] = _assemble(annotation, values, f"{key}.") if is_section else values[key]
    return cls(**arguments)


def _checked(spec: FieldSpec, setting: Setting) -> Any:
    try:
        value = _coerce(setting.value, spec.annotation)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{setting.origin}: {spec.key}: {error}, got {setting.value!r}") from None
    problem = problem_with(spec.check, value)
    if problem:
        raise RecipeError(f"{setting.origin}: {spec.key}: {problem}, got {setting.value!r}")
    return value


def _coerce(value: Any, annotation: Any) -> Any:
    """``value`` (from YAML, or a flag's text) as ``annotation``: ``int``, ``float``, ``bool``,
    ``str``, ``X | None``, ``tuple[str, ...]`` or ``dict[str, str]``."""
    arguments = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType):  # X | None
        if value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS):
            return None
        return _coerce(value, next(a for a in arguments if a is not type(None)))
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return _as_names(value)
    if origin is dict:
        return _as_mapping(value)
    return _SCALARS[annotation](value)


def _as_int(value: Any) -> int:
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("expected an integer")
    return value


def _as_float(value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise TypeError("expected a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("expected a number")
    return float(value)


def _as_bool(value: Any) -> bool:
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if isinstance(value, str) and value.lower() in words:
        return words[value.lower()]
    if not isinstance(value, bool):
        raise TypeError("expected true or false")
    return value


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


_SCALARS = {int: _as_int, float: _as_float, bool: _as_bool, str: _as_str}


def _as_names(value: Any) -> tuple[str, ...]:
    """A list of names, or ``"a,b"``; ``none`` is the empty list. Duplicates are dropped."""
    if isinstance(value, str):
        value = [] if value.lower() == "none" else [name.strip() for name in value.split(",") if name.strip()]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise TypeError("expected a list of names or a comma-separated string")
    return tuple(dict.fromkeys(value))


def _as_mapping(value: Any) -> dict[str, str]:
    """A mapping of names, or ``"ours=theirs,..."``."""
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.split(",") if item]
        if not all(len(pair) == 2 and all(pair) for pair in pairs):
            raise ValueError("expected ours=theirs[,ours=theirs...]")
        value = dict(pairs)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError("expected a mapping of names to names")
    return dict(value)


def recipe_as_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain YAML-ready data (tuples as lists), sections nested."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return list(value)
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain(dataclasses.asdict(recipe))


def recipe_to_yaml(recipe: Recipe) -> str:
    """The recipe as a YAML file that :func:`read_recipe_file` reads back into the same recipe."""
    header = "# nemo-wrap recipe, resolved (defaults, file and flags): `nemo-wrap finetune --config THIS` reruns it\n"
    return header + yaml.safe_dump(recipe_as_dict(recipe), sort_keys=False, default_flow_style=False)
