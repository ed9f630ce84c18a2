"""The checks .ci/run makes before the tests, made by the suite too, so a change that breaks
them fails where it is made: ruff (lint and format) and the import layers of pyproject.toml.
mypy, which takes minutes, is left to .ci/run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["lint-imports", "--no-cache"]],
    ids=["ruff-check", "ruff-format", "lint-imports"],
)
def test_the_tree_passes(command):
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed (pip install -e '.[lint]')")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
