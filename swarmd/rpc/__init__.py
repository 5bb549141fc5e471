"""The control socket between swarmctl and swarmd.

Offered here (all import-light): the frame codec, the request/reply protocol and method
table, and the blocking client. The trio server is ``swarmd.rpc.server``; it is not
re-exported so that importing the client never imports trio.
"""

from .client import Client, DaemonUnreachable, RemoteError
from .framing import MAX_FRAME, FrameDecoder, FramingError, FrameTooLarge, MalformedFrame, encode_frame
from .protocol import (Access, Call, Caller, Dispatcher, ErrorCode, Method, Param, RpcError, Takeover, check_owner,
                       failed)

__all__ = [
    "MAX_FRAME", "Access", "Call", "Caller", "Client", "DaemonUnreachable", "Dispatcher", "ErrorCode",
    "FrameDecoder", "FrameTooLarge", "FramingError", "MalformedFrame", "Method", "Param",
    "RemoteError", "RpcError", "Takeover", "check_owner", "encode_frame", "failed",
]
