"""`fila-server`: load config, recover state, serve gRPC until SIGTERM/SIGINT.

Shutdown order matters for durability: stop taking new work, end consume
streams (returning unsent deliveries to their queues), let in-flight unary
calls finish within the grace period, then commit what is pending and close
RocksDB.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fila import __version__
from fila.config import Config, ConfigError, default_config_text, load_config
from fila.core.broker import Broker, BrokerSettings
from fila.core.clock import SystemClock
from fila.core.recovery import recover
from fila.server.admin import FilaAdmin
from fila.server.auth import AuthInterceptor, BootstrapKey
from fila.server.service import SERVICE_NAME, FilaService
from fila.storage.store import Committer, StorageError, open_db
from fila.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger("fila.server")


# gRPC refuses larger requests before Fila sees them, with RESOURCE_EXHAUSTED. Keep
# that transport bound far above the message limits, so an oversized message reaches
# the broker's own check and gets INVALID_ARGUMENT (SPEC 3).
MIN_TRANSPORT_LIMIT = 64 * 1024 * 1024


def _server_options(config: Config) -> list[tuple[str, int]]:
    message_limit = config.server.max_message_bytes + config.server.max_header_bytes
    frame_limit = max(MIN_TRANSPORT_LIMIT, 2 * message_limit + 64 * 1024)
    return [
        ("grpc.max_receive_message_length", frame_limit),
        ("grpc.max_send_message_length", frame_limit),
        # Detect consumers that vanished without closing their connection.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _credentials(config: Config) -> grpc.ServerCredentials | None:
    tls = config.tls
    if not tls.cert_file:
        return None
    cert = Path(tls.cert_file).read_bytes()
    key = Path(tls.key_file).read_bytes()
    ca = Path(tls.ca_file).read_bytes() if tls.ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


async def serve(config: Config) -> int:
    data_dir = Path(config.storage.data_dir)
    try:
        db = open_db(data_dir)
    except Exception as exc:  # rocksdict raises plain Exception, e.g. for a held LOCK
        log.critical("cannot open data dir %s: %s", data_dir, exc)
        return 1
    stop = asyncio.Event()
    failure: list[StorageError] = []

    def on_storage_failure(exc: StorageError) -> None:
        failure.append(exc)
        stop.set()

    committer = Committer(db, config.storage.persist_mode, on_storage_failure)
    broker = Broker(db, committer, BrokerSettings.from_config(config), SystemClock())
    recover(broker)

    interceptors = []
    if config.auth.bootstrap_apikey:
        interceptors.append(AuthInterceptor(BootstrapKey(config.auth.bootstrap_apikey)))
    server = grpc.aio.server(options=_server_options(config), interceptors=interceptors)
    server.add_generic_rpc_handlers((FilaService(broker).generic_handler(),))
    admin_pb2_grpc.add_FilaAdminServicer_to_server(FilaAdmin(broker), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            admin_pb2.DESCRIPTOR.services_by_name["FilaAdmin"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    addr = config.server.listen_addr
    credentials = _credentials(config)
    try:
        if credentials is None:
            server.add_insecure_port(addr)
        else:
            server.add_secure_port(addr, credentials)
    except RuntimeError as exc:
        log.critical("cannot listen on %s: %s", addr, exc)
        db.close()
        return 1
    await server.start()
    for name in ("", SERVICE_NAME, "fila.v1.FilaAdmin"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "listening addr=%s data_dir=%s persist_mode=%s tls=%s auth=%s version=%s",
        addr,
        data_dir,
        config.storage.persist_mode,
        credentials is not None,
        bool(config.auth.bootstrap_apikey),
        __version__,
    )
    if config.telemetry.otlp_endpoint or config.telemetry.prometheus_listen:
        log.warning("telemetry export is not available in this release; [telemetry] is ignored")
    await stop.wait()

    log.info("shutting down")
    await health_servicer.enter_graceful_shutdown()
    broker.close()
    await server.stop(config.server.shutdown_grace_ms / 1000)
    if not failure:
        committer.flush_now()
    committer.close()
    db.close()
    log.info(
        "stopped batches_written=%d ops_written=%d fsyncs=%d",
        committer.batches_written,
        committer.ops_written,
        committer.syncs,
    )
    return 3 if failure else 0


def _configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("FILA_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fila-server", description="The Fila message broker.")
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="TOML config file (else FILA_CONFIG, ./fila.toml, /etc/fila/fila.toml)",
    )
    parser.add_argument(
        "--print-default-config",
        action="store_true",
        help="print the built-in configuration and exit",
    )
    parser.add_argument("--version", action="version", version=f"fila-server {__version__}")
    args = parser.parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(default_config_text())
        return 0
    try:
        config, source = load_config(args.config, os.environ)
    except ConfigError as exc:
        print(f"fila-server: {exc}", file=sys.stderr)
        return 2
    _configure_logging()
    log.info("config source=%s", source or "built-in defaults")
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
