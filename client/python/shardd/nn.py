"""FSDP-style wrapping of a torch ``nn.Module`` over shardd (use_orig_params).

    sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
    opt = sm.register_optimizer("adamw", model.parameters(), lr=1e-3)
    for batch in data:
        sm.gather()                 # all-gather every flat buffer (collective)
        loss = loss_fn(model(x), y)
        sm.zero_grad()              # zero grad areas, attach .grad views
        loss.backward()             # gradients accumulate into the grad areas
        sm.scatter("mean")          # reduce-scatter (collective)
        sm.step(opt)                # optimizer on the daemon (collective)

What the wrapper does, per *unit*. ``auto_wrap`` picks the units as FSDP's
auto-wrap policies do, plus the root's unit for every parameter no other
unit holds: "module" (the root's alone); "children" (each child of the
root, descending through ``nn.ModuleList`` / ``nn.ModuleDict``, which have
no forward: nanoGPT's ``transformer.h`` gives a unit per Block; an
``nn.ParameterList`` / ``nn.ParameterDict`` stays the root's); a set of
module classes (every instance at any depth: FSDP's
``transformer_auto_wrap_policy``, e.g. ``{Block}``); or a callable
``(module, recurse, nonwrapped_numel) -> bool`` walked as FSDP's
``_recursive_wrap`` walks it (:func:`size_based_auto_wrap_policy` with
``functools.partial(..., min_num_params=N)``). Units nest: a unit holds
its module's parameters that no unit inside it holds. A parameter that
modules of different units share (tied embedding and output weights)
belongs, as in FSDP, to the unit of their lowest common ancestor (nanoGPT's
lm_head / wte: the root's), which stays gathered while either use runs and
collects both uses' gradients in one; a parameter shared with a module
outside the wrapped one is refused (wrapping would untie it):

* flattens the unit's parameters (``named_parameters`` order, shared
  parameters once) into one flat buffer ``<prefix><unit>.flat_param`` of the
  given dtype, and registers each original parameter as a view
  ``<prefix><qualified name>`` at its offset with its shape;
* writes this rank's shard ``[rank*s, (rank+1)*s)`` of the flattened initial
  values (every rank must build the model identically, e.g. same seed: each
  rank contributes only its own slice, and the daemon refuses a rank whose
  values' checksum differs from the first rank's, naming the unit's
  buffer) — unless the buffer is *existing* (trained or restored shards:
  a relaunch after a crash, a rank rejoining), which keeps its values,
  optimizer state and step count (``init=``);
* replaces every parameter on its module(s) with a new ``nn.Parameter`` that
  is a view of the gather area (no copy: ``torch.frombuffer`` of the host
  mapping, or on the cuda backend a CUDA tensor over the daemon's GPU memory),
  so a forward after :meth:`gather` computes with the daemon's data, and the
  parameters the optimizer is registered with *are* the shardd views;
* gradients: :meth:`zero_grad` zeroes each grad area (padding included) and
  sets every parameter's ``.grad`` to the view of its slice of the grad area.
  autograd accumulates into an existing ``.grad`` in place (outside
  create_graph), so ``backward()`` writes the gradients straight into shared
  memory. If something replaced a ``.grad`` (e.g. ``zero_grad(set_to_none=True)``
  on the model after ours, or a hook), :meth:`scatter` copies it into the grad
  area first, so the result is right either way; a parameter without a
  gradient contributes zeros, and when no rank has one for it (its ``.grad``
  is None everywhere: ``zero_grad(set_to_none=True)``) the daemon's step
  skips it as torch's optimizers do -- no weight decay, no moment update, its
  own step count stays;
* frozen parameters (``requires_grad=False``, LoRA base weights) become
  frozen views: scatter reduces nothing for them and a step skips them even
  when the optimizer was given them. Setting ``requires_grad`` on a wrapped
  parameter later (gradual unfreezing) is passed to the daemon before the
  next scatter.

Resident clients: a parameter is the gathered copy and its ``.grad`` this
rank's unreduced gradient, so torch.optim (and torch's clip_grad_norm_)
raise on them, naming the parameter: use shardd.optim, or transient areas
where torch.optim steps the shards.

``model.state_dict()`` / ``model.load_state_dict()`` (torch's state-dict
hooks on the module) give and take FSDP's full state dict: torch's keys,
every parameter whole (a collective); :meth:`ShardedModule.state_dict_type`
selects FullStateDictConfig's options or the "local" form (each rank's
1-D parts).

The original parameter tensors are dropped from the module and their
storage freed once their values are in the shards (the objects stay,
empty, so their ids stay unique); the initial
gather is done by the constructor (it is a collective: every rank of the job
must construct the same wrapper). Mapped tensors alias libshardd mappings:
don't use the module after the client is closed.

Transient areas (a client made with ``transient_areas=True``): FSDP's
reshard, driven by hooks, with the plain torch loop and no explicit
gather or scatter:

    client = shardd.Client(sock, job=..., rank=r, world=w, transient_areas=True)
    sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
    opt = sm.register_optimizer("adamw", model.parameters(), lr=1e-3)
    for x, y in data:
        sm.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()             # per unit: gather, grads, scatter, release
        sm.step(opt)

Per unit, in the same order on every rank (each rank's graph is the same):

* forward pre-hook (on the unit's module and on every module holding one
  of its parameters, so that a unit whose module's forward never runs, a
  container or a module whose submodules the root calls directly, is
  gathered all the same; the outermost of those forwards gathers and
  releases): gather the unit (``Client.gather_area``) and point every
  parameter's ``.data`` at its slice of the leased gather area (on the
  host backend the node's one copy, which every local rank reads, mapped
  read-only: a write into a parameter while its unit is gathered, e.g.
  ``p.data.copy_()`` or an init under ``no_grad`` inside a forward, faults
  and the process dies of SIGSEGV, with no Python exception; a transient
  wrapper turns Python's ``faulthandler`` on (where it is off), so stderr
  shows the line that wrote; outside forward and backward a parameter is
  its part of this rank's shard, writable);
* forward post-hook: register a hook on the unit's output tensors (it fires
  when the gradient w.r.t. them is computed, before the unit's backward), then
  release the unit (FSDP's reshard after forward) and point its parameters
  back at their parts of this rank's shard (1-D, possibly empty: FSDP1's
  sharded views with use_orig_params), except the *root unit* (the
  one holding the root module's own parameters), which stays gathered until
  the end of backward as FSDP keeps it, its parameters the gathered ones
  (a loss term over ``model.parameters()`` after forward reaches them
  whole). After an eval-mode forward (``model.eval()``, grad enabled, no
  backward) they are their parts of the shard again until a backward, so
  an evaluation between backward and step leaves the optimizer stepping
  the shards; after a train-mode forward no backward came for (a loss
  only logged with grad enabled, HF's generate without ``no_grad``, a NaN
  loss dropped), they stay the read-only gathered copy until the next
  forward, or until an optimizer's step: any ``torch.optim.Optimizer``
  (shardd.optim's too) holding a parameter of the module releases such a
  unit before it steps (torch >= 2: a global step pre-hook; torch 1.13 has
  none, and its ``Optimizer._hook_for_profile``, which wraps each
  optimizer class's ``step`` once for the profiler, is extended to wrap it
  with that release too: a test while no unit waits so, per step). So the
  step writes the shards and applies the ``.grad`` the parameters hold,
  as torch's would; a later backward of that forward's output gathers the
  unit again. A write through a parameter (``p.data.copy_()``,
  ``clamp_``, an init) between such a forward and the next forward or
  step still faults (nothing sees it coming): call :meth:`reshard`
  (FSDP2's) first, or log under ``torch.no_grad()`` or ``model.eval()``.
  :meth:`full_parameters`, and so the state dicts, release such a unit
  too;
* while the root module's forward runs, saved-tensor hooks record every
  tensor autograd saves that lies in a gathered area as (unit, offset,
  sizes, strides) instead of the tensor, and backward rebuilds it from the
  unit's area *then* (the memory of a released area is leased on to other
  units, and a re-gather may land elsewhere in the pool);
* before the unit's backward (its outputs' hook): gather again with a
  gradient area (zeroed by the daemon), point ``.data`` at the new area and
  every trainable parameter's ``.grad`` at its slice of the gradient area
  (autograd accumulates into it in place);
* once autograd has accumulated the gradient of every trainable parameter of
  the unit (post-hooks on their AccumulateGrad nodes): reduce-scatter
  (``reduce_op``, "mean" by default), which consumes the gradient area, and
  release; each parameter is its part of the shard again and its ``.grad``
  its part of the reduced-gradient shard (``buffer.reduced_tensor``, the
  daemon's memory; a 16-bit unit's is a stand-in that refuses torch.optim,
  the fp32 master being the daemon's), so a torch.optim optimizer built
  after wrapping steps the shards in place, as under FSDP. Gradient
  accumulation works as in torch: a later backward adds its reduced
  gradient to a ``.grad`` that is set (after a step too), until a
  ``zero_grad()`` (ours, shardd.optim's or torch's) zeroes it or sets it
  None — the memory stays the bound's, as FSDP's sharded gradient
  accumulation (not ``no_sync``'s unsharded one);
* at the end of backward (a callback queued on autograd's engine), in
  reverse unit order: units still waiting for a gradient (a parameter that
  got none) are scattered as they are (the missing ones contribute zeros),
  and units that had no backward at all this time scatter a zeroed gradient
  area, so that the step never applies a stale gradient. Each scatter names
  the parameters no gradient reached on this rank, and the step skips those
  no rank had one for (torch's None ``.grad``).

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not)
of a unit's forward: the recomputation in backward runs the unit's forward
again; a forward of a unit while backward runs (autograd's engine accepts a
callback) gathers nothing more and releases nothing: the unit is gathered
for its backward (non-reentrant: its outputs' hook came first; reentrant:
the recomputation gathers it so), and the tensors the recomputation saves
(checkpoint's saved-tensor hooks hold them, not ours) stay valid until the
unit's gradient is reduced and the unit released. A checkpointed region
spanning several units holds each until its backward, within the rank's
2 gather leases.

A parameter the root's forward reads from a module itself
(``F.linear(x, self.wte.weight)``), outside every forward that gathers its
unit, gathers the unit at the read (the module's class becomes a subclass
of the same name whose ``__getattr__`` reports parameter reads) and holds
it until the root's forward ends; its gradient starts the unit's backward.

A rank holds at most 2 gather and 2 gradient areas at once: the hooks keep
to that for a chain of units (one unit in backward at a time, plus the root
unit). So with transient areas units other than the root's do not nest
(refused at construction, naming both), and a unit that a read holds
beside the root's makes the next unit's gather fail, naming the read.
``gather()``, ``scatter()`` and ``sync_grads()`` are for resident
clients only (E_STATE here); :meth:`ShardedModule.full_parameters` copies
out the whole parameters on either kind. From the second forward on, the
next unit's gather (in the first forward's order) runs while a unit
computes, when the rank's 2 gather leases allow and, with
``prefetch="auto"`` (the default) on the host backend, the first steps
measured it faster than gathering each unit when needed. Not done
yet: backward prefetch, an unsharded ``no_sync()`` (:meth:`no_sync` is
accepted and accumulates in the sharded gradient), and a forward that raises (the saved-tensor hooks stay pushed
until the next forward of the root). A unit with no trainable parameter
(wholly frozen) that backward runs through is released once the gradient
of each of its inputs is whole. A unit with a trainable parameter that
gets no gradient holds its areas until the end of backward, so two such
units (or one and the root unit) in one backward run into the lease limit
(E_LIMIT); so does a unit used by two forwards before one backward (a loss
over two batches: it waits for the first forward's part of backward;
FSDP's supports it), refused naming the units that wait and for what.

On the cuda backend the parameters and their ``.grad`` live on the GPU the
daemon put this rank's areas on (:attr:`ShardedModule.device`; the module's
buffers, e.g. BatchNorm statistics, are moved there too; inputs are the
caller's to move). The client waits for the queued GPU work
(``torch.cuda.synchronize``) before each gather, scatter and step it
requests, so the daemon reads finished gradients and shards and overwrites
no parameter a kernel still reads.
"""
import collections
import contextlib
import faulthandler
import functools
import gc
import math
import os
import time
import weakref
import zlib

