"""The user docs hold together: links resolve, the README stays short, no machine paths or bare
issue numbers, and docs/architecture.md matches the import contract and the package tree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "unshardfs"
README_MAX_LINES = 400

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+|<[^>\s]+>|\bmailto:\S+", re.I)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
ISSUE_NUMBER = re.compile(r"(?<![\w&/])#\d+")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|tmp)/")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "CHANGELOG.md"]
    files += sorted((REPO / "docs").rglob("*.md")) + sorted((REPO / "benchmarks").rglob("*.md"))
    return [f for f in files if f.exists()]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            out.append((number, line))
    return out


def without_code(line: str) -> str:
    return CODE_SPAN.sub(" ", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, every character but letters,
    digits, '_', '-' and spaces dropped, spaces turned into '-'."""
    text = INLINE_LINK.sub(lambda m: m.group(0)[1:m.group(0).index("](")], heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text).replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "_- ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = without_code(line)
        out += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        out += [(number, m.group(1)) for m in REFERENCE_DEF.finditer(line)]
    return out


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if not target or SCHEME.match(target):
            continue  # absolute URLs are not checked here (no network in the tests)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{rel(path)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor in {rel(dest)}")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: anchor into a file that is not Markdown")
    return problems


def test_the_doc_set_is_there() -> None:
    names = {rel(f) for f in doc_files()}
    for name in ("README.md", "BENCHMARKS.md", "CHANGELOG.md", "docs/architecture.md", "docs/glossary.md"):
        assert name in names
    assert (REPO / "LICENSE").is_file()


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, with `code` and more\n\n## Zarr v2 view (`--view zarr2`)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md#a-heading-with-code-and-more) [ok](there.md#zarr-v2-view---view-zarr2)\n"
                   "[gone](missing.md) [bad anchor](there.md#nowhere) `[in code](missing.md)`\n"
                   "```\n[fenced](missing.md)\n```\n[ref]: also-missing.md\n")
    assert broken_links(doc) == [
        "doc.md:2: missing.md: no such file",
        "doc.md:2: there.md#nowhere: no heading with that anchor in there.md",
        "doc.md:6: also-missing.md: no such file",
    ]


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_readme_names_the_demo_and_the_tests_near_its_top() -> None:
    """A newcomer finds both commands before the install instructions."""
    top = (REPO / "README.md").read_text(encoding="utf-8").split("\n## ", 2)
    assert "./scripts/demo" in top[0] + top[1] and "./scripts/test" in top[0] + top[1]
    assert all((REPO / "scripts" / name).is_file() for name in ("demo", "test"))


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_no_bare_issue_numbers(path: Path) -> None:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        prose = URL.sub(" ", INLINE_LINK.sub(lambda m: m.group(0).split("](")[0], without_code(line)))
        found += [f"{number}: {m.group(0)}" for m in ISSUE_NUMBER.finditer(prose)]
    assert found == []


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_no_machine_paths(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]
    assert found == []


def contract_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [" | ".join(part.strip() for part in layer.split("|")) for layer in layers]


def section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/architecture.md has no '## {title}' section"
    return m.group(1)


def test_architecture_lists_the_contract_layers() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\d+\.\s+`([^`]+)`", section(text, "Layers"), re.M)
    assert [" | ".join(p.strip() for p in layer.split("|")) for layer in listed] == contract_layers()


def code_map() -> tuple[set[str], list[str]]:
    """The package directories (relative, ending in '/') and module paths the code map names."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"^```\n(.*?)^```", section(text, "Code map"), re.M | re.S)
    assert block, "the code map is a fenced block"
    packages: set[str] = set()
    modules: list[str] = []
    package = ""
    for line in block.group(1).splitlines()[1:]:  # the first line is src/unshardfs/ itself
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        if name.endswith("/"):
            assert indent == 2, f"a package is named by its full path at the map's first level: {line!r}"
            package = name
            packages.add(name)
        elif name.endswith(".py"):
            modules.append(name if indent == 2 else package + name)
    return packages, modules


def test_code_map_names_every_package_and_only_real_modules() -> None:
    packages, modules = code_map()
    real = {p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")
            if p.parent != PACKAGE}
    assert packages == real
    assert [m for m in modules if not (PACKAGE / m).is_file()] == []


def test_code_map_names_every_module_once() -> None:
    """A module added (or moved) without its line in the code map fails here."""
    _, modules = code_map()
    real = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [m for m in real if m not in modules] == []
    assert sorted(m for m in set(modules) if modules.count(m) > 1) == []


def test_tests_mirror_the_package() -> None:
    """Every directory of tests/ (but its shared support and data) is named after a package of src/unshardfs,
    so a package's tests are found where the package is."""
    tests = REPO / "tests"
    real = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    stray = []
    for directory in sorted(p for p in tests.iterdir() if p.is_dir() and p.name not in ("support", "data", "__pycache__")):
        if directory.name not in real:
            stray.append(directory.name)
    assert stray == []
