"""Stream handles: what the pool accepts as a stream."""

from __future__ import annotations

from typing import Any

from waterwave_hpo import _checks

#: What the pool accepts as a stream: None (the default stream), a raw handle (``int``:
#: ``cudaStream_t``/``CUstream`` as an integer, or any integer for the sim backend), a
#: ``torch.cuda.Stream`` (``.cuda_stream``) or a ``cupy.cuda.Stream`` (``.ptr``).
StreamLike = Any


def stream_handle(stream: StreamLike, *, argument: str = "stream") -> int:
    """The raw 64-bit handle of ``stream``.

    Args:
        stream: See :data:`StreamLike`.
        argument: The argument name to use in error messages.

    Returns:
        The handle as a non-negative int; 0 for None (the default stream).

    Raises:
        TypeError: ``stream`` is none of the accepted kinds.
        ValueError: The handle is negative or does not fit in 64 bits.
    """
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise _checks.type_error(argument, stream, "a stream", "pass a stream handle, not a bool")
    if isinstance(stream, int):
        handle = stream
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):  # cupy.cuda.Stream
        handle = int(stream.ptr)
    else:
        raise _checks.type_error(
            argument,
            stream,
            "None, an int handle, a torch.cuda.Stream or a cupy.cuda.Stream",
            "pass the trial's stream",
        )
    if not 0 <= handle < 2**64:
        raise _checks.value_error(
            argument, handle, "is not a valid stream handle", "pass 0 <= handle < 2**64"
        )
    return handle
