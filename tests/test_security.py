"""Security: a cluster mgpu starts listens on 127.0.0.1 only; joining over TLS with Dask's
own settings (flags or config), with certificates made here; job files are read with the
safe YAML loader; workloads load only by registered name, never from a dotted path."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import invoke, write_job
from dask_procs import TLSFiles, start_proc_cluster
from test_multinode import matmul_job, run_mgpu

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _name(cn: str) -> Any:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: Any) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def make_tls_files(folder: Path, cn: str = "mgpu-test") -> TLSFiles:
    """A self-signed CA and one certificate it signed, for 127.0.0.1 and localhost."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{cn} CA"))
        .issuer_name(_name(f"{cn} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.key, key)
    return files


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("tls")
    cluster = start_proc_cluster(folder / "cluster", n_workers=2, tls=make_tls_files(folder / "certs"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _check_tls_run(proc: Any, out: Path, cluster: Any) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.logs()
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and data["verify"]["passed"] is True
    assert sorted(d["tiles"] for d in data["per_device"]) == [2, 2]  # both workers, over TLS


def test_submit_over_tls_with_the_tls_flags(tmp_path, tls_cluster):
    assert tls_cluster.address.startswith("tls://127.0.0.1:")
    tls = tls_cluster.tls
    job = matmul_job(tmp_path, 32, 32, 16, {"m": 8})
    proc = run_mgpu(
        job,
        "--scheduler-file",
        tls_cluster.scheduler_file,
        "--tls-ca-file",
        tls.ca,
        "--tls-cert",
        tls.cert,
        "--tls-key",
        tls.key,
        "--json",
        tmp_path / "out.json",
        "-q",
    )
    _check_tls_run(proc, tmp_path / "out.json", tls_cluster)


def test_submit_over_tls_with_dask_config(tmp_path, tls_cluster):
    tls = tls_cluster.tls
    env = {
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(tls.ca),
        "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": str(tls.cert),
        "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": str(tls.key),
        "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
    }
    job = matmul_job(tmp_path, 32, 32, 16, {"m": 8})
    proc = run_mgpu(job, "--scheduler", tls_cluster.address, "--json", tmp_path / "out.json", "-q", env=env)
    _check_tls_run(proc, tmp_path / "out.json", tls_cluster)


def test_tls_scheduler_without_tls_settings_is_refused_before_connecting(tmp_path, tls_cluster):
    job = matmul_job(tmp_path, 8, 8, 8, {"m": 4})
    res = invoke("submit", job, "--scheduler", tls_cluster.address)
    assert res.code == 2, res.output
    assert res.stderr.startswith("mgpu: error: cluster.scheduler:") and "uses TLS" in res.stderr
    assert "--tls-ca-file" in res.stderr and "Traceback" not in res.output


def test_a_certificate_from_another_ca_is_rejected(tmp_path, tls_cluster):
    """TLS is mutual: a client whose certificates come from another CA cannot join."""
    other = make_tls_files(tmp_path / "other", cn="stranger")
    job = matmul_job(tmp_path, 8, 8, 8, {"m": 4})
    proc = run_mgpu(
        job,
        "--scheduler",
        tls_cluster.address,
        "--tls-ca-file",
        other.ca,
        "--tls-cert",
        other.cert,
        "--tls-key",
        other.key,
        env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mgpu: error: cluster.scheduler: could not connect to tls://" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--tls-cert", "{cert}", "--tls-key", "{key}"], ["--tls-ca-file:", "CA file"]),
        (
            ["--scheduler", "tcp://127.0.0.1:1", "--tls-ca-file", "{ca}", "--tls-cert", "{cert}", "--tls-key", "{key}"],
            ["does not use TLS"],
        ),
        (["--tls-ca-file", "{ca}", "--tls-cert", "{cert}", "--tls-key", "{key}"], ["joining a running cluster"]),
        (
            ["--scheduler", "tls://127.0.0.1:1", "--tls-ca-file", "{ca}", "--tls-cert", "{cert}", "--tls-key", "{ca}"],
            ["--tls-cert/--tls-key:", "not a matching certificate"],
        ),
        (
            ["--scheduler", "tls://127.0.0.1:1", "--tls-ca-file", "{cert}x", "--tls-cert", "{cert}"],
            ["--tls-ca-file:", "does not exist"],
        ),
    ],
)
def test_wrong_tls_flags_are_input_errors(tmp_path, flags, needles):
    tls = make_tls_files(tmp_path / "certs")
    job = matmul_job(tmp_path, 8, 8, 8, {"m": 4})
    args = [f.format(ca=tls.ca, cert=tls.cert, key=tls.key) for f in flags]
    res = invoke("submit", job, *args)
    assert res.code == 2, res.output
    assert res.stderr.startswith("mgpu: error: "), res.stderr
    for needle in needles:
        assert needle in res.stderr
    assert "Traceback" not in res.output


# -- listening addresses -------------------------------------------------------------------------


def _listening(proc: psutil.Process) -> set[str]:
    return {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_a_cluster_mgpu_starts_listens_on_localhost_only():
    from mgpu.cluster import open_cluster, resolve_cluster
    from mgpu.spec import ClusterSpec

    me = psutil.Process()
    before = {c.laddr for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    spec = ClusterSpec(backend="cpu", devices=2)  # the default dashboard, 127.0.0.1:8787
    with open_cluster(resolve_cluster(spec)) as info:
        assert info.client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert all(addr.startswith("tcp://127.0.0.1:") for addr in info.devices)
        assert info.dashboard_link and info.dashboard_link.startswith("http://127.0.0.1:")
        mine = {c.laddr for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN} - before
        assert mine, "the scheduler and dashboard should listen in this process"
        assert {a.ip for a in mine} == {"127.0.0.1"}
        workers = [psutil.Process(pid) for pid in info.client.run(os.getpid).values()]
        assert len(workers) == 2 and set().union(*(_listening(p) for p in workers)) == {"127.0.0.1"}


# -- what a job file can load --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["os.system", "os:system", "mgpu.workloads.matmul:Matmul", "./evil.py"])
def test_a_workload_is_a_registered_name_never_a_path(tmp_path, name):
    job = write_job(tmp_path / "job.yaml", {"workload": name, "params": {}})
    res = invoke("submit", job)
    assert res.code == 2, res.output
    assert res.stderr.startswith(f"mgpu: error: workload: unknown workload {name!r}; one of: ")
    assert "dot, mandelbrot, matmul" in res.stderr


def test_yaml_python_tags_are_not_executed(tmp_path):
    marker = tmp_path / "PWNED"
    job = tmp_path / "job.yaml"
    job.write_text(f"workload: !!python/object/apply:os.system ['touch {marker}']\nparams: {{n: 8}}\n")
    res = invoke("submit", job)
    assert res.code == 2, res.output
    assert "is not valid YAML" in res.stderr and "Traceback" not in res.output
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == ["job.yaml"]
