"""A fast reader for the block YAML that OmegaConf writes (a run's `config.yaml`).

PyYAML builds every node in Python (≈ 2 ms for a resolved config on a busy core), which
dominates loading a thousand runs. `load_config` reads the subset OmegaConf's `to_yaml` emits —
nested block mappings, block lists of scalars, plain and quoted scalars, `[]` and `{}` — line
by line, resolving scalars as YAML 1.1 does (null, booleans, integers, floats). Anything else
(anchors, tags, multi-line or flow values, list items that are mappings, tabs) raises
`Unsupported`; `load_config` then falls back to PyYAML, so the result always equals
`yaml.safe_load`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

try:
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader

# YAML 1.1 as PyYAML resolves it (decimal integers and floats only; the rest falls back)
_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)$")
_FLOAT = re.compile(r"([-+]?[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)([eE][-+][0-9]+)?$")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)$")
# What YAML 1.1 might read as something other than a string: octal, hex, binary, timestamps,
# other dot forms, indicators, merge and value keys (sexagesimal numbers contain ':').
_RISKY = re.compile(r"[-+]?0[0-7_]+$|[-+]?0[xXbB]|[0-9]{4}-[0-9]|[-+]?\.[0-9_]|[?=<]|-( |$)")
_PLAIN_SPECIAL = set("&*!|>%@`{[\"'#")
_WORDS: dict[str, Any] = {
    "null": None, "Null": None, "NULL": None, "~": None, "": None,
    "true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False,
    "yes": True, "Yes": True, "YES": True, "no": False, "No": False, "NO": False,
    "on": True, "On": True, "ON": True, "off": False, "Off": False, "OFF": False,
    ".nan": float("nan"), ".NaN": float("nan"), ".NAN": float("nan"),
    "[]": [], "{}": {},
}  # fmt: skip


class Unsupported(ValueError):
    """Text outside the subset this reader handles."""


def _scalar(text: str) -> Any:
    if text in _WORDS:
        value = _WORDS[text]
        return [] if value == [] else {} if value == {} else value
    first = text[0]
    if first == "'":
        if len(text) < 2 or not text.endswith("'") or "'" in text[1:-1].replace("''", ""):
            raise Unsupported(text)
        return text[1:-1].replace("''", "'")
    if first in _PLAIN_SPECIAL or " #" in text or ": " in text or text.endswith(":"):
        raise Unsupported(text)  # double quotes (escapes), flow collections, comments, …
    if _INT.match(text):
        return int(text.replace("_", ""))
    if _FLOAT.match(text):
        return float(text.replace("_", ""))
    if _INF.match(text):
        return float("-inf") if first == "-" else float("inf")
    if ":" in text or _RISKY.match(text):
        raise Unsupported(text)
    return text


def _parse(text: str) -> dict[str, Any]:
    if "\t" in text or "\r" in text:
        raise Unsupported("tabs or carriage returns")
    root: dict[str, Any] = {}
    # (indent of the keys in it, container); a key with no value opens a pending child
    stack: list[tuple[int, Any]] = [(0, root)]
    pending: tuple[dict[str, Any], str, int] | None = None
    for line in text.split("\n"):
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        if pending is not None:
            parent, key, parent_indent = pending
            pending = None
            if stripped.startswith("- ") or stripped == "-":
                if indent < parent_indent:
                    raise Unsupported(line)
                child: Any = []
            elif indent > parent_indent:
                child = {}
            else:
                parent[key] = None
                child = None
            if child is not None:
                parent[key] = child
                stack.append((indent, child))
        while stack and indent < stack[-1][0]:
            stack.pop()
        if not stack or indent != stack[-1][0]:
            raise Unsupported(line)
        container = stack[-1][1]
        if stripped.startswith("- ") or stripped == "-":
            if not isinstance(container, list):
                raise Unsupported(line)
            container.append(_scalar(stripped[2:].strip()))
            continue
        if isinstance(container, list):
            stack.pop()  # a list at the same indent as its key ends here
            if not stack or indent != stack[-1][0]:
                raise Unsupported(line)
            container = stack[-1][1]
        key, sep, rest = stripped.partition(":")
        if not sep or (rest and not rest.startswith(" ")) or not key or _scalar(key) != key:
            raise Unsupported(line)  # keys stay strings only when YAML reads them as strings
        value = rest.strip()
        if key in container:
            raise Unsupported(f"duplicate key {key}")
        if value:
            container[key] = _scalar(value)
        else:
            container[key] = None
            pending = (container, key, indent)
    return root


def load_config(text: str) -> dict[str, Any]:
    """`yaml.safe_load(text)` for a config file (a mapping; {} when empty), fast when it is
    in the subset OmegaConf writes."""
    try:
        return _parse(text)
    except Unsupported:
        return yaml.load(text, _Loader) or {}
