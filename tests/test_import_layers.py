"""The import graph of specdecode/ has no cycles, and every import points down the layer table of docs/design.md.

Every import counts: at module level, inside functions and under `TYPE_CHECKING` (a type-only import is still a
dependency a reader must follow). The layer table is read from docs/design.md, so the document and the code
cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specdecode"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 450


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The specdecode modules `name` imports anywhere in its file (a `from pkg import sub` names the submodule)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        for target in targets:
            if not target.startswith("specdecode"):
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> b -> ... -> a, or None (iterative DFS, colours)."""
    colour: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[child] == 1:
                return path[path.index(child):] + [child]
            elif colour[child] == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def part_of(module: str) -> str:
    """The layer-table name of a module: its top-level subpackage or module (`specdecode` for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specdecode"


def design_layers() -> dict[str, int]:
    """Part -> layer number, from the rows `| N | `a`, `b` | ... |` of docs/design.md's layer table."""
    layers = {}
    for line in DESIGN.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for part in re.findall(r"`([\w.]+)`", m.group(2)):
                layers[part.removesuffix(".py").removesuffix("/")] = int(m.group(1))
    return layers


def test_the_import_graph_has_no_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_part_of_the_package_is_in_the_layer_table() -> None:
    layers = design_layers()
    missing = sorted({part_of(m) for m in module_files()} - set(layers))
    assert not missing, f"docs/design.md's layer table lacks {missing}"


def test_imports_point_down_the_layer_table() -> None:
    layers = design_layers()
    wrong = []
    for module, targets in sorted(import_graph().items()):
        here = part_of(module)
        for target in sorted(targets):
            there = part_of(target)
            if there != here and layers.get(there, 99) >= layers.get(here, -1):
                wrong.append(f"{module} (layer {layers.get(here)}) imports {target} (layer {layers.get(there)})")
    assert not wrong, "imports against the layers of docs/design.md:\n" + "\n".join(wrong)


def test_no_module_is_longer_than_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None
