"""The command's imports, lightened (:mod:`mgpu.imports`): YAML parsed by libyaml's C
loader, with the pure-Python loader's message for a malformed document, and Dask imported
without Jinja2, which stays importable; mgpu imported as a library changes neither (each
case in a fresh interpreter told how it was started)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

yaml = pytest.importorskip("yaml")
if not getattr(yaml, "__with_libyaml__", False):
    pytest.skip("PyYAML was built without libyaml", allow_module_level=True)

COMMAND = "sys.orig_argv = [sys.executable, '-m', 'mgpu', 'submit', 'job.yaml']"
LIBRARY = "sys.orig_argv = [sys.executable, 'program.py']"

DOCUMENT = "name: job\nparams: {m: 4096, dtype: float32, ratio: 0.5, flag: yes, size: 1e3}\nlist:\n  - [1, 2]\n  - ~\n"


def observed(started_as: str, code: str, tmp_path) -> dict:
    """What ``code`` puts in ``seen``, run after ``import mgpu`` in an interpreter started
    as ``started_as`` says."""
    script = (
        f"import json, sys\n{started_as}\nseen = {{}}\nimport mgpu\n{textwrap.dedent(code)}\nprint(json.dumps(seen))"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = f"""
import yaml
made = []

class Counting(yaml.CSafeLoader):
    def __init__(self, stream):
        made.append(1)
        super().__init__(stream)

yaml.CSafeLoader = Counting
seen["parsed"] = yaml.safe_load({DOCUMENT!r})
seen["c_loaders"] = len(made)
with open("bad.yaml", "w") as f:
    f.write("params: [1, 2\\n")
try:
    with open("bad.yaml") as f:
        yaml.safe_load(f)
except yaml.YAMLError as e:
    seen["error"] = str(e)
import dask.widgets, jinja2
seen["templates"] = bool(dask.widgets.FILTERS)
"""


def test_the_command_parses_yaml_in_c_and_imports_dask_without_jinja2(tmp_path, monkeypatch):
    seen = observed(COMMAND, PROBE, tmp_path)
    assert seen["parsed"] == yaml.load(DOCUMENT, Loader=yaml.SafeLoader)
    assert seen["c_loaders"] == 1
    monkeypatch.chdir(tmp_path)
    with open("bad.yaml") as f, pytest.raises(yaml.YAMLError) as pure:  # the pure-Python loader's message
        yaml.load(f, Loader=yaml.SafeLoader)
    assert seen["error"] == str(pure.value) and '"bad.yaml", line 1' in seen["error"]
    assert seen["templates"] is False  # Dask's notebook templates are off; Jinja2 imported again fine


def test_a_program_importing_mgpu_keeps_its_yaml_and_dask_templates(tmp_path):
    seen = observed(LIBRARY, PROBE, tmp_path)
    assert seen["c_loaders"] == 0
    assert seen["templates"] is True
