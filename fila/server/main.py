"""`fila-server`: load config, recover state, serve gRPC until SIGTERM, SIGINT or SIGHUP.

Shutdown order matters for durability: stop taking new work, end consume
streams (returning unsent deliveries to their queues), let in-flight unary
calls finish within the grace period, then commit what is pending and close
storage. In cluster mode (`[cluster]`, SPEC 9) the node joins the cluster before it
listens and leaves it first when it stops (see `fila.cluster.node`).

`serve` owns every resource through one `AsyncExitStack`: each is closed in one
place, in the reverse order it was opened, whether the start failed half-way or the
broker served and stopped. Every way startup can fail ends with one line on stderr
naming the cause and the way out, and a documented exit code (`fila.server.startup`);
signals are `fila.server.signals`; `--repair` is `fila.server.repair`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# Before grpc: gRPC reads its experiments once, on first import (see the module).
from fila.server.grpc_runtime import GRPC_EXPERIMENTS

# isort: split
import click
import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fila import __version__
from fila.clock import SteadyClock
from fila.config import Config, ConfigError, default_config_text, load_config
from fila.core.broker import Broker, BrokerSettings
from fila.core.errors import BrokerError
from fila.security.keyring import Keyring
from fila.server import admin, service
from fila.server.auth import auth_interceptors, load_keyring
from fila.server.limits import connection_cap, raise_open_files_limit, streams_per_connection
from fila.server.memory import HeapTrimmer
from fila.server.readers import StreamReaders
from fila.server.repair import repair
from fila.server.signals import serving_signals, startup_signals
from fila.server.startup import ExitCode, StartupError, fail, open_storage
from fila.server.startup_heap import freeze_startup_heap
from fila.server.tls import CertificateFiles, TlsFileError
from fila.storage.backend import CorruptionError, RocksStorage, StorageError
from fila.storage.committer import Committer
from fila.telemetry.logs import configure_logging

if TYPE_CHECKING:
    from fila.cluster.node import ClusterNode
    from fila.telemetry.exporters import Telemetry
    from fila.telemetry.metrics import ReplicationState

__all__ = ["ExitCode", "StartupError", "main", "serve", "server_options"]

log = logging.getLogger("fila.server")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def server_options(config: Config, max_connections: int) -> list[tuple[str, int]]:
    """gRPC's channel arguments for the listener; the transport limits are described
    in docs/operations.md ("Connections and their limits")."""
    server = config.server
    keepalive_timeout = server.keepalive_timeout_ms
    return [
        # Requests larger than the broker could accept are refused before being read
        # in full, so an unauthenticated peer cannot make the broker hold more.
        ("grpc.max_receive_message_length", server.max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # Two brokers must never share a port (gRPC sets SO_REUSEPORT by default).
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", server.handshake_timeout_ms),
        ("grpc.max_connection_idle_ms", server.idle_connection_timeout_ms),
        # Every connection is pinged, with calls in flight or not: a consumer that
        # vanished without closing its connection is noticed, and so is a peer that
        # holds a connection slot without answering.
        ("grpc.keepalive_time_ms", server.keepalive_interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC 1.85's server does not act on its keepalive timeout (docs/benchmarks.md,
        # "Measurements behind design choices"); what closes a connection whose peer
        # leaves the PING unanswered is gRPC's ping timeout (60 s by default).
        ("grpc.keepalive_timeout_ms", keepalive_timeout),
        ("grpc.http2.ping_timeout_ms", keepalive_timeout),
        # A peer that sends the HTTP/2 preface and SETTINGS, then nothing, never
        # acknowledges the broker's SETTINGS either: closed after this (default 60 s).
        ("grpc.http2.settings_timeout", keepalive_timeout),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # Rapid reset (CVE-2023-44487): see fila.server.limits.STREAMS_PER_CONNECTION.
        (
            "grpc.max_concurrent_streams",
            streams_per_connection(max_connections, config.cluster.enabled),
        ),
        # gRPC's default, stated because the limit relies on it: streams the peer
        # reset but whose calls are not finished still count against the limit.
        ("grpc.http.overload_protection", 1),
    ]


@dataclass(slots=True)
class _Run:
    """How this run is going: whether it served, and why it stops."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    storage_failure: StorageError | None = None
    served: bool = False

    def storage_failed(self, exc: StorageError) -> None:
        if self.storage_failure is None:
            self.storage_failure = exc
        self.stop.set()


