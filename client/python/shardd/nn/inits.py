"""torch's inits of a transient unit's parameter between forwards
(``nn.init.normal_`` / ``uniform_`` / ``trunc_normal_`` / ``xavier_*`` /
``kaiming_*`` / ``orthogonal_``, a module's ``reset_parameters()``,
``p.normal_()``): the parameter is then this rank's 1-D part of the shard,
and a draw on it gave each rank's part the first numbers of its own
generator (with the ranks' common seed, every part the same ones) where
torch draws the whole parameter; ``kaiming_*`` on a rank whose part is
empty returned without drawing (the generator out of step with torch's
from there on); the fans ``kaiming_*`` / ``xavier_*`` take from the shape
failed on the 1-D part (an IndexError). Here the init runs on a whole
tensor of the parameter's shape, each rank drawing from its generator as
torch does (so the generators stay in step with torch's), and the part is
kept. A draw on a tensor made from the parameter that is its part
(``p.data.normal_()``, HF's ``_init_weights``; ``p.detach()``;
``nn.init.kaiming_uniform_(p.data)``) drew the part alone, every rank the
same numbers, without a word: torch.Tensor's draws look such a tensor up
(its data_ptr, numel and stride those of a part, register_part) and run
on the whole tensor too. An empty part has a stride of its own
(empty_part), so a rank whose part of a parameter is empty still knows
which parameter's draw it is (and draws as many numbers as torch)."""
import itertools
import threading
import weakref

import torch

from .reroute import reroute

# torch.nn.init's functions that draw or read the whole shape (constant_,
# zeros_, ones_ are element-wise: right on the part as they are)
_WHOLE = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
          "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "eye_", "dirac_")

# a tensor's in-place draws (_ShardParameter's methods, and torch.Tensor's
# on a plain tensor that is a part: p.data.normal_())
DRAWS = ("normal_", "uniform_", "log_normal_", "exponential_", "cauchy_", "geometric_",
         "bernoulli_", "random_")
_TORCH = {}  # name -> torch.Tensor's own method, before install()

_INSTALLED = [False]

# part.data_ptr() -> [(weakref to its wrapper, entry)], a transient unit's
# parts (an empty one at the same address as others, told apart by stride)
_PARTS = {}
_EMPTY_STRIDES = itertools.count(2)  # never 1, a slice's
# guards the changes of _PARTS (each list replaced, never edited: a look-up
# in another thread reads the old one or the new one) and of the patches'
# state; reentrant: a wrapper's weakref callback may run inside a change
LOCK = threading.RLock()
_LISTENERS = []  # called (under LOCK) once _PARTS changed: Patches to set
_REFS = {}  # id(wrapper) -> its one weakref, whose callback prunes _PARTS


class Patches:
    """torch's methods (or functions) replaced by checks only while the
    checks can find something (a part, a stale parameter): set(False) puts
    torch's own back, so that a process whose wrappers are closed or gone
    pays nothing per call."""

    def __init__(self):
        self.items = []  # (owner, name, torch's, the check's)
        self.on = False

    def add(self, owner, name, wrap):
        """Makes wrap(torch's owner.name) the one set while on; torch's."""
        theirs = getattr(owner, name)
        self.items.append((owner, name, theirs, wrap(theirs)))
        return theirs

    def set(self, on):
        with LOCK:
            if on != self.on:
                for owner, name, theirs, ours in self.items:
                    setattr(owner, name, ours if on else theirs)
                self.on = on


_DRAW_PATCHES = Patches()


def empty_part(sh, a):
    """sh[a:a], an empty part of the shard sh, with a stride no other part
    has: p.data and p.detach() keep it, so a draw on one is known as this
    parameter's (empty, the stride is never read for elements)."""
    return sh[a:a].as_strided((0,), (next(_EMPTY_STRIDES),), sh.storage_offset() + a)


def register_part(sm, e):
    """e.part, a transient entry's part of wrapper sm's shard, is known to
    the draws on a plain tensor (_alias) until its client closes or sm is
    gone (prune)."""
    with LOCK:
        ref = _REFS.get(id(sm))
        if ref is None or ref() is not sm:
            ref = _REFS[id(sm)] = weakref.ref(sm, _gone)
        ptr = e.part.data_ptr()
        _PARTS[ptr] = _PARTS.get(ptr, []) + [(ref, e)]
        _changed()


def _gone(ref):
    prune()


def _live(ref):
    sm = ref()
    # a closed client's areas are unmapped: a later wrapper's shard may be
    # mapped at the same address (its part then taken for the old one's, a
    # draw on p.data given the old parameter's shape)
    return sm is not None and not sm.client.closed


def prune():
    """Forgets the parts of wrappers that are gone or whose client closed
    (a client's close() calls it): with none left the checks are off."""
    with LOCK:
        for ptr, got in list(_PARTS.items()):
            kept = [x for x in got if _live(x[0])]
            if not kept:
                del _PARTS[ptr]
            elif len(kept) != len(got):
                _PARTS[ptr] = kept
        for k, ref in list(_REFS.items()):
            if ref() is None:
                del _REFS[k]
        _changed()


