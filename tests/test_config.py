"""fila.config: parsing, validation, search order and environment overrides."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from fila import config as cfg
from fila.config import (
    Config,
    ConfigError,
    LuaSection,
    SchedulerSection,
    ServerSection,
    StorageSection,
    TlsSection,
    default_config_text,
    load_config,
    parse_config,
)
from fila.wire import is_port


@pytest.fixture
def no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the /etc fallback at a temp path (absent until a test writes it); cwd empty."""
    etc = tmp_path / "etc" / "fila.toml"
    monkeypatch.setattr(cfg, "SEARCH_PATHS", (Path("fila.toml"), etc))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return etc


# --- the shipped default file -------------------------------------------------------


def test_default_toml_parses_to_builtin_defaults() -> None:
    assert parse_config(default_config_text(), "default.toml") == Config()


def test_default_toml_lists_every_key_with_a_comment() -> None:
    text = default_config_text()
    doc = tomllib.loads(text)
    defaults = Config()
    expected = {
        section.name: {f.name for f in dataclasses.fields(getattr(defaults, section.name))}
        for section in dataclasses.fields(Config)
    }
    assert {name: set(table) for name, table in doc.items()} == expected
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("# "), f"no comment above {line!r}"


# --- parse_config ---------------------------------------------------------------------


def test_empty_document_is_defaults() -> None:
    assert parse_config("", "x.toml") == Config()


def test_values_are_read_into_typed_sections() -> None:
    config = parse_config(
        """
        [server]
        listen_addr = "0.0.0.0:6000"
        max_message_bytes = 1024
        [storage]
        persist_mode = "buffer"
        data_dir = "/var/lib/fila"
        [scheduler]
        quantum = 4
        [lua]
        circuit_breaker_cooldown_ms = 0
        [tls]
        cert_file = "c.pem"
        key_file = "k.pem"
        ca_file = "ca.pem"
        """,
        "x.toml",
    )
    assert config.server == ServerSection(listen_addr="0.0.0.0:6000", max_message_bytes=1024)
    assert config.storage == StorageSection(data_dir="/var/lib/fila", persist_mode="buffer")
    assert config.scheduler == SchedulerSection(quantum=4)
    assert config.lua == LuaSection(circuit_breaker_cooldown_ms=0)
    assert config.tls == TlsSection(cert_file="c.pem", key_file="k.pem", ca_file="ca.pem")


def test_config_is_immutable() -> None:
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.listen_addr = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("[server]\nfoo = 1", '"server.foo"', "unknown key"),
        ("[nope]\na = 1", '"nope"', "unknown section"),
        ("top = 1", '"top"', "unknown key"),
        ("server = 1", '"server"', "must be a table"),
        ('[scheduler]\nquantum = "4"', '"scheduler.quantum"', "must be an integer"),
        ("[scheduler]\nquantum = true", '"scheduler.quantum"', "must be an integer"),
        ("[scheduler]\nquantum = 1.5", '"scheduler.quantum"', "must be an integer"),
        ("[server]\nlisten_addr = 5555", '"server.listen_addr"', "must be a string"),
        ("[server]\nlisten_addr = [1]", '"server.listen_addr"', "must be a string"),
        ('[storage]\npersist_mode = "fast"', '"storage.persist_mode"', '"sync", "buffer"'),
        ("[storage]\npersist_mode = true", '"storage.persist_mode"', '"sync", "buffer"'),
        ("[scheduler]\nquantum = 0", '"scheduler.quantum"', ">= 1"),
        ("[scheduler]\nconsumer_buffer = 0", '"scheduler.consumer_buffer"', ">= 1"),
        ("[server]\nmax_message_bytes = -1", '"server.max_message_bytes"', ">= 1"),
        ("[lua]\ndefault_timeout_ms = 0", '"lua.default_timeout_ms"', ">= 1"),
        ("[lua]\ncircuit_breaker_threshold = 0", '"lua.circuit_breaker_threshold"', ">= 1"),
        ("[lua]\ncircuit_breaker_cooldown_ms = -1", '"lua.circuit_breaker_cooldown_ms"', ">= 0"),
        ('[tls]\nkey_file = "k"', '"tls.key_file"', 'requires "tls.cert_file"'),
        ('[tls]\ncert_file = "c"', '"tls.cert_file"', 'requires "tls.key_file"'),
        ('[tls]\ncert_file = "c"\nkey_file = "k"\nca_file = ""', None, None),
        ('[tls]\nca_file = "ca"', '"tls.ca_file"', '"tls.cert_file" and "tls.key_file"'),
        ("[server\nfoo = 1", None, "invalid TOML"),
        ("[server]\na = 1\na = 2", None, "invalid TOML"),
    ],
)
def test_invalid_values_name_the_key_and_the_file(
    text: str, key: str | None, why: str | None
) -> None:
    if why is None:
        parse_config(text, "conf/fila.toml")
        return
    with pytest.raises(ConfigError) as err:
        parse_config(text, "conf/fila.toml")
    message = str(err.value)
    assert message.startswith("conf/fila.toml: ")
    assert why in message
    if key is not None:
        assert key in message
    assert "\n" not in message


