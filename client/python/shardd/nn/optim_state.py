"""A torch.optim optimizer's state over a wrapped model's parameters, across
world sizes. Outside forward a parameter is its 1-D part of this rank's
shard, so torch.optim keeps each rank's state of its part (FSDP1's
use_orig_params), and a rank's ``opt.state_dict()`` holds tensors of that
part's shape: loaded as it is into another world (or into another rank)
its moments would land on other elements, the same shape or not.

``opt.state_dict()`` of an optimizer over a wrapper's parameters (torch's
Optimizer.state_dict, extended here) records which part each tensor is,
under PARTS_KEY; ``opt.load_state_dict()`` (extended too) then takes:

* a rank's own dict, in the same world and rank (the parts match);
* a whole dict in torch's layout, each parameter's state whole (plain
  torch's ``optimizer.state_dict()``, or :func:`full_optim_state_dict` of
  every rank's dicts): each rank keeps its part of every element-wise
  state tensor;

and refuses, naming the parameter, before anything changed: a rank's dict
whose parts are not this rank's here (another world size, another rank),
or a tensor that is neither the whole parameter's shape nor the recorded
part's. :func:`full_optim_state_dict` joins every rank's dicts into torch's
layout, which a plain torch optimizer over the unwrapped model loads."""
import functools

import torch

PARTS_KEY = "shardd_parts"


def _owned_parts(opt):
    """{index in the state dict: (entry, lo, hi)} for opt's parameters that
    a ShardedModule wraps (index: torch's numbering, the groups' order),
    [lo, hi) the elements of the parameter this rank's part holds."""
    from .optimizer_hook import owner_of
    out, i = {}, 0
    units = {}
    for g in opt.param_groups:
        for p in g["params"]:
            sm = owner_of(p)
            if sm is not None and sm.transient:  # (resident: torch.optim refused)
                e = sm._by_param.get(id(p))
                if e is not None and e.part is not None:
                    if id(sm) not in units:
                        units[id(sm)] = {id(x): u for u in sm.units for x in u.entries}
                    buf = units[id(sm)][id(e)].buffer
                    s0 = sm.client.rank * buf.shard_numel
                    lo = min(max(s0 - e.offset, 0), e.numel)
                    out[i] = (e, lo, lo + e.part.numel(), sm.client.rank, sm.client.world)
            i += 1
    return out


def _parts_of(owned):
    if not owned:
        return None
    any_ = next(iter(owned.values()))
    return {"rank": any_[3], "world": any_[4],
            "params": {i: {"name": e.name, "range": (lo, hi), "numel": e.numel,
                           "shape": tuple(e.shape)}
                       for i, (e, lo, hi, _, _) in owned.items()}}


def _wrap_state_dict(inner):
    @functools.wraps(inner)
    def state_dict(self, *args, **kwargs):
        sd = inner(self, *args, **kwargs)
        parts = _parts_of(_owned_parts(self))
        if parts is not None:
            sd[PARTS_KEY] = parts
        return sd
    state_dict._shardd_parts = True
    return state_dict


def _is_part(v):
    return isinstance(v, torch.Tensor) and v.dim() > 0


# torch.optim's 0-dim state entries that are one number per parameter (a
# count, ASGD's eta and mu, NAdam's mu_product), not one per element
_COUNTS = ("step", "eta", "mu", "mu_product")


def _whole_keys(state):
    """The state keys a whole dict holds per element (a tensor of its
    parameter's shape, dim > 0, for some parameter); None where no
    parameter's state has one (every parameter 0-dim)."""
    keys = {k for st in state.values() for k, v in st.items() if _is_part(v)}
    return keys or None


def _whole_part(k, v, e, keys):
    """Whether entry k (v) of e's parameter's state in a whole dict is per
    element: a 0-dim parameter's moments are 0-dim like its step count, so
    there the keys other parameters hold per element decide (or, with none,
    torch's names of counts)."""
    if _is_part(v):
        return True
    if not isinstance(v, torch.Tensor) or tuple(e.shape) != () or v.dim() != 0:
        return False
    return k in keys if keys is not None else k not in _COUNTS


def _for_this_rank(opt, sd, owned):
    """sd (a state dict for opt) -> the dict torch's load_state_dict takes
    on this rank: whole state sliced to this rank's parts. Raises
    ValueError, naming the parameter, where that cannot be done right."""
    saved_ids = [k for g in sd["param_groups"] for k in g["params"]]
    if len(saved_ids) != sum(len(g["params"]) for g in opt.param_groups):
        return sd  # torch's own check refuses it, with its message
    parts = sd.get(PARTS_KEY)
    saved_parts = parts["params"] if parts else {}
    state = dict(sd["state"])
    keys = False  # _whole_keys(state), once needed
    for i, (e, lo, hi, rank, world) in owned.items():
        key = saved_ids[i]
        st = state.get(key)
        if st is None:
            continue
        sp = saved_parts.get(i)
        if sp is not None:
            if (tuple(sp["range"]) != (lo, hi) or int(sp["numel"]) != e.numel
                    or sp["name"] != e.name):
                raise ValueError(
                    "load_state_dict: this dict holds the optimizer state of rank %d of %d "
                    "for %r: its elements [%d, %d) (of %r), where this rank (%d of %d) "
                    "holds elements [%d, %d): loaded as it is the state would land on "
                    "other elements. Join every rank's dicts with shardd.nn."
                    "full_optim_state_dict([...]) and load that on every rank"
                    % (parts["rank"], parts["world"], e.name, sp["range"][0],
                       sp["range"][1], sp["name"], rank, world, lo, hi))
            for k, v in st.items():
                if _is_part(v) and tuple(v.shape) != (hi - lo,):
                    raise ValueError("load_state_dict: %r's state %r has shape %s, not its "
                                     "part's (%d,)" % (e.name, k, tuple(v.shape), hi - lo))
            continue
        new = {}
        if keys is False:
            keys = _whole_keys(state)
        for k, v in st.items():
            if _whole_part(k, v, e, keys):
                if tuple(v.shape) != tuple(e.shape):
                    raise ValueError(
                        "load_state_dict: %r's state %r has shape %s, neither the whole "
                        "parameter's %s nor a part this rank's dict recorded (a rank's "
                        "opt.state_dict() of an older shardd?): load a whole dict (plain "
                        "torch's, or shardd.nn.full_optim_state_dict of every rank's)"
                        % (e.name, k, tuple(v.shape), tuple(e.shape)))
                v = v.reshape(-1)[lo:hi].clone()
            new[k] = v
        state[key] = new
    out = dict(sd)
    out.pop(PARTS_KEY, None)
    out["state"] = state
    return out


