"""Which ShardedModule a parameter belongs to (shardd.optim), and the
release before any optimizer's step of a unit a forward left gathered for
a backward that has not come (see the package docstring)."""
import functools
import weakref

import torch


# id(replacement parameter) -> (weak parameter, weak ShardedModule), for
# shardd.optim (by id: tensors compare elementwise, so they cannot be keys)
_OWNERS = {}


def owner_of(param):
    """The ShardedModule a (replacement) parameter belongs to, or None."""
    got = _OWNERS.get(id(param))
    if got is None or got[0]() is not param:
        return None
    return got[1]()


# ShardedModules whose last forward of the root (train mode, grad enabled)
# left a unit gathered for a backward that has not come yet (the root unit:
# its parameters the node's read-only gathered copy). Emptied at the end of
# each backward, so in the plain loop (forward, backward, step) an
# optimizer's step finds it empty and costs one test.
_HELD = weakref.WeakSet()


def _before_step(opt):
    """Before a torch.optim.Optimizer's step: a ShardedModule that holds one
    of opt's parameters and left a unit gathered after a forward no
    backward came for (a loss only logged with grad enabled in train mode,
    HF's generate without no_grad, a NaN loss dropped) releases it, so that
    the step writes this rank's shard, as torch's step would write the
    parameters, instead of the read-only gathered copy (a SIGSEGV). A
    backward of that forward's output later gathers the unit again."""
    if not _HELD:
        return
    held = list(_HELD)
    mine = set()
    for g in opt.param_groups:
        for p in g["params"]:
            sm = owner_of(p)
            if sm is not None and sm in held:
                mine.add(sm)
    for sm in held:
        if sm in mine:
            sm._release_unbackwarded()


# id(original parameter) -> (weak original, its qualified name): the
# parameters a wrapper replaced by its views and emptied. An optimizer built
# before wrapping holds these: they never get a gradient, so its step would
# skip them all and nothing would train, without a word.
_ORIGINALS = {}


def _forget_original(key, ref):
    """A replaced original was freed (its wrapper went): its entry goes,
    unless a later original took its id."""
    got = _ORIGINALS.get(key)
    if got is not None and got[0] is ref:
        del _ORIGINALS[key]


def _stale_names(opt):
    """The qualified names of the replaced originals opt holds."""
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            got = _ORIGINALS.get(id(p))
            if got is not None and got[0]() is p:
                out.append(got[1])
    return out


# the live ShardedModules (weakly): an optimizer's parameters are checked
# against their modules' unmanaged ones
_WRAPPERS = weakref.WeakSet()


def _unmanaged_names(opt):
    """The names of opt's parameters that sit on a wrapped module but are
    none of its wrapper's (registered after wrapping: add_module, a new
    attribute): their gradient is this rank's alone, never reduced."""
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    out = []
    for sm in list(_WRAPPERS):
        for n, p in sm.module.named_parameters():
            if id(p) in ids and id(p) not in sm._by_param:
                out.append(n)
    return out


def _listed(names):
    """(the first 8 names quoted, and how many more; "s" for a plural) for
    a refusal's message."""
    return (", ".join("%r" % n for n in names[:8]) +
            (" and %d more" % (len(names) - 8) if len(names) > 8 else ""),
            "s" if len(names) > 1 else "")


# torch.optim's optimizers whose update of an element reads that element
# alone (its gradient, its state) and scalars (the step count, the
# hyperparameters): stepped on each rank's 1-D parts, they compute torch's.
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop",
                "Rprop", "NAdam", "RAdam", "ASGD")


# the code of _wrap_step's wrapper (the same for every class it wraps)
_STEP_WRAPPER_CODES = set()


