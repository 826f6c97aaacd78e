"""The listener's TLS credentials, read again whenever their files change.

Certificates are rotated every few weeks or months (cert-manager, ACME clients, an
internal CA's renewal job). A broker that read them once would have to be restarted
for each rotation, dropping every consumer's stream, or would serve an expired
certificate. gRPC asks `CertificateFiles.fetch` for a new configuration at every new
TLS handshake; that costs a `stat()` of each file, and a read and a check only after
one of them changed. Connections already open keep their session; new ones get the
new certificate.

A rotation replaces the certificate and the key as two files, so a handshake can fall
between the two and see a new certificate with the old key. A set of files that does
not check out is not taken: the previous one keeps serving, a warning names the
reason (once per change, not per handshake), and the files are read again at the next
handshake, by which time the second file has normally arrived.

At start, a file that cannot be read or does not check out is a `TlsFileError`, which
the broker reports and exits on. Whether a client certificate is required (`ca_file`
set or not) is fixed at start; the CA bundle's contents rotate like the rest.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc

from fila.config import TlsSection

log = logging.getLogger("fila.server")

# (inode, size, mtime) of each file; None where it cannot be stat()ed.
_Stamp = tuple[tuple[int, int, int] | None, ...]


class TlsFileError(Exception):
    """A TLS file that cannot be read or is not what its setting says, worded for the
    operator."""


@dataclass(frozen=True)
class _Pem:
    cert: bytes
    key: bytes
    ca: bytes | None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert)], root_certificates=self.ca
        )


class CertificateFiles:
    """Owns what the listener serves: the last set of files that checked out."""

    def __init__(self, tls: TlsSection) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.ca_file) if p]
        self._stamp = self._stat()
        self._pem = self._load()
        self._refused: _Stamp | None = None
        # gRPC may hand two handshakes to two of its threads at once.
        self._lock = threading.Lock()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._pem.configuration(),
            # The stubs say the callback always returns a configuration; gRPC's own
            # documentation says None means "no change", which is what `fetch` returns.
            cast(Callable[[], grpc.ServerCertificateConfiguration], self.fetch),
            require_client_authentication=self._pem.ca is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC at each new handshake, on one of its threads: a new
        configuration if the files changed and check out, else None (keep serving the
        current one). Never raises: gRPC would fail the handshake."""
        try:
            with self._lock:
                return self._fetch_locked()
        except Exception:  # a failed handshake would be worse than a stale certificate
            log.exception("reading the TLS files again failed; the previous certificate is served")
            return None

    def _fetch_locked(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stat()
        if stamp == self._stamp or stamp == self._refused:
            return None
        try:
            pem = self._load()
        except TlsFileError as exc:
            self._refused = stamp
            log.warning(
                "the TLS files changed but do not check out; the previous certificate "
                "is still served, and the files are read again at the next change",
                extra={"reason": str(exc)},
            )
            return None
        self._stamp, self._pem, self._refused = stamp, pem, None
        log.info("TLS certificate reloaded", extra={"cert_file": self._tls.cert_file})
        return pem.configuration()

    def _stat(self) -> _Stamp:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self._paths:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(stamps)

    def _load(self) -> _Pem:
        """Reads and checks the files. `ssl` checks only files, so the bytes are read
        before and after the check and must agree: a file replaced meanwhile is
        reported as changing, and read again later."""
        tls = self._tls
        before = self._read()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsFileError(
                f"tls.cert_file {tls.cert_file} and tls.key_file {tls.key_file} are not a valid "
                f"PEM certificate and its private key ({_reason(exc)})"
            ) from None
        if tls.ca_file:
            try:
                context.load_verify_locations(tls.ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise TlsFileError(
                    f"tls.ca_file {tls.ca_file} is not a PEM CA bundle ({_reason(exc)})"
                ) from None
        if self._read() != before:
            raise TlsFileError("the TLS files changed while they were being read")
        return before

    def _read(self) -> _Pem:
        tls = self._tls
        cert, key = _read(tls.cert_file, "cert_file"), _read(tls.key_file, "key_file")
        return _Pem(cert, key, _read(tls.ca_file, "ca_file") if tls.ca_file else None)


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read tls.{setting} {path}: {exc.strerror or exc}") from None


def _reason(exc: OSError) -> str:
    reason = exc.reason if isinstance(exc, ssl.SSLError) else None
    return str(reason or exc.strerror or exc)