async def serve(config: Config) -> ExitCode:
    max_connections = connection_cap(config.server.max_connections, raise_open_files_limit())
    try:
        credentials = CertificateFiles(config.tls).credentials() if config.tls.cert_file else None
    except TlsFileError as exc:
        raise StartupError(str(exc)) from None
    run = _Run()
    async with contextlib.AsyncExitStack() as resources:
        storage = _open_storage(config, resources)
        committer = _open_committer(config, storage, run, resources)
        broker = Broker(
            storage,
            committer,
            BrokerSettings.from_config(config),
            SteadyClock(),
            on_storage_failure=run.storage_failed,
        )
        cluster, keyring = _recover(config, broker, storage, committer)
        # From here startup awaits (the cluster join): the event loop takes the signals,
        # and a stop asked for now is a graceful one, carried out once the broker serves.
        stopped_by = serving_signals(run.stop)
        if cluster is not None:
            resources.push_async_callback(cluster.close)
            await _join(cluster)
        telemetry = start_telemetry(
            config, broker, committer, cluster.replication if cluster is not None else None
        )
        if telemetry is not None:
            resources.callback(telemetry.shutdown)
        stream_readers = StreamReaders()
        server, health_servicer = _grpc_server(
            config, max_connections, broker, keyring, cluster, telemetry, stream_readers
        )
        _listen(server, config.server.listen_addr, credentials)
        frozen = freeze_startup_heap()
        log.debug("startup heap frozen", extra={"objects": frozen})
        await server.start()
        run.served = True
        trimmer = HeapTrimmer()
        trimmer.start()
        resources.callback(trimmer.stop)
        if cluster is not None:
            cluster_task = asyncio.create_task(cluster.run(), name="fila-cluster")
            cluster_task.add_done_callback(lambda task: _cluster_ended(task, run.stop))
            resources.push_async_callback(_cancelled, cluster_task)
        for name in ("", service.SERVICE_NAME, admin.SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        _log_listening(config, storage, credentials is not None, max_connections)
        await run.stop.wait()

        log.info("shutting down", extra={"signal": stopped_by[0] if stopped_by else None})
        await health_servicer.enter_graceful_shutdown()
        if cluster is not None:
            await cluster.leave()
        if run.storage_failure is None:
            broker.close()
        stream_readers.interrupt()
        await server.stop(config.server.shutdown_grace_ms / 1000)
    log.info(
        "stopped",
        extra={
            "batches_written": committer.batches_written,
            "ops_written": committer.ops_written,
            "fsyncs": committer.syncs,
        },
    )
    if run.storage_failure is not None:
        log.critical("stopped because storage failed", extra={"error": str(run.storage_failure)})
        return ExitCode.STORAGE_FAILED
    return ExitCode.OK


def _open_storage(config: Config, resources: contextlib.AsyncExitStack) -> RocksStorage:
    storage = open_storage(Path(config.storage.data_dir), config.storage.direct_io)

    def close() -> None:
        try:
            storage.close()
        except StorageError as exc:  # the failure that stopped us may stop the close too
            log.error("closing storage failed", extra={"error": str(exc)})

    resources.callback(close)
    return storage


def _open_committer(
    config: Config, storage: RocksStorage, run: _Run, resources: contextlib.AsyncExitStack
) -> Committer:
    committer = Committer(
        storage,
        config.storage.persist_mode,
        run.storage_failed,
        fsync_priority_boost=config.storage.fsync_priority_boost,
        recent_bytes=config.storage.recent_records_bytes,
    )

    def close() -> None:
        # What the broker accepted while it served is committed; a start that failed
        # half-way writes nothing more (recovery writes its repairs in one batch).
        if run.served and run.storage_failure is None:
            committer.flush_now()
        committer.close()

    resources.callback(close)
    return committer


def _recover(
    config: Config, broker: Broker, storage: RocksStorage, committer: Committer
) -> tuple[ClusterNode | None, Keyring]:
    """Rebuilds the broker's state from storage, then the node (cluster mode) and keys."""
    try:
        if not config.cluster.enabled:
            broker.recover()
            return None, load_keyring(storage, committer, config.auth)
        # Imported here: a single-node broker never loads the etcd client and the
        # cluster modules, a quarter of its startup.
        from fila.cluster.layout import placed_name
        from fila.cluster.node import ClusterNode
        from fila.cluster.replication.store import replicas_on_disk

        # A replicated queue's replica is served only once this node leads it.
        replicas = replicas_on_disk(storage)
        broker.recover(held=lambda name: placed_name(name) in replicas)
        cluster = ClusterNode(config, broker, storage, committer)
        return cluster, cluster.keyring
    except CorruptionError as exc:
        raise StartupError(
            f"data in {config.storage.data_dir} is damaged: {exc}. The broker refuses to start "
            "rather than serve without acknowledged messages; see 'Damaged data' in "
            "docs/operations.md (fila-server --repair)",
            ExitCode.DATA_DAMAGED,
        ) from None


async def _join(cluster: ClusterNode) -> None:
    from fila.cluster.errors import Misconfigured  # loaded with ClusterNode already

    try:
        await cluster.start()
    except BrokerError as exc:
        # A node id or an address another live node holds, or a data directory of
        # another node id, is the configuration's fault, not this start's: exit 2,
        # which systemd does not retry.
        bad_config = isinstance(exc, Misconfigured)
        code = ExitCode.BAD_CONFIG if bad_config else ExitCode.STARTUP_FAILED
        raise StartupError(f"cannot join the cluster: {exc}", code) from None


def _grpc_server(
    config: Config,
    max_connections: int,
    broker: Broker,
    keyring: Keyring,
    cluster: ClusterNode | None,
    telemetry: Telemetry | None,
    stream_readers: StreamReaders,
) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """The gRPC server with its interceptors and services, not yet listening."""
    # tracing first, so refused calls are traced too
    interceptors = list(telemetry.interceptors) if telemetry is not None else []
    interceptors += auth_interceptors(keyring, cluster.find_key if cluster else None)
    if cluster is not None:
        # In cluster mode the edge's splitter reads each StreamEnqueue, not the service.
        interceptors += cluster.interceptors(stream_readers)
    server = grpc.aio.server(
        options=server_options(config, max_connections), interceptors=interceptors
    )
    server.add_generic_rpc_handlers(
        (
            service.FilaService(broker, None if cluster else stream_readers).generic_handler(),
            admin.FilaAdmin(broker, keyring).generic_handler(),
        )
    )
    if cluster is not None:
        server.add_generic_rpc_handlers((cluster.replication_handler(),))
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service.SERVICE_NAME, admin.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
    )
    return server, health_servicer


