"""ShardedModule: construction (units, flat buffers, the parameters
replaced by views), resident areas' gather / zero_grad / scatter, the
optimizer registration, memory reports; the rest comes from its mixins
(hooks, backward, prefetch, state_dicts, meta)."""
import contextlib
import faulthandler
import functools
import math
import os
import weakref

import torch
from torch import nn

import shardd

from . import backward_errors
from .acc_hooks import check_originals
from ._precision import _DTYPE_OF, _TORCH_DTYPES, _cast_floats, _checksum, _mixed_precision
from .clip_hook import install as _install_clip_hook
from .inits import empty_part as _empty_part, install as _install_inits, register_part as _register_part
from .part_ops import closed as _part_ops_closed, install as _install_part_ops
from .part_ops import mark_stale as _mark_stale
from .backward import _BackwardHooks
from .grads import _Grad16, _ResidentGrad
from .builtin import check_builtin, pre_hooks_first, refresh_cached
from .hook_writes import guard_hook_writes
from .hooks import _ForwardHooks
from .meta import _MetaInit
from .optimizer_hook import (_ORIGINALS, _OWNERS, _WRAPPERS, _forget_original,
                             _install_step_hook)
from .prefetch import _Prefetch
from .state_dicts import FullStateDictConfig, _StateDicts
from .units import (FlatUnit, _Entry, _ShardParameter, _check_nesting, _check_outside_holders,
                    _collect, _hooked_modules, _unit_modules)


INIT_POLICIES = ("auto", "overwrite", "require_existing")