def _wrap_load_state_dict(inner):
    @functools.wraps(inner)
    def load_state_dict(self, state_dict):
        owned = _owned_parts(self)
        if owned and isinstance(state_dict, dict) and "param_groups" in state_dict:
            state_dict = _for_this_rank(self, state_dict, owned)
        elif isinstance(state_dict, dict) and PARTS_KEY in state_dict:
            raise ValueError(
                "load_state_dict: this dict holds one rank's parts of a wrapped model's "
                "parameters (rank %d of %d); this optimizer's parameters are whole: join "
                "every rank's dicts with shardd.nn.full_optim_state_dict([...]) first"
                % (state_dict[PARTS_KEY]["rank"], state_dict[PARTS_KEY]["world"]))
        return inner(self, state_dict)
    load_state_dict._shardd_parts = True
    return load_state_dict


def install():
    """torch.optim.Optimizer's state_dict and load_state_dict extended as
    the module docstring says (once; an optimizer class that defines its
    own, shardd.optim's, keeps them)."""
    O = torch.optim.Optimizer
    if not getattr(O.state_dict, "_shardd_parts", False):
        O.state_dict = _wrap_state_dict(O.state_dict)
    if not getattr(O.load_state_dict, "_shardd_parts", False):
        O.load_state_dict = _wrap_load_state_dict(O.load_state_dict)


def full_optim_state_dict(dicts):
    """Every rank's ``opt.state_dict()`` of a torch.optim optimizer over a
    wrapped model (a list, any order) -> torch's layout with every
    parameter's state whole (its shape), which a plain torch optimizer over
    the unwrapped model loads, and ``opt.load_state_dict()`` of a wrapped
    model in any world size (each rank takes its part). No client needed.
    Raises ValueError where a rank's dict is missing or a state tensor is
    not element-wise (its part's shape)."""
    dicts = list(dicts)
    if not dicts or not all(isinstance(d, dict) and PARTS_KEY in d for d in dicts):
        raise ValueError("full_optim_state_dict: a list of every rank's opt.state_dict() "
                         "of an optimizer over a wrapped model")
    world = dicts[0][PARTS_KEY]["world"]
    ranks = sorted(d[PARTS_KEY]["rank"] for d in dicts)
    if ranks != list(range(world)) or any(d[PARTS_KEY]["world"] != world for d in dicts):
        raise ValueError("full_optim_state_dict: the dicts are of ranks %s; every rank's "
                         "of world %d is needed, once each" % (ranks, world))
    dicts.sort(key=lambda d: d[PARTS_KEY]["rank"])
    base = dicts[0]
    ids = [[k for g in d["param_groups"] for k in g["params"]] for d in dicts]
    if any(len(x) != len(ids[0]) for x in ids):
        raise ValueError("full_optim_state_dict: the ranks' dicts hold different "
                         "numbers of parameters")
    state, groups, n = {}, [], 0
    for g in base["param_groups"]:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = list(range(n, n + len(g["params"])))
        n += len(g["params"])
        groups.append(d)
    for i in range(len(ids[0])):
        sts = [d["state"].get(ids[r][i]) for r, d in enumerate(dicts)]
        info = base[PARTS_KEY]["params"].get(i)
        if info is None:  # not a wrapper's: each rank holds it whole
            if sts[0] is not None:
                state[i] = sts[0]
            continue
        if all(s is None for s in sts):
            continue
        if any(s is None for s in sts):
            raise ValueError("full_optim_state_dict: %r has state on some ranks only"
                             % (info["name"],))
        numel, shape = int(info["numel"]), tuple(info["shape"])
        ranges = [tuple(d[PARTS_KEY]["params"][i]["range"]) for d in dicts]
        first = next((r for r, (lo, hi) in enumerate(ranges) if hi > lo), 0)
        out = {}
        for k, v0 in sts[first].items():
            if not _is_part(v0):
                out[k] = v0  # step and scalars: the same on every rank
                continue
            whole = torch.zeros(numel, dtype=v0.dtype)
            have = torch.zeros(numel, dtype=torch.bool)
            for r, (lo, hi) in enumerate(ranges):
                v = sts[r].get(k)
                if v is None or tuple(v.shape) != (hi - lo,):
                    raise ValueError(
                        "full_optim_state_dict: %r's state %r on rank %d is %s, not its "
                        "part's shape (%d,): not an element-wise state"
                        % (info["name"], k, r, None if v is None else tuple(v.shape),
                           hi - lo))
                whole[lo:hi] = v.detach().cpu()
                have[lo:hi] = True
            if not bool(have.all()):
                raise ValueError("full_optim_state_dict: %r's state %r: element %d is in "
                                 "no rank's part" % (info["name"], k,
                                                     int((~have).nonzero()[0])))
            out[k] = whole.view(shape)
        state[i] = out
    return {"state": state, "param_groups": groups}
