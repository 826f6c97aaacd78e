"""Runtime config over gRPC: SetConfig / GetConfig / ListConfig, deletion, persistence,
and refusal of bad keys and malformed `throttle.*` values (INVALID_ARGUMENT, no change).
"""

from __future__ import annotations

import grpc
import pytest
from support import ServerFactory
from support.stubs import Fila, connect, rpc_error

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2

T = 10.0


def set_config(fila: Fila, key: str, value: str) -> None:
    fila.admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=value), timeout=T)


def get_config(fila: Fila, key: str) -> str:
    return str(fila.admin.GetConfig(admin_pb2.GetConfigRequest(key=key), timeout=T).value)


def list_config(fila: Fila, prefix: str = "") -> tuple[dict[str, str], int]:
    reply = fila.admin.ListConfig(admin_pb2.ListConfigRequest(prefix=prefix), timeout=T)
    entries = {e.key: e.value for e in reply.entries}
    assert len(entries) == len(reply.entries), f"duplicate keys in {reply.entries}"
    return entries, reply.total_count


def throttle_stats(fila: Fila, queue_name: str) -> dict[str, tuple[float, float]]:
    stats = fila.stats(queue_name)
    return {t.key: (t.rate_per_second, t.burst) for t in stats.per_throttle_stats}


