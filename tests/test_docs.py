"""The README stays short (the two commands, what the product does, links) and every relative
link in it and in docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_starts_with_the_two_commands_and_stays_under_10_kb():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 10 * 1024
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines() if line.startswith("make")] == [
        ["make", "run"], ["make", "test"]]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("make test")


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 7
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
    readme = (ROOT / "README.md").read_text()
    for page in pages[1:]:
        assert f"docs/{page.name}" in readme, f"the README does not link {page.name}"
