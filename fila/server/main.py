"""`fila-server`: load config, recover state, serve gRPC until SIGTERM, SIGINT or SIGHUP.

Shutdown order matters for durability: stop taking new work, end consume
streams (returning unsent deliveries to their queues), let in-flight unary
calls finish within the grace period, then commit what is pending and close
storage. In cluster mode (`[cluster]`, SPEC 9) the node joins the cluster before it
listens and leaves it first when it stops (see `fila.cluster.node`).

Every way startup can fail ends with one line on stderr naming the cause and the
way out, and a documented exit code (see `ExitCode`); no traceback.

Signals (docs/operations.md, "Exit codes and signals"). SIGTERM, SIGINT and SIGHUP
(a closed terminal; some supervisors) stop the broker gracefully once it serves.
Before that, while storage opens and recovery runs, one of them ends the process at
once with one line and exit code 0 (`_abandon_startup`): nothing was served, and
nothing the interrupted start did needs undoing, since the store recovers from any
point as it does from a crash, and recovery writes its repairs in one batch at its
end. Raising instead (Python's KeyboardInterrupt) surfaced wherever recovery was, and
unwinding through asyncio and gRPC printed a 28-line traceback. SIGUSR1 and SIGUSR2,
whose default action would kill the broker with no drain and no log line, are
ignored with a warning. SIGQUIT keeps its default (a core dump is what it asks for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

# Before grpc: gRPC reads its experiments once, on first import (see the module).
from fila.server.grpc_runtime import GRPC_EXPERIMENTS

# isort: split
import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fila import __version__
from fila.config import Config, ConfigError, default_config_text, load_config
from fila.core.broker import Broker, BrokerSettings
from fila.core.clock import SteadyClock
from fila.core.errors import BrokerError
from fila.core.quarantine import describe, sweep
from fila.core.recovery import recover
from fila.server import admin, service
from fila.server.auth import auth_interceptors, load_keyring
from fila.server.limits import connection_cap, raise_open_files_limit, streams_per_connection
from fila.server.memory import HeapTrimmer
from fila.server.readers import StreamReaders
from fila.server.startup_heap import freeze_startup_heap
from fila.server.tls import CertificateFiles, TlsFileError
from fila.storage.backend import CorruptionError, DataDirInUse, RocksStorage, StorageError
from fila.storage.committer import Committer
from fila.storage.layout import upgrade_layout
from fila.storage.salvage import salvage
from fila.telemetry.logs import configure_logging

if TYPE_CHECKING:
    from fila.cluster.node import ClusterNode
    from fila.telemetry.exporters import Telemetry

log = logging.getLogger("fila.server")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ExitCode(IntEnum):
    OK = 0
    STARTUP_FAILED = 1  # cannot listen, data directory unusable or in use, TLS files bad
    BAD_CONFIG = 2  # the configuration (file, environment, arguments) is invalid, or
    # names a cluster node id, address or data directory that another node holds
    STORAGE_FAILED = 3  # a write or sync failed while serving; the broker stopped
    DATA_DAMAGED = 4  # stored data failed its checksums; see `fila-server --repair`


# Stop the broker (see the module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# No meaning for fila-server: ignored, with a warning, rather than fatal.
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _abandon_startup(signum: int, frame: object) -> None:
    """A stop signal before the broker serves: one line, exit 0, nothing more run.

    `os._exit`, not an exception: no code of the interrupted start (a recovery
    half-way through its scan, its writes still pending) runs after this, and nothing
    is written; what is on disk is what was there, which the next start recovers."""
    name = signal.Signals(signum).name
    os.write(
        sys.stderr.fileno(),
        f"fila-server: stopped by {name} while starting, before serving; stored data is "
        "as it was\n".encode(),
    )
    os._exit(ExitCode.OK)


def _ignore_signal(signum: int, frame: object = None) -> None:
    log.warning(
        "ignored %s: it has no meaning for fila-server (SIGTERM, SIGINT or SIGHUP stop it)",
        signal.Signals(signum).name,
    )


def _install_startup_signals() -> None:
    """Until `serve` hands the signals to its event loop (see the module docstring)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _abandon_startup)
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, _ignore_signal)