def _changed():
    for fn in _LISTENERS:
        fn()


def _first(sm, e):
    """The first element of e's part in its parameter."""
    for u in sm.units:
        if any(x is e for x in u.entries):
            s0 = sm.client.rank * u.buffer.shard_numel
            return e, min(max(s0 - e.offset, 0), e.numel)
    return None


def _alias(t):
    """(entry, first element) where t, a plain tensor, is a registered
    part (its address, numel, stride, dtype, device): ``p.data``,
    ``p.detach()`` of a transient parameter outside forward."""
    got = _PARTS.get(t.data_ptr())
    if not got:
        return None
    n, st = torch.Tensor.numel(t), t.stride()
    for ref, e in got:
        if not _live(ref):
            prune()  # a client closed without telling (garbage-collected)
            continue
        sm, part = ref(), e.part
        if (sm is not None and part.numel() == n and part.stride() == st
                and part.dtype == t.dtype and part.device == t.device and sm.transient):
            return _first(sm, e)
    return None


def part_of(p):
    """(entry, first element of the part in the parameter) where p is a
    transient wrapper's parameter that is its part of this rank's shard
    now (outside forward), or a plain tensor made from one (``p.data``,
    ``p.detach()``); None else (gathered: the whole parameter)."""
    if not isinstance(p, torch.nn.Parameter):
        if type(p) is torch.Tensor and _PARTS and p.dim() == 1:
            return _alias(p)
        return None
    from .optimizer_hook import owner_of
    sm = owner_of(p)
    if sm is None or not sm.transient:
        return None
    e = sm._by_param.get(id(p))
    if e is None or e.part is None:
        return None
    n = e.part.numel()
    if torch.Tensor.numel(p) != n or (n and p.data_ptr() != e.part.data_ptr()):
        return None
    return _first(sm, e)


def on_whole(fn, p, args, kwargs, got=None):
    """fn(p, *args, **kwargs), an in-place init: where p is its part, fn
    runs on a whole tensor of the parameter's shape and this rank's part is
    copied from it."""
    got = got or part_of(p)
    if got is None:
        return fn(p, *args, **kwargs)
    e, lo = got
    whole = torch.empty(e.shape, dtype=p.dtype, device=p.device)
    fn(whole, *args, **kwargs)
    with torch.no_grad():
        torch.Tensor.copy_(p, whole.reshape(-1)[lo:lo + e.part.numel()])
    return p


def draw(p, name, args, kwargs):
    """p.<name>(*args, **kwargs), a tensor's in-place draw (normal_,
    uniform_, ...: _ShardParameter's methods), on the whole parameter."""
    method = _TORCH.get(name) or getattr(torch.Tensor, name)
    if part_of(p) is not None and torch.is_grad_enabled() and p.requires_grad:
        return method(p, *args, **kwargs)  # torch's error (a leaf in an in-place op)
    return on_whole(method, p, args, kwargs)


def _plain_draw(name, torch_method):
    """torch.Tensor.<name>: on a plain tensor that is a part (p.data), the
    whole parameter's draw; else torch's (one dict look-up more)."""
    def method(self, *args, **kwargs):
        if _PARTS and type(self) is torch.Tensor:
            got = part_of(self)
            if got is not None:
                return on_whole(torch_method, self, args, kwargs, got)
        return torch_method(self, *args, **kwargs)
    method.__name__ = name
    method.__qualname__ = "Tensor." + name
    method.__doc__ = torch_method.__doc__
    return method


def install():
    """Makes torch.nn.init's functions in _WHOLE run on the whole parameter
    (on_whole), once per process (a ShardedModule's construction calls it).
    Each function object keeps its identity (reroute.py), so names bound
    before (``from torch.nn.init import trunc_normal_``) and module code
    calling ``init.kaiming_uniform_`` (a Linear's reset_parameters) reach
    it."""
    if _INSTALLED[0]:
        return
    _INSTALLED[0] = True
    import torch.nn.init as init
    # the fans a Linear's or Conv's reset_parameters() takes of its weight
    # for its bias's bound (init._calculate_fan_in_and_fan_out(self.weight))
    torch_fans = init._calculate_fan_in_and_fan_out

    def _calculate_fan_in_and_fan_out(tensor):
        got = part_of(tensor)
        return torch_fans(tensor if got is None else torch.empty(got[0].shape, device="meta"))

    init._calculate_fan_in_and_fan_out = _calculate_fan_in_and_fan_out
    # p.data.normal_() (HF's _init_weights), p.detach().uniform_(): while
    # a part is known
    for name in DRAWS:
        _TORCH[name] = _DRAW_PATCHES.add(torch.Tensor, name,
                                         lambda fn, name=name: _plain_draw(name, fn))
    _LISTENERS.append(lambda: _DRAW_PATCHES.set(bool(_PARTS)))
    with LOCK:
        _changed()
    for name in _WHOLE:
        reroute(init, name, lambda torch_fn: lambda tensor, *args, **kwargs: on_whole(
            torch_fn, tensor, args, kwargs))
