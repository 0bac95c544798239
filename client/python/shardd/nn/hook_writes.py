"""Transient areas: a forward hook of the script's that writes a parameter
in place while its unit is gathered (WGAN's weight clipping as a pre-hook:
``with torch.no_grad(): m.weight.clamp_(-c, c)``, or ``m.weight.data.clamp_``)
writes the gathered copy: on the host backend the node's one copy, mapped
read-only, so the process would die of SIGSEGV with no Python exception;
on the cuda backend a copy the unit's release drops, so the write would be
lost without a word (as a write into FSDP's unsharded copy, freed at
reshard).

So every forward pre-hook and forward hook of the script's on a module of
the wrapped model (registered before wrapping or after) runs, while a
parameter of the module is gathered, with that parameter's ``.data`` a
private copy of the gathered values; after it, a copy that differs
(bitwise) or a ``.data`` replaced raises RuntimeError naming the
parameter, the hook and the module, before the forward computes with it
and before any shard changed (the write is made between steps instead,
after the optimizer's step, where a parameter is its part of this rank's
shard, writable, as torch's). A hook that writes nothing sees the same
values and leaves the parameters as they were. The cost: a copy and a
comparison of the module's gathered parameters per call of such a hook;
a module with no hook of the script's pays nothing, and torch's own
weight_norm / spectral_norm pre-hooks (which compute ``weight`` and write
buffers, not parameters) are not checked."""
import collections
import weakref

import torch


def _safe_hook(hook):
    """torch's weight_norm / spectral_norm hooks (class instances) write no
    parameter: not checked (a copy of the module's parameters per call)."""
    mod = type(hook).__module__ or ""
    return mod in ("torch.nn.utils.weight_norm", "torch.nn.utils.spectral_norm")


class _Guarded:
    """A script's hook, run with the module's gathered parameters as copies
    and refused where it wrote one (see the module docstring)."""
    __slots__ = ("hook", "sm", "kind", "__weakref__")

    def __init__(self, hook, sm, kind):
        self.hook = hook
        self.sm = sm          # weakref to the ShardedModule
        self.kind = kind      # "forward pre-hook" / "forward hook"

    def __call__(self, module, *args):
        sm = self.sm()
        if sm is None or not sm.transient:
            return self.hook(module, *args)
        gathered = _gathered_params(sm, module)
        swapped = []
        prev = getattr(sm, "_hook_swaps", None)
        # a parameter the hook reads from a module whose unit is released
        # (a forward hook after the wrapper's, which released it) is
        # gathered by the read (reads.py): copied then (hooks.py's _read)
        sm._hook_swaps = swapped
        try:
            swapped.extend(to_copies(gathered))
            res = self.hook(module, *args)
        finally:
            sm._hook_swaps = prev
            written = []
            for e, p, orig, copy in swapped:
                if p.data.data_ptr() != copy.data_ptr() or not _same_bits(copy, orig):
                    written.append(e.name)
                p.data = orig
        if written:
            raise RuntimeError(
                "shardd: the %s %s of module %s (%s) wrote parameter(s) %s in place while "
                "their unit is gathered: under the wrapper that is the gathered copy "
                "(read-only on the host backend, dropped at the unit's release), not the "
                "shards, so the write would be lost or kill the process. Write the "
                "parameters between steps instead (after the optimizer's step, "
                "e.g. `with torch.no_grad(): p.clamp_(-c, c)` over model.parameters(), "
                "where each is its part of this rank's shard and the write lands as "
                "in torch); nothing was written to the shards" % (
                    self.kind, _hook_name(self.hook), _module_name(sm, module),
                    type(module).__name__, ", ".join(repr(n) for n in written)))
        return res


def to_copies(params):
    """[(entry, parameter)]: each parameter's .data a copy of its values;
    -> [(entry, parameter, the data before, the copy)]."""
    out = []
    for e, p in params:
        orig = p.data
        copy = orig.clone()
        p.data = copy
        out.append((e, p, orig, copy))
    return out


def _gathered_params(sm, module):
    """[(entry, parameter)] of module's parameters (its children's too)
    that are views of a gathered unit's area now."""
    out = []
    for p in module.parameters():
        # a later forward's leaf in the parameter's place (leaves.py):
        # its data is the gathered area too
        e = sm._by_param.get(id(p.__dict__.get("_shardd_of", p)))
        if e is None or not p.numel():
            continue
        for u in sm.units:
            g = u.gather
            if g is not None and g.numel() and g.dtype == p.dtype and g.device == p.device:
                lo = g.data_ptr()
                if lo <= p.data_ptr() < lo + g.numel() * g.element_size():
                    out.append((e, p))
                    break
    return out


def _module_name(sm, module):
    for n, m in sm.module.named_modules():
        if m is module:
            return repr(n or "<root>")
    return "(outside the wrapped model)"


def _same_bits(a, b):
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _hook_name(hook):
    return repr(getattr(hook, "__qualname__", None) or type(hook).__name__)


class _HookDict(collections.OrderedDict):
    """A module's _forward_pre_hooks / _forward_hooks: it holds the hooks
    as registered, and gives them guarded (values(), what torch's
    _call_impl runs), so a hook the script registers later
    (register_forward_pre_hook stores it here) is guarded too. The dict
    it replaced stays alive: a RemovableHandle of a hook registered
    before wrapping holds a weak reference to that one, and a hook its
    remove() deleted there is dropped here."""

    def __init__(self, old, sm, kind, own):
        super().__init__(old.items())
        self._old = old
        self._from_old = set(old) - own
        self._own = own
        self._sm = sm
        self._kind = kind
        self._guarded = {}

    def _prune(self):
        gone = [k for k in self._from_old if k not in self._old]
        for k in gone:
            self._from_old.discard(k)
            if collections.OrderedDict.__contains__(self, k):
                collections.OrderedDict.__delitem__(self, k)

    def _guard(self, k, hook):
        if k in self._own or _safe_hook(hook) or getattr(hook, "_shardd_own", False):
            return hook
        g = self._guarded.get(k)
        if g is None or g.hook is not hook:
            g = self._guarded[k] = _Guarded(hook, self._sm, self._kind)
        return g

    def values(self):  # torch 1.13's _call_impl runs these
        self._prune()
        return [self._guard(k, v) for k, v in collections.OrderedDict.items(self)]

    def items(self):  # torch 2's runs these
        self._prune()
        return [(k, self._guard(k, v)) for k, v in collections.OrderedDict.items(self)]

    def __bool__(self):
        self._prune()
        return len(self) > 0

    def __delitem__(self, k):
        collections.OrderedDict.__delitem__(self, k)
        self._guarded.pop(k, None)
        if k in self._old:
            del self._old[k]

    def __reduce__(self):  # copy / pickle of the module: a plain dict of the hooks
        self._prune()
        return (collections.OrderedDict, (list(collections.OrderedDict.items(self)),))


def guard_hook_writes(sm, modules, own):
    """Every module's forward pre-hooks and forward hooks but `own` ({(id
    of module, hook key)}: the wrapper's) guarded, now and when registered
    later."""
    ref = weakref.ref(sm)
    for m in modules:
        for attr, kind in (("_forward_pre_hooks", "forward pre-hook"),
                           ("_forward_hooks", "forward hook")):
            d = getattr(m, attr)
            mine = {k for k in d if (id(m), k) in own}
            setattr(m, attr, _HookDict(d, ref, kind, mine))
