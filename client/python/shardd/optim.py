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

The optimizer state (Adam's moments, the step counts) is the daemon's, not
``self.state``: it survives trainer restarts and daemon checkpoints.
``state_dict()`` / ``load_state_dict()`` use torch's layout with each
parameter's whole state (read from and written to the daemon), so
torch.optim's optimizers and shardd.optim over another world size load
them. ``add_param_group`` after construction is refused (the daemon's state
is laid out per registration): pass every group at construction.
"""
import math

import torch
from torch.optim.optimizer import required as _required

import shardd

__all__ = ["SGD", "Adam", "AdamW"]

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
        # torch accepts an empty group; the daemon registers the others
        self._live = [i for i, g in enumerate(self.param_groups) if g["params"]]
        groups = []
        for i in self._live:
            g = self.param_groups[i]
            d = {"params": list(g["params"])}
            d.update(self._hyper(g))
            groups.append(d)
        self._opt = self._module.register_optimizer(self._kind, groups, name=self._name)
        self.last_step = None  # the daemon's StepResult of the last step
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
        if self._opt is not None:
            raise NotImplementedError(
                "add_param_group after construction: shardd keeps this optimizer's "
                "state in the daemon, laid out at registration; pass every param "
                "group to the constructor")
        super().add_param_group(param_group)

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
        resident ones call ``sm.scatter()`` first. Returns closure's loss.

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
        self.last_step = self._module.client.step(self._opt, groups=groups,
                                                  expect_step=expect_step)
        self._count = self.last_step.step
        return loss

    # -- torch's state_dict, whole (world-independent) ----------------------
    _state_keys = ()  # the names of the daemon's state arrays, in order

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _view(self, p):
        v = self._module.view_of(p)
        if v is None:
            raise ValueError("a parameter of this optimizer is not the module's")
        return v

    def _entry(self, st, view):
        """torch's per-parameter state from the daemon's: None when the
        parameter was never stepped (torch keeps no state for it)."""
        if st["steps"] == 0:
            return None
        out = {}
        for name, a in zip(self._state_keys, st["arrays"]):
            out[name] = torch.from_numpy(a).view(view.shape)
        return out

    def state_dict(self):
        """torch's layout, whole: {"state": {index: {...}}, "param_groups":
        [...]} with each parameter's full state (every rank's shard of this
        node), so torch.optim's own optimizer, or shardd.optim over another
        world size, loads it. A collective only in that every rank may call
        it (each gets the whole dict); no step may be in flight."""
        client = self._module.client
        state = {}
        for i, p in enumerate(self._params()):
            v = self._view(p)
            e = self._entry(client.optim_state(self._opt, v), v)
            if e is not None:
                state[i] = e
        groups, i = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(i, i + len(g["params"])))
            i += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """torch's load_state_dict: the groups' hyperparameters from the
        dict, and every parameter's state into the daemon (written by rank
        0 of the job, the others wait for it at their next step; a
        parameter without state starts afresh). Every rank calls it."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, ng in zip(self.param_groups, groups):
            if len(g["params"]) != len(ng["params"]):
                raise ValueError("loaded state dict contains a parameter group that "
                                 "doesn't match the size of optimizer's group")
        index = {}
        for g, ng in zip(self.param_groups, groups):
            for p, k in zip(g["params"], ng["params"]):
                index[p] = k
            for key, val in ng.items():
                if key != "params":
                    g[key] = val
        state = {int(k) if not isinstance(k, int) else k: v
                 for k, v in state_dict["state"].items()}
        client = self._module.client
        if client.rank != 0:
            return
        writes, most = [], 0
        for p in self._params():
            v = self._view(p)
            st = state.get(index[p])
            steps = 0 if st is None else int(float(st.get("step", 1)))
            arrays = []
            for name in self._state_keys:
                t = None if st is None else st.get(name)
                arrays.append(torch.zeros(v.numel) if t is None
                              else torch.as_tensor(t).detach().float().reshape(-1))
            writes.append((v, arrays, steps))
            most = max(most, steps)
        for v, arrays, steps in writes:
            have = client.optim_state(self._opt, v, arrays=False)["nstate"]
            client.set_optim_state(self._opt, v, [a.numpy() for a in arrays[:have]],
                                   steps=steps, optimizer_steps=most)
        self._count = None  # the count changed: the next step reads it again


class SGD(_ShardedOptimizer):
    """torch.optim.SGD over shardd shards (same arguments and defaults)."""
    _kind = "sgd"
    _keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    _state_keys = ("momentum_buffer",)

    def _entry(self, st, view):
        if st["steps"] == 0:
            return None
        if not st["arrays"]:  # momentum 0: torch records None
            return {"momentum_buffer": None}
        return {"momentum_buffer": torch.from_numpy(st["arrays"][0]).view(view.shape)}

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

    def _entry(self, st, view):
        out = _ShardedOptimizer._entry(self, st, view)
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
