"""Each algorithm's and outer optimizer's options are declared once (`dpresearch.options`): the
YAML of every node names a class whose `OPTIONS` declares each key it sets, with the YAML's
value as the default; constructors take their defaults from the declaration; no module of
`algorithms/` or `config/` reads a node key with a literal default of its own; the docs table
is the one the declarations generate. New algorithms are found through their YAML files."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import compose_config
from hydra.utils import get_object
from omegaconf import OmegaConf

from dpresearch.asynchrony import protocol as protocol_module
from dpresearch.asynchrony.options import AsyncOptions
from dpresearch.asynchrony.protocol import DEFAULT_PROTOCOL
from dpresearch.config import schema
from dpresearch.config.checks import (
    check_compression,
    check_data,
    check_hierarchy,
    check_protocol,
)
from dpresearch.config.checks.plugins import NOT_TAKEN, data_value
from dpresearch.errors import ConfigError
from dpresearch.options import CONF, GROUPS, Options, document, node_files, options_of
from dpresearch.run.build import algorithm_class

PACKAGE = Path(__file__).resolve().parents[1] / "dpresearch"
# Modules that read config nodes: they take a node's values from its declaration.
READERS = (PACKAGE,)  # every module of the package
NOT_OPTIONS = {"_target_", "_recursive_", "defaults"}


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def wiring(value: Any) -> bool:
    """A value that refers to another node (`${seed}`, `${compressor}`) or is a node itself."""
    return isinstance(value, dict) or (isinstance(value, str) and value.startswith("${"))


def target_of(group: str, node: dict[str, Any]) -> str | None:
    """The `_target_` of a node, or of the preset it extends (its `defaults` list's entry of
    the same group, e.g. `- sgd`), followed to the file that sets one."""
    if "_target_" in node:
        return node["_target_"]
    for entry in node.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("/"):
            return target_of(group, load(CONF / group / f"{entry}.yaml"))
    return None


def nodes() -> list[tuple[str, Path]]:
    return [(group, path) for group in GROUPS for path in node_files(group)]


def declared(group: str, path: Path) -> type[Options] | None:
    target = target_of(group, load(path))
    return options_of(target) if target else None


def yaml_problems(node: dict[str, Any], options: type[Options], base: bool) -> list[str]:
    """What a node's YAML writes differently from its declaration: a literal key the
    declaration lacks; for a base node (one with `_target_`, not a preset) a value other than
    the declared default, or a declared key it does not show."""
    defaults = options.defaults()
    problems = []
    for key, value in node.items():
        if key in NOT_OPTIONS or wiring(value):
            continue
        if key not in defaults:
            problems.append(f"{key}: not declared in {options.__name__}")
        elif base and value != defaults[key]:
            problems.append(f"{key}: YAML {value!r} but {options.__name__} {defaults[key]!r}")
    if base:
        problems += [f"{key}: declared, missing in the YAML" for key in defaults if key not in node]
    return problems


def literal_defaults(source: str, keys: set[str], literal_only: bool = False) -> list[int]:
    """Lines calling `<x>.get("<key>", <default>)` for a node key: the default written there
    instead of read from the declaration (`literal_only`: only where it is a literal, so that
    `.get(key, TrainConfig.key)` reads the declaration)."""
    lines = []
    for call in ast.walk(ast.parse(source)):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "get"
            and len(call.args) == 2
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value in keys
            and (not literal_only or isinstance(call.args[1], ast.Constant))
        ):
            lines.append(call.lineno)
    return lines


def literal_parameters(function: Any, options: type[Options]) -> list[str]:
    """Parameters of `function` named as declared options whose default is a literal in the
    source or differs from the declared default."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    args = tree.args  # type: ignore[attr-defined]
    positional = args.posonlyargs + args.args
    pairs = list(
        zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
    ) + [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    defaults = options.defaults()
    signature = inspect.signature(function).parameters
    bad = []
    for arg, node in pairs:
        if arg.arg not in defaults:
            continue
        if isinstance(node, ast.Constant):
            bad.append(f"{arg.arg}={ast.unparse(node)} (a literal)")
        elif signature[arg.arg].default != defaults[arg.arg]:
            bad.append(f"{arg.arg}={signature[arg.arg].default!r} (declared {defaults[arg.arg]!r})")
    return bad


def node_keys() -> set[str]:
    """Every declared option and every literal key of a node YAML."""
    keys = set()
    for group, path in nodes():
        keys |= {k for k, v in load(path).items() if k not in NOT_OPTIONS and not wiring(v)}
        options = declared(group, path)
        keys |= set(options.defaults()) if options else set()
    return keys


@pytest.mark.parametrize(("group", "path"), nodes(), ids=lambda p: getattr(p, "stem", p))
def test_every_yaml_value_is_its_declared_default(group, path):
    """A node with a `_target_` writes exactly the declared defaults; a preset (it extends
    another file, e.g. `outer=streaming`) sets declared keys only."""
    node = load(path)
    options = declared(group, path)
    if options is None:
        assert target_of(group, node) is None, f"{path.name}: its class declares no OPTIONS"
        return  # (outer=none: no node)
    assert yaml_problems(node, options, base="_target_" in node) == []


@pytest.mark.parametrize(("group", "path"), nodes(), ids=lambda p: getattr(p, "stem", p))
def test_constructors_take_their_defaults_from_the_declaration(group, path):
    target = target_of(group, load(path))
    if target is None:
        return
    module, _, name = target.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    options = options_of(target)
    bad = {
        klass.__name__: found
        for klass in cls.__mro__
        if inspect.isfunction(vars(klass).get("__init__"))
        and (found := literal_parameters(klass.__init__, options))
    }
    assert bad == {}


def test_no_module_reads_a_node_key_with_a_literal_default():
    keys = node_keys()
    assert {"period", "gamma", "fragments"} <= keys  # the walk found the declarations
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for root in READERS
        for path in sorted(root.rglob("*.py"))
        if (lines := literal_defaults(path.read_text(), keys))
    }
    assert offenders == {}


