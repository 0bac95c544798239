"""The .grad stand-ins that refuse torch.optim by name: a 16-bit unit's
(its fp32 master and reduced gradient are the daemon's) and a resident
client's (the unreduced gradient of a gathered copy)."""

import torch


# what a 16-bit parameter's .grad stand-in lets through: the zeroing of
# torch's and nn.Module's zero_grad() (on the reduced gradient) and the
# attribute reads around it
_GRAD16_GETS = frozenset(("grad_fn", "requires_grad", "shape", "dtype", "device",
                          "is_leaf", "is_cuda", "layout"))


class _Grad16(torch.Tensor):
    """The .grad of a 16-bit unit's parameter outside backward. The reduced
    gradient is fp32 in the daemon and the fp32 master of the parameter is
    the daemon's, so torch.optim cannot step it (it would step the 16-bit
    shard and the next daemon step would overwrite it from the master):
    every use but zero_grad() raises, naming the parameter, before an
    optimizer changed anything. zero_() zeroes its part of the reduced
    gradient; set it to None as torch's zero_grad(set_to_none=True) does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", "")
            if name in _GRAD16_GETS or (name == "is_sparse" and _in_zero_grad()):
                return super().__torch_function__(func, types, args, kwargs or {})
        if name == "_foreach_zero_" and args:  # zero_grad of foreach optimizers
            for t in args[0]:
                if isinstance(t, _Grad16):
                    t._rpart.zero_()
                else:
                    with torch._C.DisableTorchFunction():
                        t.zero_()
            return None
        me = args[0] if args and isinstance(args[0], _Grad16) else None
        if me is not None and name == "zero_":
            me._rpart.zero_()  # a plain tensor: no torch function of ours
            return me
        if me is not None and name in ("requires_grad_", "detach_"):
            return me
        who = next((a for a in list(args) + list((kwargs or {}).values())
                    if isinstance(a, _Grad16)), None)
        raise RuntimeError(
            "shardd: %r is a %s parameter whose fp32 master and reduced gradient "
            "live in the daemon: torch.optim optimizers and torch's "
            "clip_grad_norm_ cannot use its .grad (%s); use shardd.optim "
            "(e.g. shardd.optim.AdamW(model.parameters())) and "
            "sm.clip_grad_norm_, or wrap the unit in fp32"
            % (getattr(who, "_name", "?"), getattr(who, "_dtype16", "16-bit"),
               name or func))


def _in_zero_grad():
    """Whether the current tensor operation is part of a zero_grad() of
    torch's optimizers or modules."""
    import sys
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return False
        if f.f_code.co_name == "zero_grad" and f.f_globals.get("__name__", "").startswith(
                ("torch.optim", "torch.nn.modules")):
            return True
        f = f.f_back
    return False


def _torch_caller():
    """The torch function of torch.optim (but its zero_grad) or of torch's
    clip_grad_norm_ that the current tensor operation is part of, or None."""
    import sys
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return None
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("torch.optim"):
            return None if f.f_code.co_name == "zero_grad" else "%s.%s" % (mod, f.f_code.co_name)
        if mod == "torch.nn.utils.clip_grad":
            return "torch.nn.utils.%s" % f.f_code.co_name
        f = f.f_back
    return None


class _ResidentGrad(torch.Tensor):
    """The .grad of a parameter of a resident client: its slice of the grad
    area, where autograd accumulates this rank's unreduced gradient while
    the parameter is the gathered copy. torch.optim would step that copy
    with it, and torch's clip_grad_norm_ scale it by a per-rank norm: both
    raise, naming the parameter. Every other use is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        who = _torch_caller()
        if who is not None:
            me = next((a for a in args if isinstance(a, _ResidentGrad)), None)
            raise RuntimeError(
                "shardd: %s on %r: the client has resident areas, where a parameter "
                "is the gathered copy and its .grad this rank's unreduced gradient "
                "(torch.optim would step the copy, not the shard); use shardd.optim "
                "(e.g. shardd.optim.AdamW(model.parameters())) and sm.clip_grad_norm_, "
                "or a client with transient_areas=True (FSDP's FULL_SHARD), where "
                "torch.optim steps the shards" % (who, getattr(me, "_name", "?")))
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))
