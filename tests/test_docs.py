"""The documentation stays true to the repository: the measured tables of docs/results/ are exactly what
their JSON gives, the README stays short and keeps CI's commands, and no relative link points nowhere.
No jax: the generator is the standard library, the rest is reading files."""
import os
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


# What `.ci/run` may hold: the lines that make and enter a fresh venv, an upgrade of pip itself, CI=true (a skip
# then fails the run, tests/ci_skips.py), and last the README's test command verbatim. Anything else (an install
# beside the README's, a venv with the system's site-packages, a PYTHONPATH) could make CI's suite differ from
# what the README's command gives a newcomer, as PyTorch installed by CI alone once did (issue 28).
CI_SETUP = ("set -euo pipefail", 'cd "$(dirname "$0")/.."', "python3 -m venv .venv", ". .venv/bin/activate",
            "python -m pip install -q --upgrade pip", "export CI=true")


def _readme_test_line(readme: str) -> str:
    return re.search(r"^pip install [^\n]*pytest[^\n]*$", readme, re.M).group(0)


def _ci_departures(ci: str, readme: str) -> list:
    """The lines of a CI script, comments dropped, that are neither CI_SETUP nor the README's test command;
    and a note when the README's command is not the last line."""
    test_line = _readme_test_line(readme)
    code = [c for c in (re.sub(r"(^|\s)#.*", "", line).strip() for line in ci.splitlines()) if c]
    out = [c for c in code if c not in CI_SETUP and c != test_line]
    if not code or code[-1] != test_line:
        out.append(f"last line is not the README's test command: {test_line}")
    return out


def test_ci_runs_the_readme_command_and_installs_nothing_else():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _ci_departures(ci, README.read_text()) == [], ".ci/run does more than the README's test command"
    assert "export CI=true" in ci.splitlines()


def test_the_ci_guard_sees_an_install_beside_the_readme_command():
    """The guard itself, on mutated copies of .ci/run: each departure is caught."""
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_line = _readme_test_line(readme)
    mutants = {
        "torch installed by CI alone": ci.replace(test_line, 'pip install -q "torch==2.13.0+cpu"\n' + test_line),
        "system site-packages": ci.replace("python3 -m venv .venv", "python3 -m venv --system-site-packages .venv"),
        "an extra on the README's command": ci.replace("[test,gpu-target]", "[test,gpu-target,more]"),
        "an install after it": ci + "pip install setuptools\n",
        "PYTHONPATH": ci.replace("export CI=true", "export CI=true PYTHONPATH=/opt/site"),
    }
    for what, mutant in mutants.items():
        assert mutant != ci, what
        assert _ci_departures(mutant, readme), f"the guard misses: {what}"


def test_a_skip_fails_the_run_under_ci(tmp_path):
    """tests/ci_skips.py's hooks on a throw-away suite of one test that passes and one module that skips
    (as a missing PyTorch did): exit 0 without CI, 1 with CI=true, in one process and in two workers."""
    (tmp_path / "conftest.py").write_text("from tests.ci_skips import pytest_sessionfinish, pytest_terminal_summary\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_gone.py").write_text("import pytest\npytest.importorskip('no_such_module_jfsdp')\n"
                                            "def test_never():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    for extra, ci, want in (([], None, 0), ([], "true", 1), (["-n", "2"], "true", 1)):
        run_env = dict(env, **({"CI": ci} if ci else {}))
        p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=run_env)
        assert p.returncode == want, (extra, ci, p.stdout[-2000:], p.stderr[-2000:])
        assert ("1 skipped" in p.stdout) and (("CI: 1 skipped" in p.stdout) == (want == 1)), p.stdout[-2000:]


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
