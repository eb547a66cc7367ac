"""Freeing transient device memory on another stream than the one it was allocated on.

[Note: freeing on another stream] The CUDA caching allocator gives a freed block back to the
pool of the stream it was allocated on, and reuses it there at once: it knows of no other
stream's work still queued on that memory. Two buffers are allocated on one stream and may be
freed on another: a stage 2-3 bucket (allocated in an AccumulateGrad hook, on the autograd
leaf's stream; freed when its reduction finishes, maybe in the end-of-backward callback, on the
caller's current stream) and a stage 3 unit's gathered params (allocated where the gather is
issued; freed where the unit is released, and a user may run forward under
`torch.cuda.stream(s)`). With TORCH_NCCL_AVOID_RECORD_STREAMS=1 (the default from torch 2.8)
ProcessGroupNCCL does not `record_stream` its inputs, so nothing else protects them.

So the allocating stream is remembered (`allocating_stream`, None off CUDA) and, when the free
runs on another stream, made to wait for the current one first (`free_storage`): every later
use of the block on the allocating stream is ordered after the work queued on the current stream
(which itself waited on the collective). That is `wait_stream` (an event, no host sync) rather
than `Tensor.record_stream`: torch's docs and allocator notes prefer the wait where the
lifetime is managed by hand, since it is deterministic, where `record_stream` makes later
allocations poll the recorded stream, so reuse (and peak memory) depends on how far the GPU has
got when the CPU runs ahead. Off CUDA it costs one `is None` test, no op.
"""

from __future__ import annotations

import torch

__all__ = ["allocating_stream", "free_storage"]


def allocating_stream(t: torch.Tensor) -> torch.cuda.Stream | None:
    """The stream whose pool `t`'s block goes back to when freed (the current one, as `t` was
    just allocated or resized); None off CUDA. See [Note: freeing on another stream]."""
    return torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None


def free_storage(t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Free `t`'s storage (its views stay, over an empty storage), allocated on `stream`: when
    the current stream is another, `stream` waits for it first. See [Note: freeing on another
    stream]."""
    if stream is not None:
        current = torch.cuda.current_stream(t.device)
        if current != stream:
            stream.wait_stream(current)
    t.untyped_storage().resize_(0)
