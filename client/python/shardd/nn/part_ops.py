"""Element-wise writes that meet a transient unit's parameter outside
forward, where it is this rank's 1-D part of the shard, as if it were the
whole parameter. Two habits computed something else than torch without a
word:

* a copy of the model made before wrapping (an EMA, SWA's
  ``AveragedModel``) updated over ``zip(ema.parameters(),
  model.parameters())``: ``ema_p.mul_(d).add_(p.detach(), alpha=1 - d)``
  or ``ema_p.copy_(p)`` broadcast the part over the whole tensor where its
  length is 1 or the last dimension's (and failed on the shapes, naming
  neither, elsewhere);
* a write into one row of the part: nn.Embedding's ``reset_parameters()``
  (``weight[padding_idx].fill_(0)``), HF's ``_init_weights``
  (``weight.data[padding_idx].zero_()``), ``p.data[i] = v``: torch's row i
  is another place in the part (or in another rank's), so a row that
  should be zero keeps its values and an element of another is zeroed.

torch.Tensor's in-place methods below (``+=`` and the like too, operands
given by name too, torch._foreach_*'s, pair by pair, and torch.add's and
the like's ``out=``: ``torch.lerp(e, p, w, out=e)``; ``ema[:] = p``)
refuse both, naming the parameter and the way to do it (a part is found
as inits.part_of finds a draw's: the parameter, or a plain tensor at a
registered part's address); a write by index (``index_fill_``,
``scatter_``, ``put_``, ...) into a part or a view of one, whose index is
the whole parameter's, too. A write between two tensors of the part's
shape (an optimizer's, an EMA kept as parts; ``masked_fill_`` or
``p.data[mask] = v`` with a mask of its shape), with a value of one
element, and a write into a whole part (``p.data.zero_()``,
``p.data[:] = t``) are torch's, for one dictionary look-up more per call
while a part is known: once every transient wrapper's client is closed
(or the wrapper gone) and no resident parameter is stale, torch's own
methods are back (inits.Patches), costing nothing. A part met through an
expression (``e.copy_(d * e + (1 - d) * p)``, ``e += (1 - d) * p``) is a
new tensor, not found: those still broadcast the part without a word.
nn.Embedding's own zeroing of its padding row (in its
``reset_parameters()`` after wrapping, after inits.py's whole draw)
zeroes the elements of the row that lie in this rank's part, as
torch's.

On a resident client the parameters are the gathered copy, which an
optimizer step leaves holding the stepped values (it gathers what it
changed: ShardedModule._stepped). Where that gather failed (a peer lost)
they hold the values from before the step until a gather(): an EMA
updated from them (``e.add_(p.detach(), ...)``) would lag torch's by a
step, so the same writes refuse such a parameter as an operand, naming it
and ``sm.gather()``."""
import weakref

import torch

from .inits import LOCK, _LISTENERS, _PARTS, Patches, part_of, prune

# in-place writes that take another tensor and broadcast it
_BINARY = ("add_", "sub_", "mul_", "div_", "lerp_", "copy_", "addcmul_", "addcdiv_",
           # ``a += p`` (a sum of parameters for an average) calls these, not add_
           "__iadd__", "__isub__", "__imul__", "__itruediv__",
           # element-wise where the mask has the part's shape (and masked_scatter_'s
           # source is the part's); a mask of the whole's is refused
           "masked_fill_", "masked_scatter_",
           # the same broadcast of another tensor operand (a bound: clamp_(min=p),
           # an exponent, a sign), and the aliases that bypass the names above
           "clamp_", "clip_", "copysign_", "pow_", "float_power_", "fmod_", "remainder_",
           "atan2_", "arctan2_", "hypot_", "xlogy_", "heaviside_", "nextafter_", "ldexp_",
           "true_divide_", "divide_", "multiply_", "subtract_")
# torch's in-place writes over lists, pairwise (timm's ModelEmaV3 steps an
# EMA so; they broadcast as the methods do)
_FOREACH = ("_foreach_add_", "_foreach_sub_", "_foreach_mul_", "_foreach_div_",
            "_foreach_lerp_", "_foreach_addcmul_", "_foreach_addcdiv_")
# in-place writes of a value: refused on a view into a part (a row of it)
_FILLS = ("zero_", "fill_")
# in-place writes at indices: an index into a part is not torch's
_INDEXED = ("index_fill_", "index_copy_", "index_add_", "index_reduce_", "scatter_",
            "scatter_add_", "scatter_reduce_", "put_", "index_put_")
