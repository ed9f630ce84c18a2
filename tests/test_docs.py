"""The documentation says what the code does: docs/jobs.md is the job models' own text,
no link leaves the repository, the README stays short, and its test command is the one
CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mgpu import docs
from mgpu.spec import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_jobs_md_is_generated_from_the_models():
    text = (ROOT / "docs" / "jobs.md").read_text()
    assert text == docs.jobs_markdown(), "docs/jobs.md is stale: run `python -m mgpu.docs > docs/jobs.md`"


def test_every_cluster_key_is_documented_with_its_default():
    text = docs.jobs_markdown()
    for name, field in ClusterSpec.model_fields.items():
        default = "`null`" if field.default is None else f"`{field.default}`"
        assert f"| `{name}` | {default} |" in text


def test_a_note_for_a_key_that_is_gone_is_an_error(monkeypatch):
    monkeypatch.setitem(docs.NOTES, "cluster.gone", "a key no model has")
    with pytest.raises(KeyError, match="cluster.gone"):
        docs.jobs_markdown()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_stay_in_the_repository(page):
    for target in LINK.findall(page.read_text()):
        assert not re.match(r"[a-z]+:", target), f"{page.name} links outside the repository: {target}"
        path = target.split("#", 1)[0]
        if path:
            resolved = (page.parent / path).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (
                f"{page.name}: {target} is not in the repository"
            )


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, tests
    steps = [step.strip() for step in tests[0].split(" && ")]
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs the README's extras (and may add its own), then runs the same pytest.
    (install,) = [s for s in steps if s.startswith("pip install")]
    wanted = set(re.search(r"\.\[([\w,]+)\]", install)[1].split(","))
    installed = re.search(r"pip install -q -e '\.\[([\w,]+)\]'", ci)
    assert installed and wanted <= set(installed[1].split(",")), ci
    (pytest_cmd,) = [s for s in steps if "pytest" in s]
    assert re.search(rf"^{re.escape(pytest_cmd)}$", ci, re.MULTILINE), ci
