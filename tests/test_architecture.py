"""The layers stay layers: no import cycle between the package's modules nor between its
packages (`comm`, `run`, `launch`, ...; a module at the top is a package of its own),
torch.distributed called only by the communicator and the launcher, algorithm traits read from
one declaration, the outer optimizer's delegation complete, a short loop, and configuration
checks owned by their nodes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.config import checks
from dpresearch.config.schema import schema
from dpresearch.config.validate import validate

PACKAGE = Path(__file__).resolve().parents[1] / "dpresearch"
# Where torch.distributed may be called: the communicator and the process launcher.
DISTRIBUTED_ALLOWED = ("comm/", "launch/")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph() -> dict[str, dict[str, int]]:
    """module → {imported module of the package: line}, for imports anywhere in the module
    (functions included: a lazy import is still a dependency), `if TYPE_CHECKING:` excluded."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    for a in node.names
                ]
            else:
                continue
            if _type_checking_only(node, parents):
                continue
            for target in targets:
                if target in mods and target != name:
                    graph[name][target] = node.lineno
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """The package a module belongs to: `dpresearch.run.build` → `run`; a module directly
    under `dpresearch` is its own (`dpresearch.train` → `train`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """package → {package it imports: one import that does it, `module:line`}."""
    packages: dict[str, dict[str, str]] = {package_of(m): {} for m in graph}
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = package_of(module), package_of(target)
            if a != b:
                packages[a].setdefault(b, f"{module}:{line}")
    return packages


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert cycles(graph) == []


def test_no_package_import_cycle():
    """Packages are layers too: no two packages import each other, however indirectly (module
    and function-level imports both count)."""
    packages = package_graph(import_graph())
    assert {"comm", "run", "launch", "config", "algorithms"} <= set(packages)
    found = cycles(packages)
    # each cycle with the imports that close it
    closing = [{a: {b: packages[a][b] for b in packages[a] if b in c} for a in c} for c in found]
    assert closing == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_cycle_finder_finds_a_package_cycle():
    """Modules without a cycle among them whose packages import each other: a package cycle,
    through a function-level import too."""
    graph = {
        "dpresearch.config.checks": {"dpresearch.run.build": 1},
        "dpresearch.run.build": {"dpresearch.comm.base": 2},
        "dpresearch.run.resume": {"dpresearch.config.validate": 3},
        "dpresearch.config.validate": {},
        "dpresearch.comm.base": {},
        "dpresearch.train": {"dpresearch.config.checks": 4},
    }
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["config", "run"]]


def test_function_level_imports_are_in_the_graph(tmp_path, monkeypatch):
    """A lazy import is still a dependency: the graph sees it."""
    package = tmp_path / "dpresearch"
    (package / "a").mkdir(parents=True)
    (package / "b").mkdir()
    (package / "a" / "m.py").write_text("def f():\n    from dpresearch.b.n import g\n")
    (package / "b" / "n.py").write_text("from dpresearch.a.m import f\n\ndef g(): pass\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    graph = import_graph()
    assert graph["dpresearch.a.m"] == {"dpresearch.b.n": 2}
    assert cycles(package_graph(graph)) == [["a", "b"]]


def distributed_calls(path: Path) -> list[int]:
    """Lines of `path` that call into torch.distributed: `dist.<f>(…)` through any alias of the
    module, or a function imported from it (types in annotations and isinstance checks, e.g.
    the DDP hook's `dist.GradBucket`, are not calls)."""
    tree = ast.parse(path.read_text())
    modules_, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules_.update(
                a.asname or a.name for a in node.names if a.name.startswith("torch.distributed")
            )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "torch.distributed"
        ):
            functions.update(a.asname or a.name for a in node.names)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        while isinstance(func, ast.Attribute) and ast.unparse(func.value) not in modules_:
            func = func.value
        called = ast.unparse(func.value) if isinstance(func, ast.Attribute) else None
        if called in modules_ or (isinstance(node.func, ast.Name) and node.func.id in functions):
            lines.append(node.lineno)
    return lines


