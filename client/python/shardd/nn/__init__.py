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

An optimizer is built after wrapping (FSDP's order): one built before
holds the original parameters, emptied, that never get a gradient, and
its step (any ``torch.optim.Optimizer``'s, hooked as below) raises,
naming them, instead of skipping them all; so does its step over a
parameter registered on the wrapped model after wrapping (``add_module``),
which no wrapper manages (its gradient each rank's own, never reduced).
A torch.optim optimizer steps each rank's 1-D part of a parameter, so
only an element-wise one computes torch's update: torch's SGD, Adam,
AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop, NAdam, RAdam, ASGD (and
subclasses keeping their step, not wrapping it in a decorator of their
own), shardd.optim's, and a class marked with
:func:`elementwise_optimizer`; any other's first step over a transient
wrapper's parameters raises, naming it (a LARS trust ratio would take the
part's norm, Adafactor the part's shape, LBFGS dot products over the
parts). Its ``state_dict()`` records each rank's part of every parameter,
and its ``load_state_dict()`` takes a whole dict (plain torch's, or
:func:`full_optim_state_dict` of every rank's, for any world size) and
refuses a rank's dict whose parts differ here (optim_state.py).

A parameter replaced or converted behind the wrapper's back after
wrapping (``module.weight = nn.Parameter(t)``, ``model.half()`` /
``.double()`` / ``.to(dtype)`` / ``.to(device)``, ``p.data = t``) would
compute outside the shards or be pointed back at them: the next forward
(transient: the root's pre-hook; resident: :meth:`ShardedModule.gather`)
raises, naming it and what happened. A hook on a parameter's
AccumulateGrad node (torch 1.13's post-accumulate hook) is refused,
naming the parameter: made before wrapping it would never run (at
wrapping), made after it would see a unit's unreduced gradient or its
reduced part by the order of its parameters (transient areas: at the
unit's gather or in backward; acc_hooks.py).

Resident clients: a parameter is the gathered copy and its ``.grad`` this
rank's unreduced gradient, so torch.optim (and torch's clip_grad_norm_)
raise on them, naming the parameter: use shardd.optim, or transient areas
where torch.optim steps the shards. A write into a resident parameter
(an init, ``clamp_()``) between gathers writes the gathered copy, which
the next gather would overwrite: that gather raises instead, naming the
unit (load new values with ``model.load_state_dict()``). The loop's
collectives are explicit and each one forgotten raises before anything
changed, naming it: a step (or ``clip_grad_norm_``) after a backward no
``scatter()`` reduced, a step with no ``scatter()`` since that
optimizer's last step, a forward with ``initial_gather=False`` before
any ``gather()``. A step gathers the units it changed (as ZeRO-2's step
does), so the parameters hold the stepped values for whatever reads them
next, and the ``gather()`` after it sends nothing.

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
  shows the line that wrote; such a write from a forward pre-hook or
  forward hook of the script's is refused instead, naming the parameter
  (hook_writes.py); outside forward and backward a parameter is
  its part of this rank's shard, writable);
* forward post-hook: register a hook on the unit's output tensors (it fires
  when the gradient w.r.t. them is computed, before the unit's backward), then
  release the unit (FSDP's reshard after forward) and point its parameters
  back at their parts of this rank's shard (1-D, possibly empty: FSDP1's
  sharded views with use_orig_params; but ``p.dim()`` / ``p.ndim`` stay
  the original's, so param groups split by them, nanoGPT's no-decay
  split, are torch's: units.py's _ShardParameter), except the *root unit* (the
  one holding the root module's own parameters), which stays gathered until
  the end of backward as FSDP keeps it, its parameters the gathered ones
  (a loss term over its parameters after forward reaches them whole; a
  backward through one over another unit's, its 1-D part by then, is
  refused naming them: backward_errors.py). After an eval-mode forward (``model.eval()``, grad enabled, no
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
  with that release too, and the classes that exist when the first
  wrapper is built are wrapped then: a test while no unit waits so, about
  0.3 us per step). So the
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
  after wrapping steps the shards in place, as under FSDP, and torch's
  ``clip_grad_norm_`` over them clips by the norm over every rank's parts
  (clip_hook.py: torch's function object answers so). Gradient
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
2 gather leases. A unit reduced already in this backward that a
recomputation runs again (two calls, each in its own reentrant
checkpoint: each nested backward ends the unit) is gathered again with a
gradient area, and its scatter adds to the first one's.

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
out the whole parameters on either kind, and
:meth:`ShardedModule.gathered_parameters` (DeepSpeed's GatheredParameters)
also writes back what every rank wrote into those copies. From the second forward on, the
next unit's gather (in the first forward's order) runs while a unit
computes, when the rank's 2 gather leases allow and, with
``prefetch="auto"`` (the default) on the host backend, the first steps
measured it faster than gathering each unit when needed. Likewise in
backward (``backward_prefetch``, FSDP's BACKWARD_PRE): when a unit's
backward begins, the gather (with its gradient area) of the unit before it
in this step's forward is sent, when the leases allow it; the ranks agree
at the end of each backward whether the next one prefetches (all want
it), so every rank sends the same gathers. Not done
yet: an unsharded ``no_sync()`` (:meth:`no_sync` is
accepted and accumulates in the sharded gradient), and a forward that
raises (the saved-tensor hooks stay pushed, and the units it left gathered
for their forward held, until the next forward of the root, which
releases them). A unit with no trainable parameter
(wholly frozen) that backward runs through is released once the gradient
of each of its inputs is whole; a tensor autograd saves of its parameter
read outside its forward (by the root's) is a copy, taken then, so that
backward gathers nothing for it. A unit with a trainable parameter that
gets no gradient holds its areas until the end of backward, so two such
units (or one and the root unit) in one backward run into the lease limit
(E_LIMIT), refused naming the units that wait and for what; so does
``torch.autograd.grad(loss, params)``, which accumulates no gradient (no
unit's is ever whole) and returns each rank's unreduced one. Such a
refused backward releases every area leased for it and its forwards,
unscattered, and puts each ``.grad`` back as it was, but where a unit
had already added its share to a ``.grad`` kept from before: the next
backward and optimizer step refuse (E_STATE) until ``zero_grad()``.

Two (or more) forwards before one backward (a loss over two batches, a
siamese pair): each root forward's use of a unit (a _Use: every call of
it in that forward) ends its backward on its own, gathered again for it,
reduce-scattered and added to the sharded gradient, as a backward per
loss would. A forward while no earlier forward's use of the unit waits
for its backward (one forward per backward: always) computes with the
parameters themselves; a later forward's trainable parameters are leaf
tensors of its own over the gathered values, put into the unit's
modules' ``_parameters`` while its forward runs (the parameters put
back after), so autograd accumulates each forward's gradient on its own
node (the root unit, gathered all through backward, takes their sum
once); in that forward's code each leaf stands for its parameter
(leaves.py: its .grad is the parameter's, the script's attributes are
read and set on the parameter, a script's hook's write into it is
refused as one into the parameter). Each rank must run as many forwards through the same units (else
their collectives differ: E_MISMATCH, saying so); a script's hook on a
parameter a second forward uses (it would see one forward's part) and
an interleaving of two uses' backwards of one unit are refused (E_LIMIT).

On the cuda backend the parameters and their ``.grad`` live on the GPU the
daemon put this rank's areas on (:attr:`ShardedModule.device`; the module's
buffers, e.g. BatchNorm statistics, are moved there too; inputs are the
caller's to move). The client waits for the queued GPU work
(``torch.cuda.synchronize``) before each gather, scatter and step it
requests, so the daemon reads finished gradients and shards and overwrites
no parameter a kernel still reads.
"""
# The wrapper lives in module.py (ShardedModule) and its mixins: hooks.py
# and backward.py (transient areas around forward and in backward),
# prefetch.py, state_dicts.py, meta.py (meta-device init); units.py plans
# the units, grads.py has the .grad stand-ins, reads.py the parameter reads,
# optimizer_hook.py the owners and the pre-step checks and release,
# optim_state.py torch.optim's state dicts of parts, hook_writes.py the
# script's forward hooks that write a gathered parameter, acc_hooks.py the
# hooks on a parameter's AccumulateGrad node, backward_errors.py torch's
# shape error for a loss term over the parts, leaves.py a later forward's
# stand-ins for the parameters, _precision.py the
# dtypes, builtin.py what torch's built-in modules need (MultiheadAttention's
# out_proj, an RNN's _flat_weights, weight_norm's pre-hook), clip_hook.py
# torch's clip_grad_norm_ over a wrapper's parameters, inits.py torch.nn.init's
# functions on a parameter's part (both through reroute.py). Every name
# nn.py had before the split is imported here, private ones included, so
# shardd.nn.X stays what it was.
# flake8: noqa: F401
from ._precision import (_DTYPE_OF, _TORCH_DTYPES, _cast_floats, _checksum, _dtype_name,
                         _mixed_precision)
from .units import (FlatUnit, _CONTAINERS, _Entry, _PARAM_CONTAINERS, _Saved, _ShardParameter,
                    _check_nesting,
                    _check_outside_holders, _collect, _hooked_modules,
                    _name_outside, _policy, _tensors, _unit_modules,
                    size_based_auto_wrap_policy)
from .grads import _GRAD16_GETS, _Grad16, _ResidentGrad, _in_zero_grad, _torch_caller
from .reads import _WATCH, _WATCHED, _watch, _watched_class
from .optimizer_hook import (_HELD, _ORIGINALS, _OWNERS, _STEP_HOOKED, _before_step,
                             _install_step_hook, _mark_step_hooked, _wrap_step, owner_of,
                             elementwise_optimizer)
from .optim_state import PARTS_KEY, full_optim_state_dict
from .state_dicts import FullStateDictConfig, _StateDicts
from .hooks import _ForwardHooks
from .backward import _BackwardHooks
from .prefetch import _Prefetch
from .meta import _MetaInit, _materialize
from .module import INIT_POLICIES, ShardedModule

# the public names are shardd.nn's, as before the split (repr, pickling)
for _o in (ShardedModule, FullStateDictConfig, FlatUnit, size_based_auto_wrap_policy, owner_of,
           elementwise_optimizer, full_optim_state_dict):
    _o.__module__ = __name__
del _o
