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
kept. What draws on another tensor (``p.data.normal_()``, HF's
``_init_weights``) is not seen: see the README."""
import torch

from .reroute import reroute

# torch.nn.init's functions that draw or read the whole shape (constant_,
# zeros_, ones_ are element-wise: right on the part as they are)
_WHOLE = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
          "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "eye_", "dirac_")

_INSTALLED = [False]


def part_of(p):
    """(entry, first element of the part in the parameter) where p is a
    transient wrapper's parameter that is its part of this rank's shard
    now (outside forward); None else (gathered: the whole parameter)."""
    if not isinstance(p, torch.nn.Parameter):
        return None
    from .optimizer_hook import _OWNERS
    got = _OWNERS.get(id(p))
    sm = got[1]() if got is not None and got[0]() is p else None
    if sm is None or not sm.transient:
        return None
    e = sm._by_param.get(id(p))
    if e is None or e.part is None:
        return None
    n = e.part.numel()
    if torch.Tensor.numel(p) != n or (n and p.data_ptr() != e.part.data_ptr()):
        return None
    for u in sm.units:
        if any(x is e for x in u.entries):
            s0 = sm.client.rank * u.buffer.shard_numel
            return e, min(max(s0 - e.offset, 0), e.numel)
    return None


def on_whole(fn, p, args, kwargs):
    """fn(p, *args, **kwargs), an in-place init: where p is its part, fn
    runs on a whole tensor of the parameter's shape and this rank's part is
    copied from it."""
    got = part_of(p)
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
    method = getattr(torch.Tensor, name)
    if part_of(p) is not None and torch.is_grad_enabled() and p.requires_grad:
        return method(p, *args, **kwargs)  # torch's error (a leaf in an in-place op)
    return on_whole(method, p, args, kwargs)


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
    for name in _WHOLE:
        reroute(init, name, lambda torch_fn: lambda tensor, *args, **kwargs: on_whole(
            torch_fn, tensor, args, kwargs))
