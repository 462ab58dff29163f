"""A config node's options declared once: a frozen dataclass per algorithm (and per outer
optimizer node) whose fields are the node's own keys, each with its default and a docstring
(the string literal under the field, as attribute docstrings are written).

From the one declaration are read: the constructor's defaults (`period: int =
LocalSGDOptions.period`), the configuration check (`Options.check_node`: `from_node(node)`
then `check()`, one ValueError line naming the fix), the YAML's values (a test compares
`conf/algorithm/*.yaml` and `conf/outer/*.yaml` with `defaults()`) and the documentation
table (`table()`, written to `docs/options.md` by `python -m dpresearch.options`).

A node also carries wiring that is not an option of its own (`_target_`, `${topology}`,
`${compressor}`, `${seed}`, ...): `from_node` takes the declared fields and leaves the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Options")
CONF = Path(__file__).resolve().parent / "conf"
# The node groups whose YAML files name a class declaring its options (`options_of`).
GROUPS = ("algorithm", "outer")
# Typed nodes of the schema declared the same way (no YAML: the schema is the declaration).
SCHEMA_NODES = (
    "dpresearch.asynchrony.options.AsyncOptions",
    "dpresearch.run.time_scenarios.ScenarioOptions",
)


class Options:
    """Base of every declaration. Subclasses are dataclasses (frozen, but for a typed node of
    the schema that OmegaConf must be able to change, `async`); `NODE` is the config path
    their messages and tables name (`algorithm`, `outer`); `check` raises ValueError, one line
    naming the fix, for values that cannot run (the default: none)."""

    NODE: ClassVar[str] = "algorithm"

    @classmethod
    def from_node(cls: type[T], node: Mapping[str, Any] | None) -> T:
        """The options a config node (or plain mapping) sets; missing keys take the defaults,
        keys that are not declared fields (wiring, `_target_`) are left out."""
        node = node or {}
        return cls(**{f.name: node[f.name] for f in dataclasses.fields(cls) if f.name in node})

    @classmethod
    def check_node(cls, node: Mapping[str, Any] | None) -> None:
        """`from_node(node).check()`: raise ValueError for a node's values that cannot run."""
        cls.from_node(node).check()

    def check(self) -> None:
        """Raise ValueError (one line naming the fix) for values that cannot run."""

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field's default value, by name (a `default_factory`'s value made)."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Every field's docstring, by name ("" where a field has none)."""
        return field_docs(cls)

    @classmethod
    def table(cls) -> str:
        """The markdown table of the options: key, default, meaning."""
        docs = cls.docs()
        rows = ["| key | default | meaning |", "|---|---|---|"]
        for name, value in cls.defaults().items():
            meaning = " ".join(docs[name].split()).replace("|", "\\|")
            rows.append(f"| `{cls.NODE}.{name}` | `{show(value)}` | {meaning} |")
        return "\n".join(rows)


def show(value: Any) -> str:
    """A default as the YAML writes it (null, true, 0.005)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass's fields, walking its bases (the string literal
    right under `name: type = default`)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        docs.update(_own_field_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


@cache
def _own_field_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, after in zip(body, body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def node_files(group: str) -> list[Path]:
    """The YAML files of a config group (`conf/<group>/*.yaml`), sorted."""
    return sorted((CONF / group).glob("*.yaml"))


def options_of(target: str) -> type[Options] | None:
    """The declaration of the class `target` names (its `OPTIONS` class attribute), or None."""
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    declared = getattr(cls, "OPTIONS", None)
    return declared if isinstance(declared, type) and issubclass(declared, Options) else None


def document() -> str:
    """`docs/options.md`: one table per declaration that a YAML of `GROUPS` names (with every
    YAML naming it), in file order."""
    import yaml

    named: dict[type[Options], list[str]] = {}
    for group in GROUPS:
        for path in node_files(group):
            target = (yaml.safe_load(path.read_text()) or {}).get("_target_")
            declared = options_of(target) if target else None
            if declared is not None:
                named.setdefault(declared, []).append(f"`{group}={path.stem}`")
    parts = [
        "# Options of each algorithm and outer optimizer",
        "",
        "Generated from the declarations (`python -m dpresearch.options > docs/options.md`);",
        "a test keeps this file, the classes and the YAML defaults equal.",
    ]
    for path in SCHEMA_NODES:
        module, _, name = path.rpartition(".")
        declared = getattr(importlib.import_module(module), name)
        named[declared] = [f"`{declared.NODE}` (schema node)"]
    for declared, names in named.items():
        summary = " ".join((inspect.getdoc(declared) or "").split("\n\n")[0].split())
        parts += ["", f"## {', '.join(names)}: `{declared.__name__}`", "", summary, ""]
        parts.append(declared.table())
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    # the package's own module: the algorithms' declarations subclass its `Options`, not
    # this `__main__` copy's
    from dpresearch import options

    print(options.document(), end="")
