"""YAML -> `Scenario`, with ``--set`` overrides and errors that say where and what is allowed."""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .config import Scenario

Path_ = tuple[Any, ...]


@dataclass
class Problem:
    source: str  # the file, or the --set argument that introduced the value
    line: int | None
    path: str
    message: str
    allowed: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        text = f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"
        if self.allowed and "allowed" not in self.message and "available" not in self.message:
            text += f" (allowed: {', '.join(self.allowed)})"
        return text


class ScenarioError(ValueError):
    """A scenario file or override is wrong; the message lists every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def _key_lines(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                problems.append(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
            lines[(*path, key)] = key_node.start_mark.line + 1
            _key_lines(value_node, (*path, key), lines, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _key_lines(item, (*path, i), lines, problems)


def parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[Path_, int]]:
    """Safely parse a scenario; return the data and the line of every key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = mark.line + 1 if mark else None
        raise ScenarioError(
            [Problem(source, line, "", f"not valid YAML: {error.problem or error}")]
        ) from None
    except yaml.YAMLError as error:
        raise ScenarioError([Problem(source, None, "", f"not valid YAML: {error}")]) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ScenarioError(
            [
                Problem(
                    source, 1, "", f"a scenario must be a mapping of sections, this file is {kind}"
                )
            ]
        )
    lines: dict[Path_, int] = {}
    duplicates: list[str] = []
    _key_lines(node, (), lines, duplicates)
    if duplicates:
        raise ScenarioError([Problem(source, None, "", d) for d in duplicates])
    return data, lines