# products of a tensor with a whole parameter: of a part, a dot product of
# 1-D parts (LoRA's merge W += B @ A * scale outside forward) or a failure
# naming neither (Tensor's methods and torch's functions)
_MATMUL = ("matmul", "mm", "__matmul__", "__rmatmul__")
# torch's functions whose out= is an in-place write as _BINARY's
# (torch.lerp(e, p, w, out=e), an EMA's update; torch.maximum(e, p, out=e),
# a running maximum; torch.where(c, e, p, out=e); torch.addmm(p, a, b,
# out=e), the part as the bias)
_OUT = ("add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv",
        "maximum", "minimum", "fmax", "fmin", "clamp", "clip", "where", "addmm",
        "copysign", "pow", "float_power", "fmod", "remainder", "atan2", "arctan2",
        "hypot", "xlogy", "heaviside", "nextafter", "ldexp", "logaddexp", "true_divide",
        "divide", "multiply", "subtract")
_PATCHES = Patches()  # all of the above, set while a part or stale parameter is known
_TORCH = {}  # name -> torch.Tensor's own method, before install()
# a resident wrapper's parameters (the gathered copy) between an optimizer
# step and the next gather(), when they hold the values from before the
# step: their address -> (weak parameter, name); read as an operand of the
# writes below (an EMA's update after the step) they are refused
_STALE = {}
_INSTALLED = [False]

_EMA = ("a copy of the model kept beside it (an EMA, SWA's AveragedModel) is "
        "updated from model.state_dict() (every parameter whole, a collective on "
        "every rank), or kept as parts: [p.detach().clone() for p in "
        "model.parameters()] made after wrapping")


def _part(t):
    """(entry, first element) where t is a part now; None else (cheap for
    tensors that are not 1-D)."""
    if not isinstance(t, torch.Tensor) or torch.Tensor.dim(t) != 1:
        return None
    return part_of(t)


def _describe(e, lo, t):
    n = torch.Tensor.numel(t)
    return ("%r (outside forward this rank's 1-D part of it, elements [%d, %d) of "
            "its %s)" % (e.name, lo, lo + n, "x".join(str(d) for d in e.shape) or "scalar"))


def _shape(t):
    return tuple(torch.Tensor.size(t))


def _check_binary(name, self, args):
    """Refuses self.<name>(*args) where a part meets a tensor of another
    shape (a 0-dim one is a value, broadcast as torch's)."""
    shape = self.shape
    for a in args:  # a loop, not all(): this runs on every optimizer write
        if isinstance(a, torch.Tensor) and a.shape != shape:
            break
    else:
        return  # the optimizer's writes, a value's
    tensors = [self] + [a for a in args if isinstance(a, torch.Tensor)]
    shapes = {_shape(t) for t in tensors if torch.Tensor.dim(t) > 0}
    if len(shapes) < 2:
        return
    for t in tensors:
        got = _part(t)
        if got is None:
            continue
        # a value of one element (torch.tensor([s])) broadcast into the
        # part leaves its shape: torch's on the whole parameter too
        other = [s for s in {_shape(a) for a in tensors if a is not t and (
            torch.Tensor.dim(a) > 1 or torch.Tensor.numel(a) != 1 or _part(a) is not None)}
            if s != _shape(t) and s != ()]
        if not other:
            continue
        e, lo = got
        other = other[0]
        raise RuntimeError(
            "%s of a tensor of shape %s with %s: torch would broadcast the "
            "part (or fail on the shapes), not combine the whole parameter; %s" % (
                name, list(other), _describe(e, lo, t), _EMA))


def mark_stale(sm, stale):
    """The parameters of sm (a resident wrapper) hold values from before
    a step (stale True, after it) or the shards' (after a gather, or its
    client's close())."""
    with LOCK:
        for e in (e for u in sm.units for e in u.entries):
            ptr = e.param.data_ptr()
            if not stale:
                _STALE.pop(ptr, None)
            elif torch.Tensor.numel(e.param):
                _STALE[ptr] = (weakref.ref(e.param, lambda r, ptr=ptr: _unstale(ptr, r)),
                               e.name)
        _refresh()


def _unstale(ptr, ref):
    with LOCK:  # a parameter gone: its address may be another tensor's
        if _STALE.get(ptr, (None,))[0] is ref:
            del _STALE[ptr]
        _refresh()


def _refresh():
    _PATCHES.set(_INSTALLED[0] and bool(_PARTS or _STALE))


def closed(sm):
    """sm's client closed: its parts and stale parameters are forgotten
    (with no other wrapper's left, torch's own methods are back)."""
    if sm is not None:
        mark_stale(sm, False)
    prune()