import torch
from torch import nn

import shardd


_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_OF = {v: k for k, v in _TORCH_DTYPES.items()}
INIT_POLICIES = ("auto", "overwrite", "require_existing")


def _dtype_name(dt, what):
    """"fp32" / "bf16" / "fp16" of a torch dtype or of one of those names."""
    if isinstance(dt, torch.dtype):
        if dt not in _TORCH_DTYPES:
            raise ValueError("%s %s is not supported by shardd (torch.float32, "
                             "torch.bfloat16 or torch.float16)" % (what, dt))
        return _TORCH_DTYPES[dt]
    if dt not in _DTYPE_OF:
        raise ValueError("%s %r: fp32, bf16, fp16 or a torch dtype" % (what, dt))
    return dt


def _mixed_precision(dtype, mixed_precision, param_dtype, reduce_dtype, buffer_dtype):
    """FSDP's MixedPrecision knobs (given as an object with those attributes,
    such as torch's MixedPrecision, or one by one) mapped onto shardd:
    -> (the units' dtype or None, buffer dtype or None, input dtype or None).

    param_dtype is the units' dtype (a 16-bit unit computes in it; its fp32
    master and reduced gradient are the daemon's), and the root's floating
    inputs are cast to it, as FSDP casts them. The daemon reduces every
    gradient in fp32 into the fp32 reduced-gradient shard (16-bit gradients
    widened first): FSDP's reduce_dtype=torch.float32, so that, None, or the
    param_dtype when it is fp32 are taken; a 16-bit reduce_dtype is refused.
    buffer_dtype casts the module's floating buffers (full precision again
    in a full state dict, as FSDP's)."""
    if mixed_precision is not None:
        for k, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                     ("buffer_dtype", buffer_dtype)):
            if v is not None:
                raise ValueError("%s given twice: in mixed_precision and as an "
                                 "argument" % k)
        param_dtype = getattr(mixed_precision, "param_dtype", None)
        reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
        buffer_dtype = getattr(mixed_precision, "buffer_dtype", None)
        if getattr(mixed_precision, "keep_low_precision_grads", False):
            raise ValueError("keep_low_precision_grads: a 16-bit unit's reduced "
                             "gradient is the daemon's fp32 one")
    pdt = None if param_dtype is None else _dtype_name(param_dtype, "param_dtype")
    if pdt is not None and dtype is not None and _dtype_name(dtype, "dtype") != pdt:
        raise ValueError("dtype %r and param_dtype %r differ (param_dtype is the "
                         "units' dtype: pass one)" % (dtype, param_dtype))
    if reduce_dtype is not None:
        rdt = _dtype_name(reduce_dtype, "reduce_dtype")
        if rdt != "fp32":
            raise ValueError(
                "reduce_dtype %s: shardd reduces gradients in fp32 (a 16-bit unit's "
                "widened) into the fp32 reduced-gradient shard, FSDP's "
                "reduce_dtype=torch.float32; a %s reduction is not offered "
                "(pass torch.float32 or None)" % (reduce_dtype, rdt))
    bdt = None if buffer_dtype is None else _DTYPE_OF[_dtype_name(buffer_dtype, "buffer_dtype")]
    return (pdt if pdt is not None else dtype, bdt,
            None if pdt is None else _DTYPE_OF[pdt])


def _cast_floats(obj, dt):
    """obj with its floating tensors (in tuples, lists, dicts) cast to dt."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dt) if obj.is_floating_point() and obj.dtype != dt else obj
    if isinstance(obj, tuple):
        return type(obj)(*[_cast_floats(x, dt) for x in obj]) if hasattr(obj, "_fields") \
            else tuple(_cast_floats(x, dt) for x in obj)
    if isinstance(obj, list):
        return [_cast_floats(x, dt) for x in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dt) for k, v in obj.items()}
    return obj


def _checksum(flat):
    """crc32 of the flattened initial values' bytes: equal on every rank
    exactly when the ranks built the same model."""
    return zlib.crc32(flat.contiguous().view(torch.uint8).cpu().numpy())

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
            got = _OWNERS.get(id(p))
            if got is not None and got[0]() is p:
                sm = got[1]()
                if sm is not None and sm in held:
                    mine.add(sm)
    for sm in held:
        if sm in mine:
            sm._release_unbackwarded()


_STEP_HOOKED = [False]


def _mark_step_hooked(fn):
    fn._shardd_before_step = True
    return fn


def _wrap_step(cls):
    """cls.step runs _before_step first (torch < 2, which has no global step
    pre-hook). Once per class: a subclass that inherits a wrapped step keeps
    it; one that overrides step is wrapped itself (a super().step() then
    runs _before_step twice: the second finds nothing held)."""
    inner = getattr(cls, "step", None)
    if inner is None or getattr(inner, "_shardd_before_step", False):
        return

    @functools.wraps(inner)
    def step(self, *args, **kwargs):
        if _HELD:
            _before_step(self)
        return inner(self, *args, **kwargs)

    cls.step = _mark_step_hooked(step)


def _install_step_hook():
    """Makes every torch.optim.Optimizer's step call _before_step first, once
    per process (a transient ShardedModule's construction calls it). torch
    >= 2: its global register_optimizer_step_pre_hook. torch 1.13 has none;
    it wraps each Optimizer class's step once, for the profiler, in
    Optimizer._hook_for_profile, which every optimizer's __init__ calls:
    that is extended to wrap the class's step with _before_step too, once
    (functools.wraps carries the profiler's "hooked" mark over, so neither
    wraps twice). An optimizer made before the wrapper holds the
    parameters the wrapper replaced, none of the module's: it needs no
    hook."""
    if _STEP_HOOKED[0]:
        return
    _STEP_HOOKED[0] = True
    Optimizer = torch.optim.Optimizer
    import torch.optim.optimizer as optimizer_mod  # not an attribute of torch.optim in 1.13
    reg = getattr(optimizer_mod, "register_optimizer_step_pre_hook", None)
    if reg is not None:
        reg(lambda opt, args, kwargs: _before_step(opt) if _HELD else None)
        return
    orig = getattr(Optimizer, "_hook_for_profile", None)
    if orig is None:
        return  # shardd.optim's step still releases (an older torch)

    @functools.wraps(orig)
    def _hook_for_profile(self):
        orig(self)
        _wrap_step(type(self))

    Optimizer._hook_for_profile = _hook_for_profile


class FullStateDictConfig:
    """FSDP's FullStateDictConfig: what model.state_dict() of a wrapped
    model gives (ShardedModule.state_dict_type("full", config)).
    offload_to_cpu: the values on the CPU (the cuda backend's parameters
    are on the GPU); rank0_only: only rank 0 gets the values, the other
    ranks an empty dict (every rank still calls it: it is a collective)."""

    def __init__(self, offload_to_cpu=False, rank0_only=False):
        self.offload_to_cpu = bool(offload_to_cpu)
        self.rank0_only = bool(rank0_only)


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
        # the client's step count at the unit's last scatter: while it is
        # the same, the reduced gradient is the daemon's live one (an
        # accumulating scatter adds to it); a step since consumed it (the
        # daemon's next scatter replaces it), None: never scattered
        self.live_at = None
        # torch.optim can step it: fp32, so its parameters' .grad can be
        # their parts of the (fp32) reduced-gradient shard
        self.torch_grads = buffer.dtype_code == shardd._lib.DTYPE_FP32
        self.ran = False  # transient: a backward reached it (this backward)
        self.no_grad = []  # resident: the views sync_grads found without a .grad

    def __repr__(self):
        return "<FlatUnit %r buffer=%d numel=%d params=%d>" % (
            self.name, self.buffer.id, self.buffer.numel, len(self.entries))


class _Entry:
    __slots__ = ("name", "view", "param", "owners", "grad_view", "offset", "numel",
                 "shape", "acc", "got", "part", "rpart", "kept", "grad16")

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
        self.got = False          # transient: a gradient reached it this backward
        # its part of this rank's shard and of the reduced-gradient shard
        # (1-D, possibly empty: FSDP's sharded views with use_orig_params)
        self.part = None
        self.rpart = None
        self.kept = False         # transient: its .grad was set when backward began
        self.grad16 = None        # a 16-bit unit's .grad stand-in (_Grad16)


class _Saved:
    """A tensor autograd saved that lay in a unit's gather area: rebuilt from
    the unit's area when backward unpacks it."""
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit = unit
        self.offset = offset
        self.size = size
        self.stride = stride


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

    def walk(m, name):
        numel = sum(p.numel() for p in m.parameters())
        if not policy(m, True, numel):
            return 0
        wrapped = 0
        for cname, c in m.named_children():
            wrapped += walk(c, name + "." + cname if name else cname)
        if id(m) in seen or not policy(m, False, numel - wrapped):
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


# module -> {attribute: (weak ShardedModule, unit)}: the parameters whose
# read _Watched reports; weak, so a module dropped is forgotten
_WATCH = weakref.WeakKeyDictionary()
_WATCHED = {}  # module class -> its _Watched subclass


def _watch(module, attr, sm, u):
    """Reports reads of module.attr (a parameter of unit u) to sm._read: the
    module's class becomes a subclass of it (same name, so repr and
    isinstance stay; FSDP2's fully_shard swaps the class likewise) whose
    __getattr__ -- the lookup nn.Module answers parameters with --
    reports the read first."""
    base = type(module)
    if base not in _WATCHED.values():
        cls = _WATCHED.get(base)
        if cls is None:
            cls = _WATCHED[base] = _watched_class(base)
        module.__class__ = cls
    _WATCH.setdefault(module, {})[attr] = (weakref.ref(sm), u)


def _watched_class(base):
    def __getattr__(self, name):
        got = _WATCH.get(self, {}).get(name)
        if got is not None:
            sm = got[0]()
            if sm is not None:
                sm._read(got[1], self, name)
        return base.__getattr__(self, name)

    def __reduce_ex__(self, protocol):
        # pickled and copied as the class it was built as
        cls = type(self)
        self.__class__ = base
        try:
            return self.__reduce_ex__(protocol)
        finally:
            self.__class__ = cls

    return type(base.__name__, (base,), {
        "__getattr__": __getattr__, "__reduce_ex__": __reduce_ex__,
        "__module__": base.__module__, "__qualname__": base.__qualname__})


def _materialize(module, init_fn, sink):
    """Materializes every parameter and buffer of `module` on the meta device
    on the CPU, one module at a time in registration order (module.modules()):
    the module's own meta tensors become empty CPU tensors, then
    init_fn(module) (default: the module's reset_parameters()) initializes
    them, as building the model on the CPU does when its constructors
    initialize through reset_parameters in that order. Buffers stay
    materialized on the module; each parameter's values go to
    sink(original parameter, values) right after its first owner's init
    and the module gets its (meta) parameter back, so that no more than one
    module's parameters are materialized at a time. A parameter tied after
    construction (``head.weight = emb.weight``) has the values of the
    module it was taken from, the first owner: a later owner's init runs
    on a scratch tensor (it draws from the RNG as on the CPU, where it
    initialized a parameter the tie then dropped). A parameter not on the
    meta device goes to the sink as it is."""
    done = set()  # ids of the parameters already sunk
    for name, m in module.named_modules():
        own = [(k, p) for k, p in m._parameters.items() if p is not None]
        metas = [(k, p) for k, p in own if p.is_meta]
        mbufs = [(k, b) for k, b in m._buffers.items() if b is not None and b.is_meta]
        made = {}
        if metas or mbufs:
            if init_fn is None and not callable(getattr(m, "reset_parameters", None)):
                raise ValueError(
                    "module %r (%s) has parameters or buffers on the meta device and no "
                    "reset_parameters(): pass param_init_fn= to initialize them"
                    % (name or "<root>", type(m).__name__))
            for k, p in metas:
                t = made.get(id(p))
                if t is None:
                    t = made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                   requires_grad=p.requires_grad)
                m._parameters[k] = t
            for k, b in mbufs:
                m._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
            try:
                with torch.no_grad():
                    if init_fn is not None:
                        init_fn(m)
                    else:
                        m.reset_parameters()
            finally:
                for k, p in metas:
                    m._parameters[k] = p
        for k, p in own:
            if id(p) not in done:
                done.add(id(p))
                sink(p, made[id(p)].detach() if p.is_meta else p.detach())
        made = None


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