# gRPC takes these as C ints of milliseconds: 2^31 and beyond passed --check-config and
# then failed at startup with an OverflowError traceback (exit 1 instead of 2).
@pytest.mark.parametrize(
    "text",
    [
        "[server]\nidle_connection_timeout_ms = 2147483648",
        "[server]\nhandshake_timeout_ms = 3000000000",
        "[server]\nkeepalive_interval_ms = 4294967296",
        "[server]\nkeepalive_timeout_ms = 9223372036854775807",
        "[telemetry]\nmetrics_interval_ms = 9223372036854775807",
    ],
)
def test_durations_beyond_what_the_c_runtimes_take_are_refused(text: str) -> None:
    key = text.split("\n")[1].split(" = ")[0]
    with pytest.raises(ConfigError, match=rf"\.{key}\" must be <= 86400000") as err:
        parse_config(text, "conf/fila.toml")
    assert str(err.value).startswith("conf/fila.toml: ")
    parse_config(text.split(" = ")[0] + " = 86400000", "conf/fila.toml")  # a day is fine


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        ("127.0.0.1:5555", True),
        ("0.0.0.0:6000", True),
        ("[::1]:5555", True),
        ("[::]:5555", True),
        ("localhost:5555", True),
        ("127.0.0.1:0", True),  # any free port, as the tests' brokers listen
        ("unix:/run/fila/fila.sock", True),
        ("nonsense", False),
        ("", False),
        ("127.0.0.1", False),
        ("127.0.0.1:65536", False),
        ("127.0.0.1:http", False),
        ("::1:5555:", False),
        ("[::1:5555", False),
        ("my host:5555", False),
        ("http://127.0.0.1:5555", False),
        ("unix:", False),
    ],
)
def test_listen_addr_is_checked_with_the_config(
    no_system_config: Path, value: str, accepted: bool
) -> None:
    """Left to gRPC, a bad address passed --check-config and failed only at startup."""
    text = f"[server]\nlisten_addr = {json.dumps(value)}\n"
    if accepted:
        assert parse_config(text, "conf/fila.toml").server.listen_addr == value
        assert load_config(None, {"FILA_LISTEN_ADDR": value})[0].server.listen_addr == value
        return
    with pytest.raises(ConfigError, match=r'^conf/fila\.toml: "server\.listen_addr" '):
        parse_config(text, "conf/fila.toml")
    if value:  # an empty variable is no override
        with pytest.raises(ConfigError, match=r'^environment: "FILA_LISTEN_ADDR" '):
            load_config(None, {"FILA_LISTEN_ADDR": value})


# --- load_config: search order --------------------------------------------------------


def _write(path: Path, quantum: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"[scheduler]\nquantum = {quantum}\n", encoding="utf-8")
    return path


def test_no_file_anywhere_gives_defaults(no_system_config: Path) -> None:
    assert load_config(None, {}) == (Config(), None)


def test_system_file_is_the_last_resort(no_system_config: Path) -> None:
    _write(no_system_config, 5)
    config, path = load_config(None, {})
    assert (config.scheduler.quantum, path) == (5, no_system_config)


def test_cwd_file_beats_system_file(no_system_config: Path) -> None:
    _write(no_system_config, 5)
    _write(Path("fila.toml"), 4)
    config, path = load_config(None, {})
    assert (config.scheduler.quantum, path) == (4, Path("fila.toml"))


