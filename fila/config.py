"""Broker configuration: one TOML file plus a few environment overrides.

The schema *is* the dataclasses below. Each section is a frozen, slotted dataclass
whose fields carry their type, default and constraints (`Annotated[int, AtLeast(1)]`,
`Annotated[str, Requires("cert_file")]`, a `Literal` for enumerations). The loader
walks those fields generically, so adding a setting means adding one annotated field
and one line to `default.toml`; there is no per-key parsing code that could drift
from the schema, and every error names the dotted key and the file it came from.

Validation is strict because a typo in a broker's config (`persist_mod = "buffer"`)
that is silently ignored is worse than a refusal to start: unknown sections and keys,
wrong types (including `true` for an integer, since `bool` subclasses `int`) and
out-of-range values all raise `ConfigError`.

Search order (SPEC 4): `--config PATH`, else `$FILA_CONFIG` (both must exist), else
`./fila.toml`, else `/etc/fila/fila.toml`, else built-in defaults. Then the non-empty
environment variables in `ENV_OVERRIDES` replace single keys; they are converted to the
key's type and checked against its constraints like a value from the file (a list of
strings is written comma-separated: `FILA_ETCD_ENDPOINTS=10.0.0.1:2379,10.0.0.2:2379`).

`[cluster]` (SPEC 9) is off while `node_id` is 0, its default; a cluster setting given
without a node id is refused rather than ignored, and a node id without the settings a
node cannot run without (`advertise_addr`, `etcd_endpoints`) is refused too.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from fila.wire import is_port

PersistMode = Literal["sync", "buffer"]


@dataclass(frozen=True, slots=True)
class AtLeast:
    """Constraint marker: a numeric field must be >= `minimum`."""

    minimum: int


class Requires:
    """Constraint marker: a non-empty string field needs these sibling fields set too."""

    __slots__ = ("siblings",)

    def __init__(self, *siblings: str) -> None:
        self.siblings = siblings


Positive = Annotated[int, AtLeast(1)]


class Address:
    """Constraint marker: a non-empty string field must be `host:port` (IPv6 hosts in
    brackets), or `scheme://host:port[/path]` with one of `schemes` when any are given."""

    __slots__ = ("schemes",)

    def __init__(self, *schemes: str) -> None:
        self.schemes = schemes

    def problem(self, value: str) -> str | None:
        """Why `value` is not such an address, or None if it is."""
        rest = value
        if "://" in value:
            scheme, rest = value.split("://", 1)
            if scheme not in self.schemes:
                allowed = " or ".join(f"{s}://" for s in self.schemes) or "none"
                return f"scheme {scheme}:// is not supported (allowed: {allowed})"
            rest = rest.split("/", 1)[0]
        host, sep, port = rest.rpartition(":")
        if not sep or not is_port(port):
            return "expected host:port with a port from 1 to 65535"
        if host.startswith("[") != host.endswith("]") or " " in host:
            return "the host is malformed"
        return None


class ListenAddress:
    """Constraint marker: where the broker listens. `host:port` (IPv6 hosts in brackets;
    port 0 lets the system pick one), or a gRPC Unix socket (`unix:PATH`,
    `unix-abstract:NAME`). Checked with the config rather than left to gRPC, which
    reports only "address in use or not valid" when the broker starts: a typo then
    passes `--check-config` and fails the deployment (exit 1, not 2)."""

    __slots__ = ()

    def problem(self, value: str) -> str | None:
        """Why `value` is not a listen address, or None if it is."""
        for scheme in ("unix:", "unix-abstract:"):
            if value.startswith(scheme):
                return None if value[len(scheme) :] else f"names no socket after {scheme}"
        host, sep, port = value.rpartition(":")
        if not sep or not (port == "0" or is_port(port)):
            return "expected host:port (a port from 0 to 65535) or unix:PATH"
        if host.startswith("[") != host.endswith("]") or " " in host or "/" in host:
            return "the host is malformed"
        return None


@dataclass(frozen=True, slots=True)
class AtMost:
    """Constraint marker: a numeric field must be <= `maximum`."""

    maximum: int


class Secret:
    """Constraint marker: a string field holding a secret. Its value is never echoed in
    an error, and it may not start or end with whitespace: a presented key is compared
    without it, so such a secret could never match (a stray newline from a file, say)."""


MiB = 1024 * 1024
# Room in a request for everything but payload and headers (queue name, framing).
REQUEST_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ServerSection:
    listen_addr: Annotated[str, ListenAddress()] = "127.0.0.1:5555"
    max_message_bytes: Annotated[int, AtLeast(1), AtMost(256 * MiB)] = 4 * MiB
    max_headers: Annotated[int, AtLeast(1), AtMost(100_000)] = 64
    max_header_bytes: Annotated[int, AtLeast(1), AtMost(16 * MiB)] = 64 * 1024
    max_request_bytes: Annotated[int, AtLeast(1), AtMost(1024 * MiB)] = 16 * MiB
    max_batch_messages: Annotated[int, AtLeast(1), AtMost(1_000_000)] = 10_000
    shutdown_grace_ms: Positive = 5000
    max_queue_depth: Annotated[int, AtLeast(0)] = 0
    max_queues: Annotated[int, AtLeast(1), AtMost(1_000_000)] = 10_000
    max_connections: Annotated[int, AtLeast(1), AtMost(1_000_000)] = 1024
    # gRPC takes these four as C ints of milliseconds (2^31 - 1 at most: beyond, the
    # broker failed at startup with an OverflowError); a day is far beyond any use.
    idle_connection_timeout_ms: Annotated[int, AtLeast(1000), AtMost(86_400_000)] = 300_000
    handshake_timeout_ms: Annotated[int, AtLeast(100), AtMost(86_400_000)] = 5_000
    keepalive_interval_ms: Annotated[int, AtLeast(1000), AtMost(86_400_000)] = 30_000
    keepalive_timeout_ms: Annotated[int, AtLeast(100), AtMost(86_400_000)] = 10_000


@dataclass(frozen=True, slots=True)
class StorageSection:
    data_dir: str = "./data"
    persist_mode: PersistMode = "sync"
    direct_io: bool = True
    # Nice levels the WAL fsync thread runs above the rest of the broker (nice values
    # span 40 levels); see fila.storage.thread_priority.
    fsync_priority_boost: Annotated[int, AtLeast(0), AtMost(39)] = 15
    # Message records kept in memory from their write to their delivery, so a delivery
    # need not read them back (fila.storage.recent); 0 keeps none.
    recent_records_bytes: Annotated[int, AtLeast(0)] = 64 * MiB


@dataclass(frozen=True, slots=True)
class SchedulerSection:
    quantum: Positive = 1
    consumer_buffer: Positive = 16
    max_prefetch: Annotated[int, AtLeast(1), AtMost(1_000_000)] = 10_000
    stream_buffer_bytes: Annotated[int, AtLeast(1024)] = 2 * MiB
    total_buffer_bytes: Annotated[int, AtLeast(1024)] = 64 * MiB
    keepalive_ms: Positive = 15000


@dataclass(frozen=True, slots=True)
class LuaSection:
    default_timeout_ms: Positive = 10
    default_memory_limit_bytes: Positive = 1048576
    circuit_breaker_threshold: Positive = 3
    circuit_breaker_cooldown_ms: Annotated[int, AtLeast(0)] = 10000


LogFormat = Literal["logfmt", "json"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


@dataclass(frozen=True, slots=True)
class TelemetrySection:
    otlp_endpoint: Annotated[str, Address("http", "https")] = ""
    service_name: str = "fila"
    # The OTLP reader waits this long on a thread lock, whose timeout the C runtime
    # caps (about 292 years; beyond, the reader's thread died with an OverflowError).
    metrics_interval_ms: Annotated[int, AtLeast(100), AtMost(86_400_000)] = 10000
    prometheus_listen: Annotated[str, Address()] = ""
    log_format: LogFormat = "logfmt"
    log_level: LogLevel = "info"


@dataclass(frozen=True, slots=True)
class TlsSection:
    cert_file: Annotated[str, Requires("key_file")] = ""
    key_file: Annotated[str, Requires("cert_file")] = ""
    ca_file: Annotated[str, Requires("cert_file", "key_file")] = ""


@dataclass(frozen=True, slots=True)
class AuthSection:
    bootstrap_apikey: Annotated[str, Secret()] = ""


@dataclass(frozen=True, slots=True)
class ClusterSection:
    # 0 = cluster mode off (one node, SPEC 1-8); > 0 = this node's unique id (SPEC 9)
    node_id: Annotated[int, AtLeast(0)] = 0
    advertise_addr: str = ""
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = "/fila"
    # etcd grants whole seconds and no lease shorter than about 2 s (its minimum TTL)
    lease_ttl_ms: Annotated[int, AtLeast(2000), AtMost(3_600_000)] = 5000
    # nodes that hold each queue created from now on (a leader and followers; SPEC 9)
    replication_factor: Annotated[int, AtLeast(1), AtMost(7)] = 1

    @property
    def enabled(self) -> bool:
        return self.node_id > 0


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerSection = field(default_factory=ServerSection)
    storage: StorageSection = field(default_factory=StorageSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    lua: LuaSection = field(default_factory=LuaSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    tls: TlsSection = field(default_factory=TlsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)


class ConfigError(Exception):
    """A configuration problem; the message is one line naming the key and the file."""


# Environment variable -> (section, key). Applied after the file, when non-empty.
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "FILA_DATA_DIR": ("storage", "data_dir"),
    "FILA_LISTEN_ADDR": ("server", "listen_addr"),
    "FILA_BOOTSTRAP_APIKEY": ("auth", "bootstrap_apikey"),
    "FILA_NODE_ID": ("cluster", "node_id"),
    "FILA_ADVERTISE_ADDR": ("cluster", "advertise_addr"),
    "FILA_ETCD_ENDPOINTS": ("cluster", "etcd_endpoints"),
    "FILA_REPLICATION_FACTOR": ("cluster", "replication_factor"),
}

# Looked for, in order, when neither --config nor FILA_CONFIG names a file.
SEARCH_PATHS: tuple[Path, ...] = (Path("fila.toml"), Path("/etc/fila/fila.toml"))

_TOML_TYPE_NAMES: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "a string",
    list: "an array",
    tuple: "an array of strings",
    dict: "a table",
}


def default_config_text() -> str:
    """The shipped `default.toml`: every key with its default and a comment."""
    return importlib.resources.files("fila").joinpath("default.toml").read_text("utf-8")


def parse_config(text: str, source: str) -> Config:
    """Parse and validate one TOML document; `source` names it in error messages."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    sections = _fields(Config)
    for name, value in doc.items():
        if name not in sections:
            kind = "section" if isinstance(value, dict) else "key"
            raise ConfigError(f'{source}: unknown {kind} "{name}"')
        if not isinstance(value, dict):
            raise ConfigError(f'{source}: "{name}" must be a table ([{name}]), got {_toml(value)}')
    built = {
        name: _section(hint, name, doc.get(name, {}), source)
        for name, (hint, _) in sections.items()
    }
    config = Config(**built)
    server = config.server
    needed = server.max_message_bytes + server.max_header_bytes + REQUEST_OVERHEAD_BYTES
    if server.max_request_bytes < needed:
        raise ConfigError(
            f'{source}: "server.max_request_bytes" ({server.max_request_bytes}) must be at least '
            f"max_message_bytes + max_header_bytes + {REQUEST_OVERHEAD_BYTES} ({needed}), "
            "so that every message the broker accepts fits in one request"
        )
    return config