def _check_stale(name, args):
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if not isinstance(t, torch.Tensor):
                continue
            got = _STALE.get(t.data_ptr())
            p = got[0]() if got is not None else None
            if p is None or torch.Tensor.numel(p) != torch.Tensor.numel(t):
                continue
            raise RuntimeError(
                "%s reads %r, on a resident client the gathered copy, which holds "
                "the values from before the last optimizer step (torch's parameter "
                "holds the stepped ones): call sm.gather() (a collective, every "
                "rank) before reading it, as before a forward" % (name, got[1]))


def _check_fill(name, self):
    """Refuses a fill of a view into a part (one row, one element)."""
    base = self._base
    if base is None or type(self) is not torch.Tensor:
        return
    got = _part(base)
    if got is None or _part(self) is not None:
        return
    e, lo = got
    raise RuntimeError(
        "Tensor.%s of an element or row of %s: an index into the part is not "
        "torch's row (nn.Embedding's padding row, written by its reset_parameters() "
        "or HF's _init_weights, lies elsewhere, maybe in another rank's part); "
        "write it before wrapping, or load the whole parameter with "
        "model.load_state_dict()" % (name, _describe(e, lo, base)))


def _check_index(name, self, args):
    """Refuses self.<name>(index, ...) where self is a part or a view into
    one, or where a part is written into a tensor of another shape."""
    got, t = _part(self), self
    if got is None and self._base is not None and type(self) is torch.Tensor:
        got, t = _part(self._base), self._base
    if got is not None and not _mask_of(self, args[:1] and args[0]):
        e, lo = got
        raise RuntimeError(
            "Tensor.%s into %s: its index is not torch's (an index of the whole "
            "parameter lies elsewhere, maybe in another rank's part); write it before "
            "wrapping, or load the whole parameter with model.load_state_dict()" % (
                name, _describe(e, lo, t)))
    for a in args:
        for v in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(v, torch.Tensor) and v.shape != self.shape and _part(v):
                _check_binary("Tensor." + name, self, (v,))


def _mask_of(t, index):
    """index (of t[index], index_put_'s) is one bool tensor of t's shape:
    element-wise, torch's on a part too."""
    if isinstance(index, (list, tuple)) and len(index) == 1:
        index = index[0]
    return (isinstance(index, torch.Tensor) and index.dtype == torch.bool
            and index.shape == t.shape)


def _indexed(name, torch_method):
    def method(self, *args, **kwargs):
        if _PARTS:
            _check_index(name, self, args + tuple(kwargs.values()) if kwargs else args)
        return torch_method(self, *args, **kwargs)
    return _like(method, name, torch_method)


def _matmul(name, torch_fn, owner="Tensor."):
    def fn(*args, **kwargs):
        if _PARTS:
            for t in args[:2]:
                got = _part(t)
                if got is not None and tuple(got[0].shape) != _shape(t):
                    e, lo = got
                    raise RuntimeError(
                        "%s%s of %s: torch's multiplies the whole parameter (a part "
                        "gives a dot product of parts, or fails on the shapes); take "
                        "the whole parameters from sm.full_parameters() (FSDP's "
                        "summon_full_params; a LoRA merge W + B @ A * scale so) and "
                        "write them back with model.load_state_dict(), or compute it "
                        "inside a forward" % (owner, name, _describe(e, lo, t)))
        return torch_fn(*args, **kwargs)
    return _like(fn, name, torch_fn, owner=owner)


def _out(name, torch_fn):
    def fn(*args, **kwargs):
        out = kwargs.get("out")
        if out is not None and (_PARTS or _STALE) and isinstance(out, torch.Tensor):
            ops = args + tuple(v for k, v in kwargs.items() if k != "out")
            if _PARTS:
                _check_binary("torch." + name, out, ops)
            if _STALE:
                _check_stale("torch." + name, ops)
        return torch_fn(*args, **kwargs)
    return _builtin(_like(fn, name, torch_fn, owner=""), name)


def _builtin(fn, name):
    """fn, standing for torch.<name>, known to torch.jit as aten's."""
    try:  # torch.jit.script over a function calling torch.add: still aten's
        torch.jit._builtins._register_builtin(fn, "aten::" + name)
    except Exception:
        pass
    return fn


def _binary(name, torch_method):
    def method(self, *args, **kwargs):
        if _PARTS or _STALE:
            # add_(other=p), lerp_(end=p): an operand by name is one too
            ops = args + tuple(kwargs.values()) if kwargs else args
            if _PARTS:
                _check_binary("Tensor." + name, self, ops)
                if self._base is not None:  # w.data[pad].mul_(0): as zero_()
                    _check_fill(name, self)
            if _STALE:
                _check_stale("Tensor." + name, ops)
        return torch_method(self, *args, **kwargs)
    return _like(method, name, torch_method)


