"""The package's floor plan holds: every component imports only from the
layers below it, no module imports itself back through others, and no
component reaches for another's private names.

Read from the source with `ast` (every import, also those inside functions),
so it holds for code paths the other tests do not run.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "mlfabric"

# Lower layers first. A component may import from its own layer's packages
# only if they are itself: components of one layer stay independent.
LAYERS: list[set[str]] = [
    {"errors"},
    {"kernels"},
    {"wire", "scheduling", "sharding", "compression"},
    {"runtime"},
    {"transport", "coordination"},
    {"client"},
    {"server"},
    {"agent"},
    {"replication"},
    {"controller"},
    {"(api)"},  # the public modules: mlfabric, mlfabric.aio, .torch, .config, .cli
    {"sim", "tools"},  # tooling: uses the library as its users do
    {"(entry)"},  # __main__ and the `python -m mlfabric.<tool>` entries
]
API = {"mlfabric", "mlfabric.aio", "mlfabric.torch", "mlfabric.config", "mlfabric.cli"}
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# A command (`mlfabric server`, ...) puts components together: the server's
# command also starts a replica. Commands may use any component below the tools.
COMMAND = re.compile(r"(^|_)cli$")
TOP_LEVEL_LIMIT = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def component(module: str) -> str:
    parts = module.split(".")
    if module in API:
        return "(api)"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "errors" if parts[1] == "errors" else "(entry)"


def imports(module: str, path: Path, known: dict[str, Path]
            ) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every mlfabric import in `path`."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mlfabric":
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mlfabric":
                continue
            names = [a.name for a in node.names]
            # `from package import module` imports that module
            submodules = [n for n in names if f"{target}.{n}" in known]
            for n in submodules:
                found.append((node.lineno, f"{target}.{n}", []))
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                found.append((node.lineno, target, rest))
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str, list[str]]]]]:
    known = modules()
    return known, {m: imports(m, p, known) for m, p in known.items()}


def test_every_component_imports_only_from_the_layers_below():
    known, edges = graph()
    wrong = []
    for module, found in edges.items():
        mine = component(module)
        is_command = bool(COMMAND.search(module.rsplit(".", 1)[-1]))
        for line, target, _ in found:
            theirs = component(target)
            if theirs == mine:
                continue
            allowed = RANK[theirs] < RANK[mine]
            if is_command and RANK[theirs] < RANK["(api)"]:
                allowed = True
            if not allowed:
                wrong.append(f"{known[module].relative_to(ROOT)}:{line}: {mine} imports "
                             f"{target} ({theirs})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_cycle():
    _, edges = graph()
    succ = {m: sorted({t for _, t, _ in found if t in edges and t != m})
            for m, found in edges.items()}
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in succ:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == node:
                        break
                if len(scc) > 1:
                    cycles.append(sorted(scc))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_crosses_a_component():
    known, edges = graph()
    wrong = []
    for module, found in edges.items():
        for line, target, names in found:
            if component(target) == component(module):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target.rsplit(".", 1)[-1].startswith("_"):
                private.append(target)
            if private:
                wrong.append(f"{known[module].relative_to(ROOT)}:{line}: {private} "
                             f"from {target}")
    assert not wrong, "private names used across components:\n" + "\n".join(wrong)


def test_the_issue_grep_finds_nothing():
    # The literal check the layout was asked to pass.
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in PACKAGE.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\._send_push|import _[a-z]", line)]
    assert not hits, "\n".join(hits)


def test_the_top_level_holds_only_the_public_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
    # Every folder is a component the layer order knows.
    folders = sorted(p.name for p in PACKAGE.iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    assert set(folders) <= set(RANK), set(folders) - set(RANK)


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The check above is not vacuous: a wire module importing the client fails it."""
    fake = tmp_path / "src" / "mlfabric"
    for path in PACKAGE.rglob("*.py"):
        target = fake / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (fake / "wire" / "bad.py").write_text("from ..client.blocking import Client\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "src")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"wire/bad.py:1: wire imports mlfabric.client"):
        test_every_component_imports_only_from_the_layers_below()
    (fake / "client" / "core.py").write_text(
        (fake / "client" / "core.py").read_text() + "\nfrom .blocking import Client\n")
    with pytest.raises(AssertionError, match=r"import cycles"):
        test_no_import_cycle()


def test_a_tool_runs_from_the_checkout_root():
    """The src/ layout: from the repository's root, `python -m mlfabric.sim`
    imports the installed package (with its compiled kernels), not the
    source tree. It failed with "cannot import name '_core'" before."""
    proc = subprocess.run([sys.executable, "-m", "mlfabric.sim", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m mlfabric.sim" in proc.stdout


def test_every_test_that_needs_root_is_marked_root():
    """`pytest -m "not root"` must leave out exactly the tests that need root:
    a test skipped for want of root (`needs_root`) carries the `root` marker."""
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                 for t in node.targets)
            and "root" in ast.unparse(node.value)
            for node in tree.body)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list]
            if any("needs_root" in m for m in marks) and not module_marked \
                    and not any(m == "pytest.mark.root" for m in marks):
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, unmarked
