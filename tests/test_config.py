"""mgpu's settings: mgpu.yaml, its schema and mgpu.config.Settings hold the same keys; every
``mgpu.*`` key the code or the docs name is one of them; bad values and unknown keys stop
``mgpu submit`` with exit 2 before a cluster starts; the workers run with the client's values."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import dask.config
import pytest
import yaml
from conftest import invoke, write_job
from distributed import Client
from pydantic import BaseModel

import mgpu.cluster
from mgpu import config

ROOT = Path(__file__).resolve().parents[1]
FILE_SUFFIXES = (".yaml", ".py", ".json", ".md")  # mgpu.yaml is a file, not a key


def _yaml_keys(node: dict[str, Any], prefix: str) -> set[str]:
    keys = set()
    for k, v in node.items():
        keys.add(f"{prefix}.{k}")
        if isinstance(v, dict):
            keys |= _yaml_keys(v, f"{prefix}.{k}")
    return keys


def _schema_keys(node: dict[str, Any], prefix: str) -> set[str]:
    keys = set()
    for k, v in node.get("properties", {}).items():
        keys.add(f"{prefix}.{k}")
        keys |= _schema_keys(v, f"{prefix}.{k}")
    return keys


def _model_keys(model: type[BaseModel], prefix: str) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name.replace('_', '-')}"
        keys.add(key)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys |= _model_keys(field.annotation, key)
    return keys


DEFAULTS = yaml.safe_load(config.DEFAULTS_PATH.read_text())
SCHEMA = yaml.safe_load(config.SCHEMA_PATH.read_text())
KEYS = _yaml_keys(DEFAULTS["mgpu"], "mgpu")


def test_the_yaml_the_schema_and_the_settings_hold_the_same_keys():
    assert KEYS == _schema_keys(SCHEMA["properties"]["mgpu"], "mgpu") == _model_keys(config.Settings, "mgpu")
    assert {"mgpu.io.read", "mgpu.io.threads", "mgpu.io.task-size", "mgpu.transfer.chunk-bytes"} <= KEYS
    assert {"mgpu.transfer.host-threads"} <= KEYS


def test_every_key_in_the_schema_is_described_and_the_defaults_fit_it():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(DEFAULTS, SCHEMA)
    io = SCHEMA["properties"]["mgpu"]["properties"]["io"]["properties"]
    assert tuple(io["read"]["enum"]) == config.READ_METHODS
    with pytest.raises(jsonschema.ValidationError):  # the schema does say what may not be
        jsonschema.validate({"mgpu": {"transfer": {"chunk-byte": 1}}}, SCHEMA)

    def leaves(node: dict[str, Any], name: str) -> None:
        if "properties" in node:
            for k, v in node["properties"].items():
                leaves(v, f"{name}.{k}")
        else:
            assert node.get("description", "").strip(), f"{name} has no description"

    leaves(SCHEMA["properties"]["mgpu"], "mgpu")


def test_the_defaults_are_the_settings_of_an_empty_configuration():
    # mgpu.yaml is registered with Dask: with nothing set, load() gives the model's defaults.
    assert dask.config.get("mgpu.transfer.chunk-bytes") == DEFAULTS["mgpu"]["transfer"]["chunk-bytes"]
    assert config.load() == config.Settings()
    assert config.Settings.model_validate(DEFAULTS["mgpu"]) == config.Settings()


def _is_code(dotted: str) -> bool:
    """Whether ``mgpu.a.b`` names a module or something in one (mgpu.worker.transfer.load), not a key."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_mgpu_key_the_code_and_the_docs_name_is_a_setting():
    files = [*(ROOT / "mgpu").rglob("*.py"), *(ROOT / "mgpu").rglob("*.yaml"), ROOT / "README.md"]
    files += [*(ROOT / "docs").rglob("*.md")] if (ROOT / "docs").is_dir() else []
    named: dict[str, str] = {}
    for path in files:
        for match in re.finditer(r"(?<![\w/.-])mgpu(?:\.[a-z][a-z0-9_-]*)+", path.read_text()):
            named.setdefault(match.group(), str(path.relative_to(ROOT)))
    keys = {k: where for k, where in named.items() if not _is_code(k) and not k.endswith(FILE_SUFFIXES)}
    assert "mgpu.transfer.chunk-bytes" in keys  # the scan finds keys at all
    unknown = {k: where for k, where in keys.items() if k not in KEYS}
    assert unknown == {}, "named in the source but not in mgpu/mgpu.yaml"


def test_no_module_but_mgpu_config_reads_an_mgpu_key():
    reads = re.compile(r"config\.get\(\s*[\"'](mgpu[\w.-]*)")
    offenders = [
        f"{p.relative_to(ROOT)}: {key}"
        for p in (ROOT / "mgpu").rglob("*.py")
        if p.name != "config.py"
        for key in reads.findall(p.read_text())
    ]
    assert offenders == []


# -- bad values --------------------------------------------------------------------------------

