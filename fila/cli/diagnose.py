"""Why a broker could not be reached, found by retracing gRPC's steps: resolve the
name, open a TCP connection, then (with TLS) shake hands and verify certificates.

gRPC's error text names the same causes, but its wording changes between releases
and is written for gRPC developers. Each step here is one sentence with one fix,
and runs only after gRPC has already failed, so it never slows a working command.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

import grpc

from fila_sdk import FilaError

if TYPE_CHECKING:
    from fila.cli.connection import Endpoint
    from fila.cli.context import Options

PROBE_TIMEOUT_S: Final = 2.0
# What an HTTP/2 client sends first; a broker checking client certificates after a
# TLS 1.3 handshake answers it with the refusal.
_H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_ADDR_HINT: Final = "--addr / FILA_ADDR"


def unreachable(opts: Options, target: Endpoint | None, err: FilaError, waited_s: float) -> str:
    """One sentence naming the failed step and its fix."""
    if target is None:  # a gRPC target URI: nothing to retrace
        return f"cannot reach a broker at {opts.addr}: {err.message}"
    host, port, where = target.host, target.port, str(target)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f'cannot resolve host "{host}" ({exc.strerror}): check the host in {_ADDR_HINT}'
    try:
        probe = socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S)
    except ConnectionRefusedError:
        return (
            f"connection refused by {where}: no broker is listening there; start one "
            f"(fila-server) or point {_ADDR_HINT} at the broker's host:port"
        )
    except TimeoutError:
        return (
            f"no answer from {where} within {PROBE_TIMEOUT_S:g}s: check the host and port "
            f"in {_ADDR_HINT} and any firewall between"
        )
    except OSError as exc:
        return f"cannot connect to {where}: {exc.strerror or exc}"
    probe.close()
    if opts.tls or opts.ca_cert is not None or opts.client_cert is not None:
        return _tls_failure(opts, target) or f"TLS connection to {where} failed: {err.message}"
    if _speaks_tls(target):
        return (
            f"{where} serves TLS but fila connected in plaintext: add --tls (and "
            "--ca-cert PATH when a private CA signed the broker's certificate)"
        )
    if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"the broker at {where} accepted a connection but did not answer within {waited_s:g}s"
        )
    return f"cannot reach a broker at {where}: {err.message}"


def _tls_failure(opts: Options, target: Endpoint) -> str | None:
    where = str(target)
    if not _speaks_tls(target):
        return (
            f"TLS handshake with {where} failed: the broker there is not serving TLS "
            "(it answered in plaintext); drop --tls and the certificate options"
        )
    try:
        context = _verifying_context(opts)
    except (OSError, ssl.SSLError) as exc:
        return f"the certificate files given cannot be used: {exc}"
    try:
        with _tls(target, context) as conn:
            conn.sendall(_H2_PREFACE)
            answered = conn.recv(1)
    except ssl.SSLCertVerificationError as exc:
        return (
            f"TLS handshake with {where} failed: the broker's certificate is not trusted "
            f"({exc.verify_message}); pass the CA that signed it with --ca-cert PATH"
        )
    except (ssl.SSLError, ConnectionResetError):
        answered = b""  # refused during or right after the handshake
    except OSError:
        return None
    if answered:
        return None
    # The handshake passed our checks, yet the broker hung up at once: it checks client
    # certificates (mTLS) and refused ours, or the lack of one.
    if opts.client_cert is None:
        return (
            f"TLS handshake with {where} failed: the broker requires a client "
            "certificate (mTLS); pass --client-cert PATH and --client-key PATH"
        )
    return (
        f"TLS handshake with {where} failed: the broker refused the client certificate; "
        "use one signed by a CA the broker trusts"
    )


def _speaks_tls(target: Endpoint) -> bool:
    """Whether the server completes a TLS handshake at all (nothing verified)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with _tls(target, context):
            return True
    except (OSError, ssl.SSLError):
        return False


def _verifying_context(opts: Options) -> ssl.SSLContext:
    """What gRPC checks: the broker's certificate and name, with our client certificate."""
    context = ssl.create_default_context(cafile=opts.ca_cert)
    context.set_alpn_protocols(["h2"])
    if opts.client_cert is not None and opts.client_key is not None:
        context.load_cert_chain(opts.client_cert, opts.client_key)
    return context


@contextmanager
def _tls(target: Endpoint, context: ssl.SSLContext) -> Iterator[ssl.SSLSocket]:
    with (
        socket.create_connection((target.host, target.port), timeout=PROBE_TIMEOUT_S) as sock,
        context.wrap_socket(sock, server_hostname=target.host) as conn,
    ):
        yield conn
