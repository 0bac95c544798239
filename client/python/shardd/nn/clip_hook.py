"""torch's clip_grad_norm_ over a transient wrapper's parameters: the
global norm, as over the unwrapped model (see install)."""
import functools

import torch

from .grads import _Grad16
from .optimizer_hook import _listed, owner_of
from .reroute import reroute

_INSTALLED = [False]


def _clip_grad_norm_(torch_clip, parameters, max_norm, norm_type=2.0,
                     error_if_nonfinite=False, *args, **kwargs):
    """torch.nn.utils.clip_grad_norm_, where the parameters are a transient
    ShardedModule's: outside forward each is this rank's 1-D part of the
    shard and its .grad its part of the reduced gradient, so torch's own
    would take the norm of this rank's parts only (a per-rank norm, every
    rank clipping by another coefficient, without an error, as under FSDP1
    with use_orig_params); here the parts' norms are all-reduced over the
    ranks (a collective: every rank calls it, as every rank of a training
    loop does) and each part scaled as torch scales the whole gradient.
    Anything else (no wrapper's parameter: a plain model; a resident
    client's or a 16-bit unit's, whose .grad refuses torch's by name) goes
    to torch's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    sm, others = None, []
    for p in params:
        owner = owner_of(p)
        if isinstance(p.grad, _Grad16):
            # a 16-bit unit's: its .grad refuses torch's by name (the fp32
            # master and reduced gradient are the daemon's)
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, *args, **kwargs)
        if owner is not None and owner.transient:
            if sm is not None and owner is not sm:
                raise RuntimeError(
                    "torch.nn.utils.clip_grad_norm_: the parameters are of two "
                    "shardd.nn.ShardedModules; clip each one's (or call each "
                    "wrapper's sm.clip_grad_norm_)")
            sm = owner
        elif p.grad is not None:
            others.append(p)
    if sm is None:
        return torch_clip(params, max_norm, norm_type, error_if_nonfinite, *args, **kwargs)
    if others:
        names = {id(q): n for n, q in sm.module.named_parameters()}
        raise RuntimeError(
            "torch.nn.utils.clip_grad_norm_ over parameters of a shardd.nn."
            "ShardedModule (each rank's part of the shard, whose norm is taken over "
            "every rank) and %s: tensor%s no wrapper manages (a module added after "
            "wrapping, another model), whose gradient may be each rank's own: their "
            "global norm is not known. Register them before wrapping, or clip "
            "them apart" % _listed([names.get(id(q), "a tensor of shape %s"
                                          % (tuple(q.shape),)) for q in others]))
    total = sm._clip_grads(params, float(max_norm), norm_type, error_if_nonfinite)
    grads = [p.grad for p in params if p.grad is not None]
    return total.to(grads[0].device) if grads else total


def install():
    """Makes torch.nn.utils.clip_grad_norm_ (and clip_grad_norm, which
    calls it) compute the global norm over a transient ShardedModule's
    parameters, once per process (a ShardedModule's construction calls
    it). The function object keeps its identity (reroute.py), so a name
    bound before (``from torch.nn.utils import clip_grad_norm_`` at a
    script's top; Lightning's and HF's call sites) reaches it too; what is
    not a wrapper's goes to torch's function unchanged."""
    if _INSTALLED[0]:
        return
    _INSTALLED[0] = True
    import torch.nn.utils
    import torch.nn.utils.clip_grad as cg
    reroute(cg, "clip_grad_norm_", lambda torch_clip: functools.partial(_clip_grad_norm_,
                                                                        torch_clip))
    if torch.nn.utils.clip_grad_norm_ is not cg.clip_grad_norm_:  # replaced (a closure)
        torch.nn.utils.clip_grad_norm_ = cg.clip_grad_norm_
