"""Errors of the client: the daemon's gRPC status as Python exceptions."""

from __future__ import annotations

from typing import Any, Dict, Type

import grpc


class ShardtrainError(Exception):
    """A call the daemon refused or could not answer. ``code`` is the gRPC
    status code's name (e.g. ``"INVALID_ARGUMENT"``), ``message`` the
    daemon's message (naming the field and what is allowed)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidArgument(ShardtrainError):
    """A malformed job spec, an unknown preset, a negative batch size..."""


class NotFound(ShardtrainError):
    """No such job."""


class Unauthenticated(ShardtrainError):
    """The daemon requires a token (``Client(token=...)`` or
    $SHARDTRAIN_TOKEN) and got none or a wrong one."""


class PermissionDenied(ShardtrainError):
    """The job is another user's: only its owner or an admin may change it
    (the message names the owner)."""


class Unavailable(ShardtrainError):
    """No daemon answers at the address."""


class FailedPrecondition(ShardtrainError):
    """The job is not in a state that allows the call."""


class ResourceExhausted(ShardtrainError):
    """The daemon is short of something (disk space, streams)."""


class JobDidNotSucceed(ShardtrainError):
    """A job :meth:`Client.compare` ran ended FAILED or CANCELLED; ``job``
    is it, with its failure."""

    def __init__(self, job: Any) -> None:
        failure = job.failure or {}
        super().__init__(job.state, f"job {job.id} ({job.name}) ended {job.state}"
                         + (f": {failure.get('reason')}: {failure.get('message')}" if failure else ""))
        self.job = job


_BY_CODE: Dict[grpc.StatusCode, Type[ShardtrainError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def from_rpc_error(error: grpc.RpcError, address: str) -> ShardtrainError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        message = f"no shardtraind answers at {address} ({message}); start one with `shardtrain daemon`"
    return _BY_CODE.get(code, ShardtrainError)(code.name, message or "")
