"""Unit planning: which modules are units (auto_wrap policies, FSDP's),
which parameters each unit holds (nesting, shared parameters), and the
records of a unit (FlatUnit), of one parameter in it (_Entry) and of a
saved tensor in a gathered area (_Saved)."""
import collections
import gc
import weakref

import torch
from torch import nn

import shardd
from .builtin import leaf_children


class FlatUnit:
    """One flat buffer and the original parameters it holds."""

    def __init__(self, name, buffer, entries, module=None, is_root=False):
        self.name = name
        self.buffer = buffer
        self.entries = entries  # list of _Entry
        self.module = module    # the module whose forward is the unit's
        self.is_root = is_root  # holds the root module's own parameters
        # transient areas: the leased areas now held, and where the unit is
        # in this iteration: "idle", "forward" (gathered for forward),
        # "backward" (gathered with a gradient area), "done" (scattered),
        # "late" (gathered again for a saved tensor after it was done)
        self.gather = None
        self.grad = None
        self.state = "idle"
        self.pending = 0
        # forwards of the unit's hooked modules (its own, and every module
        # holding one of its parameters) now running: gathered on the first,
        # released when the outermost returns
        self.depth = 0
        # the outermost running forward is a recomputation in backward
        # (activation checkpointing): the unit stays gathered after it
        self.recompute = False
        # transient: the unit's use by the running root forward (_Use: its
        # gradient's leaves and input bounds), the use whose backward runs
        # now (_UNKNOWN until a gradient says which: a recomputation), and
        # the use that computes with the parameters themselves (a weak
        # reference: the first forward's since its backward came, or its
        # graph was dropped; a later forward's use gets leaves of its own)
        self.fw_use = None
        self.fw_gen = None  # the root forward fw_use belongs to
        self.bw_use = None
        self.param_use = None
        self.live_uses = weakref.WeakSet()  # the _Uses whose graph is alive
        self.swapped = None  # the _Use whose leaves are in its modules now
        self.use = None  # the running use's input views (_bound_inputs)
        # the client's step count at the unit's last scatter: while it is
        # the same, the reduced gradient is the daemon's live one (an
        # accumulating scatter adds to it); a step since consumed it (the
        # daemon's next scatter replaces it), None: never scattered
        self.live_at = None
        # transient: reduced_tensor._version right after zero_grad() zeroed
        # every parameter's part of the reduced-gradient shard (fp32 units):
        # while the version is the same and no scatter came since, the
        # shard is all zeros (its padding always is), and a scatter that
        # replaces it needs nothing added back (_finish)
        self.zeroed_at = None
        # torch.optim can step it: fp32, so its parameters' .grad can be
        # their parts of the (fp32) reduced-gradient shard
        self.torch_grads = buffer.dtype_code == shardd._lib.DTYPE_FP32
        self.ran = False  # transient: a backward reached it (this backward)
        self.no_grad = []  # resident: the views sync_grads found without a .grad
        # resident: its gather area's version counter after our last gather
        # (a write through a parameter since bumps it)
        self.gathered_version = None

    def __repr__(self):
        return "<FlatUnit %r buffer=%d numel=%d params=%d>" % (
            self.name, self.buffer.id, self.buffer.numel, len(self.entries))


class _ShardParameter(nn.Parameter):
    """A transient unit's parameter. Outside forward and backward its data
    is its 1-D part of this rank's shard (FSDP1's use_orig_params view, its
    shape the part's), but dim() and ndim are always its original's: a
    script that splits param groups by them after wrapping (nanoGPT's
    configure_optimizers: weight decay for ``p.dim() >= 2``; timm's: none
    for ``p.ndim <= 1``) gets torch's split, where FSDP1 puts every
    parameter in the no-decay group without a word. What needs the whole
    shape refuses as on a 1-D tensor (``p.shape[1]``, an IndexError), but
    torch.nn.init's functions and the in-place draws below run on the
    whole parameter (inits.py); norm() is the part's, as FSDP1's.
    Anything torch makes from it (``p.detach()``, ``p.data``, ``p * 2``,
    a deepcopy, a state dict) is a plain tensor of the part's shape, except
    where torch returns the object itself (``p.float()`` of an fp32 one)."""
    _shardd_ndim = None  # a deepcopy's (made by type(p)(data)) is its own

    def dim(self):
        n = self._shardd_ndim
        return torch.Tensor.dim(self) if n is None else n

    @property
    def ndim(self):
        return self.dim()

    def norm(self, *args, **kwargs):
        # torch.norm(p, 2) takes range(p.dim()) as its dims
        return torch.Tensor.norm(self.view(self.shape), *args, **kwargs)

    def __repr__(self):
        return "Parameter containing:\n" + repr(self.detach())