def load_config(cli_path: str | None, env: Mapping[str, str]) -> tuple[Config, Path | None]:
    """Find, read and validate the config, then apply environment overrides.

    Returns the config and the file it came from (None when built-in defaults apply).
    """
    path = _find(cli_path, env)
    if path is None:
        config = Config()
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ConfigError(f"{path}: cannot read config file: {reason}") from None
        config = parse_config(text, str(path))
    overridden = []
    for var, (section, key) in ENV_OVERRIDES.items():
        if raw := env.get(var):
            value = _env_value(_fields(Config)[section][0], key, var, raw)
            patched = dataclasses.replace(getattr(config, section), **{key: value})
            config = dataclasses.replace(config, **{section: patched})
            overridden.append(var)
    # Checked once the environment applied: one file may serve every node, each node
    # giving its own FILA_NODE_ID and FILA_ADVERTISE_ADDR.
    source = str(path) if path is not None else "built-in defaults"
    _check_cluster(config, f"{source} (with {', '.join(overridden)})" if overridden else source)
    return config, path


def _env_value(section_cls: type, key: str, var: str, raw: str) -> Any:
    """An environment override converted to its key's type and checked like a file value."""
    base, markers = _fields(section_cls)[key]
    value: Any = raw
    if base is int:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f'{var} must be an integer, got "{raw[:40]}"') from None
    elif get_origin(base) is tuple:
        value = [part.strip() for part in raw.split(",") if part.strip()]
    _check(base, markers, var, value, "environment")
    return tuple(value) if isinstance(value, list) else value


