"""Certificates rotate without a restart (`fila.server.tls`): new connections get the
files' new contents, open ones keep their session, and a half-rotated pair is not
taken."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.cli import make_certs

from fila.testing.server import ServerProcess


def _handshake(addr: str, ca: Path, client: tuple[Path, Path] | None = None) -> str:
    """ "ok", or the status of a health check on a connection of its own (a new
    handshake: a channel of its own never reuses another's connection)."""
    cert, key = (client[0].read_bytes(), client[1].read_bytes()) if client else (None, None)
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), private_key=key, certificate_chain=cert)
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(addr, creds, options=options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return "ok"


def _install(source: Path, target: Path) -> None:
    """As a renewal job does: write the new file beside the old, rename it over."""
    partial = target.with_suffix(".new")
    shutil.copyfile(source, partial)
    partial.replace(target)


def _mtls(served: Path, client: dict[str, Path]) -> tuple[str, grpc.ChannelCredentials]:
    """A [tls] section requiring client certificates, naming `served`'s server.pem,
    server.key and ca.pem; and credentials that trust `client`'s CA and present its
    client certificate."""
    config = (
        f'[tls]\ncert_file = "{served / "server.pem"}"\nkey_file = "{served / "server.key"}"\n'
        f'ca_file = "{served / "ca.pem"}"\n'
    )
    creds = grpc.ssl_channel_credentials(
        client["ca.pem"].read_bytes(),
        private_key=client["client.key"].read_bytes(),
        certificate_chain=client["client.pem"].read_bytes(),
    )
    return config, creds


@pytest.fixture
def certs(tmp_path: Path) -> tuple[dict[str, Path], dict[str, Path], Path]:
    """Two unrelated CAs' files (old, new), and a directory the broker's [tls] names."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    live = tmp_path / "live"
    live.mkdir()
    return make_certs(tmp_path / "old"), make_certs(tmp_path / "new"), live


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path, certs: tuple[dict[str, Path], dict[str, Path], Path]
) -> None:
    old, new, live = certs
    _install(old["server.pem"], live / "server.pem")
    _install(old["server.key"], live / "server.key")
    config = f'[tls]\ncert_file = "{live / "server.pem"}"\nkey_file = "{live / "server.key"}"\n'
    creds = grpc.ssl_channel_credentials(old["ca.pem"].read_bytes())
    with ServerProcess(tmp_path / "data", config_toml=config, channel_credentials=creds) as srv:
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.secure_channel(srv.addr, creds, options=options) as open_channel:
            check = health_pb2_grpc.HealthStub(open_channel).Check
            check(health_pb2.HealthCheckRequest(), timeout=5)
            assert _handshake(srv.addr, old["ca.pem"]) == "ok"
            assert _handshake(srv.addr, new["ca.pem"]) == "UNAVAILABLE"

            # Half-way through the rotation: the new certificate with the old key.
            _install(new["server.pem"], live / "server.pem")
            assert _handshake(srv.addr, old["ca.pem"]) == "ok", "the old pair still served"
            assert _handshake(srv.addr, new["ca.pem"]) == "UNAVAILABLE"
            assert "the TLS files changed but do not check out" in srv.log_text()

            _install(new["server.key"], live / "server.key")
            assert _handshake(srv.addr, new["ca.pem"]) == "ok"
            assert _handshake(srv.addr, old["ca.pem"]) == "UNAVAILABLE"
            assert "TLS certificate reloaded" in srv.log_text()

            # The connection opened before the rotation carries on.
            # (were it closed, its reconnection would trust only the old CA, and fail)
            check(health_pb2.HealthCheckRequest(), timeout=5)
        log = srv.log_text()
    assert log.count("the TLS files changed but do not check out") == 1, "once per change"


def test_a_rotated_client_ca_decides_which_client_certificates_are_taken(
    tmp_path: Path, certs: tuple[dict[str, Path], dict[str, Path], Path]
) -> None:
    old, new, live = certs
    for name in ("server.pem", "server.key", "ca.pem"):
        _install(old[name], live / name)
    config, creds = _mtls(live, old)
    with ServerProcess(tmp_path / "data", config_toml=config, channel_credentials=creds) as srv:
        old_client = (old["client.pem"], old["client.key"])
        new_client = (new["client.pem"], new["client.key"])
        assert _handshake(srv.addr, old["ca.pem"], old_client) == "ok"
        assert _handshake(srv.addr, old["ca.pem"], new_client) == "UNAVAILABLE"
        assert _handshake(srv.addr, old["ca.pem"]) == "UNAVAILABLE", "a client cert is required"

        _install(new["ca.pem"], live / "ca.pem")
        assert _handshake(srv.addr, old["ca.pem"], new_client) == "ok"
        assert _handshake(srv.addr, old["ca.pem"], old_client) == "UNAVAILABLE"
        assert _handshake(srv.addr, old["ca.pem"]) == "UNAVAILABLE", "still required"


@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_failed_handshakes_write_no_log_lines_unless_asked(
    tmp_path: Path, certs: tuple[dict[str, Path], dict[str, Path], Path], verbosity: str | None
) -> None:
    old, new, _ = certs
    config, creds = _mtls(old["ca.pem"].parent, old)
    env = {"GRPC_VERBOSITY": verbosity} if verbosity else None
    srv = ServerProcess(tmp_path / "data", config_toml=config, channel_credentials=creds, env=env)
    with srv:
        for _ in range(5):  # a client certificate from a CA the broker does not trust
            assert (
                _handshake(srv.addr, old["ca.pem"], (new["client.pem"], new["client.key"])) != "ok"
            )
        assert _handshake(srv.addr, old["ca.pem"], (old["client.pem"], old["client.key"])) == "ok"
    failures = srv.log_text().count("Handshake failed")
    if verbosity is None:
        assert failures == 0, "gRPC's per-handshake lines are off by default"
    else:
        assert failures >= 5, "the operator's GRPC_VERBOSITY is kept"