def _whole_draw(name):
    def method(self, *args, **kwargs):
        from .inits import draw
        return draw(self, name, args, kwargs)
    method.__name__ = name
    return method


# an in-place draw (nn.init's normal_ / uniform_ / trunc_normal_, p.normal_())
# on the part draws the whole parameter, as torch's (inits.py)
for _name in ("normal_", "uniform_", "log_normal_", "exponential_", "cauchy_", "geometric_",
              "bernoulli_", "random_"):  # inits.DRAWS
    setattr(_ShardParameter, _name, _whole_draw(_name))
del _name


class _Entry:
    __slots__ = ("name", "view", "param", "owners", "grad_view", "offset", "numel",
                 "shape", "acc", "acc_hooks", "got", "part", "rpart", "kept", "grad16", "home")

    def __init__(self, name, view, owners):
        self.name = name          # qualified name of the (first) occurrence
        self.view = view          # shardd.View
        self.owners = owners      # [(module, attr)] where the parameter lives
        self.param = None         # the replacement nn.Parameter (gather view)
        self.grad_view = None     # tensor view of the grad area
        self.offset = view.offset
        self.numel = view.numel
        self.shape = view.shape
        self.acc = None           # transient: its AccumulateGrad node (hooked)
        self.acc_hooks = None     # transient: that node's dict of Python hooks (acc_hooks.py)
        self.got = False          # transient: a gradient reached it this backward
        # its part of this rank's shard and of the reduced-gradient shard
        # (1-D, possibly empty: FSDP's sharded views with use_orig_params)
        self.part = None
        self.rpart = None
        self.kept = False         # transient: its .grad was set when backward began
        self.grad16 = None        # a 16-bit unit's .grad stand-in (_Grad16)
        # data_ptr() of its part of the shard (transient) or of its slice
        # of the gather area (resident): where it is between forwards
        self.home = None


class _Saved:
    """A tensor autograd saved that lay in a unit's gather area: rebuilt from
    the unit's area when backward unpacks it (use: the unit's _Use then)."""
    __slots__ = ("unit", "offset", "size", "stride", "use")

    def __init__(self, unit, offset, size, stride, use=None):
        self.unit = unit
        self.offset = offset
        self.size = size
        self.stride = stride
        self.use = use


# a unit's backward began before anything said which forward's use it is
# (a recomputation of activation checkpointing): its first gradient says
_UNKNOWN = object()


class _Use:
    """One root forward's use of a transient unit (every call of it in that
    forward), whose backward ends on its own: the gradient leaves its
    trainable parameters are in that forward (``leaves`` None: the
    parameters themselves; else a list by entry, a leaf tensor of the
    gathered values for each trainable one, swapped into its modules
    while the unit's forward runs, so that autograd accumulates each
    forward's gradient on its own node), and the inputs whose gradient
    ends it (see _bound_inputs). The graph's hooks hold it: dropped with
    the forward's graph."""
    __slots__ = ("leaves", "accs", "bounds", "calls", "unbounded", "ended", "__weakref__")

    def __init__(self, leaves=None, unbounded=False):
        self.leaves = leaves
        self.accs = []
        self.bounds = 0
        self.calls = 0  # the calls that bounded it (bounds: those whose backward is to come)
        self.unbounded = unbounded
        # the ShardedModule's backward count when its backward last ended
        self.ended = None


# FSDP's auto-wrap never makes these units of their own: they have no
# forward (their parent's forward calls their children), so "children"
# descends through them (torch's size_based_auto_wrap_policy excludes
# them likewise, EXCLUDE_WRAP_MODULES)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
# nor these: the parent's forward reads their parameters, so "children"
# leaves them to the root's unit (gathered all through its forward)
_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=int(1e8),
                                force_leaf_modules=None, exclude_wrap_modules=None):
    """FSDP's size_based_auto_wrap_policy, for auto_wrap (with
    functools.partial for min_num_params): recurse into a module of at least
    min_num_params parameters (not into force_leaf_modules: MultiheadAttention,
    whose forward reads its parameters directly), and wrap one whose
    parameters not wrapped below are at least min_num_params (never a
    container: exclude_wrap_modules, ModuleList and ModuleDict)."""
    if force_leaf_modules is None:
        force_leaf_modules = (nn.MultiheadAttention,)
    if exclude_wrap_modules is None:
        exclude_wrap_modules = _CONTAINERS
    large = nonwrapped_numel >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(force_leaf_modules))
    return large and not isinstance(module, tuple(exclude_wrap_modules))


