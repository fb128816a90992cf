"""Layering: a module imports only packages at or below its own level, and no modules import each other
in a circle (inside a package too).

The levels, lowest first: `errors`, `config` and `flags` (the command-line parser), then `families` (one spec per model family, the only code that
knows a `model_type`: a test below holds every other module to that), `data` and `quant` (number formats and their
arithmetic, for the checkpoint reader's dequantization and the FP8 compute of `parallel`/`models`), `parallel`, `models`,
`checkpoint`, `peft` (adapters on the model, saved in checkpoint formats), `optim`, `hub` and `generation` (RL
rollout engines), `plan`, `train`, and
at the top `commands` (the `hfmeg` console command, whose subcommands use every package) with `hfmeg/__main__.py`
(`python -m hfmeg`). `plan` sits below `train` because the
trainer asks the planner for its layout (`--layout auto`) and counts MFU with the
planner's FLOP formula (`plan/flops.py`); the planner needs nothing from the trainer.
Every module of every package is parsed (not imported), and every import counts,
including those inside functions and under `TYPE_CHECKING`, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hfmeg
from hfmeg.families import FAMILIES

LEVELS = {"errors": 0, "config": 0, "flags": 0, "families": 1, "data": 2, "quant": 2, "parallel": 3, "models": 4, "checkpoint": 5, "peft": 6,
          "optim": 7, "hub": 8, "generation": 8, "plan": 9, "train": 10, "commands": 11, "__main__": 11}
ROOT = Path(hfmeg.__file__).parent


def _package(path: Path) -> str:
    """The layered unit a module belongs to: its subpackage, or itself for a top-level module."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module(path: Path) -> tuple[str, ...]:
    parts = ("hfmeg", *path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported_modules(path: Path) -> set[tuple[str, ...]]:
    """The hfmeg modules (dotted parts) `path` imports, resolved from absolute and relative imports: for
    `from X import name`, X.name where that is a module of its own, else X."""
    own = ["hfmeg", *path.relative_to(ROOT).with_suffix("").parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = own[: len(own) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            targets = [module] if node.module else [module + [alias.name] for alias in node.names]
        else:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            targets = [t + [alias.name] if _exists(t + [alias.name]) else t for t in targets for alias in node.names]
        found.update(tuple(parts) for parts in targets if parts[:1] == ["hfmeg"] and len(parts) > 1)
    return found


def _exists(parts: list[str]) -> bool:
    rel = Path(*parts[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _imported_packages(path: Path) -> set[str]:
    """The hfmeg packages `path` imports."""
    return {parts[1] for parts in _imported_modules(path)}


def test_no_module_imports_a_package_above_its_own():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        package = _package(path)
        if package not in LEVELS:
            continue
        for target in _imported_packages(path) - {package}:
            if LEVELS.get(target, -1) > LEVELS[package]:
                violations.append(f"{path.relative_to(ROOT)} ({package}) imports {target}")
    assert not violations, "\n".join(violations)


def test_every_package_has_a_level():
    packages = {_package(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages <= set(LEVELS), sorted(packages - set(LEVELS))


def test_no_import_cycle_between_modules():
    graph = {_module(p): _imported_modules(p) - {_module(p)} for p in ROOT.rglob("*.py")}
    cycles, state = [], {}

    def visit(node, stack):  # depth-first; a node met again while on the stack closes a cycle
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(".".join(m) for m in stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def _keyed_by_family(node: ast.AST, types: set[str]) -> bool:
    """Whether `node` names a model_type (`x.model_type`, `model_type`) or holds a model_type string."""
    return any(isinstance(n, ast.Name) and n.id == "model_type" or isinstance(n, ast.Attribute) and n.attr == "model_type"
               or isinstance(n, ast.Constant) and n.value in types for n in ast.walk(node))


def test_only_families_branch_on_a_model_type():
    """A family's knowledge lives in its spec: outside `hfmeg/families` no comparison or membership test, no
    lookup and no dict key involves a model_type (asking `families.family_of` is the way)."""
    types = {t for family in FAMILIES for t in family.model_types}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if _package(path) == "families":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                suspects = [node.left, *node.comparators]
            elif isinstance(node, ast.Subscript):
                suspects = [node.slice]
            elif isinstance(node, ast.Dict):
                suspects = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                suspects = node.args[:1]
            else:
                continue
            if any(_keyed_by_family(s, types) for s in suspects):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)
