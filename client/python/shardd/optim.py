"""torch.optim-compatible optimizers whose state and update live in shardd.

    sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
    opt = shardd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        sm.clip_grad_norm_(1.0)        # optional: FSDP's, over all shards
        opt.step()
        sched.step()

(that loop on a transient client, the default; a resident one adds
``sm.gather()`` before the forward and ``sm.scatter("mean")`` after
backward, and refuses a step that misses the scatter; the step gathers
what it changed, so that gather() sends nothing.)

:class:`SGD`, :class:`Adam` and :class:`AdamW` take torch's constructor
arguments and defaults and are ``torch.optim.Optimizer`` subclasses: their
``param_groups`` are torch's dicts, so a scheduler (LambdaLR, OneCycleLR, a
hand-written warmup) or a script may edit any group's ``lr``, ``betas``,
``weight_decay``, ``momentum``... between steps, and :meth:`step` sends
every group's current values to the daemon, which applies torch's update to
the shards it owns (a collective: every rank calls it). The parameters must
be the ones a :class:`shardd.nn.ShardedModule` put on the module (after
wrapping, ``model.parameters()``); any other tensor is named in the
daemon's refusal at construction. Every rank constructs the same
optimizers in the same order (the daemon registers them by name, default
``shardd.optim.<Kind>#<n>``).

A frozen parameter (``requires_grad=False``, a block frozen mid-run) is
skipped by the step whatever its ``.grad``: as torch 2's optimizers (whose
``zero_grad()`` sets None) and torch 1.13's after
``zero_grad(set_to_none=True)``; torch 1.13's default ``zero_grad()`` keeps
a zeroed ``.grad`` that its own optimizers step (weight decay, moments),
which a ``torch.optim`` optimizer over a wrapped model still does.

The optimizer state (Adam's moments, the step counts, the fp32 master of
16-bit parameters) is the daemon's, not ``self.state``: it survives trainer
restarts and daemon checkpoints. ``state_dict()`` is sharded per rank by
default, as FSDP's ``optim_state_dict`` under ``SHARDED_STATE_DICT``: each
rank's dict holds its shard of every state array, keyed by parameter FQN,
with the flat range it covers and the parameter's numel and shape under
``"shardd_sharded"``; ``load_state_dict`` takes a rank's own dict, or every
rank's dicts (a list) to reshard into another world size.
``full_state_dict(rank0_only=True)`` is torch.optim's layout with each
parameter's whole state on rank 0 (FSDP's ``FullOptimStateDictConfig``),
which torch.optim's optimizers load too; ``state_dict_type = "full"`` makes
it ``state_dict()``'s. 16-bit parameters add ``"master"`` (their fp32
master) to their state; ``fp32_state_dict()`` is the module's full state
dict with those masters in place of the 16-bit values (DeepSpeed's
zero_to_fp32). ``add_param_group`` after construction registers
the optimizer anew with every group, carrying the state over (every rank
calls it, as torch scripts do).
"""
import math

import torch
from torch.optim.optimizer import required as _required

import shardd

__all__ = ["SGD", "Adam", "AdamW", "SHARDED_KEY"]

# the sharded state dict's own key: this rank, the world, and each
# parameter's range ({"rank", "world", "params": {fqn: {"range": (lo, hi),
# "numel", "shape"}}})
SHARDED_KEY = "shardd_sharded"

_count = [0]  # optimizers made in this process: the default names


def _owner(params):
    from shardd import nn as snn  # torch-only module, imported late
    owners = {snn.owner_of(p) for p in params}
    owners.discard(None)
    if len(owners) > 1:
        raise ValueError("the parameters belong to %d ShardedModules; one "
                         "optimizer per ShardedModule" % len(owners))
    return owners.pop() if owners else None