def _policy(module, auto_wrap):
    """auto_wrap -> FSDP's policy, a callable (module, recurse,
    nonwrapped_numel) -> bool, or None for one unit."""
    if auto_wrap is None or auto_wrap is False or (
            isinstance(auto_wrap, str) and auto_wrap in ("module", "none")):
        return None
    if isinstance(auto_wrap, str) and auto_wrap == "children":
        # each child of the root, and through containers each of theirs
        wrap = set()
        todo = list(module.children())
        while todo:
            m = todo.pop()
            if isinstance(m, _CONTAINERS):
                todo.extend(m.children())
            elif not isinstance(m, _PARAM_CONTAINERS):
                wrap.add(id(m))
        return lambda m, recurse, numel: recurse or id(m) in wrap
    if isinstance(auto_wrap, (set, frozenset, tuple, list)) and auto_wrap and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in auto_wrap):
        # ModuleWrapPolicy / transformer_auto_wrap_policy: every instance
        classes = tuple(auto_wrap)
        return lambda m, recurse, numel: recurse or isinstance(m, classes)
    if callable(auto_wrap) and not isinstance(auto_wrap, type):
        return auto_wrap  # positional: torch 1.13 names the third unwrapped_params
    raise ValueError("auto_wrap must be 'module', 'children', a set of nn.Module "
                     "classes or a callable (module, recurse, nonwrapped_numel) -> bool, "
                     "not %r" % (auto_wrap,))


def _unit_modules(module, auto_wrap):
    """-> [(unit name, module whose forward is the unit's)]: the modules
    auto_wrap's policy wraps, as FSDP's _recursive_wrap walks them (a
    module is asked whether to recurse into it, then, after its children,
    whether to wrap it with the parameters its wrapped descendants left),
    nested ones before their parent, and then the root (for the rest)."""
    policy = _policy(module, auto_wrap)
    if policy is None:
        return [("", module)]
    units = []
    seen = {id(module)}  # a module under two names is one unit
    leaves = leaf_children(module)  # read by their parent's forward (builtin.py)

    def walk(m, name):
        numel = sum(p.numel() for p in m.parameters())
        if not policy(m, True, numel):
            return 0
        wrapped = 0
        for cname, c in m.named_children():
            wrapped += walk(c, name + "." + cname if name else cname)
        if id(m) in seen or id(m) in leaves or not policy(m, False, numel - wrapped):
            return wrapped
        seen.add(id(m))
        units.append((name, m))
        return numel

    walk(module, "")
    units.append(("", module))
    return units


def _collect(module, units):
    """Every parameter of `module`, once, assigned to one of `units` (from
    _unit_modules) by FSDP's rule: the unit of the innermost wrapped module
    holding it, and for a parameter that modules of different units share
    (a tied embedding and output weight) the unit of their lowest common
    ancestor. Only that unit's gather is live whenever any of its users
    runs, and its one gradient collects every use before the unit's
    reduce-scatter; a copy per unit would leave one use on stale values and
    drop its gradient.
    -> (per unit [(qualified name, param, [(module, attr)])] in the order of
    first use, per unit the index of the unit it is nested in (None for the
    root's)); the name is the first one (as module.named_parameters() gives
    it), the owners are every module attribute that holds the parameter."""
    index = {}
    for i, (_, r) in enumerate(units):
        index.setdefault(id(r), i)
    root_i = index[id(module)]
    parent = [None] * len(units)
    at = {"": root_i}  # module occurrence (qualified name) -> its unit
    found = {}   # id(param) -> [name, param, owners, unit indices of its users]
    order = []
    for mname, m in module.named_modules(remove_duplicate=False):
        ui = root_i
        if mname:
            up = at[mname.rsplit(".", 1)[0] if "." in mname else ""]
            ui = index.get(id(m), up)
            if ui != up and parent[ui] is None:
                parent[ui] = up
        at[mname] = ui
        for pname, p in m._parameters.items():
            if p is None:
                continue
            rec = found.get(id(p))
            if rec is None:
                rec = found[id(p)] = [(mname + "." if mname else "") + pname, p, [], set()]
                order.append(rec)
            rec[2].append((m, pname))
            rec[3].add(ui)

    def chain(i):
        out = [i]
        while parent[out[-1]] is not None:
            out.append(parent[out[-1]])
        return out

    out = [[] for _ in units]
    for qn, p, owners, users in order:
        if len(users) == 1:
            ui = users.pop()
        else:  # the innermost unit on every user's chain
            chains = [chain(u) for u in users]
            common = set(chains[0]).intersection(*chains[1:])
            ui = next(u for u in chains[0] if u in common)
        out[ui].append((qn, p, owners))
    return out, parent