BAD = [
    ("transfer.chunk-bytes", "lots", "mgpu.transfer.chunk-bytes: 'lots' is not a positive number of bytes"),
    ("transfer.chunk-bytes", 0, "mgpu.transfer.chunk-bytes: 0 is not a positive number of bytes"),
    ("transfer.chunk-bytes", 1.5, "mgpu.transfer.chunk-bytes: 1.5 is not a positive number of bytes"),
    ("transfer.host-threads", 0, "mgpu.transfer.host-threads: 0 is not a positive whole number or auto"),
    ("transfer.host-threads", None, "mgpu.transfer.host-threads: None is not a positive whole number or auto"),
    ("io.read", "mapped", "mgpu.io.read: 'mapped' is not one of auto, kvikio, mmap"),
    ("io.write", "pread", "mgpu.io.write: 'pread' is not one of mmap, pwrite, kvikio"),
    ("io.writers", 0, "mgpu.io.writers: 0 is not a positive whole number or auto"),
    ("io.threads", 0, "mgpu.io.threads: 0 is not a positive whole number"),
    ("io.task-size", "big", "mgpu.io.task-size: 'big' is not a positive number of bytes"),
    ("transfer.read", "pread", "mgpu.transfer.read: mgpu has no such setting; it has mgpu.transfer.chunk-bytes,"),
    ("recovery.wait-for-workers", "soon", "mgpu.recovery.wait-for-workers: 'soon' is not a length of time"),
    ("recovery.wait-for-workers", -1, "mgpu.recovery.wait-for-workers: -1 is not a length of time"),
    ("recovery.checkpoint-steps", -1, "mgpu.recovery.checkpoint-steps: -1 is not a whole number of steps, 0 or more"),
    ("recovery.checkpoint-steps", True, "mgpu.recovery.checkpoint-steps: True is not a whole number of steps"),
    ("recovery.checkpoint-steps", 2.5, "mgpu.recovery.checkpoint-steps: 2.5 is not a whole number of steps"),
    ("cache-dir", 3, "mgpu.cache-dir: 3 is not a folder"),
    ("ceilings.sustain", "long", "mgpu.ceilings.sustain: 'long' is not a length of time (e.g. 1s)"),
    ("ceilings.samples", 0, "mgpu.ceilings.samples: 0 is not a positive whole number of timed runs"),
    ("transfer.chunk-byte", 1, "mgpu.transfer.chunk-byte: mgpu has no such setting; it has mgpu.transfer.chunk-bytes,"),
    ("transfer", "fast", "mgpu.transfer: 'fast' is not a mapping of settings"),
]


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if a cluster is started or joined."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cluster was started with settings that should have been refused")

    monkeypatch.setattr(mgpu.cluster, "_start_cpu", refuse)
    monkeypatch.setattr(mgpu.cluster, "_start_cuda", refuse)
    monkeypatch.setattr(mgpu.cluster, "_join", refuse)


@pytest.mark.parametrize("key,value,says", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_setting_stops_the_submit_before_anything_starts(tmp_path, no_cluster, key, value, says):
    doc = {"workload": "matmul", "params": {"m": 8, "n": 8, "k": 8, "output": str(tmp_path / "c.npy")}}
    job = write_job(tmp_path / "job.yaml", doc)
    with dask.config.set({f"mgpu.{key}": value}):
        res = invoke("submit", job, "--json", tmp_path / "r.json", "-q")
    assert res.code == 2, res.output
    assert says in res.stderr and res.stdout == ""
    assert "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no result, no output, no partial file


def test_a_bad_setting_in_the_environment_exits_2_from_the_real_command(tmp_path):
    job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 100}})
    env = {
        **os.environ,
        "DASK_MGPU__TRANSFER__CHUNK_BYTES": "lots",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mgpu", "submit", str(job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr.strip()
        == "mgpu: error: mgpu.transfer.chunk-bytes: 'lots' is not a positive number of bytes (e.g. 16MiB)"
    )
    assert proc.stdout == ""


# -- good values -------------------------------------------------------------------------------


def test_values_are_parsed_once_into_their_types(tmp_path):
    with dask.config.set(
        {
            "mgpu.transfer.chunk-bytes": "32MiB",
            "mgpu.transfer.host-threads": "4",
            "mgpu.recovery.wait-for-workers": "2 minutes",
            "mgpu.cache-dir": str(tmp_path),
        }
    ):
        s = config.load()
    assert s.transfer.chunk_bytes == 32 << 20 and s.transfer.host_threads == 4
    assert s.recovery.wait_for_workers == 120.0
    assert s.ceilings_folder() == tmp_path


def test_a_joined_clusters_workers_run_with_the_clients_settings(tmp_path, scheduler):
    def worker_chunk_bytes() -> int:
        from mgpu import config

        return config.load().transfer.chunk_bytes

    job = write_job(tmp_path / "job.yaml", {"workload": "dot", "params": {"n": 1000}})
    with Client(scheduler) as client:
        before = set(client.run(worker_chunk_bytes).values())
    assert before == {16 << 20}  # the workers started with the defaults
    with dask.config.set({"mgpu.transfer.chunk-bytes": "3MiB"}):
        res = invoke("submit", job, "--scheduler", scheduler, "-q")
    assert res.code == 0, res.output
    with Client(scheduler) as client:
        assert set(client.run(worker_chunk_bytes).values()) == {3 << 20}
