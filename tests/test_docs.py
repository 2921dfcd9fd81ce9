"""The documentation stays true to the repository: the measured tables of docs/results/ are exactly what
their JSON gives, the README stays short and keeps CI's commands, and no relative link points nowhere.
No jax: the generator is the standard library, the rest is reading files."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


def test_results_pages_are_what_their_json_gives(tmp_path):
    """Regenerate docs/results/ from benchmarks/results/*.json with the one command and compare with the
    committed pages: a table edited by hand, a JSON re-measured without regenerating, a page left behind
    or one missing all fail here. Fix: `python benchmarks/results_pages.py`, then commit the pages."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_pages.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    fresh = {f.name: f.read_text() for f in tmp_path.glob("*.md")}
    committed = {f.name: f.read_text() for f in RESULTS.glob("*.md")}
    assert sorted(committed) == sorted(fresh), "docs/results/ holds other pages than the generator writes"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"docs/results/ pages differ from their JSON: {stale}; run python benchmarks/results_pages.py"


def test_readme_is_short_and_keeps_ci_commands():
    text = README.read_text()
    assert text.count("\n") <= 250, f"README.md has {text.count(chr(10))} lines; move detail into docs/"
    ci = (ROOT / ".ci" / "run").read_text()
    first_test_command = re.search(r"(python3? -m )?pytest[^`\n]*", text).group(0).strip()
    assert first_test_command == "python -m pytest -q -n 2 --dist loadfile tests"
    assert first_test_command in ci
    assert 'pip install -e ".[test,gpu-target]"' in text and 'pip install -e ".[test,gpu-target]"' in ci


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside code blocks and code spans, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (repeats get -1, -2...)."""
    seen, out = {}, set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _pages() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in _pages():
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no such heading")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_links_and_headings(tmp_path):
    """The checker itself: links in prose count, links in code do not, anchors follow GitHub's rule."""
    page = tmp_path / "p.md"
    page.write_text("# Training: train.py\n\n## What it *prints*\n\n## What it *prints*\n\n"
                    "[a](x.md) and `[b](y.md)`\n\n```\n[c](z.md)\n```\n[d](x.md#sec-one)\n")
    assert LINK.findall(_prose(page.read_text())) == ["x.md", "x.md#sec-one"]
    assert _anchors(page) == {"training-trainpy", "what-it-prints", "what-it-prints-1"}
