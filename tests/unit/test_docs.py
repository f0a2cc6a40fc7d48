"""The README is a front door: short, the two commands first, and one click to every subsystem's page."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def links(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()) if not m.group(1).startswith("http")]


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    block = lines[lines.index("```bash") + 1:lines.index("```bash") + 3]
    assert block[0].endswith("mlxb serve") and block[1].endswith("python -m pytest")


def test_every_docs_page_is_one_click_from_the_readme_and_every_link_resolves():
    readme = ROOT / "README.md"
    linked = {(ROOT / t).resolve() for t in links(readme)}
    assert {p.resolve() for p in (ROOT / "docs").glob("*.md")} <= linked
    for page in [readme, ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        missing = [t for t in links(page) if not (page.parent / t).exists()]
        assert not missing, (page.name, missing)