def test_env_file_beats_cwd_file(no_system_config: Path, tmp_path: Path) -> None:
    _write(Path("fila.toml"), 4)
    env_file = _write(tmp_path / "env.toml", 3)
    config, path = load_config(None, {"FILA_CONFIG": str(env_file)})
    assert (config.scheduler.quantum, path) == (3, env_file)


def test_cli_file_beats_env_file(no_system_config: Path, tmp_path: Path) -> None:
    _write(Path("fila.toml"), 4)
    env_file = _write(tmp_path / "env.toml", 3)
    cli_file = _write(tmp_path / "cli.toml", 2)
    config, path = load_config(str(cli_file), {"FILA_CONFIG": str(env_file)})
    assert (config.scheduler.quantum, path) == (2, cli_file)


def test_missing_cli_file_is_an_error_not_a_fallback(no_system_config: Path) -> None:
    _write(Path("fila.toml"), 4)
    with pytest.raises(ConfigError, match=r"^missing\.toml: config file not found.*--config"):
        load_config("missing.toml", {})


def test_missing_env_file_is_an_error_not_a_fallback(no_system_config: Path) -> None:
    _write(Path("fila.toml"), 4)
    with pytest.raises(ConfigError, match=r"^gone\.toml: config file not found.*FILA_CONFIG"):
        load_config(None, {"FILA_CONFIG": "gone.toml"})


def test_errors_in_a_found_file_name_its_path(no_system_config: Path) -> None:
    Path("fila.toml").write_text("[storage]\npersist_mode = 'fast'\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r'^fila\.toml: "storage\.persist_mode"'):
        load_config(None, {})


def test_unreadable_file_is_a_config_error(no_system_config: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path), {})
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError, match=r"bin\.toml: cannot read config file"):
        load_config(str(binary), {})


# --- load_config: environment overrides -----------------------------------------------

ENV = {
    "FILA_DATA_DIR": "/srv/fila",
    "FILA_LISTEN_ADDR": "0.0.0.0:7000",
    "FILA_BOOTSTRAP_APIKEY": "secret",
}


def test_env_overrides_defaults(no_system_config: Path) -> None:
    config, path = load_config(None, ENV)
    assert path is None
    assert config.storage.data_dir == "/srv/fila"
    assert config.server.listen_addr == "0.0.0.0:7000"
    assert config.auth.bootstrap_apikey == "secret"
    assert config.server.max_headers == ServerSection().max_headers


def test_env_overrides_the_file(no_system_config: Path) -> None:
    Path("fila.toml").write_text(
        '[server]\nlisten_addr = "127.0.0.1:1"\nmax_headers = 7\n'
        '[storage]\ndata_dir = "d"\npersist_mode = "buffer"\n'
        '[auth]\nbootstrap_apikey = "file-key"\n',
        encoding="utf-8",
    )
    config, _ = load_config(None, ENV)
    assert config.server == ServerSection(listen_addr="0.0.0.0:7000", max_headers=7)
    assert config.storage == StorageSection(data_dir="/srv/fila", persist_mode="buffer")
    assert config.auth.bootstrap_apikey == "secret"


@pytest.mark.parametrize("key", ["secret ", "\tsecret", "secret\n"])
def test_a_bootstrap_key_with_surrounding_whitespace_is_refused_without_showing_it(
    no_system_config: Path, key: str
) -> None:
    """A presented key is compared stripped: this one could never authenticate."""
    with pytest.raises(ConfigError, match="whitespace") as from_env:
        load_config(None, {"FILA_BOOTSTRAP_APIKEY": key})
    Path("fila.toml").write_text(f"[auth]\nbootstrap_apikey = {json.dumps(key)}\n")
    with pytest.raises(ConfigError, match="whitespace") as from_file:
        load_config(None, {})
    for refused in (from_env, from_file):
        assert "secret" not in str(refused.value)


def test_empty_env_values_are_ignored(no_system_config: Path) -> None:
    empty = dict.fromkeys([*ENV, "FILA_CONFIG"], "")
    assert load_config(None, empty) == (Config(), None)


# --- [cluster] (SPEC 9) ---------------------------------------------------------------

CLUSTER = (
    '[cluster]\nnode_id = 2\nadvertise_addr = "10.0.0.2:5555"\n'
    'etcd_endpoints = ["10.0.0.9:2379", "10.0.0.10:2379"]\n'
)


