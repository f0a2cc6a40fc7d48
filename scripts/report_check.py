"""Render an `mlxb report` HTML page in headless Chromium and check what a reader sees first.

Checks, on the DOM Chromium built (``--dump-dom``), not on our own template text:
* the page opens with the headline (``#headline``), before the labels and every table;
* each headline line names a cell, a peer and a verdict;
* the colour legend names every stack once, each in its own colour;
and writes a screenshot beside the report (``<report>.png``) for a person to look at.

Usage: ``python scripts/report_check.py reports/NAME.html`` (needs Debian's ``chromium``). Exit 1 on a
failed check, with what failed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Outline(HTMLParser):
    """Document order of headings, tables, the headline's items and the legend's swatches."""

    def __init__(self):
        super().__init__()
        self.order, self.items, self.swatches, self._in_li, self._text = [], [], [], False, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id") == "headline":
            self.order.append("headline")
        elif tag in ("h2", "table"):
            self.order.append(tag)
        if tag == "li" and "data-cell" in a:
            self._in_li, self._text = True, []
        if "data-stack" in a:
            color = re.search(r"background:\s*([^;\"]+)", a.get("style", ""))
            self.swatches.append((a["data-stack"], color.group(1).strip() if color else None))

    def handle_endtag(self, tag):
        if tag == "li" and self._in_li:
            self.items.append("".join(self._text))
            self._in_li = False

    def handle_data(self, data):
        if self._in_li:
            self._text.append(data)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("report_check: no Chromium found (Debian: apt-get install chromium)")


def check(report: Path) -> list[str]:
    exe, url = chromium(), report.resolve().as_uri()
    with tempfile.TemporaryDirectory() as profile:
        base = [exe, *FLAGS, f"--user-data-dir={profile}"]
        dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        shot = report.with_suffix(".png")
        subprocess.run(base + [f"--screenshot={shot}", "--window-size=1200,900", url], capture_output=True, timeout=120)
    problems = []
    if not dom.strip():
        return ["Chromium rendered nothing"]
    o = Outline()
    o.feed(dom)
    if not o.order or o.order[0] != "headline":
        problems.append(f"the page does not open with the headline: {o.order[:4]}")
    if "table" in o.order and "headline" in o.order and o.order.index("table") < o.order.index("headline"):
        problems.append("a table comes before the headline")
    for item in o.items:
        if not re.search(r"against \S+: tok/s", item) or not re.search(r"\((faster|slower|indistinguishable|too few samples|peer served nothing)\)|: ", item):
            problems.append(f"a headline line without cell, peer and verdict: {item!r}")
    stacks = [s for s, _ in o.swatches]
    colors = [c for _, c in o.swatches]
    if len(set(stacks)) != len(stacks) or len(set(colors)) != len(colors) or None in colors:
        problems.append(f"the legend must give each stack its own colour once: {o.swatches}")
    if not shot.exists():
        problems.append("no screenshot was written")
    print(f"{report}: {len(o.items)} headline lines, legend {o.swatches}, screenshot {shot}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    problems = check(Path(argv[0]))
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
