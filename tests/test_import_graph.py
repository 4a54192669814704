"""The package's import graph, read from the source (every import: module level, inside functions and under
TYPE_CHECKING): no circles, and the layers import downwards only — every module stands on one floor of `FLOORS`
(docs/layout.md) and imports from its own floor or those below; the pure tensor math (`correction`, `losses`)
imports no distributed glue, rollout or trainer code, and nothing but the main job imports the trainer (the flag
layer, `slime_corr.flags`, which owns the main job's flags, reads the trainer's config modules only)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slime_corr"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (a `from package import name` counts as the package's module
    `name` when there is one, else as the package)."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slime_corr"):
                targets = [resolve(f"{node.module}.{alias.name}") for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names if alias.name.startswith("slime_corr")]
            else:
                continue
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert "slime_corr.config" in import_graph()["slime_corr.flags.correction"]


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


# The floors from the ground up: a module stands on the floor of its longest prefix listed here, and imports only
# from its own floor and those below. The ground floor holds what everything stands on (no project imports but its
# own floor's): the error types, the flag fields, the sample record, ports, disks, extras.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("slime_corr", "slime_corr.errors", "slime_corr.fields", "slime_corr.samples", "slime_corr.routed_experts",
     "slime_corr.ports", "slime_corr.addresses", "slime_corr.device", "slime_corr.device_check", "slime_corr.disk",
     "slime_corr.extras", "slime_corr.threads", "slime_corr.startup_gc", "slime_corr.kernel_fallback"),
    ("slime_corr.config", "slime_corr.config_checks", "slime_corr.config_yaml", "slime_corr.presets",
     "slime_corr.registry", "slime_corr.loss_terms"),  # the correction's configuration
    ("slime_corr.layout",),
    ("slime_corr.correction", "slime_corr.losses", "slime_corr.loss_inputs", "slime_corr.policy_losses",
     "slime_corr.mismatch_masks", "slime_corr.opsm", "slime_corr.verl_rollout_rs"),  # the pure tensor math
    ("slime_corr.integrations",),
    ("slime_corr.mcore",),
    ("slime_corr.rollout",),
    ("slime_corr.engines",),
    ("slime_corr.models",),
    ("slime_corr.monitoring",),
    ("slime_corr.trainer.config", "slime_corr.trainer.config_checks", "slime_corr.trainer.task"),  # the job's config
    ("slime_corr.flags", "slime_corr.arguments"),
    ("slime_corr.trainer",),
    ("slime_corr.main", "slime_corr.cli", "slime_corr.flag_docs", "slime_corr.mcore.megatron_lm",
     "slime_corr.models.check"),  # the entry points: commands and Megatron-LM's extra_args_provider
)
ARROWS_UP_ALLOWED = 1


def floor_of(module: str) -> int | None:
    """The index in `FLOORS` of the longest prefix of `module` listed there (the package root by its name only)."""
    found = [(len(prefix), level) for level, prefixes in enumerate(FLOORS) for prefix in prefixes
             if module == prefix or (prefix != "slime_corr" and module.startswith(prefix + "."))]
    return max(found)[1] if found else None


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import from a lower floor to a higher one."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m))


def test_every_module_stands_on_a_floor() -> None:
    assert [m for m in import_graph() if floor_of(m) is None] == []
    assert floor_of("slime_corr.mcore.megatron_lm") > floor_of("slime_corr.flags.checks") > floor_of("slime_corr.mcore")
    assert arrows_up({"slime_corr.errors": {"slime_corr.trainer"}, "slime_corr.trainer": {"slime_corr.errors"}}) == [
        "slime_corr.errors -> slime_corr.trainer"]


def test_at_most_one_arrow_runs_back_up_the_floors() -> None:
    up = arrows_up(import_graph())
    assert len(up) <= ARROWS_UP_ALLOWED, f"{len(up)} imports run up the floors (at most {ARROWS_UP_ALLOWED}): {up}"


def _imports_under(graph: dict[str, set[str]], importer: str, imported: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == importer or m.startswith(importer + ".")
                  for t in targets if t.startswith(imported))


def test_layers_import_downwards() -> None:
    graph = import_graph()
    upper = ("slime_corr.mcore", "slime_corr.rollout", "slime_corr.engines", "slime_corr.trainer",
             "slime_corr.models", "slime_corr.integrations", "slime_corr.main", "slime_corr.monitoring")
    assert _imports_under(graph, "slime_corr.correction", upper) == []
    assert _imports_under(graph, "slime_corr.losses", upper) == []
    outside = [m for m in graph if not m.startswith(("slime_corr.trainer", "slime_corr.main"))]
    config = ("slime_corr.trainer.config", "slime_corr.trainer.config_checks", "slime_corr.trainer.task")
    assert sorted(f"{m} -> {t}" for m in outside for t in graph[m] if t.startswith("slime_corr.trainer")
                  and not (m.startswith("slime_corr.flags.") and t in config)) == []


def test_the_layout_is_the_ground_floor_of_the_trainer_and_the_megatron_glue() -> None:
    """`slime_corr.layout` owns the sequence layout: it imports only torch and the ground floor's `Sample` record, and
    the trainer, the Megatron glue and the correction core read the layout from it (no other module defines it)."""
    graph = import_graph()
    upward = [f"{m} -> {t}" for m, targets in graph.items() if m.startswith("slime_corr.layout")
              for t in targets if not t.startswith(("slime_corr.layout", "slime_corr.samples", "slime_corr.routed_experts"))]
    assert upward == []
    users = {m.split(".")[1] for m, targets in graph.items() for t in targets
             if t.startswith("slime_corr.layout") and not m.startswith("slime_corr.layout")}
    assert {"trainer", "mcore", "correction", "rollout"} <= users
    assert not (PACKAGE / "rollout" / "batching.py").exists() and not (PACKAGE / "correction" / "segments.py").exists()


def _function_local_imports() -> list[str]:
    """`module:line` of every import of the project's own modules inside a function, unless its line says why it is
    lazy (`# lazily: ...`, an optional dependency or a cheap import path)."""
    found = []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slime_corr")
                        and "lazily" not in lines[node.end_lineno - 1]):
                    found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


def test_the_project_imports_its_modules_at_module_level() -> None:
    assert _function_local_imports() == []
