"""Worker processes of a cluster the ``mgpu`` script starts skip the script: a spawned
process imports its parent's main module first, which for the script is mgpu's whole
command line (rich, click)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import json, logging, sys
from mgpu.cli import main, _spawn_without_the_script

if __name__ == "__main__":
    if sys.argv[1] == "skip":
        _spawn_without_the_script()  # what main() does first
    from distributed import Client, LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, dashboard_address=None, silence_logs=logging.WARNING
    ) as cluster, Client(cluster) as client:
        (modules,) = client.run(lambda: sorted(m for m in sys.modules if m in ("mgpu.cli", "rich"))).values()
    print(json.dumps(modules))
"""


@pytest.mark.parametrize("how,imported", [("skip", []), ("as-is", ["mgpu.cli", "rich"])])
def test_a_worker_of_the_mgpu_script_does_not_import_its_command_line(tmp_path, how, imported):
    script = tmp_path / "mgpu"  # the command, as the installed script runs it
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == imported