def apply_override(data: dict[str, Any], override: str) -> Path_:
    """Apply ``a.b.c=value`` (value parsed as YAML) to ``data``; return the path set."""
    if "=" not in override:
        raise ScenarioError(
            [Problem(f"--set {override}", None, "", "expected KEY=VALUE, e.g. train.steps=20")]
        )
    dotted, _, raw = override.partition("=")
    keys = tuple(k for k in dotted.strip().split(".") if k)
    if not keys:
        raise ScenarioError([Problem(f"--set {override}", None, "", "empty key")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        if raw.strip()[:1] in "[{":  # meant as a list or mapping: say why it is not one
            said = getattr(error, "problem", None) or "not valid YAML"
            raise ScenarioError(
                [
                    Problem(
                        f"--set {override}", None, "", f"{raw.strip()} is not valid YAML ({said})"
                    )
                ]
            ) from None
        value = raw
    target = data
    for key in keys[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    kind = _model_at(keys[:-1], data) if keys[-1] == "name" else None
    target[keys[-1]] = value
    if kind is not None and (now := _model_at(keys[:-1], data)) not in (None, kind):
        # Another kind of the section (data.name=cifar10 over synthetic images): the
        # keys only the earlier kind takes (shape, num_samples) go with it; any other
        # unknown key (a typo) stays, to be named.
        for key in [k for k in target if k in kind.model_fields and k not in now.model_fields]:
            del target[key]
    return keys


def _unwrap(annotation: Any) -> list[Any]:
    """The classes an annotation admits (through Annotated, Optional and unions)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _unwrap(arg)]
    return [annotation]


def _model_at(path: Path_, data: Any) -> type[BaseModel] | None:
    """The config class that validates the mapping at ``path``."""
    cls: type[BaseModel] = Scenario
    for key in path:
        if not isinstance(data, dict) or key not in cls.model_fields:
            return None
        data = data.get(key)
        candidates = [
            c
            for c in _unwrap(cls.model_fields[key].annotation)
            if isinstance(c, type) and issubclass(c, BaseModel)
        ]
        if len(candidates) > 1 and isinstance(data, dict):
            # A union chosen by "name" (model, data): pick the member whose name matches.
            candidates = [
                c
                for c in candidates
                if data.get("name") in typing.get_args(c.model_fields["name"].annotation)
            ]
        if len(candidates) != 1:
            return None
        cls = candidates[0]
    return cls


def _problem_from(
    error: dict[str, Any],
    data: dict[str, Any],
    lines: dict[Path_, int],
    sources: dict[Path_, str],
    default_source: str,
) -> Problem:
    loc = list(error["loc"])
    # Discriminated unions put the chosen member's tag into the location: drop it.
    if len(loc) > 1 and loc[0] in ("model", "data") and isinstance(data.get(loc[0]), dict):
        if loc[1] == data[loc[0]].get("name"):
            del loc[1]
    ctx = error.get("ctx") or {}
    allowed: list[str] = []
    if error["type"] == "scenario":
        loc = ctx["path"].split(".")
        message, allowed = ctx["message"], list(ctx["allowed"])
    elif error["type"] == "extra_forbidden":
        model = _model_at(tuple(loc[:-1]), data)
        allowed = list(model.model_fields) if model else []
        message = f"unknown key {loc[-1]!r}"
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        message += f" (did you mean {hint[0]!r}?)" if hint else ""
    elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        allowed = [t.strip(" '") for t in str(ctx.get("expected_tags", "")).split(",") if t.strip()]
        section = loc[0] if loc else "section"
        if error["type"] == "union_tag_not_found":
            message = f"{section} needs a 'name'"
        else:
            message = f"unknown {section} {ctx.get('tag')!r}"
            hint = difflib.get_close_matches(str(ctx.get("tag")), allowed, n=1)
            message += f" (did you mean {hint[0]!r}?)" if hint else ""
        loc = [*loc, "name"] if error["type"] == "union_tag_invalid" else loc
    elif error["type"] == "missing":
        message = "required key is missing"
    elif error["type"] == "number_not_bool":  # raised for its section: name the key
        loc, message = [*loc, ctx["name"]], error["msg"]
    elif error["type"] == "value_error":  # a section's own check: its words, not its input
        message = str(error["msg"]).removeprefix("Value error, ")
    else:
        message = f"{error['msg']}, got {error.get('input')!r}"
        if error["type"] == "literal_error" and "expected" in ctx:
            allowed = [
                t.strip(" '")
                for t in str(ctx["expected"]).replace(" or ", ",").split(",")
                if t.strip()
            ]
    path = tuple(loc)
    source, line = default_source, None
    # A key only --set wrote, or a section the file has that a --set wrote into and the
    # message names that --set's key (a section's own check, a value a --set turned
    # into a section): that --set names it, the latest such.
    below = [(keys, text) for keys, text in sources.items() if keys[: len(path)] == path]
    named = [text for keys, text in below if re.search(rf"\b{re.escape(str(keys[-1]))}\b", message)]
    if named or (below and path not in lines):
        source = (named or [text for _, text in below])[-1]
        return Problem(source, None, ".".join(str(p) for p in path), message, allowed)
    # A --set that wrote the key or a section above it replaced what the file had there.
    written = next((path[:end] for end in range(len(path), 0, -1) if path[:end] in sources), None)
    if written is not None:
        source = sources[written]
    else:
        line = next(
            (lines[path[:end]] for end in range(len(path), 0, -1) if path[:end] in lines), None
        )
    return Problem(source, line, ".".join(str(p) for p in path), message, allowed)


def validate_scenario(
    data: dict[str, Any], lines: dict[Path_, int], sources: dict[Path_, str], source: str
) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        problems = [
            _problem_from(e, data, lines, sources, source) for e in error.errors(include_url=False)
        ]
        raise ScenarioError(problems) from None


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read a scenario file, apply ``--set`` overrides and validate everything."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise ScenarioError([Problem(source, None, "", f"scenario file {what}")])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ScenarioError(
            [Problem(source, None, "", f"not UTF-8 text (byte {error.start}): save it as UTF-8")]
        ) from None
    except OSError as error:
        raise ScenarioError([Problem(source, None, "", f"cannot read: {error.strerror}")]) from None
    data, lines = parse_yaml(text, source)
    data.setdefault("name", path.stem)
    sources: dict[Path_, str] = {}
    for override in overrides:
        keys = apply_override(data, override)
        sources[keys] = f"--set {override}"
    return validate_scenario(data, lines, sources, source)


def dump_scenario(scenario: Scenario) -> str:
    """The fully resolved scenario as YAML (what a run actually used)."""
    return yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False)
