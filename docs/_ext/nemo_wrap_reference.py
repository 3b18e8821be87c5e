"""The generated reference pages: the Python API, the command line and every recipe key.

Their headings start at H1; the page that includes one offsets them.

Written from the code when the build starts (``builder-inited``) into ``reference/_generated/``
(ignored by git), and included by the reference pages, so the reference cannot drift from what
``nemo_wrap.__all__``, ``nemo-wrap --help`` and the recipe schema say: each is read from the very
objects the package uses (``__all__``, ``build_parser()``, ``recipe_fields()``).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

GENERATED = Path(__file__).resolve().parents[1] / "reference" / "_generated"


def _rst(directives: list[str]) -> str:
    """autodoc directives in an ``eval-rst`` block: their output is reStructuredText, which MyST
    would otherwise read as Markdown (and print as text, without a warning)."""
    return "```{eval-rst}\n" + "\n\n".join(directives) + "\n```\n"


def api_page() -> str:
    """One autodoc entry per public name, grouped: classes, functions, errors, data."""
    import nemo_wrap
    from nemo_wrap.errors import NeMoWrapError

    groups: dict[str, list[str]] = {"Classes": [], "Functions": [], "Errors": [], "Data": []}
    for name in nemo_wrap.__all__:
        value = getattr(nemo_wrap, name)
        if inspect.isclass(value) and issubclass(value, NeMoWrapError):
            groups["Errors"].append(f".. autoexception:: nemo_wrap.{name}")
        elif inspect.isclass(value):
            groups["Classes"].append(f".. autoclass:: nemo_wrap.{name}")
        elif callable(value):
            groups["Functions"].append(f".. autofunction:: nemo_wrap.{name}")
        else:
            groups["Data"].append(f".. autodata:: nemo_wrap.{name}\n   :no-value:")
    return "\n".join(f"# {title}\n\n{_rst(entries)}" for title, entries in groups.items() if entries)


def errors_page() -> str:
    """Every exception class of :mod:`nemo_wrap.errors`, the base first, as the module orders them.

    Those exported by ``nemo_wrap`` are indexed on the API page (as ``nemo_wrap.X``, the name users
    import), so here they are not indexed a second time."""
    import nemo_wrap
    from nemo_wrap import errors

    classes = [value for value in vars(errors).values() if inspect.isclass(value) and issubclass(value, Exception)]
    entries = []
    for cls in classes:
        if cls.__module__ == errors.__name__:
            exported = "\n   :no-index:" if cls.__name__ in nemo_wrap.__all__ else ""
            entries.append(f".. autoexception:: nemo_wrap.errors.{cls.__name__}{exported}")
    return _rst(entries)


def cli_page() -> str:
    """Each command's usage, description and example, then its flags by group, as ``--help`` has them."""
    from nemo_wrap.cli import build_parser, command_parsers

    parser = build_parser()
    version = "`nemo-wrap --version` prints the package's, torch's and transformers' versions."
    sections = [f"{parser.description}\n\n{version}\n"]
    for name, command in command_parsers(parser).items():
        sections.append(_command_section(name, command))
    return "\n".join(sections)


def _command_section(name: str, command: argparse.ArgumentParser) -> str:
    usage = command.format_usage().strip()
    lines = [f"# `nemo-wrap {name}`\n", f"{command.description}.\n", f"```text\n{usage}\n```\n"]
    lines.append(f"Example:\n\n```bash\n{command.epilog.split(chr(10), 1)[1].strip()}\n```\n")
    for group in command._action_groups:
        actions = [action for action in group._group_actions if action.help != argparse.SUPPRESS]
        if not actions or group.title == "options":
            continue
        lines.append(f"## {group.title}\n")
        if group.description:
            lines.append(f"{' '.join(group.description.split())}\n")
        lines.append("| flag | what it sets |\n|---|---|")
        lines += [f"| {_invocation(action)} | {_cell(action.help or '')} |" for action in actions]
        lines.append("")
    return "\n".join(lines)


def _invocation(action: argparse.Action) -> str:
    from nemo_wrap.recipes.flags import short_name_first

    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = short_name_first(action.option_strings)
    metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{option}{metavar}`" for option in names)


def recipe_page() -> str:
    """Every recipe key by section: its type, default, flag and help, from the schema."""
    from nemo_wrap.recipes.config_file import recipe_fields, recipe_sections

    descriptions = dict(recipe_sections())
    by_section: dict[str, list[Any]] = {"top level": []}
    for spec in recipe_fields().values():
        section = spec.section or "top level"
        by_section.setdefault(section, []).append(spec)
    lines = []
    for section, specs in by_section.items():
        lines.append(f"# `{section}`\n" if section != "top level" else "# Top level\n")
        if section in descriptions:
            lines.append(f"{descriptions[section]}\n")
        lines.append("| key | type | default | flag | what it sets |\n|---|---|---|---|---|")
        for spec in specs:
            flag = f"`{spec.flag}`" if spec.flag else "the `MODEL` argument" if spec.key == "model" else ""
            default = _cell(repr(spec.default))
            kind = _cell(_type_name(spec.annotation))
            lines.append(f"| `{spec.key}` | `{kind}` | `{default}` | {flag} | {_cell(spec.help)} |")
        lines.append("")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


PAGES = {"api.md": api_page, "errors.md": errors_page, "cli.md": cli_page, "recipe.md": recipe_page}


def write_pages(_app: Any) -> None:
    """Write every generated page; a page whose text did not change is not touched (no rebuild)."""
    GENERATED.mkdir(parents=True, exist_ok=True)
    for name, page in PAGES.items():
        path, text = GENERATED / name, page()
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


def resolve_short_names(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A docstring's ``:class:`InvalidSetupError``` names the public object: the errors and
    ``__all__`` are documented as ``nemo_wrap.errors.X`` and ``nemo_wrap.X``, not under the module
    whose docstring mentions them, so an unresolved short Python name is looked up there."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or "." in target:
        return None
    domain = env.get_domain("py")
    for qualified in (f"nemo_wrap.errors.{target}", f"nemo_wrap.{target}"):
        if qualified in domain.objects:
            node["reftarget"] = qualified
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], qualified, node, contnode)
    return None


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", write_pages)
    app.connect("missing-reference", resolve_short_names)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