def test_torch_distributed_only_in_the_communicator_and_the_launcher():
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if not str(path.relative_to(PACKAGE)).startswith(DISTRIBUTED_ALLOWED)
        and (lines := distributed_calls(path))
    }
    assert offenders == {}


def test_the_distributed_call_finder_finds_calls(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch.distributed as dist\n"
        "from torch.distributed import all_reduce\n"
        "def f(x, g: dist.ProcessGroup):\n"
        "    dist.all_reduce(x)\n"
        "    all_reduce(x)\n"
        "    return dist.distributed_c10d._get_default_group()\n"
    )
    assert distributed_calls(source) == [4, 5, 6]


def test_traits_are_declared_once_and_never_looked_up_by_name():
    """No `getattr(<something>, "<trait>")` anywhere: traits are `Algorithm.traits`."""
    names = {f.name for f in Traits.__dataclass_fields__.values()} | {
        "run_process",
        "num_processes",
        "check_config",
        "traits",
    }
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []
    assert isinstance(Algorithm.traits, Traits)


def test_the_loop_module_is_short():
    assert len((PACKAGE / "run" / "loop.py").read_text().splitlines()) < 250


def test_validation_is_split_by_config_node():
    """`validate` only runs the nodes' own checks; every node of the schema is checked by
    one (or, for the nodes below, by the build in preflight or by another node's check)."""
    assert len(inspect.getsource(validate).splitlines()) < 30
    checked = {name.split(".")[0] for name in (*checks.NODE_CHECKS, *checks.PLUGIN_CHECKS)}
    # model: built once by preflight; error_feedback: with the compressor; topology: by the
    # algorithm that uses it; seed, debug: any value runs; async: the asynchronous algorithms.
    elsewhere = {"model", "error_feedback", "topology", "seed", "debug", "async"}
    assert set(schema()) - checked == elsewhere
    for check in (*checks.NODE_CHECKS.values(), *checks.PLUGIN_CHECKS.values()):
        assert len(inspect.getsource(check).splitlines()) < 60, check.__name__


def algorithm_members() -> set[str]:
    """The members `Algorithm` defines (hooks, class attributes), dunders and ABC's aside."""
    return {n for n in vars(Algorithm) if not n.startswith("__") and n != "_abc_impl"}


def outer_delegation_gaps(outer: type[Algorithm], members: set[str]) -> dict[str, str]:
    """Members of `Algorithm` that `outer` neither defines, takes from its base in `__init__`
    (`self.<name> = base.<name>`), nor leaves on purpose (`NOT_FORWARDED`); and members it
    both defines and claims to leave."""
    init = inspect.getsource(outer.__init__)
    taken = {n for n in members if f"self.{n} = base.{n}" in init}
    defined = {n for n in members if n in vars(outer)} | taken
    left = set(outer.NOT_FORWARDED)
    gaps = {n: "neither forwarded nor left on purpose" for n in members - defined - left}
    gaps.update({n: "forwarded and also listed as left" for n in defined & left})
    gaps.update({n: "listed as left but not a member of Algorithm" for n in left - members})
    return gaps


def test_the_outer_optimizer_decides_every_algorithm_hook():
    """`OuterOptimizer` wraps any base algorithm: every hook of `Algorithm` is forwarded (or
    wrapped) or left as `Algorithm` has it for a stated reason."""
    from dpresearch.algorithms.outer.optimizer import OuterOptimizer

    assert outer_delegation_gaps(OuterOptimizer, algorithm_members()) == {}


def test_a_new_algorithm_hook_is_a_gap_of_the_outer_optimizer():
    from dpresearch.algorithms.outer.optimizer import OuterOptimizer

    members = algorithm_members() | {"new_hook"}
    assert outer_delegation_gaps(OuterOptimizer, members) == {
        "new_hook": "neither forwarded nor left on purpose"
    }
