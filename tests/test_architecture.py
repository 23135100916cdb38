"""The layers of docs/architecture.md, held against the code: every import counted (those written
inside functions too, since a lazy import still ties two packages together), none may point to a
higher floor, no two packages may import each other in a loop, config/ loads nothing outside it,
and a package's __init__.py only hands names on."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "overdrive"

# Bottom first. A package may import from its own floor and below; a new package takes a floor here
# (and in docs/architecture.md) before anything imports it.
FLOORS = (
    ("errors", "console"),
    ("config",),
    ("storage", "hub", "system", "boundary"),
    ("strategies",),
    ("interop",),
    ("hf",),
    ("resolving",),
    ("data",),
    ("memory",),
    ("checkpoint",),
    ("observe",),
    ("launch",),
    ("training",),
    ("tune", "reports", "wizard"),
    ("sweep",),
    ("commands",),
    ("cli",),
)
FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}


def _package(module: str) -> str:
    """overdrive.config.schema -> config; the top-level face (overdrive) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules() -> dict[str, Path]:
    return {".".join(("overdrive",) + p.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__"): p
            for p in SOURCE.rglob("*.py")}


def _imports(module: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """(imported overdrive module, line) for every import in the file, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("overdrive."):
                found.add((target, node.lineno))
    return found


def _arrows() -> list[tuple[str, str, str]]:
    """(from package, to package, where) for every import between two packages."""
    modules = _modules()
    known = set(modules)
    arrows = []
    for module, path in modules.items():
        source = _package(module)
        for target, line in _imports(module, path, known):
            if source and _package(target) != source:
                arrows.append((source, _package(target), f"{path.relative_to(SOURCE)}:{line} imports {target}"))
    return arrows


def test_every_package_has_a_floor():
    packages = {_package(m) for m in _modules()} - {""}
    assert sorted(packages - set(FLOOR)) == [], "give each new package a floor in FLOORS and docs/architecture.md"


def test_no_import_points_up():
    upward = [where for source, target, where in _arrows() if FLOOR.get(target, -1) > FLOOR.get(source, -1)]
    assert upward == []


def test_no_two_packages_import_each_other_in_a_loop():
    edges: dict[str, set[str]] = {}
    for source, target, _ in _arrows():
        edges.setdefault(source, set()).add(target)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += edges.get(node, ())
        return False

    loops = sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if reaches(b, a)})
    assert loops == []


@pytest.mark.parametrize("package", sorted({p.parent.relative_to(SOURCE).as_posix() for p in SOURCE.rglob("__init__.py")
                                             if p.parent != SOURCE}))
def test_a_package_init_only_hands_names_on(package):
    tree = ast.parse((SOURCE / package / "__init__.py").read_text())
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert defined == [], f"move {defined} into a module of {package}/ and import them in __init__.py"


@pytest.mark.slow
def test_the_config_value_loads_nothing_above_it():
    code = ("import sys, overdrive.config.schema, overdrive.config.batch, overdrive.config.keys; "
            "print(' '.join(m for m in sys.modules if m.startswith('overdrive.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    outside = [m for m in loaded if _package(m) not in ("config", "errors", "console")]
    assert outside == []


def test_the_code_is_ruff_clean():
    """The lint rules of pyproject.toml ([tool.ruff.lint]) over src, tests and bench."""
    import shutil

    import sysconfig

    ruff = shutil.which("ruff") or str(Path(sysconfig.get_path("scripts")) / "ruff")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([ruff, "check", "src", "tests", "bench"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_every_module_path_the_docs_and_docstrings_name_exists():
    """A path like `training/step/step_loss.py` in docs/, README.md or a module's text names a file of
    the project (src/overdrive, the repository, tests/) or of an installed library."""
    import re
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    source = root / "src" / "overdrive"
    site = Path(sysconfig.get_paths()["purelib"])
    named = re.compile(r"(?<![\w/.-])((?:[a-z_]+/)+[a-z_0-9]+\.py)\b")
    texts = [*(root / "docs").glob("*.md"), root / "README.md", *source.rglob("*.py")]
    missing = []
    for text in texts:
        for path in set(named.findall(text.read_text())):
            places = [root / path, source / path, root / "tests" / path, site / path, *site.glob(f"*/{path}")]
            if not any(place.exists() for place in places):
                missing.append(f"{text.relative_to(root)}: {path}")
    assert not missing, "\n".join(missing)


def test_every_test_that_starts_an_interpreter_is_marked_slow():
    """The quick tier (`-m "not slow"`) starts no interpreter: a test calling `run_cli`, naming
    `sys.executable` or spawning a terminal (or a module helper that does) is marked slow, itself
    or by its module's `pytestmark`; `run_here` runs a command in this process instead."""
    tests = Path(__file__).resolve().parent
    unmarked = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

        def starts(function: ast.FunctionDef, seen: frozenset = frozenset()) -> bool:
            text = ast.unparse(function)
            if any(mark in text for mark in ("sys.executable", "run_cli(", "pexpect.spawn")):
                return True
            called = {c.func.id for c in ast.walk(function) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            return any(starts(functions[name], seen | {function.name})
                       for name in called & set(functions) - seen - {function.name})

        for name, function in functions.items():
            marked = module_slow or any("slow" in ast.unparse(d) for d in function.decorator_list)
            this = name == "test_every_test_that_starts_an_interpreter_is_marked_slow"  # names the marks, starts nothing
            if name.startswith("test_") and not marked and not this and starts(function):
                unmarked.append(f"{path.name}::{name}")
    assert not unmarked, "start an interpreter but are not marked slow:\n" + "\n".join(unmarked)
