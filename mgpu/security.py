"""TLS for joining a running cluster, through Dask's own security settings.

mgpu adds nothing of its own: ``--tls-ca-file``, ``--tls-cert`` and ``--tls-key`` become a
``distributed.security.Security`` for the client, as the same flags of ``dask scheduler``
and ``dask worker`` do for them; without the flags, Dask's config
(``distributed.comm.tls.*``) applies as it does to any Dask client.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import dask.config

from .errors import JobInputError

__all__ = ["check_tls", "client_security"]


def client_security(ca_file: str | None, cert: str | None, key: str | None) -> Any:
    """The client's ``Security`` from the ``--tls-*`` flags, or None when none is given.

    Raises
    ------
    JobInputError
        If the flags are incomplete, a file is missing, or a file is not a usable PEM.
    """
    if not (ca_file or cert or key):
        return None
    if not (ca_file and cert):
        missing = " and ".join(f for f, v in (("--tls-ca-file", ca_file), ("--tls-cert", cert)) if not v)
        raise JobInputError(
            f"{missing}: TLS needs the CA file and this client's certificate "
            "(--tls-ca-file, --tls-cert, and --tls-key unless the key is in the certificate file)"
        )
    for flag, path in (("--tls-ca-file", ca_file), ("--tls-cert", cert), ("--tls-key", key)):
        if path and not Path(path).is_file():
            raise JobInputError(f"{flag}: file {path!r} does not exist")
    # Load the files now, so that a wrong one is named here rather than as a failed connection.
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (ssl.SSLError, ValueError) as e:
        raise JobInputError(f"--tls-ca-file: {ca_file!r} holds no usable CA certificate ({e})") from None
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as e:
        raise JobInputError(
            f"--tls-cert/--tls-key: {cert!r} and {key!r} are not a matching certificate and private key in PEM ({e})"
        ) from None
    from distributed.security import Security

    return Security(tls_ca_file=ca_file, tls_client_cert=cert, tls_client_key=key, require_encryption=True)


def check_tls(address: str | None, security: Any) -> None:
    """A TLS scheduler needs TLS settings, and TLS settings need a TLS scheduler to join.

    ``address`` is the scheduler's address (None: mgpu starts its own cluster).

    Raises
    ------
    JobInputError
        Naming the flag or key to change.
    """
    tls_address = bool(address) and address.startswith("tls://")  # type: ignore[union-attr]
    if security is not None and address is None:
        raise JobInputError(
            "--tls-ca-file/--tls-cert/--tls-key: TLS is for joining a running cluster "
            "(--scheduler tls://HOST:PORT); a cluster mgpu starts listens on 127.0.0.1 only"
        )
    if security is not None and not tls_address:
        raise JobInputError(
            f"--tls-ca-file/--tls-cert/--tls-key: the scheduler at {address} does not use TLS; "
            "give its tls://HOST:PORT address, or leave the TLS flags out"
        )
    if tls_address and security is None and not dask.config.get("distributed.comm.tls.ca-file", default=None):
        raise JobInputError(
            f"cluster.scheduler: {address} uses TLS; give --tls-ca-file, --tls-cert and --tls-key "
            "(or set distributed.comm.tls.ca-file and distributed.comm.tls.client.cert in Dask's config)"
        )
