"""docs/reference.md, generated: every command-line flag (the `mmspec` command, the batch jobs, the drafter-training
job) read from their argparse parsers, and every config field (job YAML, Serve args, training) read from the
pydantic models, so the reference cannot drift from the code. `tests/test_reference.py` checks the file is current.

    python -m mmspec_ray.reference > docs/reference.md
"""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Reference

Every command-line flag and every config field, generated from the code (`python -m mmspec_ray.reference >
docs/reference.md`; a test fails when this file is out of date). How to use them: README.md and the guides in docs/.
"""


def _cell(text: Any) -> str:
    """One Markdown table cell: pipes escaped, newlines folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):  # a flag that turns a setting on: off unless given
        return "on" if action.default is True else "off"
    if isinstance(action, argparse._StoreFalseAction):  # a flag that turns a setting off: on unless given
        return "off" if action.default is False else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def parser_section(title: str, parser: argparse.ArgumentParser, level: int = 2) -> list[str]:
    """A heading, the parser's usage line and one table row per flag; sub-commands follow as sub-sections."""
    out = [f"{'#' * level} {title}", "", f"`{_cell(parser.format_usage().replace('usage: ', '').strip())}`", ""]
    rows, subs = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            subs += [(name, sub, helps.get(name)) for name, sub in action.choices.items()]
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
        rows.append(f"| {name} | {_cell(_default(action))} | {_cell((action.help or '') + choices)} |")
    if rows:
        out += ["| flag | default | what it does |", "|---|---|---|", *rows, ""]
    for name, sub, help_ in subs:
        if help_:
            out += [f"{'#' * (level + 1)} {title} {name}", "", _cell(help_), ""]
            out += parser_section(f"{title} {name}", sub, level + 1)[2:]
        else:
            out += parser_section(f"{title} {name}", sub, level + 1)
    return out


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `TreeConfig | Literal['auto']`, not the module path."""
    if not typing.get_args(annotation):
        return getattr(annotation, "__name__", str(annotation))
    text = str(annotation).replace("typing.", "")
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and arg.__module__ != "builtins":
            text = text.replace(f"{arg.__module__}.{arg.__qualname__}", arg.__name__)
    return text


def model_section(title: str, model: type[BaseModel], level: int = 3,
                  seen: dict[str, str] | None = None) -> list[str]:
    """A heading and one row per field (type, default, description); nested models get their own sections, once
    (`seen`: model name -> the section that lists its fields)."""
    seen = {} if seen is None else seen
    if model.__name__ in seen:
        head = f"{'#' * level} {title} (`{model.__name__}`)"
        return [head, "", f"The fields of `{seen[model.__name__]}` above.", ""]
    seen[model.__name__] = title
    out = [f"{'#' * level} {title} (`{model.__name__}`)", ""]
    if model.__doc__:
        out += [_cell(model.__doc__), ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        if field.default is not PydanticUndefined:
            value = field.default
        elif field.default_factory is not None:
            value = field.default_factory()
        else:
            value = PydanticUndefined
        default = ("required" if value is PydanticUndefined else "(below)" if isinstance(value, BaseModel)
                   else f"`{value!r}`")
        out.append(f"| `{name}` | {_cell(_type_name(field.annotation))} | {_cell(default)} | "
                   f"{_cell(field.description or '')} |")
        sub = field.annotation if isinstance(field.annotation, type) else None
        for arg in typing.get_args(field.annotation):
            sub = arg if isinstance(arg, type) and issubclass(arg, BaseModel) else sub
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            nested.append((f"{title}.{name}", sub))
    out.append("")
    for sub_title, sub in nested:
        out += model_section(sub_title, sub, level + 1, seen)
    return out


def render() -> str:
    """The whole reference as Markdown."""
    from mmspec_ray.batch.cli import build_parser as job_parser
    from mmspec_ray.batch.jobspec import JobSpec
    from mmspec_ray.cli import build_parser as mmspec_parser
    from mmspec_ray.serve.settings import ServeSettings
    from mmspec_ray.training.cli import build_parser as train_parser
    from mmspec_ray.training.schedule import TrainConfig

    lines = [HEADER, "## Commands", ""]
    lines += parser_section("mmspec", mmspec_parser(), 3)
    for job in ("caption_kinetics", "instruct"):
        lines += parser_section(f"jobs/{job}.py", job_parser(job), 3)
    lines += parser_section("jobs/train_drafter.py", train_parser(), 3)
    lines += ["## Config files", "",
              "A batch job's `--config` YAML (flags override it), a Serve config's `applications[].args`, and the "
              "trainer's settings. Nested tables are the fields of a nested section.", ""]
    seen: dict[str, str] = {}
    lines += model_section("job", JobSpec, seen=seen)
    lines += model_section("serve", ServeSettings, seen=seen)
    lines += model_section("training", TrainConfig, seen=seen)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