def _check_cluster(config: Config, source: str) -> None:
    """`[cluster]` is all or nothing: see the module docstring."""
    cluster = config.cluster
    if not cluster.enabled:
        given = [k for k in ("advertise_addr", "etcd_endpoints") if getattr(cluster, k)]
        if cluster.replication_factor != 1:
            given.append("replication_factor")
        if given:
            raise ConfigError(
                f'{source}: "cluster.{given[0]}" is set but "cluster.node_id" is not: set '
                "node_id (an integer > 0, unique in the cluster, or FILA_NODE_ID) to run in "
                "cluster mode, or remove the [cluster] settings to run a single node"
            )
        return
    if not _is_host_port(cluster.advertise_addr):
        raise ConfigError(
            f'{source}: cluster mode needs "cluster.advertise_addr" (or FILA_ADVERTISE_ADDR), '
            f"the host:port clients and other nodes reach this node at, got "
            f'"{cluster.advertise_addr[:60]}"'
        )
    if not cluster.etcd_endpoints:
        raise ConfigError(
            f'{source}: cluster mode needs "cluster.etcd_endpoints" (or FILA_ETCD_ENDPOINTS), '
            'e.g. ["127.0.0.1:2379"]'
        )
    for endpoint in cluster.etcd_endpoints:
        if not _is_host_port(endpoint):
            raise ConfigError(
                f'{source}: "cluster.etcd_endpoints" entries are host:port (no scheme such as '
                f'http://), got "{endpoint[:60]}"'
            )
    prefix = cluster.etcd_prefix
    if not prefix.startswith("/") or prefix.endswith("/") or len(prefix) < 2:
        raise ConfigError(
            f'{source}: "cluster.etcd_prefix" must start with "/" and not end with it '
            f'(e.g. "/fila"), got "{prefix[:60]}"'
        )


