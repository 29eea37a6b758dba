"""The house stays readable: no import circles (a function-level or TYPE_CHECKING import
counts too), no function over 150 lines and no module over 900 in the shipped code, a
docstring saying the job of every package, and the engine importing nothing from the
app, the registry or the tuning files."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["krypton", "webapp", "app.py"]
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 150, 900


def python_files(*roots: str) -> list[Path]:
    files = []
    for root in roots:
        path = ROOT / root
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Modules of ``modules`` that ``path`` imports anywhere in its body."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            # `from . import a, b` of modules imports them, not the package's own code
            found.update(
                submodules if len(submodules) == len(node.names) else submodules | {target}
            )
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def import_graph(*roots: str) -> dict[str, set[str]]:
    files = python_files(*roots)
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def test_there_are_no_import_circles():
    graph = import_graph("krypton", "webapp", "app.py", "bench", "demo")
    assert cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def room_graph(top: str) -> dict[str, set[str]]:
    """``top``'s rooms — each subpackage and each top-level module, the package's own
    ``__init__`` one more — with an edge where a module of one imports one of another."""

    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for module, imported in import_graph(top).items():
        rooms.setdefault(room(module), set()).update(
            room(m) for m in imported if room(m) != room(module)
        )
    return rooms


def test_no_import_goes_back_up_a_floor():
    """Rooms stack on floors (each room above every room it imports): an import from a
    lower room to a higher one is a loop between rooms, though no module-level circle.
    There were two in krypton/: krypton/approximate/tuning.py imported the overlay
    renderer (so the registry depended on drawing, and the renderer on the top-level
    package for its version), and krypton/pacs.py and krypton/batch/broker.py imported
    each other's folder."""
    for top in ("krypton", "webapp"):
        assert cycles(room_graph(top)) == [], top


def test_the_floor_check_finds_an_import_back_up(tmp_path, monkeypatch):
    package = tmp_path / "house"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "part.py").write_text("from ..high import thing\n")
    (package / "high.py").write_text("from .low.part import other\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert cycles(room_graph("house")) == [["house.high", "house.low"]]


def test_computation_never_imports_drawing():
    """Pictures (krypton.render) are drawn by the parts that write them out — the
    command, batch runs and what is sent to the PACS — never by what computes."""
    writers = ("krypton.render", "krypton.cli", "krypton.batch", "krypton.pacs")
    for module, imported in import_graph("krypton").items():
        if not module.startswith(writers):
            assert not [m for m in imported if m.startswith("krypton.render")], module


def test_the_engine_imports_nothing_from_the_app_the_registry_or_approximate_mode():
    graph = import_graph("krypton", "webapp", "app.py")
    forbidden = (
        "webapp",
        "app",
        "krypton.registry",
        "krypton.approximate.tuning",
        "krypton.tune",
    )
    for module, imported in graph.items():
        if module.startswith("krypton.engine"):
            assert not [m for m in imported if m.startswith(forbidden)], module


def test_readers_do_not_draw():
    """krypton.io reads files; pictures and the DICOM captures drawn over them are
    krypton.render's (krypton/io/dicom.py once imported the overlay renderer to write its
    Secondary Capture)."""
    graph = import_graph("krypton")
    for module, imported in graph.items():
        if module.startswith("krypton.io"):
            assert not [m for m in imported if m.startswith("krypton.render")], module


def test_no_folder_level_loop_between_approximate_mode_and_the_explainer():
    """The explainer imports krypton.approximate; krypton/approximate/tune.py imported the
    explainer back (a loop between the folders, though no module-level circle)."""
    graph = import_graph("krypton")
    for module, imported in graph.items():
        if module.startswith("krypton.approximate"):
            assert "krypton.explainer" not in imported, module


def test_the_panels_hold_no_tensor_algebra_and_no_engine_internals():
    """The page's panels reach the library through the run package and the services:
    webapp/panels/settings.py took the top 5 with torch.softmax and torch.topk and
    checked grids with krypton.explainer's grid_positions itself."""
    graph = import_graph("krypton", "webapp", "app.py")
    files = {module_name(f): f for f in python_files("webapp")}
    for module, imported in graph.items():
        if module.startswith("webapp.panels"):
            assert not [
                m for m in imported if m.startswith(("krypton.explainer", "krypton.engine"))
            ]
            assert not imports_torch(files[module]), module


def imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def test_pictures_do_not_know_the_registry():
    """krypton.render draws what it is given: a caveat, a class name, a title; it never
    looks a model up (krypton/render/volumes.py once imported the registry's OOD check)."""
    graph = import_graph("krypton")
    for module, imported in graph.items():
        if module.startswith("krypton.render"):
            assert not [m for m in imported if m.startswith("krypton.registry")], module


def test_no_function_over_150_lines_and_no_module_over_900():
    """In the shipped code and in what makes its models and numbers (demo/, bench/):
    demo/fundus/train.py had grown to 979 lines while the check looked away."""
    too_long = []
    for path in python_files(*SHIPPED, "demo", "bench"):
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    too_long.append(f"{where} {node.name}: {length} lines")
    assert too_long == []


def test_no_module_of_the_page_over_500_lines():
    """webapp/ is read module by module when a panel changes: layout.py had grown to 675
    lines (the gallery and the model upload inside the page builder) and team.py to 517
    (the run queue and the Redis stores in one)."""
    long = {
        str(path.relative_to(ROOT)): path.read_text().count("\n") for path in python_files("webapp")
    }
    assert {path: lines for path, lines in long.items() if lines > 500} == {}


def test_each_panel_callback_a_run_needs_is_registered_once_for_both_kinds():
    """The summary was registered per kind (the image's in panels/result.py with its
    heatmap, the volume's in panels/volume.py), so the two drifted: the image's said
    nothing where the volume's said why. What every panel does with its result — the
    summary, the downloads offered and written, another class — is written once, in
    webapp/panels/subject_panel.py; a kind adds only writes that follow it
    (allow_duplicate)."""
    shared = re.compile(r'Output\((?:\w+\.)*(summary|download)\b, "(children|data)"\)')
    owners = {
        str(path.relative_to(ROOT)): sorted({m.group(1) for m in shared.finditer(path.read_text())})
        for path in python_files("webapp")
    }
    assert {path: parts for path, parts in owners.items() if parts} == {
        "webapp/panels/subject_panel.py": ["download", "summary"]
    }


def test_every_package_says_its_job():
    packages = [
        p for p in python_files("krypton", "webapp", "demo", "bench") if p.name == "__init__.py"
    ]
    assert packages
    for package in packages:
        docstring = ast.get_docstring(ast.parse(package.read_text())) or ""
        assert len(docstring.split()) >= 8, package


def test_readme_layout_names_every_module_on_a_line_of_its_own():
    """README's Layout section is the tree: each shipped module (``__init__`` aside) on
    its own line, under its folder, so a module added or moved shows up in review."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    named = {line.split()[0] for line in tree.splitlines() if line.strip()}
    missing = []
    for path in python_files(*SHIPPED):
        if path.name == "__init__.py" or "panels" in path.relative_to(ROOT).parts:
            continue  # webapp/panels/ is one entry: a folder per kind, the same files each
        if path.name not in named:
            missing.append(str(path.relative_to(ROOT)))
    for folder in ("webapp/", "krypton/", "engine/", "approximate/", "registry/", "io/"):
        assert folder in named, folder
    assert not missing, f"not in README's Layout: {missing}"