class StartupError(Exception):
    """A reason the broker cannot start, worded for the operator."""

    def __init__(self, message: str, code: ExitCode = ExitCode.STARTUP_FAILED) -> None:
        super().__init__(message)
        self.code = code


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
        # gRPC 1.85's server does not act on its keepalive timeout (a peer that left
        # the PING at 30 s unanswered was still connected at 55 s); what closes such a
        # connection is gRPC's ping timeout (60 s by default).
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


def open_storage(data_dir: Path, direct_io: bool) -> RocksStorage:
    """Opens the database and brings an older key layout up to date before anything reads it."""
    try:
        storage = RocksStorage(data_dir, direct_io=direct_io)
    except CorruptionError as exc:
        raise StartupError(str(exc), ExitCode.DATA_DAMAGED) from None
    except StorageError as exc:
        raise StartupError(str(exc)) from None
    try:
        moved = upgrade_layout(storage)
    except StorageError as exc:
        storage.close()
        damaged = isinstance(exc, CorruptionError)
        raise StartupError(
            f"upgrading the key layout of {data_dir}: {exc}",
            ExitCode.DATA_DAMAGED if damaged else ExitCode.STARTUP_FAILED,
        ) from None
    if moved:
        log.info("key layout upgraded", extra={"records_moved": moved})
    return storage


