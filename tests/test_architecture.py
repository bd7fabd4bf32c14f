"""The package's architecture, as tests: no import cycle, small modules and folders, a pure remediation/.

The graph is read from the installed package: every package listed in pyproject.toml is located with
importlib (so the editable install's folder mapping is honoured), each module's imports are read with
`ast`, and an edge goes to the module an import names (not to its parent packages' `__init__`, which
importing runs but which is not a dependency of the importer). Imports inside functions (lazy ones) and
under `if TYPE_CHECKING:` (type-only ones) count for cycles: each hides a cycle from the interpreter, not
from the design (a module that names another's type cannot be read without it). The remediation checks
use run-time imports only.

The daemon's core names what it uses: no module imports the `Supervisor` (its parts take narrow typed
collaborators, `daemon/ports.py`), and every clock read and sleep in daemon/ goes through the one clock seam
(`daemon/clock.py`), so a simulation can run the real loop on another clock.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ulyssesd.training.spec import read_toml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ulyssesd"

MAX_MODULE_LINES = 500
MAX_MODULES_PER_FOLDER = 12  # modules of one package, its __init__.py not counted

# Modules allowed over MAX_MODULE_LINES, each with the follow-up that splits it. Keep this empty if you can.
OVERSIZED_ALLOWED: dict[str, str] = {
}

# Import cycles allowed (as sorted module lists), each with its follow-up. Keep this empty if you can.
CYCLES_ALLOWED: dict[tuple[str, ...], str] = {}

# Packages allowed over MAX_MODULES_PER_FOLDER, each with why a split would be artificial or its follow-up.
CROWDED_ALLOWED: dict[str, str] = {}


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    imports: set[str] = field(default_factory=set)  # run-time imports, as written (resolved to absolute names)
    type_imports: set[str] = field(default_factory=set)  # imports under `if TYPE_CHECKING:` only
    tree: ast.Module | None = None


def _listed_packages() -> list[str]:
    return list(read_toml(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"])


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"package {name} is listed but not importable"
    return Path(next(iter(spec.submodule_search_locations)))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, type_only: bool = False) -> set[str]:
    """Absolute names imported at run time (module level or inside functions; not under TYPE_CHECKING), or
    with `type_only` those imported under `if TYPE_CHECKING:` only."""
    out: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, guarded: bool = False) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, guarded)
            return
        if guarded != type_only:
            for sub in ast.iter_child_nodes(node):
                visit(sub, guarded)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                prefix = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            out.update(f"{target}.{alias.name}" for alias in node.names)
            out.add(target)
        for sub in ast.iter_child_nodes(node):
            visit(sub, guarded)

    visit(tree)
    return out


def _load_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for pkg in _listed_packages():
        folder = _package_dir(pkg)
        for path in sorted(folder.glob("*.py")):
            is_package = path.name == "__init__.py"
            name = pkg if is_package else f"{pkg}.{path.stem}"
            text = path.read_text(encoding="utf-8")
            mod = Module(name, path, is_package, text.count("\n") + (not text.endswith("\n") and bool(text)))
            mod.tree = ast.parse(text, str(path))
            mod.imports = _imports(mod.tree, name, is_package)
            mod.type_imports = _imports(mod.tree, name, is_package, type_only=True)
            modules[name] = mod
    return modules


MODULES = _load_modules()


def _edges(mod: Module) -> set[str]:
    """The package's own modules that `mod` imports, type-only imports included (a `from pkg import name`
    of a non-module is pkg)."""
    return {name for name in mod.imports | mod.type_imports if name in MODULES and name != mod.name}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    graph = {name: sorted(_edges(m)) for name, m in MODULES.items()}
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            succ = graph[node]
            if i < len(succ):
                work.append((node, i + 1))
                nxt = succ[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def test_the_walk_sees_the_whole_package() -> None:
    # A walk that found nothing would pass every test below; a package folder missing from pyproject.toml
    # would be left out of a wheel (and of this walk).
    listed = set(_listed_packages())
    for pkg in listed:
        for sub in _package_dir(pkg).iterdir():
            if (sub / "__init__.py").is_file():
                assert f"{pkg}.{sub.name}" in listed, f"{pkg}.{sub.name} ({sub}) is not in pyproject.toml packages"
    assert {"ulyssesd.daemon.supervisor", "ulyssesd.remediation.engine", "ulyssesd.training.spec"} <= set(MODULES)
    assert "ulyssesd.remediation.engine" in _edges(MODULES["ulyssesd.remediation.replay"])


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check itself must be able to fail: two modules that import each other are one component.
    tree_a = ast.parse("from ulyssesd.remediation import engine\n")
    tree_b = ast.parse("def f():\n    from ulyssesd.remediation.replay import replay\n")
    assert "ulyssesd.remediation.engine" in _imports(tree_a, "ulyssesd.remediation.replay", False)
    assert "ulyssesd.remediation.replay" in _imports(tree_b, "ulyssesd.remediation.engine", False)
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ulyssesd.daemon import spec\n")
    assert "ulyssesd.daemon.spec" not in _imports(guarded, "ulyssesd.remediation.x", False)
    assert "ulyssesd.daemon.spec" in _imports(guarded, "ulyssesd.remediation.x", False, type_only=True)
    engine = MODULES["ulyssesd.remediation.engine"]
    saved = engine.imports, engine.type_imports
    try:
        engine.imports = saved[0] | {"ulyssesd.remediation.replay"}
        assert any({"ulyssesd.remediation.engine", "ulyssesd.remediation.replay"} <= set(c) for c in _cycles())
        # A type-only import closes a circle too.
        engine.imports, engine.type_imports = saved[0], saved[1] | {"ulyssesd.remediation.replay"}
        assert any({"ulyssesd.remediation.engine", "ulyssesd.remediation.replay"} <= set(c) for c in _cycles())
    finally:
        engine.imports, engine.type_imports = saved


def test_no_import_cycle() -> None:
    cycles = [c for c in _cycles() if tuple(c) not in CYCLES_ALLOWED]
    assert not cycles, "import cycles (each line one strongly connected group):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_module_over_the_size_limit() -> None:
    over = {m.name: m.lines for m in MODULES.values() if m.lines > MAX_MODULE_LINES}
    unexpected = {n: lines for n, lines in over.items() if n not in OVERSIZED_ALLOWED}
    assert not unexpected, f"modules over {MAX_MODULE_LINES} lines: {unexpected}"


def test_no_folder_over_the_module_limit() -> None:
    per_pkg: dict[str, int] = {}
    for m in MODULES.values():
        if not m.is_package:
            pkg = m.name.rpartition(".")[0]
            per_pkg[pkg] = per_pkg.get(pkg, 0) + 1
    over = {p: n for p, n in per_pkg.items() if n > MAX_MODULES_PER_FOLDER}
    unexpected = {p: n for p, n in over.items() if p not in CROWDED_ALLOWED}
    assert not unexpected, f"packages with more than {MAX_MODULES_PER_FOLDER} modules: {unexpected}"


@pytest.mark.parametrize("forbidden", ["ulyssesd.daemon", "ulyssesd.training"])
def test_remediation_imports_neither_daemon_nor_training(forbidden: str) -> None:
    bad = {m.name: sorted(i for i in m.imports if i == forbidden or i.startswith(forbidden + "."))
           for m in MODULES.values() if m.name.startswith("ulyssesd.remediation")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"remediation imports {forbidden} at run time: {bad}"


def test_importing_all_of_remediation_loads_neither_daemon_nor_training() -> None:
    # The same promise, checked by the interpreter in a fresh process: import every remediation module.
    names = sorted(n for n in MODULES if n.startswith("ulyssesd.remediation"))
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('ulyssesd.daemon', 'ulyssesd.training')))\n"
            "print(bad)\nraise SystemExit(1 if bad else 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"stdout: {res.stdout}\nstderr: {res.stderr[-2000:]}"


def test_the_supervisors_parts_use_only_its_public_operations() -> None:
    # daemon/core/ helpers take the run as `sup` (typed by their Protocol) and call what it offers (set_state,
    # fail, launch, begin_termination, incidents, ...); none reaches into its privates (`sup._x`), which would tie them to
    # its insides again. The regex must be able to fail: it finds the pattern in a line written for it.
    import re

    private = re.compile(r"\bsup\._[A-Za-z]")
    assert private.search("    sup._action(iid)") and not private.search("    sup.incidents.action(iid)")
    core = _package_dir("ulyssesd.daemon.core")
    hits = [f"{path.name}:{n}: {line.strip()}" for path in sorted(core.glob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if private.search(line)]
    assert not hits, "daemon/core reaches into the Supervisor's privates:\n" + "\n".join(hits)


SUPERVISOR = "ulyssesd.daemon.supervisor"
# Modules that may import the Supervisor: the ones that build it and run its loop (wiring), nothing else.
SUPERVISOR_WIRING = {
    "ulyssesd.daemon.cli": "builds the daemon's Supervisor from the spec and runs its loop",
    "ulyssesd.daemon.demo": "builds a Supervisor for `ulyssesd demo` and ticks it",
    "ulyssesd.daemon.sim.runner": "builds the real Supervisor against the simulated clock, job and disk (ulyssesd simulate)",
}


def _names_supervisor(mod: Module) -> bool:
    return any(i == SUPERVISOR or i.startswith(SUPERVISOR + ".") for i in mod.imports | mod.type_imports)


def test_no_module_imports_the_supervisor() -> None:
    # Its parts take narrow typed collaborators (daemon/ports.py, a Protocol per part); importing the
    # Supervisor, even for a type, ties a part to all the others again. The check must be able to fail.
    probe = Module("ulyssesd.daemon.core.x", Path("x.py"), False, 1)
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..supervisor import Supervisor\n")
    probe.type_imports = _imports(tree, "ulyssesd.daemon.core.x", False, type_only=True)
    assert _names_supervisor(probe)
    bad = sorted(m.name for m in MODULES.values()
                 if m.name != SUPERVISOR and m.name not in SUPERVISOR_WIRING and _names_supervisor(m))
    assert not bad, f"modules importing the Supervisor (take a Protocol from daemon/ports.py instead): {bad}"


CLOCK_SEAM = "ulyssesd.daemon.clock"
# Clock reads outside the seam, each with why it must be the host's own clock. Keep this empty if you can.
CLOCK_ALLOWED: dict[str, str] = {}
_CLOCK_READS = {"time": {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "sleep"},
                "datetime": {"now", "utcnow", "today"}, "date": {"today"}}
# Functions of `time` that read the clock when called without the time argument (argument count).
_READS_WITHOUT_ARG = {"gmtime": 0, "localtime": 0, "ctime": 0, "asctime": 0, "strftime": 1}


def _clock_reads(tree: ast.Module) -> list[str]:
    """Lines that read a clock or sleep directly: `time.time()`, `time.monotonic`, `time.sleep(...)`,
    `datetime.now(...)`, `from time import sleep`, `time.gmtime()` (no argument: now), through any alias."""
    aliases: dict[str, str] = {}  # local name -> "time" / "datetime" / "date" (module or class)
    hits: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("time", "datetime"):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime") and not node.level:
            for a in node.names:
                if node.module == "time" and a.name in _CLOCK_READS["time"]:
                    hits.append(f"{node.lineno}: from time import {a.name}")
                elif node.module == "datetime" and a.name in ("datetime", "date"):
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            kind = None
            if isinstance(owner, ast.Name):
                kind = aliases.get(owner.id)
            elif isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) \
                    and aliases.get(owner.value.id) == "datetime" and owner.attr in ("datetime", "date"):
                kind = owner.attr  # datetime.datetime.now
            if kind and node.attr in _CLOCK_READS.get(kind, ()):
                hits.append(f"{node.lineno}: {kind}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and aliases.get(node.func.value.id) == "time" \
                and _READS_WITHOUT_ARG.get(node.func.attr, -1) == len(node.args) and not node.keywords:
            hits.append(f"{node.lineno}: time.{node.func.attr}() of now")
    return sorted(set(hits), key=lambda h: int(h.split(":")[0]))


def test_every_clock_read_in_the_daemon_goes_through_the_seam() -> None:
    # A simulation runs the real loop on a simulated clock only if no part reads the host's clock by itself.
    # The finder must be able to fail: each form it looks for, written for it, is found.
    written = ("import time as t\nfrom time import monotonic\nimport datetime\nfrom datetime import datetime as D\n"
               "a = t.time()\nb = t.sleep\nc = datetime.datetime.now()\nd = D.utcnow()\ne = t.strftime('%Y')\n"
               "f = t.gmtime(3.0)\ng = D.fromtimestamp(0)\n")
    found = _clock_reads(ast.parse(written))
    assert [h.split(": ")[1] for h in found] == [
        "from time import monotonic", "time.time", "time.sleep", "datetime.now", "datetime.utcnow",
        "time.strftime() of now"], found
    assert CLOCK_SEAM in MODULES
    bad = {m.name: _clock_reads(m.tree) for m in MODULES.values() if m.tree is not None
           and m.name.startswith("ulyssesd.daemon") and m.name != CLOCK_SEAM and m.name not in CLOCK_ALLOWED}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, ("clock reads outside daemon/clock.py (use the module's clock: `sup.os`, a `clock` "
                     "parameter, or daemon.clock.SYSTEM):\n" + "\n".join(f"{k}: {v}" for k, v in bad.items()))