class ShardedModule(_ForwardHooks, _BackwardHooks, _Prefetch, _StateDicts,
                    _MetaInit):
    """Wraps `module` in place over the client's job; see the package
    docstring (shardd.nn).

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
      alternate (fewer where the rest cannot change the choice), each
      timed to the next training forward, and prefetching stays on only
      if the median of its steps is lower by more than 5% (each rank
      chooses on its own timings, and prefetches only while every rank
      chose it, as the ranks learn at the end of each backward; within
      that the two are the same, and prefetch=False's loop is kept).
      Without a CPU to spare, the copy of a prefetched gather takes its
      CPU from the forward it overlaps (one run measured 1.65x the
      gather-everything loop's step with prefetch, 1.05x without): where
      the node's ranks times torch's threads are as many as the CPUs this
      rank may run on, there is no trial and no prefetch. Where ranks
      wait for each other at every gather, a prefetched one does not make
      them meet there. True: always; False: never.
      :attr:`ShardedModule.prefetch` says what is chosen (it alternates
      during the trial), :attr:`ShardedModule.prefetch_trial` the trial's
      step times once it chose (and the CPUs, ranks and threads it
      counted).
    backward_prefetch: transient areas: when a unit's backward begins, the
      gather (with its gradient area) of the unit whose backward comes next
      -- the one before it in this step's forward, FSDP's BACKWARD_PRE,
      which records the order every step -- is already under way, when the
      rank's 2 gather and 2 gradient leases allow it. A wrong guess costs
      a gather, never a result. "auto" (default): where forward prefetch
      is on (prefetch=True, the cuda backend, or the host backend's trial
      chose it); True: always; False: never; BackwardPrefetch.BACKWARD_PRE
      and None are taken for True and False. Every rank prefetches in a
      backward or none does: the ranks agree at the end of each backward
      (on the all-reduce that compares their None gradients), all of them
      wanting it, for the next one, so the first backward never
      prefetches. :attr:`ShardedModule.backward_prefetch` says whether
      the next backward does, :attr:`ShardedModule.backward_prefetches`
      counts the backwards that found their gather under way.
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
                 param_dtype=None, reduce_dtype=None, buffer_dtype=None,
                 backward_prefetch="auto"):
        dtype, buffer_dtype, input_dtype = _mixed_precision(
            dtype, mixed_precision, param_dtype, reduce_dtype, buffer_dtype)
        if init not in INIT_POLICIES:
            raise ValueError("init %r: one of %s" % (init, ", ".join(INIT_POLICIES)))
        if reduce_op not in shardd.REDUCE_OPS:
            raise ValueError("reduce_op %r: one of %s" % (
                reduce_op, ", ".join(sorted(shardd.REDUCE_OPS))))
        if getattr(client, "job", "job") in (None, ""):
            # the daemon's E_STATE at the first registration says only
            # "control session": the usual cause is a torchrun script run
            # without torchrun
            raise ValueError(
                "ShardedModule needs a Client of a job, and this one is a control "
                "session: no job= was given and $TORCHELASTIC_RUN_ID is unset (a "
                "script for torchrun started without it?); launch it with torchrun, "
                "or pass shardd.Client(job=NAME, rank=R, world=W)")
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
        check_builtin(module)  # Embedding(max_norm=...), lazy modules: builtin.py
        specs = _unit_modules(module, auto_wrap)
        per_unit, parent = _collect(module, specs)
        # a model built on the meta device (nn.Linear(..., device="meta")):
        # materialized one module at a time, straight into the shards
        meta = any(t.is_meta for t in module.parameters()) or \
            any(t.is_meta for t in module.buffers())
        if self.transient:
            _check_nesting(specs, per_unit, parent)
        _check_outside_holders(module, per_unit)
        # a hook on an original's AccumulateGrad node would never run
        check_originals([(qn, p) for params in per_unit for qn, p, _ in params])
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
                e.part = sh[a:b] if b > a else _empty_part(sh, a)
                e.rpart = red[a:b]
                if gat is None:  # its part of the shard until a gather
                    newp = _ShardParameter(e.part, requires_grad=p.requires_grad)
                    newp._shardd_ndim = p.dim()  # a split by p.dim() is torch's
                else:
                    newp = nn.Parameter(gat[off:off + n].view(p.shape),
                                        requires_grad=p.requires_grad)
                    e.grad_view = grd[off:off + n].view(p.shape)
                e.param = newp
                # the attributes the script set on p (Mamba's
                # `A_log._no_weight_decay = True`, read when it builds the
                # optimizer's groups; Megatron's flags) are newp's: FSDP's
                # use_orig_params keeps the parameter objects, so they stay
                # (dropped, a group split by them changed without a word)
                for k, v in p.__dict__.items():
                    if not k.startswith("_shardd"):
                        newp.__dict__.setdefault(k, v)
                hooks = getattr(p, "_backward_hooks", None)
                owner = _OWNERS.get(id(p))
                if hooks and (owner is None or owner[0]() is not p):
                    # a gradient hook registered before wrapping
                    # (p.register_hook) runs on the parameter that replaces
                    # p, as one registered after (else it never ran, with
                    # no word); the same dict, so the script's handles
                    # still remove it. Not from another wrapper's
                    # parameter, whose dict holds that wrapper's hooks
                    newp._backward_hooks = hooks
                # where its data lives between forwards (_check_replaced)
                e.home = newp.data_ptr()
                self._orig_names[id(p)] = qn
                self._orig_keep.append(p)
                _ORIGINALS[id(p)] = (weakref.ref(p, functools.partial(_forget_original, id(p))),
                                     qn)
                with torch.no_grad():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
                for m, attr in owners:
                    m._parameters[attr] = newp
                self._by_param[id(newp)] = e
                _OWNERS[id(newp)] = (weakref.ref(newp), weakref.ref(self))
                if gat is None:  # p.data.normal_(): the whole one's draw
                    _register_part(self, e)
                entries.append(e)
                off += n
            self.units.append(FlatUnit(uname or "root", buf, entries, module=root,
                                       is_root=root is module))
        refresh_cached(module)  # an RNN's _flat_weights: the new parameters
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
            cast = lambda _m, inputs: _cast_floats(inputs, input_dtype)  # noqa: E731
            cast._shardd_own = True  # writes no parameter (hook_writes.py)
            module.register_forward_pre_hook(cast)
        dev = self.device
        if dev.type == "cuda":  # the forward must find the module's buffers there
            for m in module.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.device != dev:
                        m._buffers[k] = b.to(dev)
        self._optims = []         # daemon optimizers registered through us
        self._checks = None       # what _check_replaced walks, made on first use
        if prefetch not in (True, False, "auto"):
            raise ValueError("prefetch %r: True, False or \"auto\"" % (prefetch,))
        # "auto" on the host backend: none without a spare CPU, else a
        # trial of both, then the faster (see _prefetch_trial); the cuda
        # backend computes on the GPUs, so a gather's copy never takes a
        # forward's CPU there
        self._trial = None
        if prefetch == "auto":
            prefetch = self.transient
            if self.transient and self.client.daemon_backend == "host":
                self._trial = {"on": [], "off": [], "mode": None, "t": None}
                prefetch = False  # until the trial's first step
        self._prefetch_on = bool(prefetch)  # .prefetch (read-only, prefetch.py)
        self.prefetch_trial = None  # the trial's step times and choice, once made
        self._order = []          # units in the order the first forward met them
        self._order_done = False
        self._root_backward_first = False  # the root unit's backward came first
        # the unit whose backward began first after the root's in the last
        # backward (the last of the forward: its forward gather leases its
        # gradient area and stays for its backward, see _keeps), the one
        # this backward found so far, and the unit held so now
        self._tail = None
        self._tail_next = None
        self._kept = None
        self._pending = None      # (unit, ticket) of the gather under way
        self._releases = []       # tickets of releases not yet waited for
        self.prefetches = 0       # gathers that were under way when needed
        self._fw_agreed = False   # every rank's trial chose forward prefetch
        self._bw_opt = self._backward_prefetch_option(backward_prefetch)
        self._bw_agreed = False  # .backward_prefetch: what the ranks agreed for the next backward
        self.backward_prefetches = 0    # backwards whose gather was under way
        self._fw_gen = 0          # root forwards so far (a unit's _Use is per root forward)
        self._bw_serial = 0       # backwards ended so far (_Use.ended)
        self._leaf_uses = 0       # forwards' uses of a unit on leaves of their own
        self._bw_order = []       # units in this step's order of forwards (post-forward)
        self._sth = None          # the saved-tensor hooks pushed for a forward
        self._in_forward = False  # the root's forward is running
        self._read_held = []      # units a parameter read gathered this forward
        self._holder_calls = 0    # depth of root-unit holders' calls that gathered it
        # resident areas: the collectives of the loop a script must not
        # forget (gather before a forward, scatter between backward and step)
        self._unreduced = None    # a parameter a backward wrote since the last scatter
        self._scatters = 0        # scatter() calls so far
        self._stepped_at = {}     # optimizer id -> _scatters at its last step
        # why the parameters are not the shards' values (None: they are):
        # a step since the last gather, or no gather yet
        self._stale = None
        # the last step (or the construction) gathered what it changed: the
        # next gather() is done, unless a shard was written here since (the
        # shards' version counters then, _shard_versions); None: it gathers
        self._ahead = None
        self._final_queued = False
        # model.state_dict() / load_state_dict(): FSDP's full state dict
        self._sd_raw = 0
        self._sd_type = "full"
        self._sd_config = FullStateDictConfig()
        module._register_state_dict_hook(self._state_dict_hook)
        module._register_load_state_dict_pre_hook(self._load_state_dict_pre_hook)
        module.register_load_state_dict_post_hook(self._load_state_dict_post_hook)
        # every optimizer's step: a release before it (transient), and a
        # refusal of one built before wrapping (it holds the originals)
        _install_step_hook()
        # torch's clip_grad_norm_ over its parameters: the global norm
        _install_clip_hook()
        # torch.nn.init's functions on a parameter's part: the whole one's init
        _install_inits()
        # an EMA's update or a padding row's write on a part: refused
        _install_part_ops()
        _WRAPPERS.add(self)
        # client.step(opt) asked directly gets this wrapper's refusals too
        guards = getattr(client, "_step_guards", None)
        if guards is not None:
            guards.append(weakref.ref(self))
        hooks = getattr(client, "_close_hooks", None)
        if hooks is not None:  # the part checks off once no wrapper is open
            me = weakref.ref(self)
            hooks.append(lambda: _part_ops_closed(me()))
        if self.transient:
            # torch's shape error for a loss term over the parameters
            # outside the forward, said again naming them (backward_errors.py)
            backward_errors.install()
            mods = list(module.modules())

            def hook_keys():
                return {(id(m), k) for m in mods
                        for d in (m._forward_pre_hooks, m._forward_hooks) for k in d}
            before = hook_keys()
            with pre_hooks_first(mods):  # before weight_norm's
                self._install_hooks()
            # a script's hook that writes a parameter while its unit is
            # gathered is refused by name (hook_writes.py)
            guard_hook_writes(self, mods, hook_keys() - before)
        else:
            self._hook_resident()
            for m in {id(m): m for u in self.units
                      for m in [module] + _hooked_modules(u)}.values():
                m.register_forward_pre_hook(self._resident_pre_forward)
        if not self.transient and initial_gather:
            self.gather()
            # the loop's first gather() is this one: every rank's loop then
            # sends one gather per step, the step's, and a relaunched rank
            # (whose wrapper gathers here) meets its peers' retried gather()
            self._ahead = self._shard_versions()
        elif not self.transient:
            self._stale = "before any sm.gather() (initial_gather=False)"

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

    def _buckets(self, units=None):
        """The units (all, or those given) in order, cut into buckets of at
        most bucket_bytes (a larger unit alone); every rank cuts its
        (identical) list alike."""
        out, cur, size = [], [], 0
        for u in self.units if units is None else units:
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

    def _bucketed(self, run_many, run_one, units=None):
        """run_many(bucket) per bucket of units, or run_one(unit) per unit
        when buckets are off or one bucket has fewer than 2 units. A job an
        older daemon does not bucket for (one over several nodes) refuses
        the first bucket whole, before any of it ran (E_STATE): this module
        then sends one request per unit from there on."""
        units = self.units if units is None else units
        buckets = self._buckets(units) if self.bucket_bytes > 0 else [[u] for u in units]
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
        Resident areas only. Units go in buckets (bucket_bytes). The first
        gather() after an optimizer step (or after the wrapper's own first
        gather, at construction) sends nothing: that step gathered the
        units it changed (_stepped), as ZeRO-2's step does, so the loop
        meets the other ranks as often as before and in the same order."""
        self._resident_only("gather()")
        self._check_replaced()
        self._check_unwritten()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead == self._shard_versions():
            return
        self._gather_units(self.units)
        self._stale = None
        _mark_stale(self, False)

    def _gather_units(self, units):
        """All-gather units (collective), in buckets; the version counters
        of their gather areas as it left them (_check_unwritten)."""
        self._bucketed(lambda bk: self.client.gather_many([u.buffer for u in bk]),
                       lambda u: self.client.gather(u.buffer), units)
        self._gathered_versions(units)

    def _resident_pre_forward(self, module, inputs):
        """Resident: refuses a forward while the parameters, the gathered
        copy, do not hold the shards' values: before any gather
        (initial_gather=False: the gather areas hold no values) or after a
        step whose own gather failed (the values before the step; see
        docs/memory.md)."""
        if self._stale is not None:
            raise RuntimeError(
                "forward of %s %s: on a resident client the parameters are the "
                "gathered copy, which does not hold the shards' values now. Call "
                "sm.gather() (a collective, every rank) before the forward"
                % (type(module).__name__, self._stale))

    def _check_reduced(self, what):
        """Resident: refuses what (a step, a clip) while a backward's
        gradients are this rank's own, in the grad areas, never reduced over
        the ranks: the daemon reads the reduced gradient of the last
        scatter()."""
        if self._unreduced is not None:
            raise RuntimeError(
                "%s: a backward wrote the gradient of %r (and the others it reached) "
                "since the last sm.scatter(): on a resident client that gradient is "
                "this rank's own, never reduced over the ranks, and the daemon would "
                "use the last reduced one instead. Call sm.scatter(\"mean\") (a "
                "collective, every rank) after backward, before %s"
                % (what, self._unreduced, what))

    def _daemon_step(self, opt, **kw):
        """The daemon's step of opt (a registered optimizer), through
        sm.step() or shardd.optim's step(), after _before_daemon_step()
        (client.step(opt) asked directly runs the same). Resident: refused, before
        anything changes, after a backward no scatter() reduced, or with no
        scatter() since this optimizer's last step while a .grad is set (the
        daemon skips a gradient it has stepped already, where torch's step
        applies the .grad again; with every .grad None both change
        nothing); once it ran, the units it changed are gathered (_stepped)."""
        self._check_step(opt)
        self._before_daemon_step()
        self.client._wrapper_step = True
        try:
            res = self.client.step(opt, **kw)
        finally:
            self.client._wrapper_step = False
        try:
            self._stepped(opt)
        except BaseException as e:
            # the step ran, its gather failed: the caller's count must
            # know (shardd.optim's next expect_step), else its next step,
            # sent as this one's retry, is skipped as applied already
            e.shardd_step = res
            raise
        return res

    def _check_step(self, opt):
        """Resident: the refusals of a step of opt (_daemon_step's; also
        for client.step(opt) asked of the client directly, below the
        wrapper, which would otherwise skip them)."""
        key = getattr(opt, "id", opt)
        if not self.transient:
            self._check_reduced("the optimizer step")
            again = self._stepped_at.get(key, -1) == self._scatters
            # every .grad None (zero_grad(set_to_none=True) since): torch's
            # step changes nothing, and neither does the daemon's on a
            # gradient it has consumed
            if (again and not self._all_grads_none()) or self._scatters == 0:
                raise RuntimeError(
                    "the optimizer step: no sm.scatter() since the last step of this "
                    "optimizer (or since wrapping): on a resident client the step applies "
                    "the gradient the last scatter reduced, which the daemon has consumed "
                    "(torch's step would apply the .grad again). Call sm.scatter(\"mean\") "
                    "(a collective, every rank) after backward, before each step")
            # the step gathers what it changes (_stepped): a write into those
            # parameters since the last gather would be lost there
            self._check_unwritten(self._units_of(opt), "the step's gather")

    def _check_clip(self, what):
        """Resident: the refusal of a clip after a backward no scatter()
        reduced (clip_grad_norm_'s; also for client.clip_grad_norm(opt)
        asked of the client directly, below the wrapper)."""
        if not self.transient:
            self._check_reduced(what)

    def _stepped(self, opt):
        """Resident: after a step of opt (a collective: every rank is
        here), the units it changed are gathered, so that the parameters,
        the gathered copy, hold the stepped values as the next forward and
        every read of them (an EMA, p.norm(), p.detach().clone()) wants
        them, as torch's and FSDP's do (SHARD_GRAD_OP reshards after
        backward, so the step writes the parameters' shards; DeepSpeed's
        ZeRO-2 step all-gathers the updated partitions at its end). The
        script's next gather() is then done already and sends nothing, so
        the loop (gather, forward, backward, scatter, step) meets the other
        ranks as often as before, in the same order. If that gather fails
        (a peer lost), the parameters stay marked stale: a forward or a
        read by an in-place write is refused until a gather()."""
        if self.transient:
            return
        self._stepped_at[getattr(opt, "id", opt)] = self._scatters
        was = self._stale
        self._stale = "after an optimizer step with no sm.gather() since"
        self._ahead = None
        try:
            self._gather_units(self._units_of(opt))
        except BaseException:
            _mark_stale(self, True)
            raise
        self._stale = was  # initial_gather=False: every unit still wants one
        self._ahead = self._shard_versions() if was is None else None

    def _shard_versions(self):
        """torch's version counters of this rank's shards: a write into
        one here (a script's shard_tensor.fill_(), a part written) since
        a gather makes the next gather() a real one (the daemon's own
        writes, a step's, do not count: the step gathers after them)."""
        return [u.buffer.shard_tensor._version for u in self.units]

    def _units_of(self, opt):
        """The units whose values a step of opt changes (its refs: buffers,
        or views in them); every unit where it names none."""
        refs = getattr(opt, "refs", None)
        if refs is None:
            return self.units
        return [u for u in self.units
                if u.buffer.id in refs or any(e.view.id in refs for e in u.entries)]

    def _clipped(self, opt, scale):
        """After a step of opt whose gradients a clip scaled by scale (the
        daemon scales them as it steps, not in place): the .grad of opt's
        parameters, which the step consumed and the parameters keep
        (transient: their parts of the reduced gradient; resident: this
        rank's grad areas), scaled as torch's clip_grad_norm_ scales .grad
        in place, so that a later backward with no zero_grad() adds to the
        clipped gradient and a step with no backward applies it, as
        torch's do."""
        refs = getattr(opt, "refs", None)
        with torch.no_grad():
            for u in self.units:
                mine = [e for e in u.entries if refs is None or u.buffer.id in refs
                        or e.view.id in refs]
                if len(mine) == len(u.entries):  # one pass over the unit's area
                    # (a None .grad's part is not read: zeroed or replaced first)
                    (u.buffer.reduced_tensor if self.transient
                     else u.buffer.grad_tensor).mul_(scale)
                    continue
                for e in mine:
                    if e.param.requires_grad and e.param.grad is not None:
                        (e.rpart if self.transient else e.grad_view).mul_(scale)

    def _all_grads_none(self):
        return all(e.param.grad is None for u in self.units for e in u.entries)

    def _gathered_versions(self, units=None):
        """Resident: the version counter of each unit's gather area as the
        gather left it (torch bumps it at every in-place write through a
        parameter, which is a view of it; the daemon's gather does not)."""
        for u in self.units if units is None else units:
            u.gathered_version = u.buffer.gather_tensor._version

    def _check_unwritten(self, units=None, what="this gather"):
        """Resident: refuses a gather (what: a step's, which gathers) that
        would overwrite a write into the parameters since the last one (an
        init, ``clamp_``, an EMA shrink between steps): they are the
        gathered copy, not the shards, so the write would be lost without a
        word (transient areas write the shards: there it lands)."""
        for u in self.units if units is None else units:
            v = u.gathered_version
            if v is not None and u.buffer.gather_tensor._version != v:
                names = [e.name for e in u.entries]
                raise RuntimeError(
                    "unit %r: its parameters (%s%s) were written in place since the last "
                    "gather (an init, clamp_(), an EMA shrink): on a resident client they "
                    "are the gathered copy, which %s overwrites with the shards, "
                    "so the write would be lost. Load the values with "
                    "model.load_state_dict(), or use transient areas (the default "
                    "Client), where such writes land in the shards"
                    % (u.name, ", ".join(repr(n) for n in names[:4]),
                       " ..." if len(names) > 4 else "", what))

    def _check_gather(self, ids):
        """Resident: sm.gather()'s refusal of a write into the parameters
        since the last gather, for a gather of buffers (ids) asked of the
        client directly, below the wrapper (it overwrote the write, and a
        forward after it with no step since ran with the shards' values)."""
        if self.transient:
            return
        by = getattr(self, "_unit_by_buffer", None)
        if by is None:  # one lookup per buffer: sm.gather() comes through here too
            by = self._unit_by_buffer = {u.buffer.id: u for u in self.units}
        self._check_unwritten([by[i] for i in ids if i in by])

    def _check_replaced(self):
        """Refuses a forward (transient: the root's; resident: gather())
        after a parameter was replaced or converted behind the wrapper's
        back: on its module (``module.weight = nn.Parameter(...)``), its
        device or dtype (``model.to(device)``, ``model.half()`` /
        ``.double()`` / ``.to(dtype)``, which set ``p.data`` to a converted
        copy) or its ``.data`` (``p.data = t``). Otherwise the forward
        would point it back at the shards (the new values lost), or compute
        with a tensor outside them whose gradient no rank reduces and no
        state dict holds. One pass of identity and pointer tests over the
        parameters per forward."""
        checks = self._checks
        if checks is None:  # per unit: (entry, param, home, [(params dict, attr)])
            checks = self._checks = [
                (u, [(e, e.param, e.home, [(m._parameters, a) for m, a in e.owners])
                     for e in u.entries]) for u in self.units]
        transient = self.transient
        for u, entries in checks:
            held = transient and u.gather is not None
            for e, p, home, slots in entries:
                for params, attr in slots:
                    if params.get(attr) is not p:
                        self._replaced(e)
                # a converted or moved copy is new memory too
                if not held and p.data_ptr() != home:
                    self._replaced(e)

    def _replaced(self, e):
        """Raises what _check_replaced found of e, in words."""
        p = e.param
        for m, attr in e.owners:
            q = m._parameters.get(attr)
            if q is p:
                continue
            if q is None or q.device == e.part.device:
                raise RuntimeError(
                    "%r was replaced on its module after wrapping (%s.%s = ...): "
                    "the new tensor is not in the shards, so no rank's gradient "
                    "would be reduced into it and no state dict would hold it. "
                    "Assign it before wrapping, or write into the wrapped "
                    "parameter (with torch.no_grad(): p.copy_(t)) or load a "
                    "state dict" % (e.name, type(m).__name__, attr))
            p = q  # model.to(device) makes new Parameters: moved
            break
        if p.device != e.part.device:
            raise RuntimeError(
                "%r is on %s but its unit's shards are on %s: the model was moved "
                "after wrapping (model.to(device) / .cuda() / .cpu()), which the "
                "shards do not follow (ShardedModule.device says where they are; "
                "on the cuda backend the wrapper puts the parameters there "
                "itself)" % (e.name, p.device, e.part.device))
        if p.dtype != e.part.dtype:
            raise RuntimeError(
                "%r is %s but its unit's shards are %s: the model was converted "
                "after wrapping (model.half() / .double() / .to(dtype)), which "
                "the shards do not follow. Wrap with dtype= or mixed_precision= "
                "instead" % (e.name, p.dtype, e.part.dtype))
        raise RuntimeError(
            "the .data of %r was replaced after wrapping (p.data = t, p.set_(t)): it is no "
            "longer %s, and the new values would be lost at the next gather. "
            "Write into it instead (with torch.no_grad(): p.copy_(t)) or load "
            "a state dict" % (e.name, "its part of this rank's shard"
                              if self.transient else "its slice of the gather area"))

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
                    whole = u.torch_grads and not set_to_none
                    for e in u.entries:
                        p = e.param
                        if set_to_none or (p.grad is None and not p.requires_grad):
                            p.grad = None
                            whole = False
                            continue
                        if not p.requires_grad:
                            whole = False
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
                    u.zeroed_at = u.buffer.reduced_tensor._version if whole else None
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
        self._unreduced = e.name  # a scatter() must come before the step
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

    def _view_requires_grad(self, vid, requires_grad):
        """client.set_requires_grad(view) asked directly, below the wrapper:
        the view's parameter follows (requires_grad_), else the wrapper,
        which takes the parameter's requires_grad for the truth, undid it at
        its next scatter (_sync_requires_grad) without a word."""
        for u in self.units:
            for e in u.entries:
                if e.view.id == vid:
                    e.view.requires_grad = requires_grad
                    if e.param.requires_grad != requires_grad:
                        e.param.requires_grad_(requires_grad)

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
        self._unreduced = None
        self._scatters += 1

    def step(self, opt, lr=None, max_norm=None):
        """The step of opt, registered through this module (collective).
        Resident: after scatter(), refused otherwise (_daemon_step)."""
        return self._daemon_step(opt, lr=lr, max_norm=max_norm)

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
        self._ahead = None  # a relaunched peer's next gather() is a real one
        # what the ranks agreed on included a rank that may be relaunched
        # now: every rank prefetches again only once all have agreed anew
        self._bw_agreed = False
        self._fw_agreed = False
        # likewise which units' forward gathers lease their gradient areas
        # and stay for the backward (the root unit's, the last Block's:
        # learnt from a backward): a relaunched rank starts without it, and
        # a rank that kept it would skip the unit's gather in backward that
        # the relaunched one sends (E_MISMATCH)
        self._root_backward_first = False
        self._tail = self._tail_next = self._kept = None
        try:
            self._wait_releases()
        except shardd.Error:
            pass  # failed with the rest: release_all below returns the areas
        pend, self._pending = self._pending, None
        if pend is not None:
            try:
                self.client.wait_area(pend[1], pend[0].buffer)
                self.client.release_all(pend[0].buffer)
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
            # the dropped iteration's forward is no use still waiting for
            # its backward (_keeps, _forward_use): as on a relaunched rank
            u.param_use = None
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

    # copy.deepcopy(model) / torch.save(model) of the wrapped model reach the
    # wrapper through the hooks it put on the modules: refused here, by
    # name, rather than deep inside the client (a ctypes pointer that
    # cannot be pickled, which names neither the model nor a way out)
    _NO_COPY = (
        "%s of a model wrapped by shardd.nn.ShardedModule: its hooks hold the "
        "wrapper, whose client and shards a copy cannot share, and outside "
        "forward its parameters are each rank's 1-D parts of the shards. %s")

    def __deepcopy__(self, memo):
        raise TypeError(self._NO_COPY % (
            "copy.deepcopy", "Copy the model before wrapping (an EMA model: "
            "deepcopy it then, and update it from model.state_dict(), which gives "
            "every parameter whole on every rank), or build another and load "
            "model.state_dict() into it"))

    def __reduce_ex__(self, protocol):
        raise TypeError(self._NO_COPY % (
            "Pickling (torch.save(model))", "Save model.state_dict() (FSDP's full "
            "state dict: every parameter whole) and load it into the model built "
            "again"))

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
        (torch's plain clip_grad_norm_ over a transient wrapper's
        parameters gives the same global norm: clip_hook.py; under FSDP1
        it is a per-rank norm). Gradients are
        scaled by min(1, max_norm / (norm + 1e-6)), as torch's clipping in
        place does; max_norm=inf reports the norm only.
        optimizer: whose parameters count. A shardd.optim optimizer or a
        registered one (the default when exactly one was registered through
        this module): the daemon computes the norm and its next step
        scales. A torch.optim optimizer (the default when none was
        registered): the norm of its parameters' .grad parts (all-reduced
        over the ranks) and the parts are scaled in place. Resident
        clients call scatter() first."""
        if not self.transient:
            self._check_reduced("clip_grad_norm_")
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

    def _clip_grads(self, params, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """clip_grad_norm_ over the .grad parts of params (each parameter
        once), every rank's summed (a collective), in norm_type (inf: the
        largest |element|) as torch's: scaled by max_norm / (norm + 1e-6)
        where that is under 1; error_if_nonfinite: a NaN or infinite norm
        raises, torch's RuntimeError, on every rank."""
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
        norm_type = float(norm_type)
        if norm_type <= 0 or math.isnan(norm_type):
            raise NotImplementedError("clip_grad_norm_: norm_type %r over a wrapped "
                                      "model's parts (a positive p, or inf)" % (norm_type,))
        local = 0.0
        with torch.no_grad():
            for g in grads:
                if not g.numel():
                    continue
                if norm_type == math.inf:
                    m = float(g.abs().max())
                    # a NaN, once met, is the norm (as torch's; max() would drop it)
                    if not (math.isnan(local) or m <= local):
                        local = m
                elif norm_type == 2.0:
                    local += float(g.double().pow(2).sum())
                else:
                    local += float(g.double().abs().pow(norm_type).sum())
        if norm_type == math.inf:
            # a NaN on any rank is the norm: the daemon's max is sent a flag for it
            big, nan = self.client.all_reduce([0.0 if math.isnan(local) else local,
                                               float(math.isnan(local))], "max")
            total = math.nan if nan else big
        else:
            total = self.client.all_reduce(local, "sum")
            total = math.sqrt(total) if norm_type == 2.0 else total ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                "The total norm of order %s for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale "
                "the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`" % norm_type)
        coef = max_norm / (total + 1e-6) if math.isfinite(max_norm) else math.inf
        if not coef >= 1.0:  # (a NaN norm scales by NaN, as torch's)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return torch.tensor(total)