def _foreach(name, torch_fn):
    def fn(selves, *args, **kwargs):
        if _PARTS:
            lists = [a for a in args if isinstance(a, (list, tuple))]
            shapes = [t.shape for t in selves]
            # an optimizer's lists pair tensors of one shape: checked at once
            if any(isinstance(a[0], torch.Tensor) and (
                    len(a) != len(shapes) or [t.shape for t in a] != shapes)
                   for a in lists if a):
                for i, t in enumerate(selves):
                    _check_binary("torch." + name, t, [a[i] for a in lists if i < len(a)])
        if _STALE:
            _check_stale("torch." + name, args)
        return torch_fn(selves, *args, **kwargs)
    return _like(fn, name, torch_fn, owner="")


def _fill(name, torch_method):
    def method(self, *args, **kwargs):
        if _PARTS:
            _check_fill(name, self)
        return torch_method(self, *args, **kwargs)
    return _like(method, name, torch_method)


def _setitem(torch_method):
    def __setitem__(self, index, value):
        if _PARTS:
            got = _part(self)
            if got is None:
                if self._base is not None:  # v = p.data[1:3]; v[0] = 1
                    _check_fill("__setitem__", self)
                if isinstance(value, torch.Tensor) and _part(value) is not None:
                    # ema[:] = p: the part broadcast into what it is assigned to
                    _check_binary("Tensor.__setitem__", torch.Tensor.__getitem__(
                        self, index), (value,))
            elif _whole_index(index):
                # p.data[:] = t: the whole part written, as copy_(t)
                _check_binary("Tensor.__setitem__", self, (value,))
            elif not _mask_of(self, index):  # p.data[p.data < 0] = 0: torch's
                e, lo = got
                raise RuntimeError(
                    "an item assignment into %s: its index is not torch's (a row of "
                    "the whole parameter lies elsewhere, maybe in another rank's "
                    "part); write it before wrapping, or load the whole parameter "
                    "with model.load_state_dict()" % _describe(e, lo, self))
        return torch_method(self, index, value)
    return _like(__setitem__, "__setitem__", torch_method)


def _whole_index(index):
    return index is Ellipsis or (type(index) is slice and index == slice(None))


def _like(method, name, torch_method, owner="Tensor."):
    method.__name__ = name
    method.__qualname__ = owner + name
    method.__doc__ = torch_method.__doc__
    return method


def _padding_zeroed(torch_method):
    def _fill_padding_idx_with_zero(self):
        got = part_of(self.weight) if self.padding_idx is not None else None
        if got is None:
            return torch_method(self)
        e, lo = got
        row = e.numel // e.shape[0]
        a = self.padding_idx % e.shape[0] * row - lo  # the row's start in the part
        part = self.weight.detach()
        n = torch.Tensor.numel(part)
        _TORCH["zero_"](part[min(max(a, 0), n):min(max(a + row, 0), n)])
    return _fill_padding_idx_with_zero


def install():
    """torch's methods and functions above check for a part while one (or
    a stale parameter) is known (_refresh), once per process (a
    ShardedModule's construction calls it)."""
    with LOCK:
        if _INSTALLED[0]:
            return
        _INSTALLED[0] = True
        for names, wrap in ((_BINARY, _binary), (_FILLS, _fill), (_INDEXED, _indexed)):
            for name in names:
                _TORCH[name] = _PATCHES.add(torch.Tensor, name,
                                            lambda fn, name=name, wrap=wrap: wrap(name, fn))
        for names, wrap in ((_FOREACH, _foreach), (_OUT, _out)):
            for name in names:
                if hasattr(torch, name):
                    _TORCH[name] = _PATCHES.add(torch, name,
                                                lambda fn, name=name, wrap=wrap: wrap(name, fn))
        for name in _MATMUL:
            _TORCH[name] = _PATCHES.add(torch.Tensor, name,
                                        lambda fn, name=name: _matmul(name, fn))
            if hasattr(torch, name):
                _PATCHES.add(torch, name, lambda fn, name=name: _builtin(
                    _matmul(name, fn, "torch."), name))
        _TORCH["__setitem__"] = _PATCHES.add(torch.Tensor, "__setitem__", _setitem)
        emb = torch.nn.Embedding
        emb._fill_padding_idx_with_zero = _padding_zeroed(emb._fill_padding_idx_with_zero)
        _LISTENERS.append(_refresh)
        _refresh()
