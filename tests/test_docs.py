"""The docs a user reads: every relative link in README.md and docs/ resolves, every page the README's documentation
table names exists, and nothing in the project tells how it was made (issue or session numbers, files outside the
repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
WORK_LOG = re.compile(r"\b((?i:issues? #?\d+|sessions? \d+|work period)|DRAFTERS\.md|DESIGN\.md)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # not inside code blocks
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue  # URLs and in-page anchors
        path = link.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"


def test_the_readme_names_a_page_for_each_user_question():
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/your-checkpoint.md", "docs/getting-started.md", "docs/drafters.md", "docs/kubernetes.md",
                 "docs/benchmarks.md", "docs/reference.md"):
        assert f"]({page})" in readme, page
        assert (ROOT / page).exists(), page


def test_nothing_tells_how_the_project_was_made():
    roots = ["README.md", "docs", "mmspec_ray", "jobs", "deployments", "k8s", "scripts", "experiments"]
    found = []
    for root in roots:
        base = ROOT / root
        files = [base] if base.is_file() else [f for f in base.rglob("*") if f.is_file()]
        for f in files:
            if f.suffix not in (".md", ".py", ".sh", ".yaml", ".yml") or "bench" in f.relative_to(ROOT).parts[:2]:
                continue
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if WORK_LOG.search(line):
                    found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_the_work_log_pattern_catches_what_it_should():
    assert WORK_LOG.search("as issue 23 asked") and WORK_LOG.search("Session 39 measured") and \
        WORK_LOG.search("see DRAFTERS.md")
    assert not WORK_LOG.search("docs/design.md and docs/drafters.md") and not WORK_LOG.search("start_new_session")


SPEEDUP = re.compile(r"(?<![\w.])\d+\.\d+x\b")  # a speedup figure: 1.26x
MEASURING = [ROOT / "docs" / "benchmarks.md", *sorted((ROOT / "docs" / "drafters").glob("*.md"))]
RAW = (ROOT / "docs" / "bench", ROOT / "docs" / "history")  # run outputs and the measurement history, as written


def test_the_readme_fits_one_screen_above_its_first_command_and_quotes_no_figure():
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("```bash"))
    assert first <= 20, f"{first} lines above the README's first command"
    assert not SPEEDUP.findall("\n".join(lines))


def test_each_speedup_figure_lives_on_the_page_that_measures_it():
    """Speedups appear only on the measuring pages (benchmarks.md, drafters/*.md, and the raw run outputs under
    docs/bench and docs/history); every other page links there. And no line with a speedup is copied from one
    measuring page to another: the copy would go stale when the figure is measured again."""
    elsewhere = {str(p.relative_to(ROOT)): SPEEDUP.findall(p.read_text()) for p in PAGES
                 if p not in MEASURING and not any(r in p.parents for r in RAW)}
    assert not {p: f for p, f in elsewhere.items() if f}
    seen: dict[str, str] = {}
    copied = []
    for page in MEASURING:
        for line in page.read_text().splitlines():
            if SPEEDUP.search(line):
                key = " ".join(line.split())
                if key in seen and seen[key] != page.name:
                    copied.append(f"{seen[key]} and {page.name}: {key[:80]}")
                seen.setdefault(key, page.name)
    assert not copied, copied