async def serve(config: Config) -> ExitCode:
    open_files = raise_open_files_limit()
    max_connections = connection_cap(config.server.max_connections, open_files)
    try:
        credentials = CertificateFiles(config.tls).credentials() if config.tls.cert_file else None
    except TlsFileError as exc:
        raise StartupError(str(exc)) from None
    data_dir = Path(config.storage.data_dir)
    storage = open_storage(data_dir, config.storage.direct_io)
    stop = asyncio.Event()
    failure: list[StorageError] = []

    def on_storage_failure(exc: StorageError) -> None:
        if not failure:
            failure.append(exc)
        stop.set()

    committer = Committer(
        storage,
        config.storage.persist_mode,
        on_storage_failure,
        fsync_priority_boost=config.storage.fsync_priority_boost,
    )
    broker = Broker(
        storage,
        committer,
        BrokerSettings.from_config(config),
        SteadyClock(),
        on_storage_failure=on_storage_failure,
    )
    cluster: ClusterNode | None = None
    try:
        recover(broker)
        if config.cluster.enabled:
            # Imported here: a single-node broker never loads the etcd client and the
            # cluster modules, a quarter of its startup (about 70 ms of 0.3 s).
            from fila.cluster.node import ClusterNode

            cluster = ClusterNode(config, broker, storage, committer)
            keyring = cluster.keyring
        else:
            keyring = load_keyring(storage, committer, config.auth)
    except CorruptionError as exc:
        committer.close()
        storage.close()
        raise StartupError(
            f"data in {data_dir} is damaged: {exc}. The broker refuses to start rather than "
            "serve without acknowledged messages; see 'Damaged data' in docs/operations.md "
            "(fila-server --repair)",
            ExitCode.DATA_DAMAGED,
        ) from None
    # From here startup awaits (the cluster join): the event loop takes the signals, and
    # a stop asked for now is a graceful one, carried out as soon as the broker serves.
    loop = asyncio.get_running_loop()
    stopped_by: list[str] = []

    def stop_requested(sig: signal.Signals) -> None:
        stopped_by.append(sig.name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop_requested, sig)
    for sig in IGNORED_SIGNALS:
        loop.add_signal_handler(sig, _ignore_signal, sig)
    if cluster is not None:
        from fila.cluster.errors import Misconfigured  # loaded with ClusterNode already

        try:
            await cluster.start()
        except BrokerError as exc:
            await cluster.close()
            committer.close()
            storage.close()
            # A node id or an address another live node holds, or a data directory of
            # another node id, is the configuration's fault, not this start's: exit 2,
            # which systemd does not retry.
            bad_config = isinstance(exc, Misconfigured)
            code = ExitCode.BAD_CONFIG if bad_config else ExitCode.STARTUP_FAILED
            raise StartupError(f"cannot join the cluster: {exc}", code) from None

    try:
        telemetry = start_telemetry(config, broker, committer)
    except StartupError:
        if cluster is not None:
            await cluster.close()
        committer.close()
        storage.close()
        raise

    # In cluster mode the edge's splitter reads each StreamEnqueue, not the service.
    stream_readers = StreamReaders()
    # tracing first, so refused calls are traced too
    interceptors = list(telemetry.interceptors) if telemetry is not None else []
    interceptors += auth_interceptors(keyring, cluster.find_key if cluster else None)
    if cluster is not None:
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
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service.SERVICE_NAME, admin.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
    )
    addr = config.server.listen_addr
    try:
        if credentials is None:
            server.add_insecure_port(addr)
        else:
            server.add_secure_port(addr, credentials)
    except RuntimeError:
        if telemetry is not None:
            telemetry.shutdown()
        committer.close()
        storage.close()
        raise StartupError(
            f"cannot listen on {addr}: the address is in use (another broker?) or not "
            "valid here; set server.listen_addr or FILA_LISTEN_ADDR"
        ) from None
    frozen = freeze_startup_heap()
    log.debug("startup heap frozen", extra={"objects": frozen})
    await server.start()
    trimmer = HeapTrimmer()
    trimmer.start()
    cluster_task = None
    if cluster is not None:
        cluster_task = asyncio.create_task(cluster.run(), name="fila-cluster")
        cluster_task.add_done_callback(lambda task: _cluster_ended(task, stop))
    for name in ("", service.SERVICE_NAME, admin.SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "listening",
        extra={
            "addr": addr,
            "data_dir": str(data_dir),
            "persist_mode": config.storage.persist_mode,
            "direct_io": storage.direct_io,
            "paced_deletion": storage.paced_deletion,
            "grpc_experiments": GRPC_EXPERIMENTS,
            "tls": credentials is not None,
            "auth": bool(config.auth.bootstrap_apikey),
            "max_connections": max_connections,
            "version": __version__,
        },
    )
    await stop.wait()

    log.info("shutting down", extra={"signal": stopped_by[0] if stopped_by else None})
    await health_servicer.enter_graceful_shutdown()
    if cluster is not None:
        await cluster.leave()
    if not failure:
        broker.close()
    stream_readers.interrupt()
    await server.stop(config.server.shutdown_grace_ms / 1000)
    trimmer.stop()
    if telemetry is not None:
        telemetry.shutdown()
    if cluster is not None and cluster_task is not None:
        cluster_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cluster_task
        await cluster.close()
    if not failure:
        committer.flush_now()
    committer.close()
    try:
        storage.close()
    except StorageError as exc:  # the failure that stopped us may stop the close too
        log.error("closing storage failed", extra={"error": str(exc)})
    log.info(
        "stopped",
        extra={
            "batches_written": committer.batches_written,
            "ops_written": committer.ops_written,
            "fsyncs": committer.syncs,
        },
    )
    if failure:
        log.critical("stopped because storage failed", extra={"error": str(failure[0])})
        return ExitCode.STORAGE_FAILED
    return ExitCode.OK


def start_telemetry(config: Config, broker: Broker, committer: Committer) -> Telemetry | None:
    """The exporters `[telemetry]` asks for; with none, None, and OpenTelemetry is not
    even imported."""
    section = config.telemetry
    if not (section.otlp_endpoint or section.prometheus_listen):
        return None
    from fila.telemetry.exporters import Telemetry, TelemetryStartError

    try:
        telemetry = Telemetry.start(section, broker, committer, config.server.max_queues)
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


