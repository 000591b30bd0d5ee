"""The package's shape, checked from the source: no import cycles, small modules, a pure planner.

Static (``ast``, nothing is imported): every ``import`` and ``from ... import`` inside
``megatron_fcp`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (annotations only, never executed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_fcp"
MAX_LINES = 600


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
    assert "megatron_fcp.planning.plan" in MODULES and "megatron_fcp.patches.runtime" in MODULES
    assert GRAPH.has_edge("megatron_fcp.planning.build", "megatron_fcp.planning.cost")
    assert GRAPH.has_edge("megatron_fcp.patches.megatron", "megatron_fcp.patches.runtime")


def test_no_import_cycle_inside_the_package():
    cycles = list(nx.simple_cycles(GRAPH))
    described = [" -> ".join(f"{a} (line {GRAPH.edges[a, b]['line']})" for a, b in zip(c, c[1:] + c[:1]))
                 for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_a_cycle_would_be_caught():
    g = GRAPH.copy()
    g.add_edge("megatron_fcp.planning.plan", "megatron_fcp.planning.compare", line=0)
    assert list(nx.simple_cycles(g))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[module]} has {n} lines (limit {MAX_LINES}): split it by job"


# the planning half, bottom to top: a module may import only from layers below it
PLANNING_LAYERS = [
    ("blocks", "megatron_layout"),
    ("needs", "placement"),     # the causal need rule; packed batches and their need sets
    ("verify", "graph", "rounds", "table", "route_table"),  # proofs of a plan; graphs over a CP group; rounds vs
                                #   Delta (edge colouring); a plan's transfers as columns; the cost model's rounds as columns
    ("table_verify", "table_compile"),  # proofs of a columnar plan; columnar graphs and waves for large groups
    ("plan",),                  # the plan contract
    ("cost", "head_parallel"),  # cost model of a plan; the head-parallel stage (groups + KV-stage plan)
    ("builders", "compile", "waves", "floors"),  # graph strategies; graph -> plan; backward waves of a plan;
                                #   lower bounds that prune the searches
    ("build", "wave_timeline", "chains"),  # planner entry point; the wave loop's timeline; a ring's streaming backward
    ("baselines", "head_parallel_compile"),  # TE's schedules; head-parallel plans for a degree and graph
    ("packed_cost",),           # TE's schedules on packed documents (THD); backward of every schedule
    ("head_parallel_cost",),    # fwd/bwd of every schedule with the head-parallel stage; bound over families
    ("head_parallel_choose",),  # auto: degree, graph and block size by predicted fwd+bwd time
    ("compare",),               # schedules side by side
]


def test_planning_dependencies_run_one_way():
    level = {f"megatron_fcp.planning.{m}": i for i, layer in enumerate(PLANNING_LAYERS) for m in layer}
    assert set(level) == {m for m in MODULES if m.startswith("megatron_fcp.planning.")}
    for a, b in GRAPH.edges:
        if a in level and b in level:
            assert level[b] < level[a], f"{a} imports {b} (line {GRAPH.edges[a, b]['line']}): against the layering"


def test_the_planning_and_topology_halves_import_no_torch():
    """Pure halves: no torch anywhere in planning/ or topology/, except host grouping (collective)."""
    allowed = {"megatron_fcp.topology.detect.hosts"}
    for module, path in MODULES.items():
        if not module.startswith(("megatron_fcp.planning", "megatron_fcp.topology")) or module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{module} imports torch"