def _check_nesting(specs, per_unit, parent):
    """Transient areas: a rank leases 2 gather (and 2 gradient) areas, the
    root unit's all through forward and backward and one more, so a unit
    with parameters inside another non-root one (gathered while its parent
    is) would run into E_LIMIT in the first forward: refused here, naming
    both."""
    def holder(i):  # the nearest enclosing unit that holds parameters
        i = parent[i]
        while i is not None and not per_unit[i]:
            i = parent[i]
        return i

    for i, params in enumerate(per_unit):
        if not params:
            continue
        chain = [i]
        while holder(chain[-1]) is not None:
            chain.append(holder(chain[-1]))
        if len(chain) > 2:
            raise ValueError(
                "auto_wrap: unit %r is nested in unit %r: with transient areas a "
                "rank holds 2 gather areas (the root unit's and one more while "
                "the root holds parameters), and this nesting needs %d at once "
                "(%s); wrap only one of the two, or use resident areas"
                % (specs[i][0], specs[chain[1]][0], len(chain),
                   " in ".join(repr(specs[j][0] or "root") for j in chain)))


def _check_outside_holders(module, per_unit):
    """Refuses a parameter that a module outside `module` holds too (nanoGPT's
    transformer wrapped alone: wte.weight is lm_head.weight): the wrapper
    replaces it only inside, which would silently untie the two. One pass
    over the objects the garbage collector tracks (every nn.Module), at
    construction only."""
    mine = {id(p): qn for params in per_unit for qn, p, _ in params}
    inside = {id(m) for m in module.modules()}
    # type(), not isinstance(): no __class__ of a lazy or deprecated object runs
    mods = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    for m in mods:
        if id(m) in inside:
            continue
        for attr, p in m._parameters.items():
            if p is not None and id(p) in mine:
                raise ValueError(
                    "auto_wrap: parameter %r of the wrapped module is also %s, outside "
                    "it: wrapping would untie them; wrap their common ancestor"
                    % (mine[id(p)], _name_outside(mods, module, m, attr)))


def _name_outside(mods, module, holder, attr):
    """holder.attr named in the lowest module that holds both it and the
    wrapped module, else by its class."""
    parents = collections.defaultdict(list)
    for x in mods:
        for c in x._modules.values():
            if c is not None:
                parents[id(c)].append(x)

    def ancestors(x):  # nearest first
        out, todo, seen = [], [x], {id(x)}
        while todo:
            y = todo.pop(0)
            out.append(y)
            for up in parents[id(y)]:
                if id(up) not in seen:
                    seen.add(id(up))
                    todo.append(up)
        return out

    above = {id(a) for a in ancestors(module)}
    for top in ancestors(holder):
        if id(top) in above:
            names = {id(x): n for n, x in top.named_modules()}
            inner = names[id(module)]
            return "%r of the %s holding both (the wrapped module is its %r)" % (
                (names[id(holder)] + "." if names[id(holder)] else "") + attr,
                type(top).__name__, inner)
    return "the %r of a %s" % (attr, type(holder).__name__)


def _hooked_modules(u):
    """The modules whose forward gathers unit u: its own, and for a unit
    other than the root's (gathered all through the root's forward) every
    module holding one of its parameters, so that a forward that calls
    them without the unit's module (the unit is a container, or the root
    calls a child's submodules directly, as nanoGPT calls the blocks of
    transformer.h) still computes with the gathered values."""
    out = {id(u.module): u.module}
    if not u.is_root:
        for e in u.entries:
            for m, _ in e.owners:
                out.setdefault(id(m), m)
    return list(out.values())


def _tensors(obj):
    """The tensors in a module's output (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
