"""docs/architecture.md cannot drift from the code: every file, module, class, function
and method it cites in backticks exists, where it says it is. Before, it named an
``export_refusal`` that did not exist, ``run_strip.result_handle`` in the module of that
name that does not hold it, and a ``shown_view`` two modules define, without saying which."""

from __future__ import annotations

import ast
import builtins
import importlib
import keyword
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_structure import ROOT, SHIPPED, module_name, python_files

DOC = ROOT / "docs" / "architecture.md"
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# the run's services object and the run package, as the doc calls them (an instance or an
# import alias in the code: ``services.cells``, ``runs.execute``)
ALIASES = {"services": "Services"}


@dataclass
class Code:
    """What the shipped code defines: each module's top-level names, each class's own
    members and bases, and every name defined anywhere (functions, classes, arguments,
    assignments, attributes set on ``self``)."""

    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> names
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)
    anywhere: set[str] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)

    def members(self, name: str, seen: frozenset = frozenset()) -> set[str]:
        """The members of every class called ``name``, their bases' included."""
        found: set[str] = set()
        for own, bases in self.classes.get(name, []):
            found |= own
            for base in bases:
                if base not in seen:
                    found |= self.members(base, seen | {name})
        return found

    def modules_named(self, short: str) -> list[str]:
        return [m for m in self.modules if m.rpartition(".")[2] == short]

    def defines(self, name: str) -> bool:
        """Whether the dotted ``name`` is a module's, a class's or an alias's member."""
        head, _, rest = name.partition(".")
        if not rest:
            return name in self.anywhere
        if head in ("krypton", "webapp") or head not in self.anywhere | set(self.classes):
            return _importable(name)  # the project's by its full name, or a library's
        first, _, more = rest.partition(".")
        if more:
            return False
        owner = ALIASES.get(head, head)
        if owner in self.classes:
            return first in self.members(owner)
        modules = self.modules_named(head)
        return len(modules) == 1 and first in self.modules[modules[0]]


def _importable(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(target, part):
                return False
            target = getattr(target, part)
        return True
    return False


def read_code() -> Code:
    code = Code()
    for path in python_files(*SHIPPED):
        tree = ast.parse(path.read_text())
        top = code.modules.setdefault(module_name(path), set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom):
                top |= {alias.asname or alias.name for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = {
                    item.name if not isinstance(item, (ast.Assign, ast.AnnAssign)) else
                    getattr(item.targets[0] if isinstance(item, ast.Assign) else item.target,
                            "id", "")
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                         ast.Assign, ast.AnnAssign))
                }  # fmt: skip
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases]  # fmt: skip
                code.classes.setdefault(node.name, []).append((own, bases))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                code.anywhere.add(node.name)
            elif isinstance(node, ast.arg):
                code.anywhere.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                code.anywhere.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                code.anywhere.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                code.strings.add(node.value)
    return code


def cited(text: str) -> list[str]:
    """Every span in backticks, once, in the order of the text."""
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]
    return list(dict.fromkeys(spans))


def problems(text: str, code: Code) -> list[str]:
    """What the text cites that the code does not have, one line each."""
    makefile = (ROOT / "Makefile").read_text()
    found = []
    for span in cited(text):
        if span.startswith("make "):
            target = span.split()[1]
            if not re.search(rf"^{re.escape(target)}:", makefile, re.M):
                found.append(f"{span}: no such make target")
        elif span.startswith("python -m "):
            module = shlex.split(span)[2]
            if not (ROOT / Path(*module.split("."))).with_suffix(".py").exists():
                found.append(f"{span}: no such module")
        elif "/" in span and " " not in span:  # a file or a folder
            candidates = [ROOT / span, ROOT / "krypton" / span]
            if not any(c.exists() for c in candidates):
                found.append(f"{span}: no such file")
        elif span.startswith('"') and span.endswith('"'):
            if span.strip('"') not in code.strings:
                found.append(f"{span}: no such string in the code")
        elif re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", span):  # a page component's id
            scoped = span.split("-", 1)[1]  # a panel scope's id: its prefix, then the part
            if not any(span in s for s in code.strings) and scoped not in code.strings:
                found.append(f"{span}: no component id says it")
        elif IDENTIFIER.match(span) and not keyword.iskeyword(span):
            if not code.defines(span) and not hasattr(builtins, span):
                found.append(f"{span}: not defined there (or two modules have its name)")
            elif "." not in span and _ambiguous(span, code):
                found.append(f"{span}: {_ambiguous(span, code)} define it; name one")
    return found


def _ambiguous(name: str, code: Code) -> list[str]:
    """The modules that define ``name`` at top level, where they are more than one and it
    is a function the doc cites bare (a class's method is cited with its class)."""
    holders = [m for m, names in code.modules.items() if name in names]
    defining = []
    for module in holders:
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
            defining.append(module)
    return defining if len(defining) > 1 else []


@pytest.fixture(scope="module")
def code() -> Code:
    return read_code()


def test_every_name_the_architecture_cites_exists_where_it_says(code):
    assert problems(DOC.read_text(), code) == []


def test_the_check_finds_a_name_that_drifted(code):
    drifted = (
        "`export_refusal`, `panel_scope.result_handle`, `shown_view`, `webapp/nowhere.py`, "
        "`records.relabel`, `SubjectPanel.show_result`, `make bench`, `runs.execute`"
    )
    found = problems(drifted, code)
    assert [line.split(":")[0] for line in found] == [
        "export_refusal", "panel_scope.result_handle", "shown_view", "webapp/nowhere.py",
    ]  # fmt: skip
