"""The design the code cites is in the repository: every ``docs/design.md, "Section"``
reference (also as a Markdown link, ``[docs/design.md](...), "Section"``) names a heading
that exists, so does every ``deploy/<page>.md, "Section"`` reference in the page it names,
and the links of the README, the docs and the deployment guide (deploy/*.md) reach a file
and, with ``#anchor``, one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", "build", "node_modules"}
CITATION = re.compile(r'docs/design\.md(?:\]\([^)]*\))?,\s+((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)')
SECTION = re.compile(r'"([^"]+)"')


def sources() -> list[Path]:
    return [
        p
        for p in ROOT.rglob("*")
        if p.suffix in {".py", ".md", ".yaml", ".toml"}
        and p.is_file()
        and not SKIP & set(p.relative_to(ROOT).parts)
        and p.name != "test_docs.py"  # its own docstring shows the pattern
    ]


def headings(doc: Path) -> set[str]:
    return {line[3:].strip() for line in doc.read_text().splitlines() if line.startswith("## ")}


def test_every_citation_of_the_design_names_a_section_that_exists() -> None:
    sections = headings(ROOT / "docs" / "design.md")
    cited: dict[str, set[str]] = {}
    for path in sources():
        text = " ".join(path.read_text(errors="replace").split())  # citations may wrap
        for match in CITATION.finditer(text):
            for name in SECTION.findall(match.group(1)):
                cited.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert cited, "no citation found: the pattern is wrong"
    missing = {name: sorted(paths) for name, paths in cited.items() if name not in sections}
    assert missing == {}


def test_nothing_cites_a_contract_outside_the_repository() -> None:
    outside = [
        str(p.relative_to(ROOT))
        for p in sources()
        if re.search(r"SPEC §|shared/SPEC|\.\./shared", p.read_text(errors="replace"))
    ]
    assert outside == []


def test_the_docs_link_to_files_that_exist() -> None:
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), (doc.name, target)


FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# ``deploy/security.md, "Redis users"``, also as a Markdown link.
DEPLOY_CITATION = re.compile(
    r'deploy/([\w-]+\.md)(?:\]\([^)]*\))?,\s+((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)'
)
COMMENT_WRAP = re.compile(r"\n[ \t]*#+[ \t]*")  # a citation wrapped in a YAML or Python comment


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "deploy").glob("*.md")),
    ]


def test_the_links_of_the_readme_the_docs_and_deploy_reach_a_file_and_its_heading() -> None:
    broken = []
    for doc in pages():
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists() or (anchor and anchor not in anchors(file)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def deploy_citations(text: str) -> set[tuple[str, str]]:
    """The ``(page, section)`` pairs ``text`` cites as ``deploy/<page>.md, "Section"``."""
    text = " ".join(COMMENT_WRAP.sub("\n", text).split())  # citations may wrap
    return {
        (page, name)
        for page, names in DEPLOY_CITATION.findall(text)
        for name in SECTION.findall(names)
    }


def test_citations_of_the_deployment_guide_name_a_page_and_a_section_that_exist() -> None:
    cited: dict[tuple[str, str], set[str]] = {}
    for path in {*sources(), *pages()}:
        for citation in deploy_citations(path.read_text(errors="replace")):
            cited.setdefault(citation, set()).add(str(path.relative_to(ROOT)))
    assert {page for page, _ in cited} >= {"security.md", "operations.md"}, "pattern is wrong"
    missing = {
        f"deploy/{page}, {name!r}": sorted(paths)
        for (page, name), paths in cited.items()
        if not (ROOT / "deploy" / page).exists() or name not in headings(ROOT / "deploy" / page)
    }
    assert missing == {}


def test_the_citation_pattern_reads_each_form() -> None:
    assert deploy_citations(
        '(deploy/security.md, "Redis users"); [deploy/operations.md](../deploy/operations.md),\n'
        '"Metrics" and (deploy/compose.md, "Docker Compose\n    # (one host)")'
    ) == {
        ("security.md", "Redis users"),
        ("operations.md", "Metrics"),
        ("compose.md", "Docker Compose (one host)"),
    }


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_readme_layout_matches_the_tree() -> None:
    """Every top-level directory of the project is in the Layout block, and every
    ``name.py`` it mentions exists in the package it is listed under."""
    block = _layout_block()
    listed = set(re.findall(r"^([a-z_]+)/", block, re.MULTILINE))
    tracked = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p.name not in SKIP | {"__pycache__"}
        and not p.name.endswith(".egg-info")
    }
    assert listed == tracked
    package = ""
    missing = []
    for line in block.splitlines():
        head = re.match(r"^([a-z_]+)/", line)
        if head:
            package = head.group(1)
        for name in re.findall(r"\b([a-z_]+\.py)\b", line):
            if not list((ROOT / package).rglob(name)):
                missing.append(f"{package}/{name}")
    assert missing == []