class _ShardedOptimizer(torch.optim.Optimizer):
    _kind = None
    # the daemon's SGD / Adam / AdamW step each element from its own
    # gradient and state (shardd.nn's check of torch.optim's steps)
    shardd_elementwise = True
    # the group keys sent each step, torch's names
    _keys = ()

    def __init__(self, params, defaults, name=None, module=None):
        for k in ("capturable", "differentiable", "fused"):
            if defaults.pop(k, False):
                raise ValueError("%s=True is not supported by shardd" % k)
        defaults.pop("foreach", None)  # the daemon has one kernel per kind
        self._opt = None
        super().__init__(params, defaults)
        plist = [p for g in self.param_groups for p in g["params"]]
        self._module = module if module is not None else _owner(plist)
        if self._module is None:
            raise ValueError("no parameter of this optimizer is a shardd.nn."
                             "ShardedModule parameter (wrap the model first, "
                             "then pass model.parameters())")
        _count[0] += 1
        self._name = name or "shardd.optim.%s#%d" % (type(self).__name__, _count[0])
        self._register()
        self.last_step = None  # the daemon's StepResult of the last step

    # state_dict()'s layout: "sharded" (each rank its shard) or "full"
    # (full_state_dict(rank0_only=full_rank0_only)), as FSDP's state dict type
    state_dict_type = "sharded"
    full_rank0_only = True

    def _register(self):
        # torch accepts an empty group; the daemon registers the others
        self._live = [i for i, g in enumerate(self.param_groups) if g["params"]]
        groups = []
        for i in self._live:
            g = self.param_groups[i]
            d = {"params": list(g["params"])}
            d.update(self._hyper(g))
            groups.append(d)
        self._opt = self._module.register_optimizer(self._kind, groups, name=self._name)
        self._count = None  # the daemon's step count as this object knows it

    @property
    def steps(self):
        """The daemon's step count (a query): a relaunched script attaches
        to the optimizer it left and resumes its loop from here."""
        return self._opt.steps()

    def _hyper(self, g):
        out = {}
        for k in self._keys:
            v = g[k]
            if isinstance(v, torch.Tensor):
                v = v.item()
            out[k] = tuple(float(b) for b in v) if k == "betas" else v
        return out

    def add_param_group(self, param_group):
        """torch's add_param_group (its checks and defaults); after
        construction the daemon's optimizer is registered anew with every
        group, under the same name, and this rank's shard of each existing
        parameter's state (moments, step count, fp32 master) carried over.
        Every rank calls it (a collective), between steps. A tensor the
        module does not own is refused by the daemon, naming it, and the
        optimizer is left as it was."""
        if self._opt is None:
            return super().add_param_group(param_group)
        n = len(self.param_groups)
        super().add_param_group(param_group)
        if not self.param_groups[-1]["params"]:
            return  # an empty group: nothing for the daemon
        client = self._module.client
        try:
            saved = self._save_local([p for g in self.param_groups[:n] for p in g["params"]])
            # the added ones' fp32 master, where this optimizer's covers
            # them (its shards' exact seeds): kept, not widened from 16 bits
            saved += self._save_local([p for p in self.param_groups[-1]["params"]
                                       if self._module.view_of(p) is not None], held=False)
        except BaseException:
            del self.param_groups[n:]
            raise
        client.barrier()  # every rank read its state before it goes
        if client.rank == 0:
            client.unregister_optimizer(self._opt)
        self._module._forget_optimizer(self._opt)
        client.barrier()
        try:
            self._register()
        except BaseException:
            del self.param_groups[n:]
            self._register()
            self._restore_local(saved)
            client.barrier()
            raise
        self._restore_local(saved)
        client.barrier()  # no rank steps before every rank's state is back

    def _save_local(self, params, held=True):
        """This rank's shard of each parameter's state (a trainer's write
        to a 16-bit shard since the last step wins over the master, as the
        next step's adoption would have it); held False: parameters this
        optimizer does not hold, their master only."""
        import numpy as np
        client = self._module.client
        out = []
        for p in params:
            v, lo, hi = self._local(p)
            if held:
                st = client.optim_state(self._opt, v, offset=lo, count=hi - lo)
            else:
                st = {"arrays": [], "steps": 0, "optimizer_steps": None}
            m = self._master(v, lo, hi)
            if m is None and not held:
                continue
            if m is not None and hi > lo:
                a = v.offset + lo - client.rank * v.buffer.shard_numel
                sh = v.buffer.shard_tensor[a:a + hi - lo]
                mine = sh.float().cpu().numpy()
                rounded = torch.from_numpy(m).to(sh.dtype).float().numpy()
                m = np.where(rounded != mine, mine, m)
            out.append((v, lo, st["arrays"], st["steps"], st["optimizer_steps"], m))
        return out

    def _restore_local(self, saved):
        client = self._module.client
        for v, lo, arrays, steps, most, m in saved:
            if most is not None:
                have = client.optim_state(self._opt, v, arrays=False)["nstate"]
                client.set_optim_state(self._opt, v, arrays[:have], steps=steps,
                                       optimizer_steps=most, offset=lo)
            if m is not None and m.size:
                client.set_optim_master(self._opt, v, m, offset=lo)

    def zero_grad(self, set_to_none=False):
        """The module's gradients: zeroed, or None with set_to_none, so a
        parameter no backward reaches is skipped by the step as torch's
        (the daemon's gradient areas are zeroed either way)."""
        self._module.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None, expect_step=None):
        """One update of every shard (collective), with every param group's
        hyperparameters as they are now. Gradients must have been reduced:
        on transient clients the module's hooks did it in backward; on
        resident ones call ``sm.scatter()`` first (a step after a backward
        no scatter reduced, or with no scatter since the last step, is
        refused before anything changed). Returns closure's loss.
        As torch's, a step with no backward since the last one applies the
        ``.grad`` the parameters hold (zeros after ``zero_grad()``, the
        last gradient again without one; a None one is skipped): a
        transient module scatters it again first, as the daemon skips a
        buffer no scatter reached since its last step.

        Each step is sent with the count it makes (``expect_step``: by
        default the count this optimizer last saw + 1), so a retry of a step
        whose reply was lost never applies it twice: the daemon answers it
        with ``last_step.applied`` False and changes nothing. After a
        reconnect (new Client, module and optimizer) pass your loop's
        ``s + 1`` for the step of iteration ``s``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = []
        for gi in self._live:
            g = self._hyper(self.param_groups[gi])
            if not (g["lr"] >= 0.0 and math.isfinite(g["lr"])):
                raise ValueError("param group %d: Invalid learning rate: %r" % (gi, g["lr"]))
            groups.append(g)
        if expect_step is None:
            if self._count is None:
                self._count = self._opt.steps()
            expect_step = self._count + 1
        # _daemon_step releases a unit a forward left gathered for a
        # backward that has not come, and hands the daemon again a .grad no
        # backward since the last step made, as torch's step applies it
        try:
            self.last_step = self._module._daemon_step(self._opt, groups=groups,
                                                       expect_step=expect_step)
        except BaseException as e:
            done = getattr(e, "shardd_step", None)
            if done is not None:  # the step ran; what failed came after it
                self.last_step, self._count = done, done.step
            raise
        self._count = self.last_step.step
        return loss

    # -- state dicts: sharded per rank (default) or full on rank 0 ----------
    _state_keys = ()  # the names of the daemon's state arrays, in order

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _view(self, p):
        v = self._module.view_of(p)
        if v is None:
            raise ValueError("a parameter of this optimizer is not the module's")
        return v

    def _fqn(self, p):
        self._view(p)
        return self._module.name_of(p)

    def _local(self, p):
        """p's view and the elements [lo, hi) of p in this rank's shard."""
        v = self._view(p)
        s, rank = v.buffer.shard_numel, self._module.client.rank
        lo = min(max(rank * s - v.offset, 0), v.numel)
        hi = max(min((rank + 1) * s - v.offset, v.numel), lo)
        return v, lo, hi

    def _master(self, v, lo, hi):
        """The fp32 master of p's elements [lo, hi) (16-bit buffers, once
        it exists), else None."""
        if v.buffer.dtype_code == shardd._lib.DTYPE_FP32:
            return None
        try:
            return self._module.client.optim_master(self._opt, v, offset=lo, count=hi - lo)
        except shardd.Error as e:
            # E_STATE: no step, no seed (the shard is it); E_NOT_FOUND: a
            # parameter outside this optimizer's buffers (add_param_group)
            if e.code_name in ("E_STATE", "E_NOT_FOUND"):
                return None
            raise

    def _entry(self, st, shape):
        """torch's per-parameter state from the daemon's: None when the
        parameter was never stepped (torch keeps no state for it)."""
        if st["steps"] == 0:
            return None
        out = {}
        for name, a in zip(self._state_keys, st["arrays"]):
            out[name] = torch.from_numpy(a).view(shape)
        return out

    def _groups(self, key):
        groups, i = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [key(i + j, p) for j, p in enumerate(g["params"])]
            i += len(g["params"])
            groups.append(d)
        return groups

    def state_dict(self):
        """sharded_state_dict() (default), or full_state_dict() with
        state_dict_type = "full" (as FSDP's optim_state_dict follows the
        state dict type set on the model)."""
        if self.state_dict_type == "full":
            return self.full_state_dict(rank0_only=self.full_rank0_only)
        if self.state_dict_type != "sharded":
            raise ValueError("state_dict_type %r: \"sharded\" or \"full\""
                             % (self.state_dict_type,))
        return self.sharded_state_dict()

    def sharded_state_dict(self):
        """This rank's shard of the state (FSDP's sharded optim state
        dict): {"state": {fqn: {"step", <array>: 1-D tensor of this rank's
        elements of the parameter[, "master"]}}, "param_groups": [... with
        "params" as FQNs], SHARDED_KEY: {"rank", "world", "params": {fqn:
        {"range": (lo, hi), "numel", "shape"}}}}. Each rank saves its own;
        no step may be in flight."""
        client = self._module.client
        state, ranges = {}, {}
        for p in self._params():
            v, lo, hi = self._local(p)
            fqn = self._fqn(p)
            ranges[fqn] = {"range": (lo, hi), "numel": v.numel, "shape": tuple(v.shape)}
            e = self._entry(client.optim_state(self._opt, v, offset=lo, count=hi - lo),
                            (hi - lo,))
            if e is not None:
                m = self._master(v, lo, hi)
                if m is not None:
                    e["master"] = torch.from_numpy(m)
                state[fqn] = e
        return {"state": state,
                "param_groups": self._groups(lambda i, p: self._fqn(p)),
                SHARDED_KEY: {"rank": client.rank, "world": client.world,
                              "params": ranges}}

    def full_state_dict(self, rank0_only=True):
        """torch.optim's layout, whole: {"state": {index: {...}},
        "param_groups": [...]} with each parameter's full state (every
        rank's shard of this node), which torch.optim's own optimizer, or
        shardd.optim over another world size, loads. rank0_only (FSDP's
        FullOptimStateDictConfig): ranks other than 0 get {}."""
        client = self._module.client
        if rank0_only and client.rank != 0:
            return {}
        state = {}
        for i, p in enumerate(self._params()):
            v = self._view(p)
            e = self._entry(client.optim_state(self._opt, v), v.shape)
            if e is not None:
                m = self._master(v, 0, v.numel)
                if m is not None:
                    e["master"] = torch.from_numpy(m).view(v.shape)
                state[i] = e
        return {"state": state, "param_groups": self._groups(lambda i, p: i)}

    def fp32_state_dict(self, rank0_only=True, offload_to_cpu=False):
        """The module's full state dict (``sm.state_dict()``: torch's keys,
        every parameter whole, the buffers) with each 16-bit parameter this
        optimizer steps given as its fp32 master instead of its 16-bit
        rounding: what DeepSpeed's zero_to_fp32 gives, and what a model
        trained in mixed precision continues from in fp32. Other
        parameters (fp32 ones, those of no optimizer, a 16-bit one
        before its first step, whose shard is exact) as the state dict
        has them. Collective (every rank calls it); rank0_only: ranks other
        than 0 get {}."""
        module = self._module
        sd = module.state_dict(rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)
        if rank0_only and module.client.rank != 0:
            return {}
        mine = {id(self._view(p)): p for p in self._params()}
        for k, e in module._aliases().items():
            if k not in sd or id(e.view) not in mine:
                continue
            m = self._master(e.view, 0, e.view.numel)
            if m is not None:
                t = torch.from_numpy(m).view(sd[k].shape)
                sd[k] = t if offload_to_cpu else t.to(sd[k].device)
        return sd

    def load_state_dict(self, state_dict):
        """Loads a full dict (torch.optim's layout: full_state_dict's, or
        torch.optim's own), a sharded one of this rank, or every rank's
        sharded dicts as a list (to reshard into this world size): the
        groups' hyperparameters from the dict, and this rank's shard of
        every parameter's state into the daemon (a parameter without state
        starts afresh). Every rank calls it (it ends in a barrier)."""
        pieces = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict]
        if not pieces or not all(isinstance(d, dict) for d in pieces):
            raise ValueError("load_state_dict: a state dict, or a list of every rank's "
                             "sharded state dicts")
        from shardd.nn.optim_state import PARTS_KEY
        if any(PARTS_KEY in d for d in pieces):
            # a torch.optim optimizer's dicts over a wrapped model: each
            # holds one rank's parts, in torch's layout otherwise (read as
            # whole, its tensors would land on other elements)
            raise ValueError(
                "load_state_dict: %s a torch.optim optimizer's over a wrapped model "
                "(rank %d of %d: its parts of the parameters): join every rank's with "
                "shardd.nn.full_optim_state_dict([...]) and load that"
                % ("this dict is" if len(pieces) == 1 else "these dicts are",
                   pieces[0].get(PARTS_KEY, {}).get("rank", -1),
                   pieces[0].get(PARTS_KEY, {}).get("world", -1)))
        sharded = [SHARDED_KEY in d for d in pieces]
        if len(pieces) > 1 and not all(sharded):
            raise ValueError("load_state_dict: a list must hold sharded state dicts only")
        groups = pieces[0]["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, ng in zip(self.param_groups, groups):
            if len(g["params"]) != len(ng["params"]):
                raise ValueError("loaded state dict contains a parameter group that "
                                 "doesn't match the size of optimizer's group")
        key = {}  # parameter -> its key in the dict (index or FQN)
        for g, ng in zip(self.param_groups, groups):
            for p, k in zip(g["params"], ng["params"]):
                if sharded[0] and k != self._fqn(p):
                    raise ValueError("loaded state dict: parameter %r where this "
                                     "optimizer has %r" % (k, self._fqn(p)))
                key[p] = k
            for k2, val in ng.items():
                if k2 != "params":
                    g[k2] = val
        srcs = []  # (state, ranges or None) per piece
        for d in pieces:
            st = d["state"]
            if not sharded[0]:
                st = {int(k) if not isinstance(k, int) else k: v for k, v in st.items()}
            srcs.append((st, d[SHARDED_KEY]["params"] if sharded[0] else None))
        client = self._module.client
        writes, most = [], 0
        for p in self._params():
            v, lo, hi = self._local(p)
            got = []  # (piece lo, piece hi, entry)
            for st, ranges in srcs:
                e = st.get(key[p])
                if ranges is None:
                    got.append((0, v.numel, e))
                    continue
                r = ranges.get(key[p])
                if r is None:
                    raise ValueError("loaded state dict has no range for %r" % (key[p],))
                if int(r["numel"]) != v.numel:
                    raise ValueError("loaded state dict: %r has %d elements, this "
                                     "parameter %d" % (key[p], r["numel"], v.numel))
                got.append((int(r["range"][0]), int(r["range"][1]), e))
            stepped = [e for _, _, e in got if e is not None]
            steps = int(float(stepped[0].get("step", 1))) if stepped else 0
            names = list(self._state_keys)
            if v.buffer.dtype_code != shardd._lib.DTYPE_FP32:
                names.append("master")  # when the dicts have it all: else kept
            out = {}
            for name in names:
                a = torch.zeros(hi - lo)
                have = torch.zeros(hi - lo, dtype=torch.bool)
                for plo, phi, e in got:
                    t = None if e is None else e.get(name)
                    a0, a1 = max(lo, plo), min(hi, phi)
                    if t is None or a1 <= a0:
                        continue
                    t = torch.as_tensor(t).detach().float().reshape(-1)
                    a[a0 - lo:a1 - lo] = t[a0 - plo:a1 - plo]
                    have[a0 - lo:a1 - lo] = True
                if name == "master":
                    if stepped and bool(have.all()):
                        out[name] = a
                    continue
                if stepped and hi > lo and not bool(have.all()) and any(
                        e.get(name) is not None for e in stepped):
                    miss = int((~have).nonzero()[0]) + lo
                    raise ValueError(
                        "loaded state dict: %r %s: this rank's elements [%d, %d) are not "
                        "all in the dicts given (element %d is missing; to reshard pass "
                        "every rank's sharded dict as a list)" % (key[p], name, lo, hi, miss))
                out[name] = a
            writes.append((v, lo, out, steps))
            most = max(most, steps)
        for v, lo, out, steps in writes:
            have = client.optim_state(self._opt, v, arrays=False)["nstate"]
            arrays = [out[n].numpy() for n in self._state_keys][:have]
            client.set_optim_state(self._opt, v, arrays, steps=steps,
                                   optimizer_steps=most, offset=lo)
            if "master" in out and out["master"].numel():
                client.set_optim_master(self._opt, v, out["master"].numpy(), offset=lo)
        self._count = None  # the count changed: the next step reads it again
        client.barrier()  # no rank steps before every rank's state is in


class SGD(_ShardedOptimizer):
    """torch.optim.SGD over shardd shards (same arguments and defaults)."""
    _kind = "sgd"
    _keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    _state_keys = ("momentum_buffer",)

    def _entry(self, st, shape):
        if st["steps"] == 0:
            return None
        if not st["arrays"]:  # momentum 0: torch records None
            return {"momentum_buffer": None}
        return {"momentum_buffer": torch.from_numpy(st["arrays"][0]).view(shape)}

    def __init__(self, params, lr=_required, momentum=0, dampening=0,
                 weight_decay=0, nesterov=False, *, maximize=False, foreach=None,
                 differentiable=False, name=None, module=None):
        if lr is _required:
            raise TypeError("SGD: lr is required (as torch's)")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach,
                        differentiable=differentiable)
        super().__init__(params, defaults, name=name, module=module)


class Adam(_ShardedOptimizer):
    """torch.optim.Adam over shardd shards (same arguments and defaults)."""
    _kind = "adam"
    _keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    _state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _entry(self, st, shape):
        out = _ShardedOptimizer._entry(self, st, shape)
        if out is not None:
            out = dict(step=torch.tensor(float(st["steps"])), **out)
        return out

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, *, foreach=None, maximize=False,
                 capturable=False, differentiable=False, fused=False, name=None,
                 module=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, name=name, module=module)


class AdamW(Adam):
    """torch.optim.AdamW over shardd shards (same arguments and defaults)."""
    _kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=False, name=None,
                 module=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, name=name,
                         module=module)
