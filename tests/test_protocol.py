import pytest

from swarmd.rpc.protocol import (Access, Caller, Dispatcher, ErrorCode, Method, Param, RpcError, access_of,
                                 check_owner)


async def _noop(params, caller):
    return None


DISPATCHER = Dispatcher([
    Method(name="status", handler=_noop, doc="read", access=Access.READ),
    Method(name="jobs.cancel", handler=_noop, doc="own jobs", access=Access.JOBS),
    Method(name="set", handler=_noop, doc="write", access=Access.ADMIN,
           params={"level": Param(type=str, required=True), "n": Param(type=int), "x": Param(type=float)}),
])
OUTSIDER = Caller(pid=1, uid=65534, gid=65534, access=Access.READ)
USER = Caller(pid=1, uid=1000, gid=1000, access=Access.JOBS)
ADMIN = Caller(pid=1, uid=0, gid=0, access=Access.ADMIN)


@pytest.mark.parametrize("message, code, text", [
    ([1, 2], ErrorCode.INVALID_REQUEST, "must be a map, got list"),
    ({"method": "status"}, ErrorCode.INVALID_REQUEST, "'id' must be an integer or a string"),
    ({"id": True, "method": "status"}, ErrorCode.INVALID_REQUEST, "'id' must be"),
    ({"id": 1}, ErrorCode.INVALID_REQUEST, "'method' must be a string"),
    ({"id": 1, "method": "nope"}, ErrorCode.METHOD_NOT_FOUND, "unknown method 'nope' (known: jobs.cancel, set, status)"),
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


@pytest.mark.parametrize("method, caller, text", [
    ("set", USER, "set: refused: it needs root or the daemon's user; uid 1000 may run jobs and manage only its own"),
    ("set", OUTSIDER, "set: refused: it needs root or the daemon's user; uid 65534 may only read"),
    ("jobs.cancel", OUTSIDER, "jobs.cancel: refused: it needs root, the daemon's user, or a member of the "
                              "daemon's group; uid 65534 may only read this node's status"),
])
def test_a_method_above_the_callers_level_is_refused_saying_why(method, caller, text):
    with pytest.raises(RpcError) as err:
        DISPATCHER.prepare({"id": 1, "method": method, "params": {"level": "x"} if method == "set" else {}}, caller)
    assert err.value.code == ErrorCode.PERMISSION_DENIED
    assert text in err.value.message
    assert err.value.method == method  # the metrics label


def test_a_refused_caller_learns_nothing_about_params():
    with pytest.raises(RpcError) as err:
        DISPATCHER.prepare({"id": 1, "method": "set", "params": {"bogus": 1}}, USER)
    assert err.value.code == ErrorCode.PERMISSION_DENIED


@pytest.mark.parametrize("caller, allowed", [
    (OUTSIDER, {"status"}), (USER, {"status", "jobs.cancel"}), (ADMIN, {"status", "jobs.cancel", "set"}),
])
def test_each_level_may_call_what_is_at_or_below_it(caller, allowed):
    for name in DISPATCHER.methods:
        params = {"level": "x"} if name == "set" else {}
        try:
            DISPATCHER.prepare({"id": 1, "method": name, "params": params}, caller)
        except RpcError as exc:
            assert exc.code == ErrorCode.PERMISSION_DENIED and name not in allowed
        else:
            assert name in allowed


def test_a_method_that_does_not_say_is_admin_only():
    assert Method(name="new", handler=_noop, doc="").access is Access.ADMIN


def test_a_job_belongs_to_its_submitter_and_to_the_admins():
    check_owner(USER, "jobs.cancel", "job abc", 1000)
    check_owner(ADMIN, "jobs.cancel", "job abc", 1000)
    with pytest.raises(RpcError) as err:
        check_owner(Caller(pid=1, uid=1001, gid=1001, access=Access.JOBS), "jobs.cancel", "job abc", 1000)
    assert err.value.code == ErrorCode.PERMISSION_DENIED
    assert err.value.message.startswith("jobs.cancel: job abc belongs to uid 1000; uid 1001 may act only on its own jobs")


def test_valid_call_passes_typed_params():
    call = DISPATCHER.prepare({"id": "a", "method": "set", "params": {"level": "x", "n": 2, "x": 3}}, ADMIN)
    assert (call.id, call.method.name, call.params) == ("a", "set", {"level": "x", "n": 2, "x": 3})


@pytest.mark.parametrize("uid, gids, daemon_uid, group, level", [
    (0, [], 500, None, Access.ADMIN),         # root
    (500, [], 500, None, Access.ADMIN),       # the daemon's own user
    (1000, [100, 42], 500, 42, Access.JOBS),  # member of the swarm group
    (1000, [100], 500, 42, Access.READ),
    (1000, [100], 500, None, Access.READ),    # no swarm group on this host
])
def test_who_holds_which_level(uid, gids, daemon_uid, group, level):
    assert access_of(uid, gids, daemon_uid=daemon_uid, group_gid=group) is level


def test_duplicate_method_names_are_a_programming_error():
    with pytest.raises(ValueError, match="registered twice"):
        Dispatcher([Method(name="a", handler=_noop, doc=""), Method(name="a", handler=_noop, doc="")])