def run_node_keys() -> set[str]:
    """The keys of the typed run nodes (`config/schema.py`'s dataclasses below `Config`) and
    every literal key of a data set's YAML, at any depth: their defaults are declared by the
    schema or by the data set's signature."""
    keys = {
        f.name
        for obj in vars(schema).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj is not schema.Config
        for f in dataclasses.fields(obj)
    }

    def walk(node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value)
            elif key not in NOT_OPTIONS:
                keys.add(key)

    for path in (CONF / "data").glob("*.yaml"):
        walk(load(path))
    return keys


def test_no_module_writes_a_run_node_default_again():
    """The checks read a run node's default from the schema (`TrainConfig.eval_bn_stats`) and
    a data key's from the data set's signature, never a literal of their own."""
    keys = run_node_keys()
    assert {"eval_bn_stats", "intra_algorithm", "compute_step_s"} <= keys  # the schema
    assert {"partition", "alpha", "download_timeout_s"} <= keys  # the data YAMLs
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for root in READERS
        for path in sorted(root.rglob("*.py"))
        if (lines := literal_defaults(path.read_text(), keys, literal_only=True))
    }
    assert offenders == {}


def test_a_written_run_node_default_is_found():
    source = (
        "def f(tc):\n"
        "    a = tc.get('eval_bn_stats', 'consensus')\n"
        "    return tc.get('eval_bn_stats', TrainConfig.eval_bn_stats)\n"
    )
    assert literal_defaults(source, {"eval_bn_stats"}, literal_only=True) == [2]
    assert literal_defaults(source, {"eval_bn_stats"}) == [2, 3]


def declarations() -> list[type[Options]]:
    found = {d for g, p in nodes() if (d := declared(g, p))}
    return sorted(found, key=lambda d: d.__name__) + [AsyncOptions]


@pytest.mark.parametrize("options", declarations(), ids=lambda d: d.__name__)
def test_every_declaration_is_frozen_with_a_docstring_per_field(options):
    """Frozen, but for the schema's typed `async` node (overrides change it)."""
    assert options.__dataclass_params__.frozen is (options is not AsyncOptions)  # type: ignore[attr-defined]
    assert options.__doc__ and not options.__doc__.startswith(options.__name__ + "(")
    assert {k: v for k, v in options.docs().items() if not v} == {}
    assert options.from_node(options.defaults()) == options()


def test_the_docs_table_is_the_declarations():
    """docs/options.md is what `python -m dpresearch.options` writes."""
    written = (PACKAGE.parent / "docs" / "options.md").read_text()
    assert written == document(), "regenerate: python -m dpresearch.options > docs/options.md"


# -- the checks above can fail -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Example(Options):
    """An example declaration."""

    period: int = 8
    """steps between averages"""
    gamma: float | None = None
    """a step size"""


def test_a_yaml_that_differs_from_its_declaration_is_found():
    assert yaml_problems({"_target_": "x", "period": 8, "gamma": None}, Example, base=True) == []
    assert yaml_problems({"period": 4, "seed": "${seed}"}, Example, base=True) == [
        "period: YAML 4 but Example 8",
        "gamma: declared, missing in the YAML",
    ]
    assert yaml_problems({"period": 4, "extra": 1}, Example, base=False) == [
        "extra: not declared in Example"
    ]


def test_a_literal_default_is_found():
    source = "def f(alg, state):\n    a = alg.get('period', 8)\n    return state.get('x', 0)\n"
    assert literal_defaults(source, {"period"}) == [2]


