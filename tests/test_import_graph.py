"""The import graph of `ds4jax/` and `serve/` has no cycles, and no import reaches up a layer.

A cycle means neither module can be read, tested or replaced without the other, and which
one Python finishes first depends on who imported whom first. An import that reaches up a
layer means the lower layer no longer stands without the higher one: the model would not
load without the chat code, rendering would not work without the continuation policy.

The layers, bottom to top; a module may import its own layer and the ones below it:

0. `ds4jax` (the package itself: its version), `ds4jax.config`, `ds4jax.pallas_kernels`,
   `ds4jax.native` (CPU kernels as XLA FFI calls) — what the model is made of, knowing
   nothing of a model.
1. `ds4jax.model`, `ds4jax.sampling` — the model as pure JAX functions of (params, state,
   config); `sampling` draws tokens from logits and is called inside the model's batched
   and speculative steps, so it sits with them, not with the engine.
2. `ds4jax.chat` — everything between client JSON and token ids: request bodies, the
   prompt format, tokenizers, DSML, tool ids; `ds4jax.weights` — checkpoints in and out
   (layouts, conversion, the Hub), above the parameter pytree they fill. Neither imports
   the other.
3. `ds4jax.kvstore`, `ds4jax.continuation` — where a request's state comes from: disk
   checkpoints and page bookkeeping, and the continuation decision. They use each other
   (the decision asks the store for a disk hit); neither uses the engine.
4. The engine: `ds4jax.engine*`, `ds4jax.decoding`, `ds4jax.speculation`, `ds4jax.plan`,
   `ds4jax.interleave`, `ds4jax.distributed` — the one owner of device state, the decode
   loop and its scheduling; `distributed` wraps an engine for a multi-host group.
5. Applications of the engine: `serve`, `ds4jax.cli` (and `ds4jax.__main__`),
   `ds4jax.fidelity`, `ds4jax.demo` (which trains and evaluates the demo model through
   the engine). Nothing below imports them.

Every module must be in a layer, so a new top-level module is placed on purpose.

What counts as an import: every `import` / `from … import` statement in a module,
wherever it is — inside functions and under `if TYPE_CHECKING:` too, since a deferred import
is still a dependency — with relative imports resolved. `from pkg import name` imports the
module `pkg.name` when there is one, else `pkg`. Package `__init__` files run on import of
any submodule, but that implicit edge is not counted: only what the code names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds4jax", "serve")

#: bottom to top; a pattern names a module and everything under it, a trailing `*` any
#: module whose name starts so (the engine is being split into several)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ds4jax", "ds4jax.config", "ds4jax.pallas_kernels", "ds4jax.native"),
    ("ds4jax.model", "ds4jax.sampling"),
    ("ds4jax.chat", "ds4jax.weights"),
    ("ds4jax.kvstore", "ds4jax.continuation"),
    (
        "ds4jax.engine*",
        "ds4jax.decoding",
        "ds4jax.speculation",
        "ds4jax.plan",
        "ds4jax.interleave",
        "ds4jax.distributed",
    ),
    ("serve", "ds4jax.cli", "ds4jax.__main__", "ds4jax.fidelity", "ds4jax.demo"),
)

#: upward imports known and kept for now, (importer, imported) → why. Each is a debt with
#: its way out written next to it; do not add one to make the test pass.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, tuple[Path, bool]]:
    """Module name → (file, whether it is a package's `__init__`)."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = (path, is_package)
    return found


def _imported(node: ast.AST, package: str, known: set[str]) -> Iterable[str]:
    """The module names one import statement names; `package` resolves relative ones."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, node.module] if node.module else parts)
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield sub if sub in known else base


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module → the modules of `packages` it imports. A name that is not a module (a stale
    path, an attribute) counts as its nearest enclosing module."""
    packages = tuple(packages)
    modules = find_modules(root, packages)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target in _imported(node, package, known):
                if target.split(".")[0] not in packages:
                    continue
                while target not in known and "." in target:
                    target = target.rpartition(".")[0]
                if target in known and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle, as a path that returns to its start, for every strongly connected group of
    modules (Tarjan's algorithm, iterative: the graph is deep enough for recursion limits to
    matter in a bigger tree)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The layer of the most specific pattern that names `module`."""
    best: tuple[int, int] | None = None  # (pattern length, layer)
    for level, patterns in enumerate(layers):
        for pattern in patterns:
            if pattern.endswith("*"):
                hit = module.startswith(pattern[:-1])
            else:
                hit = module == pattern or module.startswith(pattern + ".")
            if hit and (best is None or len(pattern) > best[0]):
                best = (len(pattern), level)
    return None if best is None else best[1]


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[tuple[str, str]]:
    return sorted(
        (src, dst)
        for src, targets in graph.items()
        for dst in targets
        if (layer_of(src, layers) or 0) < (layer_of(dst, layers) or 0)
    )


def _describe(src: str, dst: str) -> str:
    return f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"


# ---------------------------------------------------------------------------- the code


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in import_graph(ROOT, PACKAGES) if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_no_import_cycles() -> None:
    found = cycles(import_graph(ROOT, PACKAGES))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_reaches_up_a_layer() -> None:
    upward = upward_imports(import_graph(ROOT, PACKAGES))
    new = [edge for edge in upward if edge not in ALLOWED_UPWARD]
    assert not new, "imports that reach up a layer:\n" + "\n".join(_describe(*e) for e in new)


def test_the_allowed_upward_imports_still_exist() -> None:
    """An exception that no longer happens is removed, so the list never hides a new one."""
    upward = set(upward_imports(import_graph(ROOT, PACKAGES)))
    gone = sorted(edge for edge in ALLOWED_UPWARD if edge not in upward)
    assert not gone, f"fixed, remove from ALLOWED_UPWARD: {gone}"


# ---------------------------------------------------------------------------- the checker


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.high import h\n",
            "pkg/low/b.py": "def f():\n    from . import a\n    from .a import thing\n",
            "pkg/low/c.py": "from ..high.h import name\nimport pkg.low.gone\n",
            "pkg/high/__init__.py": "",
            "pkg/high/h.py": "from pkg.low import b\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.low.a"] == {"pkg.high.h"}  # under TYPE_CHECKING
    assert graph["pkg.low.b"] == {"pkg.low.a"}  # inside a function; relative; a name in a
    assert graph["pkg.low.c"] == {"pkg.high.h", "pkg.low"}  # up two; a stale path
    assert graph["pkg.high.h"] == {"pkg.low.b"}  # `from package import module`


def test_the_checker_names_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import pkg.mid\n",
            "pkg/mid.py": "def f():\n    from pkg import top\n",
            "pkg/top.py": "from pkg.low import x\n",
            "pkg/alone.py": "import pkg.low\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert cycles(graph) == [["pkg.low", "pkg.mid", "pkg.top", "pkg.low"]]
    layers = (("pkg", "pkg.low", "pkg.alone"), ("pkg.mid",), ("pkg.top",))
    assert upward_imports(graph, layers) == [("pkg.low", "pkg.mid"), ("pkg.mid", "pkg.top")]