def _fail(message: str, code: ExitCode) -> int:
    print(f"fila-server: {message}", file=sys.stderr)
    return int(code)


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
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration (file and environment) and exit",
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="rebuild a damaged data directory from what is still readable, set aside "
        "records that do not decode, list what is set aside, then exit "
        "(see 'Damaged data' in docs/operations.md)",
    )
    parser.add_argument(
        "--drop-quarantined",
        action="store_true",
        help="with --repair: delete the records set aside because they do not decode",
    )
    parser.add_argument("--version", action="version", version=f"fila-server {__version__}")
    args = parser.parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(default_config_text())
        return ExitCode.OK
    try:
        config, source = load_config(args.config, os.environ)
        level = _log_level(config, os.environ)
    except ConfigError as exc:
        return _fail(str(exc), ExitCode.BAD_CONFIG)
    if args.check_config:
        print(f"fila-server: configuration OK ({source or 'built-in defaults'})")
        return ExitCode.OK
    configure_logging(level, config.telemetry.log_format)
    if args.drop_quarantined and not args.repair:
        return _fail("--drop-quarantined goes with --repair", ExitCode.BAD_CONFIG)
    if args.repair:
        return _repair(Path(config.storage.data_dir), drop_quarantined=args.drop_quarantined)
    _install_startup_signals()
    log.info("config loaded", extra={"source": str(source or "built-in defaults")})
    try:
        return asyncio.run(serve(config))
    except StartupError as exc:
        return _fail(str(exc), exc.code)
    finally:
        # The loop gave the signals their default actions back when it closed: the
        # broker has stopped (or never started); a late one changes nothing now.
        for sig in (*STOP_SIGNALS, *IGNORED_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)


def _repair(data_dir: Path, *, drop_quarantined: bool) -> int:
    """Salvages a damaged data directory (see `fila.storage.salvage`), sets aside the
    records that do not decode (`fila.core.quarantine.sweep`), and reports both."""
    if not (data_dir / "db").exists():
        return _fail(f"{data_dir} holds no database to repair", ExitCode.STARTUP_FAILED)
    try:
        report = salvage(data_dir)
    except DataDirInUse as exc:
        return _fail(str(exc), ExitCode.STARTUP_FAILED)
    except Exception as exc:  # rocksdict raises plain Exception; report it as it is
        return _fail(f"repair of {data_dir} failed: {exc}", ExitCode.DATA_DAMAGED)
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(report.by_kind.items()))
    skipped_bytes = sum(piece.bytes for piece in report.skipped_wal)
    print(
        f"fila-server: repaired {data_dir}: kept {report.copied} records ({kinds or 'none'}); "
        f"{len(report.damaged_regions)} damaged region(s) skipped"
        + (f", {skipped_bytes} unreadable WAL bytes skipped" if report.skipped_wal else "")
        + (f", {report.replayed_batches} WAL batches replayed" if report.replayed_batches else "")
        + (", database rebuilt by RocksDB first" if report.rebuilt_by_rocksdb else "")
        + (f", {len(report.lost_files)} unreadable file(s) left out" if report.lost_files else "")
        + f"; the damaged original is kept at {report.kept_at}. Start the broker normally; "
        "messages of a queue whose record was lost come back when that queue is "
        "created again and the broker restarted."
    )
    for name, size in report.lost_files:
        print(
            f"fila-server: RocksDB's repair could not read {name} ({size} bytes) and left it "
            f"out (its original is in {report.kept_at}): its records are lost, and a message "
            "whose ack was among them is delivered again"
        )
    for start, end in report.damaged_regions:
        print(f"fila-server: skipped unreadable keys after {start or '(start)'} up to {end}")
    for piece in report.skipped_wal:
        consequence = (
            "the writes in them are lost, and a message whose ack was among them is delivered again"
            if piece.lost
            else "every write in them was already in the tables: nothing is lost"
        )
        print(
            f"fila-server: skipped {piece.bytes} unreadable bytes of the write-ahead log "
            f"{piece.file} at offset {piece.offset} ({piece.reason}): {consequence}"
        )
    return _sweep(data_dir, drop_quarantined=drop_quarantined)


def _sweep(data_dir: Path, *, drop_quarantined: bool) -> int:
    try:
        storage = open_storage(data_dir, direct_io=False)
    except StartupError as exc:
        return _fail(str(exc), exc.code)
    try:
        swept = sweep(storage, drop=drop_quarantined)
    finally:
        storage.close()
    for key, reason in swept.set_aside:
        print(f"fila-server: set aside {describe(key)}: {reason}")
    if swept.dropped:
        print(f"fila-server: deleted the {swept.dropped} record(s) set aside (--drop-quarantined)")
    elif swept.held:
        print(
            f"fila-server: {swept.held} record(s) that do not decode are set aside, not served; "
            "--repair --drop-quarantined deletes them"
        )
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