def _listen(server: grpc.aio.Server, addr: str, credentials: grpc.ServerCredentials | None) -> None:
    try:
        if credentials is None:
            server.add_insecure_port(addr)
        else:
            server.add_secure_port(addr, credentials)
    except RuntimeError:
        raise StartupError(
            f"cannot listen on {addr}: the address is in use (another broker?) or not "
            "valid here; set server.listen_addr or FILA_LISTEN_ADDR"
        ) from None


def _log_listening(config: Config, storage: RocksStorage, tls: bool, max_connections: int) -> None:
    log.info(
        "listening",
        extra={
            "addr": config.server.listen_addr,
            "data_dir": config.storage.data_dir,
            "persist_mode": config.storage.persist_mode,
            "direct_io": storage.direct_io,
            "paced_deletion": storage.paced_deletion,
            "grpc_experiments": GRPC_EXPERIMENTS,
            "tls": tls,
            "auth": bool(config.auth.bootstrap_apikey),
            "max_connections": max_connections,
            "version": __version__,
        },
    )


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def start_telemetry(
    config: Config,
    broker: Broker,
    committer: Committer,
    replication: ReplicationState | None = None,
) -> Telemetry | None:
    """The exporters `[telemetry]` asks for; with none, None, and OpenTelemetry is not
    even imported."""
    section = config.telemetry
    if not (section.otlp_endpoint or section.prometheus_listen):
        return None
    from fila.telemetry.exporters import Telemetry, TelemetryStartError

    try:
        telemetry = Telemetry.start(
            section, broker, committer, config.server.max_queues, replication
        )
    except TelemetryStartError as exc:
        raise StartupError(str(exc)) from None
    log.info(
        "telemetry on",
        extra={
            "prometheus_listen": section.prometheus_listen or None,
            "otlp_endpoint": section.otlp_endpoint or None,
            "metrics_interval_ms": section.metrics_interval_ms,
            "service_name": section.service_name,
        },
    )
    return telemetry