class ShardedModule:
    """Wraps `module` in place over the client's job; see the module docstring.

    client: a shardd.Client of this rank (job, rank, world).
    auto_wrap: which modules are units (each one flat buffer), besides the
      root's unit for the rest: "module" (none), "children" (each child,
      through ModuleList / ModuleDict), a set of nn.Module classes (every
      instance), or a policy callable (module, recurse, nonwrapped_numel)
      -> bool as FSDP's (size_based_auto_wrap_policy). See the module
      docstring for nesting and shared parameters.
    prefix: prepended to buffer and view names (names are per job).
    dtype: "fp32", "bf16", "fp16" or a torch dtype; default: the parameters'
      dtype (they must all have one dtype).
    mixed_precision, or param_dtype, reduce_dtype, buffer_dtype: FSDP's
      MixedPrecision (an object with those attributes, such as torch's, or
      the knobs one by one; torch dtypes or "fp32"/"bf16"/"fp16").
      param_dtype: the units' dtype (as dtype=; a 16-bit unit keeps its
      fp32 master and reduced gradient in the daemon), and the root's
      floating inputs are cast to it, as FSDP casts them. reduce_dtype: the
      daemon reduces in fp32 (16-bit gradients widened first), FSDP's
      reduce_dtype=torch.float32; that or None is taken, a 16-bit one is a
      ValueError. buffer_dtype: the module's floating buffers are cast to it
      (a full state dict gives them in their original dtype, as FSDP's).
    initial_gather: resident areas: gather every unit at the end (a
      collective). Transient areas gather per unit in the hooks instead.
    reduce_op: transient areas: the hooks' reduce-scatter, "mean" or "sum".
    init: what a unit's buffer gets from the module's initial values.
      "auto" (default): a new buffer gets them (each rank writes its slice,
      after the daemon checked every rank's are the same); one that is
      *existing* — its shards hold trained values (a step ran, and the
      trainers crashed or were relaunched) or restored ones (a daemon
      checkpoint) — keeps its shards, optimizer state and step count, and
      the module's parameters take the daemon's values: a plain relaunch
      of the same script resumes. "overwrite": write them anyway (the
      optimizer state stays). "require_existing": refuse a new buffer
      (E_STATE), for a resume that must not start from scratch. Every rank
      passes the same.
    prefetch: transient areas: while a unit's forward runs, the next unit's
      gather (in the order the first forward met them) is already under way
      (FSDP's forward_prefetch), when the rank's 2 gather leases allow it.
      "auto" (default): on the cuda backend, always; on the host backend
      only if it makes steps faster, measured: from the second training
      forward of the root on, 3 steps with prefetch and 3 without
      alternate, each timed to the next training forward, and prefetching
      stays on only if the median of its steps is lower by more than 5%
      (each rank chooses on its own timings; within that the two are the
      same, and prefetch=False's loop is kept). Without a CPU to spare, the copy of
      a prefetched gather takes its CPU from the forward it overlaps (one
      run measured 1.65x the gather-everything loop's step with prefetch,
      1.05x without); where ranks wait for each other at every gather, a
      prefetched one does not make them meet there. True: always; False:
      never. :attr:`ShardedModule.prefetch` says what is chosen (it
      alternates during the trial), :attr:`ShardedModule.prefetch_trial`
      the trial's step times once it chose.
    bucket_bytes: resident areas: gather() and scatter() send consecutive
      units together, one request per bucket of at most this many bytes of
      units (a larger unit goes alone), as DDP's bucket_cap_mb (25 MiB) and
      ZeRO's reduce_bucket_size group small tensors: a model of many small
      units pays one round trip per bucket, not per unit. 0: one request
      per unit. Transient areas gather each unit in its hook (each gather
      leases a slot of the 2 a rank may hold, so those are not bucketed).
    param_init_fn: for a module built on the meta device (``nn.Linear(...,
      device="meta")``; torch 1.13 has no ``with torch.device("meta")``):
      the model is materialized one module at a time, in registration order
      (``module.modules()``): the module's own meta parameters and buffers
      become empty CPU tensors, then ``param_init_fn(m)`` (default:
      ``m.reset_parameters()``) initializes them in place (unlike FSDP's,
      it must not materialize submodules: each gets its own call), and
      each parameter's part of this rank's shard is written from them (a
      tied one's from its first owner's init: ``head.weight = emb.weight``
      keeps emb's values, as on the CPU, ``wte.weight = lm_head.weight``
      does not); buffers stay on the module. So
      no rank holds more than a module's parameters beyond its shards, and a
      model whose constructors initialize through reset_parameters() in
      registration order gets the values (and leaves the RNG state) of
      building it on the CPU with the same seed, in any world size. The
      model is materialized twice (the checksums, then the shards; the
      RNG state put back in between).
    """

    def __init__(self, client, module, auto_wrap="module", prefix="", dtype=None,
                 initial_gather=True, reduce_op="mean", init="auto", prefetch="auto",
                 bucket_bytes=25 << 20, param_init_fn=None, mixed_precision=None,
                 param_dtype=None, reduce_dtype=None, buffer_dtype=None):
        dtype, buffer_dtype, input_dtype = _mixed_precision(
            dtype, mixed_precision, param_dtype, reduce_dtype, buffer_dtype)
        if init not in INIT_POLICIES:
            raise ValueError("init %r: one of %s" % (init, ", ".join(INIT_POLICIES)))
        if reduce_op not in shardd.REDUCE_OPS:
            raise ValueError("reduce_op %r: one of %s" % (
                reduce_op, ", ".join(sorted(shardd.REDUCE_OPS))))
        self.client = client
        self.module = module
        self.prefix = prefix
        if int(bucket_bytes) < 0:
            raise ValueError("bucket_bytes must be >= 0, not %r" % (bucket_bytes,))
        self.bucket_bytes = int(bucket_bytes)
        self.reduce_op = reduce_op
        self.transient = bool(getattr(client, "transient_areas", False))
        if self.transient and not faulthandler.is_enabled():
            # a write into a parameter while its unit is gathered (the host
            # backend's read-only node copy) dies of SIGSEGV, which torch
            # cannot turn into an exception: Python's fault handler at least
            # prints the line that wrote (where stderr is a file)
            try:
                faulthandler.enable()
            except (OSError, ValueError, AttributeError, RuntimeError):
                pass
        self.units = []
        self._by_param = {}       # id(replacement param) -> _Entry
        self._orig_names = {}     # id(original param) -> qualified name
        # the original parameter objects, kept so that their ids stay
        # unique (_orig_names names one passed to register_optimizer), but
        # each emptied once its values are in the shards: a rank holds no
        # copy of the model beside the daemon's (FSDP frees them too)
        self._orig_keep = []
        rank = client.rank
        specs = _unit_modules(module, auto_wrap)
        per_unit, parent = _collect(module, specs)
        # a model built on the meta device (nn.Linear(..., device="meta")):
        # materialized one module at a time, straight into the shards
        meta = any(t.is_meta for t in module.parameters()) or \
            any(t.is_meta for t in module.buffers())
        if self.transient:
            _check_nesting(specs, per_unit, parent)
        _check_outside_holders(module, per_unit)
        pending = []  # units whose buffers are registered, views not yet
        # every unit's buffer in one call (a request per 250), as its views
        # below: each unit's flattened values are made once for the
        # checksum and again only when they are written
        units = []
        # every unit's parameters before any is replaced: a shared one is
        # replaced once, on every module that holds it
        for (uname, root), params in zip(specs, per_unit):
            if not params:
                continue
            udt = dtype
            if udt is None:
                dts = {p.dtype for _, p, _ in params}
                if len(dts) != 1:
                    raise ValueError("unit %r mixes dtypes %s; pass dtype=" % (uname or "<root>", dts))
                udt = dts.pop()
            if isinstance(udt, torch.dtype):
                if udt not in _TORCH_DTYPES:
                    raise ValueError("dtype %s is not supported by shardd" % udt)
                udt = _TORCH_DTYPES[udt]
            total = sum(p.numel() for _, p, _ in params)
            bname = "%s%s.flat_param" % (prefix, uname if uname else "root")
            if meta:  # the checksums come from a materialization below
                units.append([uname, root, params, udt, total, bname, None])
                continue
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1).to(_DTYPE_OF[udt])
                                  for _, p, _ in params])
            units.append([uname, root, params, udt, total, bname, _checksum(flat)])
            del flat
        if meta:
            # a first materialization for the checksums, the RNG state put
            # back after it: the second writes the shards and leaves the RNG
            # as building the model on the CPU does
            with torch.random.fork_rng(devices=[]):
                for u, ck in zip(units, self._meta_checksums(module, units, param_init_fn)):
                    u[6] = ck
        bufs = client.register_buffers([(bname, udt, total, ck)
                                        for _, _, _, udt, total, bname, ck in units])
        writes = []  # meta: (params, udt, total, buf, sh) of the units to write
        for (uname, root, params, udt, total, bname, ck), buf in zip(units, bufs):
            if init == "require_existing" and not buf.existing:
                raise shardd.Error(22, "unit %r: buffer %r holds no trained or restored "
                                   "values (init=\"require_existing\")"
                                   % (uname or "root", bname), "E_STATE")
            sh = buf.shard_tensor
            if buf.transient:  # the whole-buffer areas are leased per gather
                gat = grd = None
            else:
                gat = buf.gather_tensor
                grd = buf.grad_tensor
            # this rank's slice of the flattened initial values, unless the
            # shards hold trained or restored ones
            if meta:
                if init == "overwrite" or not buf.existing:
                    writes.append((params, udt, total, buf, sh))
            elif init == "overwrite" or not buf.existing:
                with torch.no_grad():
                    flat = torch.cat([p.detach().reshape(-1).to(_DTYPE_OF[udt])
                                      for _, p, _ in params])
                    lo = rank * buf.shard_numel
                    hi = min(lo + buf.shard_numel, total)
                    sh.zero_()
                    if hi > lo:
                        sh[:hi - lo].copy_(flat[lo:hi].to(sh.device))
                    if udt != "fp32":
                        # the fp32 master from the exact values, as FSDP's
                        # mixed precision keeps them, not from their 16-bit
                        # rounding
                        exact = torch.cat([p.detach().reshape(-1).float()
                                           for _, p, _ in params])
                        client.seed_master(buf, exact[lo:max(lo, hi)])
                        del exact
                    del flat
            pending.append((uname, root, params, buf, sh, gat, grd))
        if meta:
            self._meta_write(module, writes, param_init_fn)
        if any(u[3].dtype_code != shardd._lib.DTYPE_FP32 for u in pending):
            # no rank's first gather before every rank seeded its masters
            # (the daemon refuses a seed, E_BUSY, while the buffer is in a
            # collective)
            client.barrier()
        # every unit's views in one call (a request per 256): one round
        # trip each cost 24 us, 2.4 s for a 7B model's 10^5 parameters.
        # requires_grad=False: a frozen view, skipped by scatter and step
        vspecs = []
        for uname, root, params, buf, sh, gat, grd in pending:
            off = 0
            for qn, p, owners in params:
                vspecs.append((buf, prefix + qn, off, tuple(p.shape), p.requires_grad))
                off += p.numel()
        views = iter(client.register_views(vspecs))
        for uname, root, params, buf, sh, gat, grd in pending:
            entries = []
            off = 0
            red = buf.reduced_tensor
            s0 = rank * buf.shard_numel
            for qn, p, owners in params:
                view = next(views)
                e = _Entry(qn, view, owners)
                n = p.numel()
                # [a, b): the part of the parameter in this rank's shard
                a = min(max(off - s0, 0), buf.shard_numel)
                b = min(max(off + n - s0, 0), buf.shard_numel)
                e.part = sh[a:b]
                e.rpart = red[a:b]
                if gat is None:  # its part of the shard until a gather
                    newp = nn.Parameter(e.part, requires_grad=p.requires_grad)
                else:
                    newp = nn.Parameter(gat[off:off + n].view(p.shape),
                                        requires_grad=p.requires_grad)
                    e.grad_view = grd[off:off + n].view(p.shape)
                e.param = newp
                self._orig_names[id(p)] = qn
                self._orig_keep.append(p)
                with torch.no_grad():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
                for m, attr in owners:
                    m._parameters[attr] = newp
                self._by_param[id(newp)] = e
                _OWNERS[id(newp)] = (weakref.ref(newp), weakref.ref(self))
                entries.append(e)
                off += n
            self.units.append(FlatUnit(uname or "root", buf, entries, module=root,
                                       is_root=root is module))
        # FSDP's buffer_dtype: floating buffers cast (a full state dict
        # gives them back in their own dtype)
        self._buffer_dtypes = {}
        if buffer_dtype is not None:
            for mname, m in module.named_modules():
                for k, b in m._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != buffer_dtype:
                        self._buffer_dtypes[(mname + "." if mname else "") + k] = b.dtype
                        m._buffers[k] = b.to(buffer_dtype)
        self._input_dtype = input_dtype
        if input_dtype is not None:
            module.register_forward_pre_hook(
                lambda _m, inputs: _cast_floats(inputs, input_dtype))
        dev = self.device
        if dev.type == "cuda":  # the forward must find the module's buffers there
            for m in module.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.device != dev:
                        m._buffers[k] = b.to(dev)
        self._optims = []         # daemon optimizers registered through us
        if prefetch not in (True, False, "auto"):
            raise ValueError("prefetch %r: True, False or \"auto\"" % (prefetch,))
        # "auto" on the host backend: a trial of both, then the faster (see
        # _prefetch_trial); the cuda backend computes on the GPUs, so a
        # gather's copy never takes a forward's CPU there
        self._trial = None
        if prefetch == "auto":
            prefetch = self.transient
            if self.transient and self.client.daemon_backend == "host":
                self._trial = {"on": [], "off": [], "mode": None, "t": None}
                prefetch = False  # until the trial's first step
        self.prefetch = bool(prefetch)
        self.prefetch_trial = None  # the trial's step times and choice, once made
        self._order = []          # units in the order the first forward met them
        self._order_done = False
        self._root_backward_first = False  # the root unit's backward came first
        self._pending = None      # (unit, ticket) of the gather under way
        self._releases = []       # tickets of releases not yet waited for
        self.prefetches = 0       # gathers that were under way when needed
        self._sth = None          # the saved-tensor hooks pushed for a forward
        self._in_forward = False  # the root's forward is running
        self._read_held = []      # units a parameter read gathered this forward
        self._final_queued = False
        # model.state_dict() / load_state_dict(): FSDP's full state dict
        self._sd_raw = 0
        self._sd_type = "full"
        self._sd_config = FullStateDictConfig()
        module._register_state_dict_hook(self._state_dict_hook)
        module._register_load_state_dict_pre_hook(self._load_state_dict_pre_hook)
        if self.transient:
            self._install_hooks()
            _install_step_hook()
        else:
            self._hook_resident()
        if not self.transient and initial_gather:
            self.gather()

    # -- meta-device init --------------------------------------------------
    def _meta_checksums(self, module, units, init_fn):
        """The crc32 of each unit's flattened initial values (what
        _checksum gives for a CPU-built model), from one materialization:
        a unit's values are checksummed in the unit's order, those that
        come early (a tied weight waits for its last owner) held until
        their turn."""
        where = {}
        for ui, u in enumerate(units):
            for k, (_, p, _) in enumerate(u[2]):
                where[id(p)] = (ui, k)
        crc = [0] * len(units)
        nxt = [0] * len(units)
        held = [{} for _ in units]

        def sink(p, v):
            if id(p) not in where:
                return
            ui, k = where[id(p)]
            held[ui][k] = v
            dt = _DTYPE_OF[units[ui][3]]
            while nxt[ui] in held[ui]:
                t = held[ui].pop(nxt[ui]).reshape(-1).to(dt).contiguous()
                crc[ui] = zlib.crc32(t.view(torch.uint8).numpy(), crc[ui])
                nxt[ui] += 1

        _materialize(module, init_fn, sink)
        return crc

    def _meta_write(self, module, writes, init_fn):
        """Materializes the model again (the buffers stay on the module)
        and writes each parameter's part of this rank's shard as it comes;
        16-bit units' fp32 masters from the exact values."""
        rank = self.client.rank
        where = {}
        exact = []
        for wi, (params, udt, total, buf, sh) in enumerate(writes):
            off = 0
            for _, p, _ in params:
                where[id(p)] = (wi, off)
                off += p.numel()
            sh.zero_()
            n = max(0, min(buf.shard_numel, total - rank * buf.shard_numel))
            exact.append(torch.zeros(n) if udt != "fp32" else None)

        def sink(p, v):
            if id(p) not in where:
                return
            wi, off = where[id(p)]
            _, _, _, buf, sh = writes[wi]
            s0 = rank * buf.shard_numel
            a = max(off, s0)
            b = min(off + v.numel(), s0 + buf.shard_numel)
            if b <= a:
                return
            v = v.reshape(-1)[a - off:b - off]
            sh[a - s0:b - s0].copy_(v.to(sh.dtype).to(sh.device))
            if exact[wi] is not None:
                exact[wi][a - s0:b - s0].copy_(v.float())

        _materialize(module, init_fn, sink)
        for (params, udt, total, buf, sh), ex in zip(writes, exact):
            if ex is not None:
                self.client.seed_master(buf, ex)

    # -- introspection ---------------------------------------------------
    @property
    def buffers(self):
        return [u.buffer for u in self.units]

    @property
    def device(self):
        """Where the parameters live: cpu on the host backend, the GPU of
        this rank's areas (cuda:N) on the cuda backend."""
        for u in self.units:
            return u.buffer.shard_tensor.device
        return torch.device("cpu")

    def memory_stats(self):
        """This rank's memory for the wrapped model, in bytes (torch's
        memory_stats() in spirit; memory_summary() prints it). Not a
        collective: one status and one inspect per unit.

        shard_bytes: what the daemon holds for this rank's shards of the
          units (the same as inspect's per-shard "bytes": rank blocks,
          optimizer state, a 16-bit unit's seed before its optimizer);
        leased_bytes: the transient areas this rank holds leased now (slots
          of its job's pools, as large as the largest unit);
        gathered_bytes: the part of leased_bytes that is gathered copies;
          on the host backend (gather_shared) the node's, one read-only
          copy of a unit that every local rank holding it maps, counted
          once in the job's pools however many ranks read it;
        job_bytes, job_pool_bytes, job_persistent_bytes,
          job_pool_reserved_bytes: the whole job's, as `shardctl status`
          shows them (the gradient pool is shared by the job's ranks on a
          device, each rank leasing its own slots; reserved: what the pools
          will take beyond what they hold, before the first gather all of
          it, counted by the memory limits);
        job_gather_pool_bytes, job_gathered_bytes, gather_shared: the part
          of job_pool_bytes set aside for gathered copies (host backend:
          the node's gather pool of local ranks * (2 - 1) + 1 slots), what
          of it is held now, and whether the copies are the node's (True)
          or each rank's (cuda backend);
        trainer_bytes: what this process holds for the model outside the
          daemon: the module's buffers, and any parameter, .grad or kept
          original parameter whose storage is not the daemon's;
        units: per unit its name, dtype, numel, shard_numel, bytes (its
          share of shard_bytes) and the areas this rank leases of it."""
        rank = self.client.rank
        job, first = None, 0
        while job is None:  # status lists 256 jobs at a time
            st = self.client.status(first)
            jobs = st.get("jobs", [])
            job = next((j for j in jobs if j.get("name") == self.client.job and
                        j.get("owner_uid", os.geteuid()) == os.geteuid()), None)
            if not jobs or not st.get("jobs_more"):
                break
            first += len(jobs)
        esize = {"fp32": 4, "bf16": 2, "fp16": 2}
        slot = max([(u.buffer.padded_numel * esize.get(u.buffer.dtype, 4) + 4095)
                    // 4096 * 4096 for u in self.units] or [0])
        units, shard_bytes, leases, gathered = [], 0, 0, 0
        daemon = set()  # storages in the daemon's memory
        for u in self.units:
            b = u.buffer
            info = self.client.inspect(b)
            mine = [sh for sh in info.get("shards", []) if sh["rank"] == rank]
            nbytes = mine[0].get("bytes", 0) if mine else 0
            leased = [k for k, key in (("gather", "gather_leases"), ("gradient", "grad_leases"))
                      if rank in info.get(key, [])]
            units.append({"name": u.name, "dtype": b.dtype, "numel": b.numel,
                          "shard_numel": b.shard_numel, "bytes": nbytes, "leased": leased})
            shard_bytes += nbytes
            leases += len(leased)
            gathered += "gather" in leased
            areas = [b.shard_tensor, b.reduced_tensor, u.gather, u.grad]
            if not b.transient:
                areas += [b.gather_tensor, b.grad_tensor]
            areas += list(b._leased.values())
            daemon.update(t.storage().data_ptr() for t in areas if t is not None)
        seen, trainer = set(), 0
        tensors = list(self.module.buffers())
        for p in list(self.module.parameters()) + self._orig_keep:
            tensors += [p, p.grad] if isinstance(p.grad, torch.Tensor) else [p]
        for t in tensors:
            if t is None or t.device.type == "meta" or isinstance(t, (_Grad16, _ResidentGrad)):
                continue  # the stand-ins are views of the daemon's areas
            stg = t.storage()
            if stg.data_ptr() in daemon or stg.data_ptr() in seen:
                continue
            seen.add(stg.data_ptr())
            trainer += stg.nbytes()
        return {"rank": rank, "units": units, "shard_bytes": shard_bytes,
                "leased_bytes": leases * slot,
                "gathered_bytes": gathered * slot,
                "job_bytes": job["bytes"] if job else None,
                "job_pool_bytes": job.get("pool_bytes", 0) if job else None,
                "job_persistent_bytes": job.get("persistent_bytes", job["bytes"]) if job else None,
                "job_pool_reserved_bytes": job.get("pool_reserved_bytes", 0) if job else None,
                "job_gather_pool_bytes": job.get("gather_pool_bytes", 0) if job else None,
                "job_gathered_bytes": job.get("gathered_bytes", 0) if job else None,
                "gather_shared": bool(job.get("gather_shared", False)) if job else None,
                "trainer_bytes": trainer}

    def memory_summary(self):
        """memory_stats() as a table to print (torch.cuda.memory_summary)."""
        m = self.memory_stats()

        def h(n):
            if n is None:
                return "?"
            for unit in ("B", "KiB", "MiB", "GiB"):
                if n < 1024 or unit == "GiB":
                    return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
                n /= 1024.0

        lines = ["shardd memory of job %r, rank %d" % (self.client.job, m["rank"]),
                 "  %-32s %6s %12s %12s %12s  %s" % ("unit", "dtype", "numel", "shard numel",
                                                    "daemon", "leased")]
        for u in m["units"]:
            lines.append("  %-32s %6s %12d %12d %12s  %s" % (
                u["name"][:32], u["dtype"], u["numel"], u["shard_numel"], h(u["bytes"]),
                ",".join(u["leased"]) or "-"))
        lines += [
            "  this rank's shards (blocks, optimizer state): %s (%d bytes)"
            % (h(m["shard_bytes"]), m["shard_bytes"]),
            "  this rank's leased areas now: %s (%d bytes), of them gathered copies %s%s"
            % (h(m["leased_bytes"]), m["leased_bytes"], h(m["gathered_bytes"]),
               " (the node's, read-only, shared with the job's other local ranks)"
               if m["gather_shared"] else ""),
            "  trainer-side (buffers, tensors outside the daemon): %s (%d bytes)"
            % (h(m["trainer_bytes"]), m["trainer_bytes"]),
            "  the job in the daemon: %s, of it pools %s and persistent %s; "
            "reserved for pools %s"
            % (h(m["job_bytes"]), h(m["job_pool_bytes"]), h(m["job_persistent_bytes"]),
               h(m["job_pool_reserved_bytes"])),
            "  of the pools, gathered copies %s (%s; %s held now), gradient areas "
            "the rest (per rank)"
            % (h(m["job_gather_pool_bytes"]),
               "the node's, one per unit for every local rank" if m["gather_shared"]
               else "per rank", h(m["job_gathered_bytes"]))]
        return "\n".join(lines) + "\n"

    def __call__(self, *args, **kwargs):
        """``sm(x)``: the wrapped module's forward, as an FSDP user calls
        the wrapper (``model(x)`` is the same call: the units' hooks are on
        the module, not on this object)."""
        return self.module(*args, **kwargs)

    def named_parameters(self):
        for u in self.units:
            for e in u.entries:
                yield e.name, e.param

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def view_of(self, tensor):
        """The shardd.View a (replacement) parameter is, or None."""
        e = self._by_param.get(id(tensor))
        return e.view if e is not None else None

    def name_of(self, tensor):
        """A (replacement) parameter's fully qualified name (its first
        occurrence's, for a tied one), or None: the key of sharded state
        dicts, the same in every world size."""
        e = self._by_param.get(id(tensor))
        return e.name if e is not None else None

    # -- training loop -----------------------------------------------------
    def _resident_only(self, what):
        if self.transient:
            raise shardd.Error(22, "%s: the client has transient areas, where the "
                               "module's hooks gather, scatter and release each unit "
                               "(call model(x), loss.backward() and step() only)" % what,
                               "E_STATE")

    def _buckets(self):
        """The units in order, cut into buckets of at most bucket_bytes (a
        larger unit alone); every rank cuts its (identical) list alike."""
        out, cur, size = [], [], 0
        for u in self.units:
            t = u.buffer.gather_tensor
            n = t.numel() * t.element_size()
            if cur and size + n > self.bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(u)
            size += n
        if cur:
            out.append(cur)
        return out

    def _bucketed(self, run_many, run_one):
        """run_many(bucket) per bucket of units, or run_one(unit) per unit
        when buckets are off or one bucket has fewer than 2 units. A job an
        older daemon does not bucket for (one over several nodes) refuses
        the first bucket whole, before any of it ran (E_STATE): this module
        then sends one request per unit from there on."""
        buckets = self._buckets() if self.bucket_bytes > 0 else [[u] for u in self.units]
        for i, bk in enumerate(buckets):
            if len(bk) < 2 or self.bucket_bytes == 0:
                for u in bk:
                    run_one(u)
                continue
            try:
                run_many(bk)
            except shardd.Error as e:
                # refused whole: no entry of its first request (64) is
                # named; the later ones are only "not sent"
                first = getattr(e, "errors", None) or []
                if e.code != 22 or any(k < 64 for k, _ in first):
                    raise
                self.bucket_bytes = 0
                for u in bk:
                    run_one(u)

    def gather(self):
        """All-gather every unit (collective): parameters now hold the shards.
        Resident areas only. Units go in buckets (bucket_bytes)."""
        self._resident_only("gather()")
        self._bucketed(lambda bk: self.client.gather_many([u.buffer for u in bk]),
                       lambda u: self.client.gather(u.buffer))

    def zero_grad(self, set_to_none=False):
        """Zero the grad areas and point every trainable parameter's .grad at
        its slice (torch's zero_grad(set_to_none=False): a parameter backward
        does not reach keeps a zero gradient and is stepped). set_to_none:
        every .grad None instead, so one backward does not reach stays None and
        the step skips it, as torch's. Transient areas: .grad is each
        parameter's part of the reduced-gradient shard; set_to_none sets it
        None, otherwise it is zeroed in place (a .grad that is None stays
        None, as torch's). Until then every backward adds to it (after a
        step too), as autograd adds into .grad; torch.optim's zero_grad()
        does the same to it. A parameter frozen after it had a gradient
        keeps its .grad, zeroed, as torch's."""
        if self.transient:
            with torch.no_grad():
                for u in self.units:
                    for e in u.entries:
                        p = e.param
                        if set_to_none or (p.grad is None and not p.requires_grad):
                            p.grad = None
                            continue
                        if not p.requires_grad:
                            # frozen after it had a gradient: torch's
                            # zero_grad() zeroes the .grad it keeps (and
                            # torch.optim goes on stepping it)
                            if not isinstance(p.grad, _Grad16):
                                p.grad.zero_()
                            continue
                        # torch's: a .grad that is None stays None
                        e.rpart.zero_()
                        if p.grad is not None and not isinstance(p.grad, _Grad16) \
                                and p.grad.data_ptr() != e.rpart.data_ptr():
                            p.grad.zero_()  # the script's own tensor, zeroed as torch does
            return
        with torch.no_grad():
            for u in self.units:
                u.buffer.grad_tensor.zero_()
                for e in u.entries:
                    trainable = e.param.requires_grad and not set_to_none
                    e.param.grad = self._resident_grad(e) if trainable else None

    def _resident_grad(self, e):
        """A resident parameter's .grad: its grad-area slice as _ResidentGrad."""
        if e.grad16 is None:
            e.grad16 = e.grad_view.as_subclass(_ResidentGrad)
            e.grad16._name = e.name
        return e.grad16

    def _resident_grad_ready(self, e, grad_inputs, grad_outputs):
        """After autograd accumulated into a resident parameter's .grad: a
        .grad autograd made (the first backward after a None) is copied into
        the grad area and replaced by it, so that it is a _ResidentGrad
        too (the scatter reads the area: the same values)."""
        g = e.param.grad
        if g is None or isinstance(g, _ResidentGrad):
            return
        if g.data_ptr() != e.grad_view.data_ptr():
            with torch.no_grad():
                e.grad_view.copy_(g)
        e.param.grad = self._resident_grad(e)

    def _hook_resident(self):
        for u in self.units:
            for e in u.entries:
                p = e.param
                if e.acc is not None or not p.requires_grad:
                    continue  # a frozen one is hooked once unfrozen (sync_grads)
                with torch.enable_grad():
                    e.acc = p.expand_as(p).grad_fn.next_functions[0][0]
                e.acc.register_hook(functools.partial(self._resident_grad_ready, e))

    def _sync_requires_grad(self, u):
        """Tell the daemon about parameters frozen or unfrozen since (gradual
        unfreezing); every rank does before its scatter of u."""
        for e in u.entries:
            if e.param.requires_grad != e.view.requires_grad:
                self.client.set_requires_grad(e.view, e.param.requires_grad)

    def sync_grads(self):
        """Make the grad areas hold the current .grad of every parameter
        (copies only where autograd did not accumulate in place). Resident
        areas only."""
        self._resident_only("sync_grads()")
        self._hook_resident()  # parameters unfrozen since
        with torch.no_grad():
            for u in self.units:
                self._sync_requires_grad(u)
                u.no_grad = []  # views whose .grad is None: the step skips them
                for e in u.entries:
                    g = e.param.grad
                    if not e.param.requires_grad:
                        continue  # frozen: scatter and step skip it
                    if g is None:
                        e.grad_view.zero_()
                        u.no_grad.append(e.view)
                    elif g.data_ptr() != e.grad_view.data_ptr():
                        e.grad_view.copy_(g)
                        e.param.grad = self._resident_grad(e)

    def scatter(self, op="mean"):
        """sync_grads(), then reduce-scatter every unit (collective). Resident
        areas only."""
        self._resident_only("scatter()")
        self.sync_grads()
        self._bucketed(
            lambda bk: self.client.scatter_many([u.buffer for u in bk], op,
                                                no_grad=[u.no_grad for u in bk]),
            lambda u: self.client.scatter(u.buffer, op, no_grad=u.no_grad))

    def step(self, opt, lr=None, max_norm=None):
        return self.client.step(opt, lr=lr, max_norm=max_norm)

    def _aliases(self):
        """{qualified name: entry} for every name a parameter has on the
        module (a tied weight has one per holder, as torch's state_dict)."""
        mods = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}
        out = {}
        for u in self.units:
            for e in u.entries:
                for m, attr in e.owners:
                    mn = mods.get(id(m))
                    if mn is not None:
                        out[mn + "." + attr if mn else attr] = e
        return out

    # -- state dicts: model.state_dict() / load_state_dict() (FSDP's) -------
    @contextlib.contextmanager
    def _raw_state_dict(self):
        """The module's own state_dict()/load_state_dict(), without the
        hooks (each parameter as it is now)."""
        self._sd_raw += 1
        try:
            yield
        finally:
            self._sd_raw -= 1

    @contextlib.contextmanager
    def state_dict_type(self, kind, config=None):
        """FSDP's state_dict_type context: what model.state_dict() gives and
        model.load_state_dict() takes inside it. "full" (the default,
        FSDP's FULL_STATE_DICT): every parameter whole under torch's keys,
        config a FullStateDictConfig (offload_to_cpu, rank0_only); "local":
        each parameter as it is outside forward, its 1-D part of this
        rank's shard (FSDP's LOCAL_STATE_DICT; a rank's own, loadable only
        into the same world size)."""
        if kind not in ("full", "local"):
            raise ValueError("state_dict_type %r: 'full' or 'local'" % (kind,))
        old = self._sd_type, self._sd_config
        self._sd_type = kind
        if config is not None:
            self._sd_config = config
        try:
            yield
        finally:
            self._sd_type, self._sd_config = old

    def _local_keys(self, sd, prefix):
        """{key in sd: entry} for the parameters' keys under prefix."""
        alias = self._aliases()
        out = {}
        for k in sd:
            if k.startswith(prefix) and k[len(prefix):] in alias:
                out[k] = alias[k[len(prefix):]]
        return out

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """torch's state_dict() hook on the wrapped module: the parameters'
        values (their shard parts) replaced as the state dict type says."""
        if self._sd_raw:
            return None
        keys = self._local_keys(state_dict, prefix)
        if self._sd_type == "local":
            for k, e in keys.items():
                state_dict[k] = e.part.detach().clone()
            return None
        cfg = self._sd_config
        full = self.full_parameters()  # collective: every rank is here
        if cfg.rank0_only and self.client.rank != 0:
            for k in list(state_dict):
                if k.startswith(prefix):
                    del state_dict[k]
            return None
        for k, e in keys.items():
            state_dict[k] = full[e.name]
        for k, dt in self._buffer_dtypes.items():  # buffer_dtype's casts undone
            if prefix + k in state_dict:
                state_dict[prefix + k] = state_dict[prefix + k].to(dt)
        if cfg.offload_to_cpu:
            for k in list(state_dict):
                if k.startswith(prefix) and isinstance(state_dict[k], torch.Tensor):
                    state_dict[k] = state_dict[k].cpu()
        return None

    def _load_state_dict_pre_hook(self, state_dict, prefix, local_metadata, strict,
                                  missing_keys, unexpected_keys, error_msgs):
        """torch's load_state_dict() pre-hook on the wrapped module (torch
        calls it before the module loads anything): a full state dict's
        parameters are written into the shards (each rank its parts), and
        their entries replaced by what the parameters then are, so that
        torch's own copy (and its key and shape checks) finds them."""
        if self._sd_raw or self._sd_type == "local":
            return
        keys = self._local_keys(state_dict, prefix)
        given = {}
        for k, e in keys.items():
            v = state_dict[k]
            if tuple(v.shape) != tuple(e.shape):
                error_msgs.append("size mismatch for %s: copying a param with shape %s "
                                  "from checkpoint, the shape in current model is %s."
                                  % (k, tuple(v.shape), tuple(e.shape)))
                return
            given.setdefault(id(e), v)
        self._write_full(given)
        for k, e in keys.items():
            state_dict[k] = e.param.detach().clone()

    def _write_full(self, given):
        """given {id(entry): whole value}: each rank writes its parts into
        its shard (a 16-bit unit's fp32 master from the values given, as at
        construction); resident clients then gather (a collective). Entries
        not given keep theirs."""
        self._release_unbackwarded()
        held = [u.name for u in self.units if self.transient and u.gather is not None]
        if held:
            raise shardd.Error(22, "load_state_dict(): units %s are gathered by a "
                               "forward or backward still" % held, "E_STATE")
        rank = self.client.rank
        with torch.no_grad():
            for u in self.units:
                buf = u.buffer
                sh = buf.shard_tensor
                s0 = rank * buf.shard_numel
                exact = None if u.torch_grads else sh.float()
                for e in u.entries:
                    v = given.get(id(e))
                    if v is None:
                        continue
                    lo = min(max(s0 - e.offset, 0), e.numel)
                    hi = lo + e.part.numel()
                    flat = v.detach().reshape(-1)[lo:hi]
                    e.part.copy_(flat.to(sh.dtype).to(sh.device))
                    if exact is not None and hi > lo:
                        o = e.offset + lo - s0
                        exact[o:o + hi - lo].copy_(flat.float().to(sh.device))
                if exact is not None:
                    # the seed goes through the reduced-gradient shard, which
                    # it leaves zeroed: the gradients kept are gone
                    self.client.seed_master(buf, exact)
                    u.live_at = None
                    for e in u.entries:
                        e.param.grad = None
        if not self.transient:
            self.gather()

    def state_dict(self, rank0_only=False, offload_to_cpu=False):
        """FSDP's full state dict: torch's module.state_dict() keys and
        order (both names of a tied weight), every parameter whole (a
        collective: every rank calls it, and each gets the dict, or only
        rank 0 with rank0_only) and the module's buffers as this rank has
        them, so plain torch loads it (model.load_state_dict). What
        model.state_dict() gives in the default state dict type."""
        with self.state_dict_type("full", FullStateDictConfig(offload_to_cpu, rank0_only)):
            return self.module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        """Writes a full state dict (torch's or state_dict()'s) into the
        shards: each rank its parts of every unit (a 16-bit unit's fp32
        master from the values given, as at construction), the buffers
        into the module. Every rank calls it with the same dict; resident
        clients then gather (a collective). What model.load_state_dict()
        does in the default state dict type. The optimizer's state is its
        own: shardd.optim's load_state_dict."""
        with self.state_dict_type("full"):
            return self.module.load_state_dict(state_dict, strict=strict)

    def reshard(self):
        """FSDP2's reshard(): a unit a forward left gathered for a backward
        that has not come (the root unit after a train-mode forward with
        grad enabled whose output is only logged) is released, and its
        parameters are their parts of this rank's shard again, writable. An
        optimizer's step does it itself; call it before writing into the
        parameters (``p.data.copy_()``, ``clamp_``, an init) between such a
        forward and the next. A backward of that output later gathers the
        unit again. Transient areas, outside forward and backward; resident
        areas have nothing to reshard (a no-op)."""
        self._release_unbackwarded()

    def _before_daemon_step(self):
        """Before shardd.optim's step (every rank, in the same state): a
        unit no scatter reached since the last step whose trainable
        parameters hold a .grad (zeroed by zero_grad(set_to_none=False),
        torch 1.13's default, or kept from the last backward with no
        zero_grad since) has it scattered again, so that the daemon's step
        applies it as torch's step applies a .grad that is set (the daemon
        skips a buffer no scatter reached since its last step, taking its
        gradient for consumed: torch's None .grad). A .grad that is None
        is named to the daemon, which skips it as torch does. Costs a
        gather and a scatter per such unit: only a step with no backward
        since the last one pays it."""
        self.reshard()
        if not self.transient:
            return
        n = self.client.steps_requested
        for u in self.units:
            if u.live_at == n or u.gather is not None:
                continue
            train = [e for e in u.entries if e.param.requires_grad]
            if all(e.param.grad is None for e in train):
                continue
            u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=True)
            for e in train:
                e.kept = self._held_grad(e)
            self._finish(u, ran=False)
            u.state = "idle"
        self._wait_releases()

    def full_parameters(self):
        """-> {qualified name: tensor}, copies of the whole parameters as the
        daemon holds them now (collective: every rank must call it). Resident
        areas: gathers every unit. Transient: gathers and releases one unit
        at a time (not while a forward or backward holds units)."""
        out = {}
        self._release_unbackwarded()
        for u in self.units:
            if self.transient:
                if u.gather is not None:
                    raise shardd.Error(22, "full_parameters(): unit %r is gathered by "
                                       "a forward or backward still" % u.name, "E_STATE")
                g, _ = self.client.gather_area(u.buffer)
            else:
                self.client.gather(u.buffer)
                g = u.buffer.gather_tensor
            try:
                for e in u.entries:
                    out[e.name] = g[e.offset:e.offset + e.numel].view(e.shape).clone()
            finally:
                if self.transient:
                    self.client.release(u.buffer)
        return out

    # -- transient areas: the hooks ------------------------------------------
    def _install_hooks(self):
        root = self.module
        # the root's pre-hook that pushes the saved-tensor hooks runs before
        # the root unit's gather, its post-hook that pops them after the
        # root unit's post-forward (hooks run in registration order)
        root.register_forward_pre_hook(self._root_pre_forward)
        for u in self.units:
            for m in _hooked_modules(u):
                m.register_forward_pre_hook(functools.partial(self._pre_forward, u))
                m.register_forward_hook(functools.partial(self._post_forward, u))
            if u.is_root:
                continue
            # a parameter the root's forward reads from its module itself
            # (F.linear(x, self.wte.weight)), outside every forward that
            # gathers its unit: the read gathers the unit (held until the
            # root's forward ends), its gradient starts the unit's backward
            for e in u.entries:
                for m, attr in e.owners:
                    _watch(m, attr, self, u)
                if e.param.requires_grad:
                    e.param.register_hook(functools.partial(self._output_grad, u))
        root.register_forward_hook(self._root_post_forward)

    def _pop_saved_hooks(self):
        if self._sth is not None:
            sth, self._sth = self._sth, None
            sth.__exit__(None, None, None)

    def _root_pre_forward(self, module, inputs):
        self._pop_saved_hooks()  # a forward that raised left them pushed
        self._wait_releases()  # a forward without backward sent some
        for u in self.units:  # likewise
            u.depth = 0
            u.recompute = False
        self._in_forward = True
        if self._pending is not None:  # likewise
            self._drop_prefetch()
        if self._trial is not None and self._order_done and torch.is_grad_enabled():
            self._prefetch_trial()
        if torch.is_grad_enabled():
            self._sth = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._sth.__enter__()

    def _root_post_forward(self, module, inputs, output):
        self._in_forward = False
        for u, _ in self._read_held:  # gathered by a read of its parameter
            if u.gather is not None and u.depth == 0 and u.state == "forward":
                u.state = "idle"
                self._release(u)
        self._read_held = []
        # the root unit stays gathered for its backward, its parameters the
        # gathered ones (a loss term over model.parameters() after forward,
        # an L2 penalty, reaches the whole root parameters, as FSDP's root).
        # After an eval-mode forward (an evaluation with grad enabled, no
        # backward to come) they are their parts of the shard again until a
        # backward points them at the area (_pre_backward), so torch.optim
        # and the script's writes reach the shard, not the node's read-only
        # copy
        if not module.training:
            for u in self.units:
                if u.is_root and u.state == "forward" and u.gather is not None:
                    self._to_shard(u)
        if any(u.gather is not None and u.state == "forward" for u in self.units):
            # released before an optimizer's step if no backward comes first
            _HELD.add(self)
        self._pop_saved_hooks()
        if self._pending is not None:  # this forward did not reach that unit
            self._drop_prefetch()
        self._order_done = True

    def _release_unbackwarded(self):
        """A unit a forward left gathered for a backward that has not come
        (the root unit after a forward with grad enabled whose output was
        only logged: an evaluation, HF's generate) is released, outside
        forward and backward: its parameters are their parts of the shard
        again. A backward of that output later gathers it again, as any
        released unit's (its saved tensors are rebuilt from the area
        then)."""
        if not self.transient or self._in_forward:
            return
        stale = [u for u in self.units
                 if u.gather is not None and u.state == "forward" and u.depth == 0]
        if not stale:
            _HELD.discard(self)
            return
        if self._in_backward():
            return
        _HELD.discard(self)
        for u in stale:
            u.state = "idle"
            self._release(u)
        self._wait_releases()

    def _read(self, u, module, attr):
        """A parameter of u was read from `module` (its attribute `attr`)."""
        if not self._in_forward or u.depth > 0 or u.gather is not None:
            return  # outside the root's forward, or u is gathered
        if self._pending is not None and self._pending[0] is not u:
            self._drop_prefetch()
        self._check_leases(u, "for a read of its parameter %r" % attr)
        self._pre_forward(u, module, ())
        u.depth = 0  # held by the read, not by a forward: until the root's ends
        self._read_held.append((u, attr))

    def _check_leases(self, u, what):
        """Before u's gather beside a unit a read holds, or for a read: a
        refusal that says why, where the daemon would answer E_LIMIT."""
        held = sorted(v.name for v in self.units if v.gather is not None)
        if len(held) < self._GATHER_LEASES:
            return
        reads = ["%r by a read of its parameter %r" % (v.name, a)
                 for v, a in self._read_held if v.gather is not None]
        raise shardd.Error(
            22, "unit %r needs a gather area %s, and this rank's %d are held by "
            "units %s%s: a parameter read outside the forwards that gather its "
            "unit (its module's, or one holding the parameter) holds the unit "
            "until the root's forward ends; read it inside such a forward, or "
            "wrap it with the module whose forward reads it (an auto_wrap that "
            "leaves it to the root's unit)" % (
                u.name, what, self._GATHER_LEASES, held,
                " (%s)" % ", ".join(reads) if reads else ""), "E_LIMIT")

    # -- forward prefetch (FSDP's forward_prefetch, limit_all_gathers) ------
    _GATHER_LEASES = 2  # the daemon's default gather leases per rank

    def _prefetch_after(self, u):
        """Starts the next unit's gather while u's forward runs."""
        if not self.prefetch or not self._order_done or self._pending is not None:
            return
        try:
            i = self._order.index(u)
        except ValueError:
            return
        if i + 1 >= len(self._order):
            return
        nxt = self._order[i + 1]
        held = sum(1 for v in self.units if v.gather is not None)
        if nxt.gather is not None or held >= self._GATHER_LEASES:
            return
        self._pending = (nxt, self.client.gather_async(nxt.buffer))

    _TRIAL_STEPS = 3  # training steps timed with prefetch, and as many without
    _TRIAL_MARGIN = 0.05  # how much faster prefetching's median must be to keep it
    _clock = staticmethod(time.perf_counter)

    def _prefetch_trial(self):
        """prefetch="auto" on the host backend, at each training forward of
        the root once the order is known: the steps alternate, prefetching
        and not, each timed up to the next training forward, until
        _TRIAL_STEPS of each are; then prefetching stays on only if the
        median of its steps was lower by more than _TRIAL_MARGIN (5%): a
        step with prefetch is never kept for being as fast, so the loop
        after the trial is at worst as fast as without prefetch. Whether it pays depends on a CPU
        being free for the daemon's copy while the ranks compute, and on
        how long ranks wait for each other at each gather (a prefetched
        gather does not make them meet there): measured, not guessed.
        Each rank chooses on its own timings, with no collective of its
        own: a rank relaunched into a running job (or one that retried an
        iteration) counts its forwards differently from its peers. A rank
        that prefetches and one that does not send the same gathers in the
        same order (the first forward's, which prefetching assumes), as a
        relaunched rank's first forward, which learns the order, always
        did beside peers that prefetch."""
        tr = self._trial
        now = self._clock()
        if tr["mode"] is not None:
            tr[tr["mode"]].append(now - tr["t"])
        k = self._TRIAL_STEPS
        if len(tr["on"]) >= k and len(tr["off"]) >= k:
            med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
            on, off = med(tr["on"]), med(tr["off"])
            # within the margin the steps are the same, and prefetching is
            # what has more to lose: a peer's or the daemon's CPU, a second
            # gather slot (no gain in the noise of a shared machine, so off)
            self.prefetch = on < off * (1.0 - self._TRIAL_MARGIN)
            self.prefetch_trial = {"on": tr["on"], "off": tr["off"], "on_median": on,
                                   "off_median": off, "prefetch": self.prefetch}
            self._trial = None
            return
        tr["mode"] = "on" if len(tr["on"]) <= len(tr["off"]) else "off"
        self.prefetch = tr["mode"] == "on"
        tr["t"] = now

    def _drop_prefetch(self):
        nxt, ticket = self._pending
        self._pending = None
        self.client.wait_area(ticket, nxt.buffer)
        self.client.release(nxt.buffer)

    def _point(self, u, with_grad):
        """Every parameter of u a view of u's gather area (and its .grad of
        the gradient area)."""
        g = u.gather
        for e in u.entries:
            p = e.param
            if with_grad and p.requires_grad:
                e.kept = self._held_grad(e)
            p.data = g[e.offset:e.offset + e.numel].view(e.shape)
            if with_grad and p.requires_grad:
                p.grad = u.grad[e.offset:e.offset + e.numel].view(e.shape)
            if e.acc is None and p.requires_grad:
                # the node autograd accumulates p's gradient in, made while p
                # has its shape (its metadata checks the gradients); kept so
                # that autograd keeps using this one
                with torch.enable_grad():
                    e.acc = p.expand_as(p).grad_fn.next_functions[0][0]
                e.acc.register_hook(functools.partial(self._grad_ready, u, e))

    def _held_grad(self, e):
        """Whether e's parameter has a .grad as backward begins (its part of
        the reduced gradient, or a tensor the script put there, copied into
        that part): the unit's scatter then adds to it, as autograd adds to
        an existing .grad."""
        g = e.param.grad
        if g is None:
            return False
        if isinstance(g, _Grad16):
            return True
        if g.numel() != e.rpart.numel():
            raise RuntimeError(
                "shardd: %r's .grad has %d elements; outside forward and backward "
                "a parameter is its part of this rank's shard (%d elements) and "
                "its .grad must be that too (or None)" % (e.name, g.numel(), e.rpart.numel()))
        if g.numel() and g.data_ptr() != e.rpart.data_ptr():
            with torch.no_grad():
                e.rpart.copy_(g.reshape(-1))
        return True

    def _grad_of(self, u, e):
        """What e's parameter's .grad is outside backward: its part of the
        reduced-gradient shard (fp32 units), or a 16-bit unit's stand-in
        that refuses torch.optim."""
        if u.torch_grads:
            return e.rpart
        if e.grad16 is None:
            e.grad16 = e.part.detach().as_subclass(_Grad16)
            e.grad16._rpart = e.rpart
            e.grad16._name = e.name
            e.grad16._dtype16 = u.buffer.dtype
        return e.grad16

    def _to_shard(self, u):
        """Every parameter of u its part of this rank's shard (FSDP's
        sharded views): what an optimizer outside forward steps in place."""
        for e in u.entries:
            e.param.data = e.part

    def _release(self, u):
        u.gather = u.grad = None
        self._to_shard(u)
        # no round trip: the daemon serves this rank's requests in order,
        # so the next gather finds the lease back; the answers are read
        # once a step (_wait_releases), mostly long arrived by then
        self._releases.append(self.client.release_async(u.buffer))

    def _wait_releases(self):
        """The answers to the releases sent since the last call: the first
        failure raised once every one is read."""
        ts, self._releases = self._releases, []
        err = None
        for t in ts:
            try:
                self.client.wait(t)
            except shardd.Error as e:
                err = err or e
        if err is not None:
            raise err

    def _in_backward(self):
        """Whether autograd's engine is running a backward of ours: a forward
        now is activation checkpointing's recomputation."""
        if self._final_queued:
            return True
        if self._in_forward:
            return False
        try:  # refused outside a backward
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        except RuntimeError:
            return False
        self._final_queued = True
        return True

    def _pre_forward(self, u, module, inputs):
        u.depth += 1
        if u.depth > 1:  # inside another of its hooked modules: gathered
            return
        if torch.is_grad_enabled() and self._in_backward():
            # activation checkpointing recomputes the unit's forward in
            # backward: the tensors it saves (kept by checkpoint's own
            # saved-tensor hooks, not ours) lie in the area the unit's
            # backward uses, which stays gathered until the unit's gradient
            # is reduced. Non-reentrant: the outputs' hook gathered it
            # already; reentrant: the recomputation comes first
            u.recompute = True
            if u.state not in ("backward", "late"):
                self._pre_backward(u)
            return
        if not self._order_done and u not in self._order:
            self._order.append(u)
        pend = self._pending
        if pend is not None and pend[0] is u:
            self._pending = None
            u.gather, _ = self.client.wait_area(pend[1], u.buffer)
            self.prefetches += 1
        else:
            if pend is not None:  # the order changed: not this one
                self._drop_prefetch()
            if self._read_held and u.gather is None:
                self._check_leases(u, "for its forward")
            # a gather of an area this rank holds (the root unit, a module
            # called twice) keeps it and gathers again. The root unit stays
            # gathered until its backward (as FSDP keeps the root); where
            # the last backward began with it (a head at the end of the
            # forward: it holds its gradient area all through backward
            # anyway) its gradient area is leased now, beside the gather,
            # so that its backward needs no second gather of the same
            # values (a collective and a copy of what is often the largest
            # unit, embeddings and head)
            want = (u.is_root and self._root_backward_first and torch.is_grad_enabled()
                    and self._trainable(u) > 0)
            u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=want)
        u.state = "forward"
        self._point(u, False)
        self._prefetch_after(u)

    def _post_forward(self, u, module, inputs, output):
        u.depth = max(u.depth - 1, 0)
        if u.depth > 0:  # the outermost one's outputs get the hook
            return
        if u.recompute:  # held for its backward (see _pre_forward)
            u.recompute = False
            return
        if torch.is_grad_enabled():
            hook = functools.partial(self._output_grad, u)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
            if u.is_root:
                return  # gathered until the end of backward, as FSDP keeps it
            if not self._trainable(u):
                self._hook_frozen_inputs(u, inputs)
        u.state = "idle"
        self._release(u)

    def _hook_frozen_inputs(self, u, inputs):
        """A unit with no trainable parameter (a block frozen mid-run) has
        no gradient to wait for, but backward still runs through it (for
        its inputs' gradient) and gathers it for its saved tensors: once
        the gradient of each input that requires one is whole (every use of
        it inside the unit done), it is released, so that the units below
        it find a lease (else it held one until the end of backward)."""
        seen, ins = set(), []
        for t in _tensors(inputs):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                ins.append(t)
        if not ins:
            return
        left = [len(ins)]
        hook = functools.partial(self._frozen_input_grad, u, left)
        for t in ins:
            t.register_hook(hook)

    def _frozen_input_grad(self, u, left, grad):
        left[0] -= 1
        if left[0] == 0 and u.state == "late" and not self._trainable(u):
            u.state = "idle"
            self._release(u)
        return None

    def _trainable(self, u):
        return sum(1 for e in u.entries if e.param.requires_grad)

    def _pre_backward(self, u):
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        want = self._trainable(u) > 0 and u.state != "done"
        if u.is_root:
            self._root_backward_first = all(
                v.state in ("idle", "forward") for v in self.units if v is not u)
        if not (want and u.state == "forward" and u.gather is not None
                and u.grad is not None):
            # (the root unit leased both in its forward: the values there
            # are still the gathered ones, and no gradient reached the area)
            try:
                u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=want)
            except shardd.Error as e:
                if e.code_name != "E_LIMIT":
                    raise
                raise self._backward_limit(u, e) from e
        if want:
            u.state = "backward"
            u.ran = True
            u.pending = self._trainable(u)
            for e in u.entries:
                e.got = False
        else:  # gathered for saved tensors only: released at the end
            u.state = "late"
        self._point(u, want)

    def _backward_limit(self, u, err):
        """The daemon's E_LIMIT for u's gather in backward, saying which
        units hold this rank's areas and why they wait."""
        waiting = []
        for v in self.units:
            if v.gather is None or v is u:
                continue
            if v.state == "backward":
                left = [e.name for e in v.entries if e.param.requires_grad and not e.got]
                waiting.append("%r (waits for the gradient of %s)" % (
                    v.name, ", ".join(repr(n) for n in left[:3])
                    + (" and %d more" % (len(left) - 3) if len(left) > 3 else "")))
            else:
                waiting.append("%r (%s)" % (v.name, "the root unit, held until backward "
                                            "ends" if v.is_root else v.state))
        return shardd.Error(
            err.code, "unit %r's backward needs a gather area, and this rank's are held "
            "by %s: a unit holds its areas until every trainable parameter of it has "
            "its gradient, which comes late where a parameter is used by two forwards "
            "before one backward (a loss over two batches: call backward() on each "
            "forward's loss instead, the gradients add up) or gets none (a parameter "
            "the loss does not depend on) [%s]" % (u.name, ", ".join(waiting) or "none",
                                                  err.message), "E_LIMIT")

    def _output_grad(self, u, grad):
        if u.state in ("idle", "forward"):
            self._pre_backward(u)
        return None

    def _grad_ready(self, u, e, grad_inputs, grad_outputs):
        if u.state != "backward":
            return
        e.got = True
        u.pending -= 1
        if u.pending == 0:
            self._finish(u)

    def _finish(self, u, ran=True):
        """Scatter u (ran False: no backward reached it, its gradient area
        is zeros). As autograd adds into an existing .grad, the result adds
        to the reduced gradient of the parameters whose .grad was set when
        backward began (the last scatter's, not zeroed or set to None since
        -- after a step too, as torch keeps .grad until zero_grad()); the
        others start from zero. The trainable parameters no gradient
        reached and that had none are named to the daemon (its step skips
        those no rank had one for, as torch skips a None .grad). It
        consumes the gradient area. Then every parameter is its part of the
        shard again and every trainable one's .grad its part of the reduced
        gradient, but for those that neither got a gradient nor had one
        (None, as torch's; _final makes that the same on every rank)."""
        self._sync_requires_grad(u)
        train = [e for e in u.entries if e.param.requires_grad]
        kept = [e for e in train if e.kept]
        no_grad = [e.view for e in train if not e.kept and not (ran and e.got)]
        acc, save = False, None
        if kept:
            with torch.no_grad():
                for e in train:
                    if not e.kept:
                        e.rpart.zero_()
                if u.live_at is not None and u.live_at == self.client.steps_requested:
                    acc = True  # the daemon adds to its live reduced gradient
                else:
                    # a step consumed it: the daemon would replace it, so
                    # what the parameters kept is added back here
                    save = u.buffer.reduced_tensor.clone()
        self.client.scatter(u.buffer, self.reduce_op,
                            no_grad=(True if len(no_grad) == len(train) else no_grad),
                            accumulate=acc)
        if save is not None:
            with torch.no_grad():
                u.buffer.reduced_tensor.add_(save)
        u.live_at = self.client.steps_requested
        u.state = "done"
        self._release(u)
        for e in train:
            e.param.grad = self._grad_of(u, e) if (ran and e.got) or e.kept else None

    def _final(self):
        """End of backward: every unit scattered once, in reverse order."""
        self._final_queued = False
        _HELD.discard(self)
        self._scatter_rest()
        try:
            self._wait_releases()
            self._same_none_grads()
        finally:
            for u in self.units:
                u.ran = False

    def _same_none_grads(self):
        """A .grad left None (no gradient reached the parameter here) must be
        None on every rank, or torch.optim would step some ranks' parts of
        a parameter and not the others' (whose reduced gradient has the
        other ranks' contributions): one small all-reduce compares the
        ranks' sets; where they differ (a graph that depends on the rank),
        every trainable parameter of the units that had a backward gets its
        .grad (zeros where no rank had a gradient, as FSDP's)."""
        none = [(ui, ei) for ui, u in enumerate(self.units) for ei, e in enumerate(u.entries)
                if e.param.requires_grad and e.param.grad is None]
        sig = float(zlib.crc32(repr(none).encode()))
        n = float(len(none))
        mx = self.client.all_reduce([n, -n, sig, -sig], "max")
        if mx[0] == -mx[1] and mx[2] == -mx[3]:
            return
        for ui, ei in none:
            u = self.units[ui]
            if u.live_at == self.client.steps_requested and u.ran:
                u.entries[ei].param.grad = self._grad_of(u, u.entries[ei])

    def _scatter_rest(self):
        for u in reversed(self.units):
            if u.state == "backward":
                self._finish(u)  # a parameter got no gradient: zeros
            elif u.state == "late":
                self._release(u)
            elif u.state in ("idle", "forward") and self._trainable(u):
                # no backward reached the unit: a zeroed gradient, not the
                # last step's
                u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=True)
                for e in u.entries:
                    if e.param.requires_grad:
                        e.kept = self._held_grad(e)
                self._finish(u, ran=False)
            elif u.gather is not None:
                self._release(u)
            u.state = "idle"

    def _pack(self, t):
        try:
            ptr = t.data_ptr()
        except Exception:  # e.g. sparse
            return t
        for u in self.units:
            g = u.gather
            if g is None or t.dtype != g.dtype or t.device != g.device:
                continue
            lo = g.data_ptr()
            esz = g.element_size()
            if lo <= ptr < lo + g.numel() * esz and t.numel() > 0:
                return _Saved(u, (ptr - lo) // esz, tuple(t.size()), tuple(t.stride()))
        return t

    def _unpack(self, x):
        if not isinstance(x, _Saved):
            return x
        u = x.unit
        if u.state in ("idle", "forward", "done"):
            # backward reached a saved tensor of u before u's outputs
            self._pre_backward(u)
        return u.gather.as_strided(x.size, x.stride, x.offset)

    # -- optimizer ---------------------------------------------------------
    def param_groups(self, params=None, **defaults):
        """torch-style params (iterable of tensors, of (name, tensor) pairs, or
        of dicts with "params") -> shardd groups: every tensor becomes its
        view, named by its qualified name; a tensor this wrapper does not
        manage becomes a "not a shardd tensor" ref under the best name known
        (its name in the module, its name before wrapping, or a description),
        which the daemon refuses naming it."""
        if params is None:
            params = list(self.parameters())
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or dicts, not a tensor")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        names = {id(p): n for n, p in self.module.named_parameters()}
        groups = []
        for gi, g in enumerate(params):
            g = dict(g)
            plist = g.pop("params")
            if isinstance(plist, torch.Tensor):
                plist = [plist]
            refs = []
            for ri, item in enumerate(plist):
                given = None
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                    given, item = item
                e = self._by_param.get(id(item))
                if e is not None:
                    refs.append((given or e.view.name, e.view))
                    continue
                if given:
                    nm = given
                elif id(item) in names:  # on the module but not managed
                    nm = names[id(item)]
                elif id(item) in self._orig_names:
                    nm = "%s (the original parameter, replaced by a shardd view)" % (
                        self._orig_names[id(item)])
                else:
                    nm = "param group %d ref %d (%s of shape %s, not from the wrapped module)" % (
                        gi, ri, type(item).__name__, tuple(getattr(item, "shape", ())))
                refs.append((nm, 0))
            g["params"] = refs
            groups.append(g)
        return groups

    def register_optimizer(self, kind, params=None, name=None, **hyper):
        """Registers an optimizer over torch-style params (default: all managed
        parameters). Every rank must make the identical call (same name).
        Raises shardd.Error (E_NOT_OWNED...) with the daemon's message naming
        each parameter that is not a shardd view."""
        opt = self.client.register_optimizer(kind, self.param_groups(params), name=name, **hyper)
        if all(o.id != opt.id for o in self._optims):
            self._optims.append(opt)
        return opt

    def _forget_optimizer(self, opt):
        """opt was unregistered (shardd.optim's add_param_group registers
        its groups anew)."""
        self._optims = [o for o in self._optims if o.id != opt.id]

    def reset(self):
        """After a collective failed mid-iteration (E_PEER_LOST: a rank died
        and will be relaunched), drop this rank's part of the iteration:
        every area it leases is returned, the prefetch and saved-tensor
        hooks forgotten, .grad set to None. Then redo the iteration from
        the daemon's step count (opt.steps): the failed one's scatters are
        replaced by the redo's (zero_grad()), so nothing of it counts."""
        self._pop_saved_hooks()
        self._final_queued = False
        try:
            self._wait_releases()
        except shardd.Error:
            pass  # failed with the rest: release_all below returns the areas
        pend, self._pending = self._pending, None
        if pend is not None:
            try:
                self.client.wait_area(pend[1], pend[0].buffer)
            except shardd.Error:
                pass  # failed with the rest: it leased nothing
        for u in self.units:
            if self.transient and (u.gather is not None or u.grad is not None):
                try:
                    self.client.release_all(u.buffer)
                except shardd.Error:
                    pass  # the daemon took them back already
            if self.transient:
                u.gather = u.grad = None
                self._to_shard(u)
            u.state = "idle"
            u.live_at = None
            for e in u.entries:
                e.param.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """FSDP's no_sync(), for scripts that accumulate gradients with it:
        backwards inside it and the synced one after all add up before the
        step, as in torch. Here nothing is skipped: on transient clients
        each backward's reduce-scatter adds into the sharded reduced
        gradient (memory stays at the bound, where FSDP's no_sync keeps
        unsharded gradients), and on one node that reduction is a local
        memory pass, not communication; on resident ones autograd adds into
        the grad areas and the explicit scatter() comes after."""
        yield

    def checkpoint(self, directory):
        """A daemon checkpoint of the job (collective: every rank calls it,
        e.g. every k steps after opt.step()): shards, optimizer state and
        step counts, taken once every rank is there; a restore of it and a
        relaunch of the same script resume (init="auto"). Not while a
        forward or backward holds units."""
        held = [u.name for u in self.units if u.gather is not None]
        if self.transient and held:
            raise shardd.Error(22, "checkpoint(): units %s are gathered by a forward "
                               "or backward still" % held, "E_STATE")
        self.client.checkpoint(directory, collective=True)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, optimizer=None):
        """FSDP's clip_grad_norm_ (collective): -> the total L2 norm of the
        reduced gradients over every shard of every rank, as a torch scalar
        (torch's plain clip_grad_norm_ over model.parameters() sees only
        this rank's parts: a per-rank norm, as under FSDP). Gradients are
        scaled by min(1, max_norm / (norm + 1e-6)), as torch's clipping in
        place does; max_norm=inf reports the norm only.
        optimizer: whose parameters count. A shardd.optim optimizer or a
        registered one (the default when exactly one was registered through
        this module): the daemon computes the norm and its next step
        scales. A torch.optim optimizer (the default when none was
        registered): the norm of its parameters' .grad parts (all-reduced
        over the ranks) and the parts are scaled in place. Resident
        clients call scatter() first."""
        if float(norm_type) != 2.0:
            raise NotImplementedError("clip_grad_norm_: norm_type %r (shardd computes "
                                      "the L2 norm only)" % (norm_type,))
        if optimizer is not None and hasattr(optimizer, "_opt"):
            optimizer = optimizer._opt
        if isinstance(optimizer, torch.optim.Optimizer) or (optimizer is None and not self._optims):
            params = (list(self.parameters()) if optimizer is None else
                      [p for g in optimizer.param_groups for p in g["params"]])
            return self._clip_grads(params, float(max_norm))
        if optimizer is None:
            if len(self._optims) != 1:
                raise ValueError("clip_grad_norm_: %d optimizers are registered through "
                                 "this module; pass optimizer=" % len(self._optims))
            optimizer = self._optims[0]
        mn = float(max_norm)
        total = self.client.clip_grad_norm(optimizer, mn if math.isfinite(mn) else math.inf)
        return torch.tensor(total)

    def _clip_grads(self, params, max_norm):
        """clip_grad_norm_ over the .grad parts of params (each parameter
        once), every rank's summed (a collective)."""
        seen, grads = set(), []
        for p in params:
            e = self._by_param.get(id(p))
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            g = p.grad
            if g is None:
                continue
            if isinstance(g, _Grad16):
                g = g._rpart
            elif g.numel() != e.rpart.numel():
                raise shardd.Error(22, "clip_grad_norm_: %r's .grad is not its part of the "
                                   "reduced gradient (call it after backward, outside "
                                   "forward and backward%s)" % (
                                       e.name, "" if self.transient else ", after scatter()"),
                                   "E_STATE")
            grads.append(g)
        local = 0.0
        with torch.no_grad():
            for g in grads:
                if g.numel():
                    local += float(g.double().pow(2).sum())
        total = math.sqrt(self.client.all_reduce(local, "sum"))
        if math.isfinite(max_norm) and max_norm > 0:
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                with torch.no_grad():
                    for g in grads:
                        g.mul_(coef)
        return torch.tensor(total)
