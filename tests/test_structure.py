"""The package's shape, checked from the source: no import cycles, layers by job, a pure planner.

Static (``ast``, nothing is imported): every ``import`` and ``from ... import`` inside
``megatron_fcp`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (annotations only, never executed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PKG = Path(__file__).resolve().parents[1] / "megatron_fcp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported megatron_fcp module, line)`` for every executed import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(m, line) for m, line in found if m in MODULES and m != module]


GRAPH = nx.DiGraph()
for _m in MODULES:
    GRAPH.add_node(_m)
    for _dep, _line in _imports(_m):
        GRAPH.add_edge(_m, _dep, line=_line)


def test_the_source_walk_sees_the_package():
    assert "megatron_fcp.contract.plan" in MODULES and "megatron_fcp.patches.runtime" in MODULES
    assert GRAPH.has_edge("megatron_fcp.planner.build", "megatron_fcp.cost.model")
    assert GRAPH.has_edge("megatron_fcp.patches.megatron", "megatron_fcp.patches.runtime")


def test_no_import_cycle_inside_the_package():
    cycles = list(nx.simple_cycles(GRAPH))
    described = [" -> ".join(f"{a} (line {GRAPH.edges[a, b]['line']})" for a, b in zip(c, c[1:] + c[:1]))
                 for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_a_cycle_would_be_caught():
    g = GRAPH.copy()
    g.add_edge("megatron_fcp.contract.plan", "megatron_fcp.planner.compare", line=0)
    assert list(nx.simple_cycles(g))


# The package's layers, bottom to top: a module imports only from its own package or from one below
# it. The pure half (no torch) is topology .. planner; the engine needs only the plan contract and
# the backward program; the Megatron integration may use all of it; measuring and emulating are on
# top, and nothing below imports them.
PACKAGE_LAYERS = [
    ("jit", "memo"),            # compiled planning loops (numba, or Python); answers kept on their objects
    ("topology",),              # the cluster: hosts, NVLink domains, links, NICs; presets and detection
    ("contract",),              # blocks, need rules, placements, the Plan and its proofs
    ("schedule",),              # the backward program: every backward decision, once
    ("cost",),                  # timelines of plans and programs, TE's schedules, bounds
    ("planner",),               # graph -> plan; the choice among candidates (prices with cost)
    ("attention",),             # the engine: API, executor, runners, kernels, merge, transports
    ("config",),                # FCPConfig: the one configuration object
    ("patches",),               # the Megatron integration (apply_fcp, spec class, flags, runtime)
    ("run", "spec"),            # Megatron-LM's scripts unmodified: the launcher; the --spec functions
    ("testing",),               # in-process harness and group, gloo-world launcher
    ("emulate",),               # the emulated cluster: network namespaces, a GPU stand-in, workloads
    ("commands",),              # the CLI's commands
    ("cli",),                   # the CLI's entry point
]
PURE = ("jit", "memo", "topology", "contract", "schedule", "cost", "planner")


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_packages_depend_downwards_only():
    level = {p: i for i, layer in enumerate(PACKAGE_LAYERS) for p in layer}
    packages = {_package(m) for m in MODULES} - {"__init__", "planning"}  # planning: the lazy public facade
    assert packages == set(level), f"every package has a layer: {packages ^ set(level)}"
    for a, b in GRAPH.edges:
        pa, pb = _package(a), _package(b)
        if pa == pb or "__init__" in (pa, pb) or "planning" in (pa, pb):
            continue
        assert level[pb] < level[pa], f"{a} imports {b} (line {GRAPH.edges[a, b]['line']}): against the layering"


def test_the_engine_imports_no_planner_or_cost_model():
    """A training step's attention runs a plan and its backward program: the engine never prices
    or plans (the runtime settles plans at setup)."""
    for a, b in GRAPH.edges:
        if _package(a) == "attention":
            assert _package(b) in ("attention", "contract", "schedule", "topology"), f"{a} imports {b}"


def test_the_pure_half_imports_no_torch():
    """No torch anywhere in the pure packages, except host grouping (a collective)."""
    allowed = {"megatron_fcp.topology.detect.hosts"}
    for module, path in MODULES.items():
        if _package(module) not in PURE + ("planning",) or module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{module} imports torch"


def test_every_package_says_its_job():
    for p in sorted(PKG.iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            doc = ast.get_docstring(ast.parse((p / "__init__.py").read_text()))
            assert doc and len(doc.splitlines()[0]) > 20, f"{p.name}/__init__.py needs a docstring saying its job"


_STEP = """
import sys
import megatron_fcp
assert [m for m in sys.modules if m.startswith("megatron_fcp")] == ["megatron_fcp"], "import megatron_fcp is lazy"
from megatron_fcp import FCPConfig, apply_fcp
apply_fcp(FCPConfig(enabled=True))
import megatron_fcp.attention.function
print(sorted(m for m in sys.modules if m.startswith("megatron_fcp")))
"""


def test_a_training_step_imports_nothing_that_measures_or_emulates():
    """``import megatron_fcp`` imports only itself; ``apply_fcp`` and the engine import no emulator,
    CLI, testing support or study (planner.compare); benchmarks/import_closure.py measures the lines."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout
    loaded = eval(out.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's list of names
    assert "megatron_fcp.attention.function" in loaded and "megatron_fcp.patches.megatron" in loaded
    bad = [m for m in loaded if _package(m) in ("emulate", "commands", "cli", "testing") or
           m == "megatron_fcp.planner.compare"]
    assert not bad, bad
