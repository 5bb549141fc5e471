import pytest

from swarmd.rpc.protocol import (Caller, Dispatcher, ErrorCode, Method, Param, RpcError, may_mutate)


async def _noop(params, caller):
    return None


DISPATCHER = Dispatcher([
    Method(name="status", handler=_noop, doc="read"),
    Method(name="set", handler=_noop, doc="write", mutates=True,
           params={"level": Param(type=str, required=True), "n": Param(type=int), "x": Param(type=float)}),
])
USER = Caller(pid=1, uid=1000, gid=1000, may_mutate=False)
ADMIN = Caller(pid=1, uid=0, gid=0, may_mutate=True)


@pytest.mark.parametrize("message, code, text", [
    ([1, 2], ErrorCode.INVALID_REQUEST, "must be a map, got list"),
    ({"method": "status"}, ErrorCode.INVALID_REQUEST, "'id' must be an integer or a string"),
    ({"id": True, "method": "status"}, ErrorCode.INVALID_REQUEST, "'id' must be"),
    ({"id": 1}, ErrorCode.INVALID_REQUEST, "'method' must be a string"),
    ({"id": 1, "method": "nope"}, ErrorCode.METHOD_NOT_FOUND, "unknown method 'nope' (known: set, status)"),
    ({"id": 1, "method": "status", "params": [1]}, ErrorCode.INVALID_PARAMS, "'params' must be a map"),
    ({"id": 1, "method": "set", "params": {}}, ErrorCode.INVALID_PARAMS, "missing parameter 'level'"),
    ({"id": 1, "method": "set", "params": {"level": 3}}, ErrorCode.INVALID_PARAMS,
     "parameter 'level' must be string, got int"),
    ({"id": 1, "method": "set", "params": {"level": "a", "n": True}}, ErrorCode.INVALID_PARAMS,
     "parameter 'n' must be integer, got bool"),
    ({"id": 1, "method": "set", "params": {"level": "a", "zz": 1}}, ErrorCode.INVALID_PARAMS,
     "unknown parameter 'zz' (known: level, n, x)"),
])
def test_bad_requests_are_refused_with_a_clear_error(message, code, text):
    with pytest.raises(RpcError) as err:
        DISPATCHER.prepare(message, ADMIN)
    assert err.value.code == code
    assert text in err.value.message
    reply = err.value.reply()
    assert reply["error"] == {"code": int(code), "message": err.value.message}
    assert reply["final"] is True


def test_error_reply_keeps_the_request_id_when_known():
    with pytest.raises(RpcError) as err:
        DISPATCHER.prepare({"id": 7, "method": "nope"}, ADMIN)
    assert err.value.reply()["id"] == 7


def test_mutating_method_refused_to_unprivileged_caller():
    with pytest.raises(RpcError) as err:
        DISPATCHER.prepare({"id": 1, "method": "set", "params": {"level": "x"}}, USER)
    assert err.value.code == ErrorCode.PERMISSION_DENIED
    assert "uid 1000" in err.value.message
    DISPATCHER.prepare({"id": 1, "method": "status"}, USER)  # reading is fine


def test_valid_call_passes_typed_params():
    call = DISPATCHER.prepare({"id": "a", "method": "set", "params": {"level": "x", "n": 2, "x": 3}}, ADMIN)
    assert (call.id, call.method.name, call.params) == ("a", "set", {"level": "x", "n": 2, "x": 3})


@pytest.mark.parametrize("uid, gids, daemon_uid, group, allowed", [
    (0, [], 500, None, True),          # root
    (500, [], 500, None, True),        # the daemon's own user
    (1000, [100, 42], 500, 42, True),  # member of the swarm group
    (1000, [100], 500, 42, False),
    (1000, [100], 500, None, False),   # no swarm group on this host
])
def test_who_may_mutate(uid, gids, daemon_uid, group, allowed):
    assert may_mutate(uid, gids, daemon_uid=daemon_uid, group_gid=group) is allowed


def test_duplicate_method_names_are_a_programming_error():
    with pytest.raises(ValueError, match="registered twice"):
        Dispatcher([Method(name="a", handler=_noop, doc=""), Method(name="a", handler=_noop, doc="")])