def _cluster_ended(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    """The cluster's tasks run until shutdown; one that ends before is a bug: stop (the
    lease is no longer renewed, so the node would stop serving its queues anyway)."""
    if not task.cancelled():
        log.critical("cluster tasks ended unexpectedly, stopping: %r", task.exception())
        stop.set()


def _log_level(config: Config, env: Mapping[str, str]) -> str:
    """`telemetry.log_level`, or FILA_LOG_LEVEL (any case) when set."""
    level = env.get("FILA_LOG_LEVEL", "") or config.telemetry.log_level
    if level.upper() not in LOG_LEVELS:
        raise ConfigError(
            f'FILA_LOG_LEVEL must be one of {", ".join(LOG_LEVELS)}, got "{level[:40]}"'
        )
    return level.upper()


@click.command(
    name="fila-server",
    help="The Fila message broker.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    help="TOML config file (else FILA_CONFIG, ./fila.toml, /etc/fila/fila.toml)",
)
@click.option(
    "--print-default-config", is_flag=True, help="print the built-in configuration and exit"
)
@click.option(
    "--check-config",
    is_flag=True,
    help="validate the configuration (file and environment) and exit",
)
@click.option(
    "--repair",
    "repair_data",
    is_flag=True,
    help="rebuild a damaged data directory from what is still readable, set aside records "
    "that do not decode, list what is set aside, then exit (see 'Damaged data' in "
    "docs/operations.md)",
)
@click.option(
    "--drop-quarantined",
    is_flag=True,
    help="with --repair: delete the records set aside because they do not decode",
)
@click.version_option(__version__, prog_name="fila-server", message="%(prog)s %(version)s")
def cli(
    config_path: str | None,
    print_default_config: bool,
    check_config: bool,
    repair_data: bool,
    drop_quarantined: bool,
) -> None:
    sys.exit(_run(config_path, print_default_config, check_config, repair_data, drop_quarantined))


def _run(
    config_path: str | None,
    print_default_config: bool,
    check_config: bool,
    repair_data: bool,
    drop_quarantined: bool,
) -> int:
    if print_default_config:
        sys.stdout.write(default_config_text())
        return ExitCode.OK
    try:
        config, source = load_config(config_path, os.environ)
        level = _log_level(config, os.environ)
    except ConfigError as exc:
        return fail(str(exc), ExitCode.BAD_CONFIG)
    if check_config:
        print(f"fila-server: configuration OK ({source or 'built-in defaults'})")
        return ExitCode.OK
    configure_logging(level, config.telemetry.log_format)
    if drop_quarantined and not repair_data:
        return fail("--drop-quarantined goes with --repair", ExitCode.BAD_CONFIG)
    if repair_data:
        return repair(Path(config.storage.data_dir), drop_quarantined=drop_quarantined)
    with startup_signals():
        log.info("config loaded", extra={"source": str(source or "built-in defaults")})
        try:
            return asyncio.run(serve(config))
        except StartupError as exc:
            return fail(str(exc), exc.code)


def main(argv: list[str] | None = None) -> int:
    """The `fila-server` entry point; exits with an `ExitCode`."""
    cli.main(args=argv, prog_name="fila-server")
    return ExitCode.OK  # not reached: the command exits


if __name__ == "__main__":
    main()