def test_set_get_list_with_prefix(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        assert list_config(fila) == ({}, 0)
        values = {
            "app.limit": "10",
            "app.mode": "strict",
            "apple": "red",
            "other.thing": "x y z",
            "unicode.ключ": "значение ✓",
        }
        for key, value in values.items():
            set_config(fila, key, value)
        for key, value in values.items():
            assert get_config(fila, key) == value

        assert list_config(fila) == (values, len(values))
        assert list_config(fila, "app.") == (
            {"app.limit": "10", "app.mode": "strict"},
            2,
        )
        assert list_config(fila, "app") == (
            {"app.limit": "10", "app.mode": "strict", "apple": "red"},
            3,
        )
        assert list_config(fila, "app.mode") == ({"app.mode": "strict"}, 1)
        assert list_config(fila, "nothing.") == ({}, 0)
        # the prefix is a plain string prefix, not a pattern
        assert list_config(fila, "app.*") == ({}, 0)

        # overwriting replaces the value and does not duplicate the key
        set_config(fila, "app.limit", "20")
        assert get_config(fila, "app.limit") == "20"
        entries, total = list_config(fila, "app.")
        assert entries == {"app.limit": "20", "app.mode": "strict"} and total == 2


def test_get_missing_key_is_not_found(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        err = rpc_error(fila.admin.GetConfig, admin_pb2.GetConfigRequest(key="no.such.key"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "no.such.key" in (err.details() or "")


def test_empty_value_deletes(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        set_config(fila, "feature.a", "on")
        set_config(fila, "feature.b", "on")
        set_config(fila, "feature.a", "")
        err = rpc_error(fila.admin.GetConfig, admin_pb2.GetConfigRequest(key="feature.a"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert list_config(fila, "feature.") == ({"feature.b": "on"}, 1)
        # deleting a key that does not exist is a harmless no-op
        set_config(fila, "feature.never", "")
        assert list_config(fila, "feature.") == ({"feature.b": "on"}, 1)
        # and the key can be set again after deletion
        set_config(fila, "feature.a", "again")
        assert get_config(fila, "feature.a") == "again"


@pytest.mark.parametrize("how", ["graceful", "kill"])
def test_values_persist_across_restart(server: ServerProcess, how: str) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("cfgq")
        set_config(fila, "keep.a", "1")
        set_config(fila, "keep.b", "two")
        set_config(fila, "gone.c", "3")
        set_config(fila, "gone.c", "")  # the deletion must persist too
        set_config(fila, "keep.b", "2")  # and the last write wins
        set_config(fila, "throttle.persist", "7.5,3")
    if how == "kill":
        server.kill()  # answered writes are fsynced (sync mode) and must survive a crash
        server.start()
    else:
        server.restart()
    with connect(server.addr) as fila:
        assert get_config(fila, "keep.a") == "1"
        assert get_config(fila, "keep.b") == "2"
        err = rpc_error(fila.admin.GetConfig, admin_pb2.GetConfigRequest(key="gone.c"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert list_config(fila) == (
            {"keep.a": "1", "keep.b": "2", "throttle.persist": "7.5,3"},
            3,
        )
        # the throttle bucket is rebuilt from the stored value
        assert throttle_stats(fila, "cfgq") == {"persist": (7.5, 3.0)}


def test_a_script_reading_config_as_it_loads_decides_the_same_after_a_restart(
    server: ServerProcess,
) -> None:
    """Config comes back before the queues whose scripts read it at their top level."""
    script = """
    local weight = assert(tonumber(fila.get("tenant_weight")))
    local route = fila.get("route_key") or "unconfigured"
    function on_enqueue(m) return { fairness_key = route, weight = weight } end
    """
    with connect(server.addr) as fila:
        set_config(fila, "tenant_weight", "5")
        set_config(fila, "route_key", "blue")
        fila.create_queue("routed", on_enqueue=script)
    server.restart()
    with connect(server.addr) as fila:
        fila.enqueue("routed", b"after the restart")
        with fila.consume("routed") as stream:
            message = stream.get(T)
    assert (message.metadata.fairness_key, message.metadata.weight) == ("blue", 5)


@pytest.mark.parametrize("key", ["", "throttle."])
def test_bad_key_is_invalid_argument(server: ServerProcess, key: str) -> None:
    with connect(server.addr) as fila:
        set_config(fila, "existing", "v")
        before = list_config(fila)
        err = rpc_error(fila.admin.SetConfig, admin_pb2.SetConfigRequest(key=key, value="5,1"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert list_config(fila) == before


BAD_THROTTLE_VALUES = [
    "abc",
    "1",
    "0,5",
    "-1,5",
    "5,0",
    "nan,1",
    "1,nan",
    "inf,1",
    "1,2,3",
    ",",
    "5,-1",
]


def test_malformed_throttle_values_are_refused_and_change_nothing(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("tq")
        set_config(fila, "throttle.x", "10,2")
        before = list_config(fila)
        assert throttle_stats(fila, "tq") == {"x": (10.0, 2.0)}
        for bad in BAD_THROTTLE_VALUES:
            # an existing bucket keeps its value ...
            err = rpc_error(
                fila.admin.SetConfig, admin_pb2.SetConfigRequest(key="throttle.x", value=bad)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err)
            assert "throttle.x" in (err.details() or ""), (bad, err.details())
            # ... and a new key is not created
            err = rpc_error(
                fila.admin.SetConfig, admin_pb2.SetConfigRequest(key="throttle.y", value=bad)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err)
            assert get_config(fila, "throttle.x") == "10,2"
            assert list_config(fila) == before, bad
            assert throttle_stats(fila, "tq") == {"x": (10.0, 2.0)}, bad
        # nothing half-written reappears after a restart either
    server.restart()
    with connect(server.addr) as fila:
        assert list_config(fila) == before
        assert throttle_stats(fila, "tq") == {"x": (10.0, 2.0)}


def test_well_formed_throttle_values_are_accepted(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("tq")
        for value, expect in [
            ("20,5", (20.0, 5.0)),
            ("0.5,1", (0.5, 1.0)),
            ("1e3,2.5", (1000.0, 2.5)),
        ]:
            set_config(fila, "throttle.ok", value)
            assert get_config(fila, "throttle.ok") == value
            assert throttle_stats(fila, "tq") == {"ok": expect}
        # non-throttle keys accept any string, including what would be a bad throttle value
        set_config(fila, "notthrottle.x", "abc")
        assert get_config(fila, "notthrottle.x") == "abc"
        # emptying a throttle key removes its bucket
        set_config(fila, "throttle.ok", "")
        assert throttle_stats(fila, "tq") == {}