def test_cluster_mode_is_off_by_default_and_on_with_a_node_id(no_system_config: Path) -> None:
    assert not Config().cluster.enabled
    Path("fila.toml").write_text(CLUSTER, encoding="utf-8")
    config, _ = load_config(None, {})
    cluster = config.cluster
    assert cluster.enabled
    assert (cluster.node_id, cluster.advertise_addr) == (2, "10.0.0.2:5555")
    assert cluster.etcd_endpoints == ("10.0.0.9:2379", "10.0.0.10:2379")
    assert (cluster.etcd_prefix, cluster.lease_ttl_ms) == ("/fila", 5000)


def test_cluster_env_overrides_are_typed(no_system_config: Path) -> None:
    # One file for every node, each node naming itself in its environment.
    Path("fila.toml").write_text('[cluster]\netcd_endpoints = ["e:1"]\n', encoding="utf-8")
    config, _ = load_config(
        None,
        {
            "FILA_NODE_ID": "7",
            "FILA_ADVERTISE_ADDR": "n7:5555",
            "FILA_ETCD_ENDPOINTS": "a:2379, b:2379,",
        },
    )
    assert config.cluster.node_id == 7
    assert config.cluster.advertise_addr == "n7:5555"
    assert config.cluster.etcd_endpoints == ("a:2379", "b:2379")
    with pytest.raises(ConfigError, match='FILA_NODE_ID must be an integer, got "seven"'):
        load_config(None, {"FILA_NODE_ID": "seven"})


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            '[cluster]\nadvertise_addr = "a:1"',
            '"cluster.advertise_addr" is set but "cluster.node_id"',
        ),
        ("[cluster]\nnode_id = 1", 'needs "cluster.advertise_addr"'),
        ('[cluster]\nnode_id = 1\nadvertise_addr = "nohost"', 'needs "cluster.advertise_addr"'),
        ('[cluster]\nnode_id = 1\nadvertise_addr = "a:1"', 'needs "cluster.etcd_endpoints"'),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "a:1"\netcd_endpoints = [1]',
            '"cluster.etcd_endpoints" must be an array of strings',
        ),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "a:1"\netcd_endpoints = ["e"]',
            "entries are host:port",
        ),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "a:1"\n'
            'etcd_endpoints = ["http://127.0.0.1:2379"]',
            "no scheme such as http://",
        ),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "http://a:1"\netcd_endpoints = ["e:1"]',
            'needs "cluster.advertise_addr"',
        ),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "a:\uff15\uff15"\netcd_endpoints = ["e:1"]',
            'needs "cluster.advertise_addr"',
        ),
        (
            '[cluster]\nnode_id = 1\nadvertise_addr = "a:1"\netcd_endpoints = ["e:1"]\n'
            'etcd_prefix = "fila/"',
            '"cluster.etcd_prefix" must start with "/"',
        ),
        ("[cluster]\nlease_ttl_ms = 500", '"cluster.lease_ttl_ms" must be >= 2000'),
        ("[cluster]\nnode_id = -1", '"cluster.node_id" must be >= 0'),
    ],
)
def test_bad_cluster_settings_stop_startup(no_system_config: Path, text: str, needle: str) -> None:
    Path("fila.toml").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"fila\.toml") as raised:
        load_config(None, {})
    assert needle in str(raised.value)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("-1", "must be >= 0, got -1"),
        ("40", "must be <= 39, got 40"),
        ('"high"', "must be an integer"),
    ],
)
def test_fsync_priority_boost_outside_0_to_39_is_a_config_error(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"storage\.fsync_priority_boost") as raised:
        parse_config(f"[storage]\nfsync_priority_boost = {value}\n", "x.toml")
    assert needle in str(raised.value)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("1", True),
        ("5555", True),
        ("65535", True),
        ("0", False),
        ("65536", False),
        ("", False),
        ("-1", False),
        ("+80", False),
        (" 80", False),
        ("\uff15\uff15\uff15\uff15", False),  # full-width: int() reads them, resolvers do not
        ("\u0665\u0665", False),  # Arabic-Indic
    ],
)
def test_a_port_is_ascii_digits_from_1_to_65535(text: str, valid: bool) -> None:
    assert is_port(text) is valid
