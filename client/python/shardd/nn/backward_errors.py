"""Transient areas: a loss term computed from the parameters outside the
forward (an L2 penalty over ``model.parameters()`` added after
``model(x)``, ``loss + wd * sum(p.pow(2).sum() for p in ...)``).

Outside forward and backward a unit's parameter (but the root unit's,
gathered from its forward to the end of backward) is its 1-D part of this
rank's shard (FSDP1's use_orig_params view), while autograd's node that
accumulates its gradient (kept by the wrapper, made in the first forward)
has the parameter's shape: torch's engine refuses the term's gradient,
"Function PowBackward0 returned an invalid gradient at index 0 - got [n]
but expected shape compatible with [a, b]", which names neither the
parameter nor the cause. Made to train it could not be at that point
(the engine checks the shape before any hook of the wrapper runs), and
a term over the parts would be a per-rank partial sum anyway. So that
error is said again, naming the parameters whose part and shape it
matches and what to do instead, and the backward's areas are released
as for any refused backward.

The same for the other way round: a term computed before the first
forward made the node with the part's shape, and the forward's gradient
is refused."""
import re

import torch

from .optimizer_hook import _WRAPPERS

_INVALID = re.compile(r"returned an invalid gradient at index \d+ - got \[([0-9, ]*)\] "
                      r"but expected shape compatible with \[([0-9, ]*)\]")

_ORIGINAL = None


def _shape(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def _matching(got, want):
    """[(wrapper, entry)] whose 1-D part is `got` and shape `want`, or the
    other way round."""
    out = []
    for sm in list(_WRAPPERS):
        if not sm.transient:
            continue
        for u in sm.units:
            if u.is_root:
                continue
            for e in u.entries:
                part = (e.part.numel(),)
                if (got == part and want == tuple(e.shape)) or \
                        (want == part and got == tuple(e.shape)):
                    out.append((sm, e))
    return out


def _said_again(err):
    m = _INVALID.search(str(err))
    if m is None:
        return None
    found = _matching(_shape(m.group(1)), _shape(m.group(2)))
    if not found:
        return None
    for sm in {id(sm): sm for sm, _ in found}.values():
        if sm._final_queued or any(u.grad is not None for u in sm.units):
            sm._abort_backward()  # a backward of ours was under way
    names = [e.name for _, e in found]
    return RuntimeError(
        "shardd: the backward reached parameter %s%s outside the forward: outside forward "
        "and backward a unit's parameter is its 1-D part of this rank's shard (as FSDP's "
        "sharded views), so a loss term computed from it after the forward (or before the "
        "first), such as an L2 penalty `sum(p.pow(2).sum() for p in model.parameters())`, "
        "has the part's shape, which autograd cannot accumulate into the parameter [%s]. "
        "Use the optimizer's weight_decay (SGD's is that L2 term), or compute the term "
        "inside the forward, where each unit's parameters are whole: e.g. a forward "
        "pre-hook on each unit's module that appends `sum(p.pow(2).sum() for p in "
        "m.parameters())` to a list the loss adds (every rank adds the whole term, and "
        "the mean reduction gives torch's gradient)" % (
            ", ".join(repr(n) for n in names[:3]),
            " (or %d more of the same part and shape)" % (len(names) - 3)
            if len(names) > 3 else "", err))


def _backward(*args, **kwargs):
    try:
        return _ORIGINAL(*args, **kwargs)
    except RuntimeError as err:
        new = _said_again(err)
        if new is None:
            raise
        raise new from err


def install():
    """torch.autograd.backward (what Tensor.backward calls) said again as
    above; once per process."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    _ORIGINAL = torch.autograd.backward
    _backward.__doc__ = _ORIGINAL.__doc__
    _backward.__wrapped__ = _ORIGINAL
    torch.autograd.backward = _backward