def literal_init(self, period: int = 8, gamma: float | None = Example.gamma, seed: int = 0):
    """A constructor writing one declared default again."""


def drifted_init(self, period: int = Example.gamma, gamma: float | None = Example.gamma):  # type: ignore[assignment]
    """A constructor reading the wrong field."""


def test_a_constructor_default_written_again_is_found():
    assert literal_parameters(literal_init, Example) == ["period=8 (a literal)"]
    assert literal_parameters(drifted_init, Example) == ["period=None (declared 8)"]


def test_field_docstrings_are_read_from_the_source():
    assert Example.docs() == {"period": "steps between averages", "gamma": "a step size"}
    assert "| `algorithm.period` | `8` | steps between averages |" in Example.table()
    assert Example.from_node({"period": 3, "_target_": "x"}) == Example(period=3)


# -- compression left as it is, by what the nodes build (not by target strings) -----------------
@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ((), False),
        (("compressor=identity", "error_feedback=none"), False),
        (("error_feedback.start_after_steps=5",), True),  # an active memory, mode none
        (("error_feedback.momentum=0.5",), True),
        (("compressor=topk",), True),
    ],
)
def test_compression_is_left_alone_as_the_built_objects_say(overrides, refused):
    """An algorithm without compressed messages runs with the nodes only where they build the
    identity and an inactive memory (`compress.channel.is_identity` / `is_inactive`)."""
    cfg = compose_config("algorithm=local_sgd", *overrides)
    if not refused:
        check_compression(cfg)
        return
    with pytest.raises(ConfigError, match="LocalSGD does not use compressor/error_feedback"):
        check_compression(cfg)


# -- behaviour decided by declarations: traits, the default protocol, data sets' signatures ----
@pytest.mark.parametrize(
    ("algorithm", "two_level"), [("sync", True), ("node_sync", True), ("local_sgd", False)]
)
def test_a_two_level_cluster_is_for_the_algorithms_that_declare_it(algorithm, two_level):
    """`comm.hierarchy` is refused exactly where the class's `Traits.two_level` is false; the
    check reads the trait (flipping it flips the verdict), not a list of targets."""
    cfg = compose_config(f"algorithm={algorithm}", "workers=4", "comm.hierarchy.workers_per_node=2")
    cls = algorithm_class(cfg)
    assert cls.traits.two_level is two_level
    for declared_two_level in (two_level, not two_level):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cls, "traits", dataclasses.replace(cls.traits, two_level=declared_two_level))
            if declared_two_level:
                check_hierarchy(cfg)
            else:
                with pytest.raises(ConfigError, match="two-level cluster for algorithm=sync"):
                    check_hierarchy(cfg)


def test_the_default_protocol_is_the_yaml_default():
    """The protocol a run gets without `protocol=` is `DEFAULT_PROTOCOL`, and only it is left
    alone for an algorithm without a protocol."""
    assert get_object(compose_config().protocol._target_) is DEFAULT_PROTOCOL
    check_protocol(compose_config("algorithm=sync"))
    with pytest.raises(ConfigError, match="does not use a protocol; .* leave protocol=asgd"):
        check_protocol(compose_config("algorithm=sync", "protocol=ssp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protocol_module, "DEFAULT_PROTOCOL", protocol_module.SSP)
        with pytest.raises(ConfigError, match="leave protocol=ssp"):
            check_protocol(compose_config("algorithm=sync"))


def bad_alpha_data(partition: str = "iid", alpha: float = 0.0) -> None:
    """A data set whose declared Dirichlet concentration is out of range."""


@pytest.mark.parametrize(
    ("node", "key", "value"),
    [
        ({"_target_": "dpresearch.data.least_squares.make_least_squares"}, "partition", "shared"),
        ({"_target_": "dpresearch.data.cifar.CIFAR10.load"}, "download_timeout_s", 1800.0),
        ({"_target_": "dpresearch.data.cifar.CIFAR10.load", "alpha": 0.5}, "alpha", 0.5),
        ({"_target_": "dpresearch.data.synthetic.make_synthetic"}, "download_timeout_s", None),
        ({"_target_": "no.such.target"}, "partition", None),
    ],
)
def test_a_data_key_not_given_is_the_data_sets_declared_default(node, key, value):
    found = data_value(OmegaConf.create(node), key)
    assert (found is NOT_TAKEN) if value is None else (found == value)


def test_a_declared_data_default_is_checked():
    cfg = OmegaConf.create({"data": {"_target_": f"{__name__}.bad_alpha_data"}})
    with pytest.raises(ConfigError, match="data.alpha=0.0: the Dirichlet concentration"):
        check_data(cfg)
    check_data(OmegaConf.create({"data": {"_target_": f"{__name__}.bad_alpha_data", "alpha": 2}}))