def _is_host_port(text: str) -> bool:
    """host:port, the host a name or an address; a URL ("http://h:2379") is not one."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and "/" not in host and is_port(port))


def _find(cli_path: str | None, env: Mapping[str, str]) -> Path | None:
    for explicit, origin in ((cli_path, "--config"), (env.get("FILA_CONFIG"), "FILA_CONFIG")):
        if explicit:
            path = Path(explicit)
            if not path.exists():
                raise ConfigError(f"{path}: config file not found (from {origin})")
            return path
    return next((p for p in SEARCH_PATHS if p.exists()), None)


def _fields(cls: type) -> dict[str, tuple[Any, tuple[object, ...]]]:
    """Field name -> (base type, constraint markers), resolving `Annotated`."""
    out: dict[str, tuple[Any, tuple[object, ...]]] = {}
    for name, hint in get_type_hints(cls, include_extras=True).items():
        if get_origin(hint) is Annotated:
            base, *markers = get_args(hint)
            out[name] = (base, tuple(markers))
        else:
            out[name] = (hint, ())
    return out


def _section(cls: type, section: str, table: dict[str, Any], source: str) -> Any:
    schema = _fields(cls)
    for key in table:
        if key not in schema:
            raise ConfigError(f'{source}: unknown key "{section}.{key}"')
    for key, value in table.items():
        _check(schema[key][0], schema[key][1], f"{section}.{key}", value, source)
        if isinstance(value, list):
            table = {**table, key: tuple(value)}
    for key, (_, markers) in schema.items():
        for marker in markers:
            if isinstance(marker, Requires) and table.get(key):
                missing = [s for s in marker.siblings if not table.get(s)]
                if missing:
                    need = " and ".join(f'"{section}.{s}"' for s in missing)
                    raise ConfigError(f'{source}: "{section}.{key}" requires {need}')
    return cls(**table)


def _check(base: Any, markers: tuple[object, ...], key: str, value: Any, source: str) -> None:
    if get_origin(base) is Literal:
        choices = get_args(base)
        if value not in choices:
            allowed = ", ".join(f'"{c}"' for c in choices)
            raise ConfigError(f'{source}: "{key}" must be one of {allowed}, got {_toml(value)}')
        return
    if get_origin(base) is tuple:  # tuple[str, ...]: a TOML array of strings
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f'{source}: "{key}" must be an array of strings, got {_toml(value)}')
        return
    accepted: tuple[type, ...] = (int, float) if base is float else (base,)
    secret = any(isinstance(marker, Secret) for marker in markers)
    if secret and type(value) is str and value != value.strip():
        raise ConfigError(
            f'{source}: "{key}" starts or ends with whitespace; a presented key is compared '
            "without it, so this one could never match (the value is not shown)"
        )
    if type(value) not in accepted:
        if secret:
            raise ConfigError(f'{source}: "{key}" must be {_TOML_TYPE_NAMES[base]}')
        raise ConfigError(f'{source}: "{key}" must be {_TOML_TYPE_NAMES[base]}, got {_toml(value)}')
    for marker in markers:
        if isinstance(marker, ListenAddress) and (problem := marker.problem(value)):
            raise ConfigError(f'{source}: "{key}" {problem}, got {_toml(value)}')
        if isinstance(marker, Address) and value and (problem := marker.problem(value)):
            raise ConfigError(f'{source}: "{key}" {problem}, got {_toml(value)}')
        if isinstance(marker, AtLeast) and value < marker.minimum:
            raise ConfigError(f'{source}: "{key}" must be >= {marker.minimum}, got {value}')
        if isinstance(marker, AtMost) and value > marker.maximum:
            raise ConfigError(f'{source}: "{key}" must be <= {marker.maximum}, got {value}')


def _toml(value: object) -> str:
    """Describe a TOML value for an error message: its type and, if short, itself."""
    kind = _TOML_TYPE_NAMES.get(type(value), "a date/time")
    if not isinstance(value, str | int | float):
        return kind
    shown = json.dumps(value)
    return f"{kind} {shown}" if len(shown) <= 60 else kind