def _transparent(fn):
    """Whether fn is a wrapper that only calls the step it wraps: this
    module's (_wrap_step) or torch 1.13's profiler's (_hook_for_profile).
    Another wrapper (a decorator of the script's, functools.wraps making
    it look like the step it wraps) may read whole parameters first."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    if code in _STEP_WRAPPER_CODES:
        return True
    path = code.co_filename.replace("\\", "/")
    return code.co_name == "wrapper" and path.endswith("torch/optim/optimizer.py")


def _innermost(fn):
    while hasattr(fn, "__wrapped__") and _transparent(fn):
        fn = fn.__wrapped__
    return fn


_ELEMENTWISE_STEPS = []


def elementwise_optimizer(cls):
    """Marks a torch.optim.Optimizer subclass as element-wise (a class
    decorator; returns cls): its step updates each element from that
    element's gradient and state and from scalars only, so that stepping
    each rank's 1-D part of a wrapped parameter is torch's step. Only for
    such optimizers: one that reads a parameter's shape, norm or any other
    element (LARS / LAMB trust ratios, Adafactor's factored moments,
    Shampoo, LBFGS) computes something else on a part, without an error."""
    cls.shardd_elementwise = True
    return cls


def _is_elementwise(cls):
    if getattr(cls, "shardd_elementwise", False):
        return True
    if not _ELEMENTWISE_STEPS:
        _ELEMENTWISE_STEPS.extend(_innermost(getattr(torch.optim, n).step)
                                  for n in _ELEMENTWISE if hasattr(torch.optim, n))
    # a subclass of one of them that keeps its step (new defaults, a new
    # __init__) is it; one that writes its own step is not
    step = _innermost(getattr(cls, "step", None))
    return any(step is s for s in _ELEMENTWISE_STEPS)


def _check_elementwise(opt):
    """Refuses the step of an optimizer not known to be element-wise over
    a wrapper's parameters: it would see each rank's 1-D part (its shape,
    its norm, its dot products) where torch's sees the whole parameter,
    and compute another update without an error."""
    if _is_elementwise(type(opt)):
        return
    names = []
    for g in opt.param_groups:
        for p in g["params"]:
            sm = owner_of(p)
            if sm is not None and sm.transient:  # (resident ones refuse torch.optim)
                e = sm._by_param.get(id(p))
                names.append(e.name if e is not None else "?")
    if names:
        raise RuntimeError(
            "%s steps %s: parameter%s of a shardd.nn.ShardedModule, which outside "
            "forward are each rank's 1-D part of the shard (FSDP1's use_orig_params), "
            "and %s is not known to update each element from that element alone: an "
            "optimizer that reads a parameter's shape, norm or other elements (a "
            "LARS / LAMB trust ratio, Adafactor's factored moments, LBFGS) would compute "
            "another update than torch's on the whole parameter, without an error. "
            "torch.optim's SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop, "
            "NAdam, RAdam and ASGD are element-wise; an optimizer of your own that is "
            "can say so with shardd.nn.elementwise_optimizer(cls)"
            % ((type(opt).__name__,) + _listed(names) + (type(opt).__name__,)))


def _check_stale(opt):
    """Refuses opt's step while it holds a parameter a wrapper replaced, or
    one on a wrapped module that the wrapper does not manage; checked again
    only when its parameter count changes (add_param_group), so a step pays
    one attribute read and a sum over its groups."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    if getattr(opt, "_shardd_checked", None) == n:
        return
    stale = _unmanaged_names(opt)
    if stale:
        raise RuntimeError(
            "%s holds %s: parameter%s of the wrapped model that shardd.nn.ShardedModule "
            "does not manage (registered after wrapping: add_module, a new attribute): "
            "its gradient is this rank's alone, never reduced over the ranks, so the "
            "ranks would step it apart, and no shard or checkpoint holds it. Register "
            "it before wrapping" % ((type(opt).__name__,) + _listed(stale)))
    _check_elementwise(opt)
    stale = _stale_names(opt)
    if stale:
        raise RuntimeError(
            "%s holds %s: the original parameter%s that shardd.nn.ShardedModule "
            "replaced by views of the daemon's shards when it wrapped the model "
            "(emptied, they never get a gradient: this step would skip them and "
            "nothing would train). Build the optimizer after wrapping, over "
            "model.parameters() (FSDP's order), or give it those with "
            "add_param_group" % ((type(opt).__name__,) + _listed(stale)))
    opt._shardd_checked = n


# ShardedModules whose last backward was refused midway with part of its
# gradient added to a .grad kept from before (backward.py's
# _abort_backward): an optimizer's step over their parameters is refused
# until a zero_grad() clears them
_PARTIAL = weakref.WeakSet()


def _step_pre(opt):
    """Every torch.optim.Optimizer's step runs this first."""
    _check_stale(opt)
    if _PARTIAL:
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for sm in list(_PARTIAL):
            if not ids.isdisjoint(sm._by_param):
                sm._check_partial_grads()
            if not sm._partial:
                _PARTIAL.discard(sm)
    if _HELD:
        _before_step(opt)


_STEP_HOOKED = [False]


def _mark_step_hooked(fn):
    fn._shardd_before_step = True
    return fn


def _wrap_step(cls):
    """cls.step runs _step_pre first (torch < 2, which has no global step
    pre-hook). Once per class: a subclass that inherits a wrapped step keeps
    it; one that overrides step is wrapped itself (a super().step() then
    runs _before_step twice: the second finds nothing held)."""
    inner = getattr(cls, "step", None)
    if inner is None or getattr(inner, "_shardd_before_step", False):
        return

    @functools.wraps(inner)
    def step(self, *args, **kwargs):
        _step_pre(self)
        return inner(self, *args, **kwargs)

    _STEP_WRAPPER_CODES.add(step.__code__)
    cls.step = _mark_step_hooked(step)


def _install_step_hook():
    """Makes every torch.optim.Optimizer's step call _step_pre first, once
    per process (a ShardedModule's construction calls it). torch
    >= 2: its global register_optimizer_step_pre_hook. torch 1.13 has none;
    it wraps each Optimizer class's step once, for the profiler, in
    Optimizer._hook_for_profile, which every optimizer's __init__ calls:
    that is extended to wrap the class's step with _before_step too, once
    (functools.wraps carries the profiler's "hooked" mark over, so neither
    wraps twice), and every Optimizer class there is now is wrapped at
    once."""
    if _STEP_HOOKED[0]:
        return
    _STEP_HOOKED[0] = True
    from . import optim_state
    optim_state.install()  # state dicts of parts: see optim_state.py
    Optimizer = torch.optim.Optimizer
    import torch.optim.optimizer as optimizer_mod  # not an attribute of torch.optim in 1.13
    reg = getattr(optimizer_mod, "register_optimizer_step_pre_hook", None)
    if reg is not None:
        reg(lambda opt, args, kwargs: _step_pre(opt))
        return
    orig = getattr(Optimizer, "_hook_for_profile", None)
    if orig is None:
        return  # shardd.optim's step still releases (an older torch)

    @functools.wraps(orig)
    def _hook_for_profile(self):
        orig(self)
        _wrap_step(type(self))

    Optimizer._hook_for_profile = _hook_for_profile
    # and the classes an optimizer was made of before (one made before
    # wrapping may be given the wrapped parameters by add_param_group)
    todo = list(Optimizer.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        _wrap_step(cls)
