"""How a server waits for a request's next output: as long as the client does.

No fixed per-output timeout: a request queued behind long prefills on a loaded instance is
slow, not failed. The wait ends at the client's deadline (DEADLINE_EXCEEDED), when the client
goes away, when the request is aborted (ABORTED), or when the engine reports an error on the
stream (its loop died).
"""

from __future__ import annotations

import grpc

from pdserve.engine.engine_loop import EngineLoop, OutputStream, RequestAborted, StreamTimeout
from pdserve.outputs import RequestOutput

POLL_S = 1.0  # how often a waiting handler checks that its client is still there


def next_output(stream: OutputStream, context: grpc.ServicerContext) -> RequestOutput:
    """The stream's next output; aborts the RPC at the client's deadline or departure, or
    when the request was aborted (ABORTED). Raises what the stream raises when the engine
    failed (RuntimeError)."""
    while True:
        left = context.time_remaining()  # None: the client set no deadline
        if left is not None and left <= 0:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"request {stream.request_id}: deadline passed")
        try:
            return stream.get(timeout=POLL_S if left is None else min(POLL_S, left))
        except RequestAborted as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except StreamTimeout:
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED,
                              f"request {stream.request_id}: the client went away")


def abort_when_done(context: grpc.ServicerContext, loop: EngineLoop, request_id: str) -> None:
    """Abort `request_id` on the engine when the RPC ends (a no-op once it finished), or now
    if the RPC has ended already (its client left while the request was being queued)."""
    if not context.add_callback(lambda: loop.abort_soon(request_id)):
        loop.abort_soon(request_id)
