"""The console API's OpenAPI 3.1 description (``GET /api/v1/openapi.json``).

Written by hand beside app.py's routes (a test checks that the two name the same paths and
that what each route answers validates against its schema here). The daemon's replies are
the control API's (`swarmctl … --json` prints the same): their shapes are given where a
client reads them and left open (``additionalProperties``) elsewhere, so a daemon that adds a
field does not break the description.
"""

from __future__ import annotations

from typing import Any, Final

from ..compute.ids import ALPHABET, LENGTH

VERSION: Final = "1.0.0"

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_OPEN = {"type": "object", "additionalProperties": True}
_NULLABLE_NUMBER = {"type": ["number", "null"]}


def _answers(schema: dict[str, Any], *errors: int, kind: str = "application/json") -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "OK", "content": {kind: {"schema": schema}}}}
    for status in (401, *errors):
        out[str(status)] = {"description": _WHY[status], "content": {"application/json": {"schema": _ERROR}}}
    return out


_WHY = {400: "a malformed id, name or parameter (the error names it)",
        401: "no valid console token (cookie or Authorization: Bearer)",
        403: "the daemon refused: not the caller's job, or not in the daemon's jobs group",
        404: "no such job or service",
        409: "the daemon could not do it (the error says why)",
        421: "not the console's own loopback Host",
        502: "the daemon did not answer"}

_MEMBER = {"type": "object", "required": ["peer", "state"], "additionalProperties": True, "properties": {
    "peer": {"type": "string"}, "state": {"type": "string", "enum": ["alive", "suspect", "dead", "left"]},
    "rtt_ms": _NULLABLE_NUMBER, "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "summary": {"type": "string"}, "nat": {"type": ["string", "null"]}, "record_age_s": {"type": "number"},
    "coord": {"type": ["array", "null"], "items": {"type": "number"},
              "description": "Vivaldi coordinate: [*vector (ms), height, error, adjustment]"}}}

_SWARM = {"type": "object", "required": ["members", "paths"], "properties": {
    "swarm": {"type": ["string", "null"]}, "me": {"oneOf": [_MEMBER, {"type": "null"}]},
    "members": {"type": "array", "items": _MEMBER},
    "paths": {"type": "object", "additionalProperties": {"type": "object", "properties": {
        "path": {"type": ["string", "null"]}, "relay": {"type": ["string", "null"]}, "rtt_ms": _NULLABLE_NUMBER}}}}}

_JOB = {"type": "object", "required": ["id", "state"], "additionalProperties": True, "properties": {
    "id": {"type": "string"}, "name": {"type": ["string", "null"]}, "state": {"type": "string"},
    "nodes": {"type": ["array", "null"], "items": {"type": "string"}}, "exit_code": {"type": ["integer", "null"]},
    "reason": {"type": ["string", "null"]}}}

_JOBS = {"type": "object", "required": ["jobs"], "properties": {"jobs": {"type": "array", "items": _JOB}}}

_LINES = {"type": "array", "items": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                     "minItems": 2, "maxItems": 2},
          "description": "[rank, text] pairs, oldest first"}

_LOGS = {"type": "object", "required": ["id", "lines", "truncated"], "properties": {
    "id": {"type": "string"}, "lines": _LINES, "truncated": {"type": "boolean"}}}

_SERVICES = {"type": "object", "required": ["services"], "properties": {"services": {"type": "array", "items": {
    "type": "object", "required": ["name"], "additionalProperties": True, "properties": {"name": {"type": "string"}}}}}}

_PART = {"oneOf": [_OPEN, _ERROR]}

_SNAPSHOT = {"type": "object", "required": ["swarm", "jobs", "services", "node"],
             "properties": {"swarm": _PART, "jobs": _PART, "services": _PART, "node": _PART}}

_JOB_ID = {"name": "id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": f"^[{ALPHABET}]{{1,{LENGTH}}}$"},
           "description": "a job id, or a unique prefix of one"}

SPEC: Final[dict[str, Any]] = {
    "openapi": "3.1.0",
    "info": {"title": "swarmd console API", "version": VERSION,
             "description": "One member's view of the swarm and the caller's jobs, over its control socket, as "
                            "the user who runs `swarmctl console`. Authenticate with the console's token: "
                            "`Authorization: Bearer TOKEN`, or the cookie `GET /login?token=TOKEN` sets."},
    "servers": [{"url": "/api/v1"}],
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                       "cookie": {"type": "apiKey", "in": "cookie", "name": "swarmd_console"}}},
    "security": [{"bearer": []}, {"cookie": []}],
    "paths": {
        "/swarm": {"get": {"summary": "this member and every member it sees, and the mesh's paths",
                           "operationId": "swarm", "responses": _answers(_SWARM, 421, 502)}},
        "/jobs": {"get": {"summary": "the caller's jobs, newest first (all jobs for an administrator)",
                          "operationId": "jobs", "responses": _answers(_JOBS, 403, 421, 502)}},
        "/jobs/{id}": {"get": {"summary": "one job: attempts, hand-overs, checkpoints", "operationId": "job",
                               "parameters": [_JOB_ID], "responses": _answers(_JOB, 400, 403, 404, 421, 502)}},
        "/jobs/{id}/logs": {"get": {
            "summary": "the last lines of a job's output", "operationId": "job_logs",
            "parameters": [_JOB_ID, {"name": "tail", "in": "query", "required": False,
                                     "schema": {"type": "integer", "minimum": 1, "maximum": 2000, "default": 200}}],
            "responses": _answers(_LOGS, 400, 403, 404, 421, 502)}},
        "/jobs/{id}/logs/follow": {"get": {
            "summary": "a job's output as it is written: server-sent events `lines` (data: [rank, text] pairs) "
                       "and `end`", "operationId": "job_logs_follow", "parameters": [_JOB_ID],
            "responses": _answers({"type": "string"}, 400, 403, 404, 421, 502, kind="text/event-stream")}},
        "/jobs/{id}/cancel": {"post": {
            "summary": "cancel one of the caller's jobs (a browser's request must come from the console's page)",
            "operationId": "job_cancel", "parameters": [_JOB_ID],
            "responses": _answers(_OPEN, 400, 403, 404, 409, 421, 502)}},
        "/services": {"get": {"summary": "the services in the registry", "operationId": "services",
                              "responses": _answers(_SERVICES, 421, 502)}},
        "/services/{name}": {"get": {
            "summary": "one service: replicas, where requests enter, rates, latency, forecast, scaling",
            "operationId": "service",
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"}}],
            "responses": _answers(_OPEN, 400, 404, 409, 421, 502)}},
        "/services/{name}/scale": {"post": {
            "summary": "set one of the caller's services to a fixed number of replicas (autoscaling off)",
            "operationId": "service_scale",
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["replicas"],
                "properties": {"replicas": {"type": "integer", "minimum": 0, "maximum": 256}}}}}},
            "responses": _answers(_OPEN, 400, 403, 404, 409, 421, 502)}},
        "/node": {"get": {"summary": "this daemon's status: sandbox, relay, gossip and routing counters",
                          "operationId": "node", "responses": _answers(_OPEN, 421, 502)}},
        "/events": {"get": {
            "summary": "server-sent events: `snapshot` (swarm, jobs, services, node; a part the caller may not read "
                       "is {error}) whenever it changed", "operationId": "events",
            "responses": _answers({"type": "string"}, 421, kind="text/event-stream"),
            "x-event-schema": _SNAPSHOT}},
        "/openapi.json": {"get": {"summary": "this description", "operationId": "openapi",
                                  "responses": _answers(_OPEN, 421)}},
    },
}
