"""Profiler ranges: each phase of a step is a named range in a user's `torch.profiler` trace,
as FSDP2's are, so the trace shows where the time goes.

[Note: profiler ranges] `torch.profiler.record_function` costs ~12 us of host per range on this
repository's CPU machine even with no profiler running (it dispatches an op to enter and one to
exit), which a phase that runs per bucket or per unit would pay on every backward. So a range is
entered only while a profiler runs (torch's own flag, `torch.autograd.profiler.
_is_profiler_enabled`, read per call: ~0.1 us), and nothing else happens otherwise. The names:

  fusedzero::step              ZeroAdamW.step(), all of it
  fusedzero::grad_norm         the sum of squares, its all-reduce and the step's scalars
  fusedzero::update            the rule's launches (AdamW: the grouped launch)
  fusedzero::all_gather        stages 1-2: issuing the param all-gathers after the update
  fusedzero::param_wait        stages 1-2: waiting for them (a module's forward, the next step)
  fusedzero::all_reduce        stage 0: a bucket's grads put in and all-reduced
  fusedzero::reduce_scatter    stages 1-3: a bucket's grads put in and reduce-scattered
  fusedzero::reduce_wait       waiting for launched reductions and finishing them
  fusedzero::end_backward      what runs when backward ends (the last launches, the waits)
  fusedzero::unit_gather       stage 3: issuing a unit's all-gather
  fusedzero::unit_wait         stage 3: waiting for it
  fusedzero::unit_free         stage 3: freeing a unit
  fusedzero::zero_grad         ZeroAdamW.zero_grad()
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.autograd.profiler as _profiler

_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def phase(name: str) -> AbstractContextManager[None]:
    """`record_function(name)` while a profiler runs, else a no-op (see [Note: profiler
    ranges])."""
    if _profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _OFF
