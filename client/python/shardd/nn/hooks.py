"""Transient areas, the forward side: the hooks that gather a unit
before its forward and release it after, the root's saved-tensor hooks,
parameter reads, and the release of a unit no backward came for
(reshard(), before an optimizer's step)."""
import functools
import weakref

import torch

import shardd

from .acc_hooks import AFTER, accumulate_node, refusal as acc_refusal, script_hooks
from .builtin import put_parameter
from .hook_writes import to_copies
from .leaves import make_leaf, put_in
from .optimizer_hook import _HELD
from .reads import _watch
from .units import _UNKNOWN, _Saved, _Use, _hooked_modules, _tensors


class _ForwardHooks:
    """ShardedModule's transient-area hooks around forward."""

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
        """Before every daemon step of the module's optimizers (shardd.optim's
        step, sm.step, client.step asked directly) and a daemon clip of their
        gradients (every rank, in the same state): a
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
                for m in {id(m): m for e in u.entries for m, _ in e.owners
                          if m is not root}.values():
                    m.register_forward_pre_hook(functools.partial(self._root_holder_pre, u))
                    m.register_forward_hook(functools.partial(self._root_holder_post, u))
                continue
            # a parameter the root's forward reads from its module itself
            # (F.linear(x, self.wte.weight)), outside every forward that
            # gathers its unit: the read gathers the unit (held until the
            # root's forward ends), its gradient starts the unit's backward
            for e in u.entries:
                for m, attr in e.owners:
                    _watch(m, attr, self, u)
                if e.param.requires_grad:
                    e.param.register_hook(functools.partial(self._output_grad, u, None))
        root.register_forward_hook(self._root_post_forward)

    def _root_holder_pre(self, u, module, inputs):
        """A module holding a parameter of the root's unit u, which the
        root's forward gathers, called outside it: HF's generate() calls
        model.encoder (T5's embed_tokens is the root's shared embedding),
        an evaluation calls the head. Under no_grad it gathers u for its
        call (released after, as any unit's); with grad enabled it is
        refused (it computed with this rank's 1-D part, failing on a
        shape, or not, without naming the parameter)."""
        if self._holder_calls:
            self._holder_calls += 1
            return
        if self._in_forward or u.gather is not None:
            return
        if torch.is_grad_enabled():
            e = next(e for e in u.entries for m, _ in e.owners if m is module)
            name = next((n for n, m in self.module.named_modules() if m is module), "?")
            raise shardd.Error(
                22, "module %r, which holds %r of the root's unit, was called outside the "
                "wrapped model's forward with grad enabled: that unit is gathered by the "
                "model's forward (its backward reduces it), so here the parameter is this "
                "rank's 1-D part; call it under torch.no_grad() (an evaluation, "
                "generation: it is gathered for the call) or through the model's "
                "forward" % (name, e.name), "E_STATE")
        self._holder_calls = 1
        self._pre_forward(u, module, inputs)

    def _root_holder_post(self, u, module, inputs, output):
        if not self._holder_calls:
            return
        self._holder_calls -= 1
        if not self._holder_calls:
            self._post_forward(u, module, inputs, output)

    def _pop_saved_hooks(self):
        if self._sth is not None:
            sth, self._sth = self._sth, None
            sth.__exit__(None, None, None)

    def _root_pre_forward(self, module, inputs):
        self._pop_saved_hooks()  # a forward that raised left them pushed
        if self._in_forward:
            self._after_raised_forward()
        self._check_replaced()  # module.weight = ..., model.half() after wrapping
        self._wait_releases()  # a forward without backward sent some
        self._fw_gen += 1
        self._holder_calls = 0  # likewise (a holder's call that raised)
        for u in self.units:  # likewise
            u.depth = 0
            u.recompute = False
            # (a forward whose backward did not come, or has not yet: two
            # forwards, one backward, keeps its _Use in its graph's hooks)
            u.fw_use = u.fw_gen = None
            u.use = None  # a forward that raised left it
        self._in_forward = True
        if self._pending is not None:  # likewise
            self._drop_prefetch()
        if self._trial is not None and self._order_done and torch.is_grad_enabled():
            self._prefetch_trial()
        if torch.is_grad_enabled():
            self._bw_order = []  # this forward's, for its backward's prefetch
            self._sth = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._sth.__enter__()

    def _after_raised_forward(self):
        """The last root forward raised (its post-hook never ran): the
        units it left gathered for their forward (running when it raised,
        or held by a read) are released and their parameters put back in
        their modules (a later forward's leaves were there), so that the
        next forward finds the leases. Its graph has no backward to come."""
        self._in_forward = False
        self._free_kept()
        held = {id(v) for v, _ in self._read_held}
        self._read_held = []
        for u in self.units:
            self._swap_out(u)
            if (not u.is_root and u.gather is not None and u.state == "forward"
                    and (u.depth > 0 or id(u) in held)):
                u.state = "idle"
                self._release(u)
        if self._pending is not None:
            self._drop_prefetch()

    def _root_post_forward(self, module, inputs, output):
        self._in_forward = False
        for u, _ in self._read_held:  # gathered by a read of its parameter
            self._swap_out(u)
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
            # a backward of it ends a unit when every parameter has its
            # gradient, as before (its inputs' hooks are not waited for)
            for u in self.units:
                if u.fw_use is not None:
                    u.fw_use.unbounded = True
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
            if u is self._kept:
                self._free_kept()
                continue
            u.state = "idle"
            self._release(u)
        self._wait_releases()

    def _read(self, u, module, attr):
        """A parameter of u was read from `module` (its attribute `attr`)."""
        if not self._in_forward or u.depth > 0 or u.gather is not None:
            return  # outside the root's forward, or u is gathered
        if self._pending is not None and self._pending[0] is not u:
            self._drop_prefetch()
        self._free_kept()
        self._check_leases(u, "for a read of its parameter %r" % attr)
        self._pre_forward(u, module, ())
        if u.fw_use is not None:  # its gradient may come outside its forward's inputs'
            u.fw_use.unbounded = True
        u.depth = 0  # held by the read, not by a forward: until the root's ends
        self._read_held.append((u, attr))
        swaps = getattr(self, "_hook_swaps", None)
        if swaps is not None:  # read inside a script's hook: copies (hook_writes.py)
            swaps.extend(to_copies([(e, e.param) for e in u.entries]))

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
                # that autograd keeps using this one. A hook of the script's
                # on it already (made on the 1-D part): refused (acc_hooks.py)
                acc = accumulate_node(p)
                if script_hooks(acc):
                    raise acc_refusal(e.name, AFTER)
                e.acc = acc
                e.acc_hooks = acc.register_hook(
                    functools.partial(self._grad_ready, u, e, None)).hooks_dict_ref()

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

    def _keeps(self, u):
        """Whether u's forward gather leases its gradient area too and u
        stays gathered from its forward to its backward: u is the unit
        whose backward came first after the root unit's last time (the
        last unit of the forward, whose backward needs it gathered again
        at once, after the root's), in a training forward with grad
        enabled that computes with its parameters themselves, with both
        leases to spare. That saves a gather (a meeting of the ranks and
        a copy of the unit) and a release per step; the rank holds no
        more areas than the root unit and the unit whose backward runs
        (FSDP's limit), only from the end of u's forward on instead of
        from the start of its backward. Any other gather first gives them
        back (_free_kept)."""
        if u is not self._tail or u.is_root or not torch.is_grad_enabled() \
                or not self.module.training or not self._trainable(u):
            return False
        held = u.param_use() if u.param_use is not None else None
        if held is not None and held.ended is None:
            return False  # a second forward before a backward: leaves of its own
        return self._lease_room(0 if u.gather is not None else 1, 0 if u.grad is not None else 1)

    def _free(self, u):
        """u's gather and gradient areas back (its gradient area leased in
        its forward, unused: no backward reached it), its parameters
        their parts of the shard again."""
        if self._kept is u:
            self._kept = None
        u.gather = u.grad = None
        self._to_shard(u)
        self.client.release_all(u.buffer)

    def _free_kept(self):
        """The unit held past its forward for its backward (_keeps) gives
        its areas back: another unit's gather comes first."""
        u = self._kept
        if u is None:
            return
        self._kept = None
        if u.state == "forward" and u.gather is not None:
            u.state = "idle"
            self._free(u)

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
                # which forward's use (non-reentrant: the recomputation of a
                # region its last unit's backward began) the gradient says
                self._pre_backward(u, _UNKNOWN)
            if u.bw_use is _UNKNOWN and all(self._ended(v) for v in u.live_uses):
                # reentrant: the forward ran under no_grad, no use of it
                # bounded; the backward runs this recomputation's graph (an
                # inner backward of its own, the parameters themselves)
                u.bw_use = _Use()
                return self._bound_inputs(u, inputs, u.bw_use)
            return
        if not self._order_done and u not in self._order:
            self._order.append(u)
        # a unit held past its forward for its backward (_keeps) whose
        # backward did not come next: its areas go back first
        self._free_kept()
        pend = self._pending
        if pend is not None and pend[0] is u:
            self._pending = None
            with self._same_collectives("unit %r's gather for its forward" % u.name):
                u.gather, u.grad = self.client.wait_area(pend[1], u.buffer, want_grad=pend[2])
            self.prefetches += 1
        else:
            if pend is not None:  # the order changed: not this one
                with self._same_collectives("unit %r's gather for its forward" % u.name):
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
            want = ((u.is_root and self._root_backward_first and torch.is_grad_enabled()
                     and self._trainable(u) > 0) or self._keeps(u))
            with self._same_collectives("unit %r's gather for its forward" % u.name):
                u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=want)
        u.state = "forward"
        self._point(u, False)
        self._prefetch_after(u)
        use = self._forward_use(u)
        if use is not None and use.leaves is not None:
            self._swap_in(u, use)
        return self._bound_inputs(u, inputs, use)

    def _forward_use(self, u):
        """The running root forward's _Use of u (made at its first call
        in it): with grad enabled, for a trainable unit but the root's (which
        stays gathered all through backward, its gradient the sum of every
        use's). The first forward's since the last use of the parameters
        themselves had its backward (or its graph was dropped) computes with
        them; a later one's (two forwards before one backward) with leaves
        of its own, so that its backward ends without waiting for the
        other's, which comes later, past other units' backwards."""
        if u.is_root or not torch.is_grad_enabled() or not self._trainable(u):
            return None
        if u.fw_gen == self._fw_gen and u.fw_use is not None:
            return u.fw_use
        held = u.param_use() if u.param_use is not None else None
        if held is None or held.ended is not None:
            use = _Use()
            u.param_use = weakref.ref(use)
        else:
            self._check_param_hooks(u)
            self._leaf_uses += 1
            use = _Use()
            use.leaves = [self._leaf(u, e, use) if e.param.requires_grad else None
                          for e in u.entries]
        u.fw_use, u.fw_gen = use, self._fw_gen
        u.live_uses.add(use)
        return use

    def _leaf(self, u, e, use):
        """A leaf tensor over e's gathered values, its AccumulateGrad
        hooked as the parameter's (its gradient area is pointed at when
        that use's backward begins). It stands for the parameter in the
        code of that forward (leaves.py: its .grad, the script's
        attributes)."""
        t = make_leaf(e.param.data, e.param)
        with torch.enable_grad():
            acc = t.expand_as(t).grad_fn.next_functions[0][0]
        acc.register_hook(functools.partial(self._grad_ready, u, e, use))
        use.accs.append(acc)  # until the forward's graph holds it (_swap_out)
        # a read of the parameter outside the unit's forward starts the
        # unit's backward by its gradient, as the parameter's own hook
        t.register_hook(functools.partial(self._output_grad, u, use))
        return t

    def _check_param_hooks(self, u):
        """A hook the script registered on a parameter (p.register_hook)
        would see the first forward's gradient only, not the sum of every
        forward's as in torch: refused, naming it."""
        for e in u.entries:
            hooks = getattr(e.param, "_backward_hooks", None) or {}
            theirs = [h for h in hooks.values()
                      if getattr(h, "func", None) != self._output_grad]
            if theirs:
                raise shardd.Error(
                    22, "parameter %r has a gradient hook (register_hook) and unit %r "
                    "is used by a second forward before the first one's backward: "
                    "each forward's gradient of the unit is reduced on its own, so the "
                    "hook would see the first forward's part only (torch's sees their "
                    "sum); call backward() after each forward, or hook the loss "
                    "instead" % (e.name, u.name), "E_LIMIT")

    def _swap_in(self, u, use):
        """The use's leaves are the parameters of u's modules while its
        forward runs (put back by _swap_out)."""
        for e, t in zip(u.entries, use.leaves):
            if t is None:
                continue
            t.data = e.param.data  # the gathered values, now
            for m, attr in e.owners:
                put_parameter(m, attr, t)
            put_in(t, True)  # its .grad the parameter's (leaves.py)
        u.swapped = use

    def _swap_out(self, u):
        use = u.swapped
        if use is None:
            return
        u.swapped = None
        for e, t in zip(u.entries, use.leaves):
            if t is None:
                continue
            put_in(t, False)
            for m, attr in e.owners:
                put_parameter(m, attr, e.param)
            t.data = e.part  # not the area, leased on to other units
        use.accs = []

    def _bound_inputs(self, u, inputs, use):
        """The end of a trainable non-root unit's backward must be the
        same point on every rank (its scatter is a collective), and which
        of its parameters get a gradient may differ (an MoE expert no token
        of this rank's reached, a branch the data takes on some ranks): it
        ends when autograd has the gradient of the inputs of each use of
        the unit in this forward, every use of them inside the unit done,
        where a parameter without a gradient is taken as zero (as FSDP's
        FlatParameter, whose hook fires once whatever views were used).
        Each input that requires grad is passed on as a view of itself,
        whose gradient hook fires before the input's own (and before the
        previous unit's output hook, which starts its backward: so every
        rank scatters this unit before gathering that one) and only for
        this unit's use of it (units beside each other on the same input,
        q/k/v projections, each end after their own backward). A use with
        no such input (a unit on the data itself, kwargs only) or a
        parameter read outside the unit's forward leaves the unit to end
        once every trainable parameter has its gradient, as before."""
        if use is None:
            return None
        ins = list(inputs)
        left = [0]
        hook = functools.partial(self._input_done, u, use, left)
        views = []
        for i, t in enumerate(ins):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                ins[i] = t.view_as(t)
                ins[i].register_hook(hook)
                views.append((ins[i], ins[i].grad_fn, ins[i]._version))
                left[0] += 1
        if not left[0]:
            use.unbounded = True
            return None
        use.bounds += 1
        use.calls += 1
        u.use = views  # checked by _post_forward (_inputs_reached)
        return tuple(ins)

    # nodes _inputs_reached walks at most per use before it takes the inputs
    # as reached (a walk that left the unit's graph, through a keyword input)
    _WALK_LIMIT = 2000

    def _inputs_reached(self, views, output):
        """Whether autograd will compute the gradient of every input view
        of a use (whose hook ends the unit's backward): not where the
        unit's forward wrote into one in place (the view's node is cut
        out of the graph) or took none of the outputs' gradient from it
        (a stop-gradient, x.detach()). Then the unit's backward ends once
        every trainable parameter has its gradient, as before, rather
        than holding its areas until the end of backward."""
        if any(v._version != n for v, _, n in views):
            return False
        if len(views) == 1 and isinstance(output, torch.Tensor) and output.requires_grad:
            # one input, one output computed from it directly (a Linear,
            # an activation): no walk
            node = views[0][1]
            top = output.grad_fn
            if top is node:
                return True
            if top is not None:
                for f, _ in top.next_functions:
                    if f is node:
                        return True
        want = {node for _, node, _ in views}
        stack = [t.grad_fn for t in _tensors(output)
                 if t.requires_grad and t.grad_fn is not None]
        seen, found = set(), set()
        while stack:
            node = stack.pop()
            if node in want:
                found.add(node)
                if len(found) == len(want):
                    return True
                continue
            if node in seen:
                continue
            if len(seen) >= self._WALK_LIMIT:
                return True
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions if f is not None)
        return False

    def _input_done(self, u, use, left, grad):
        left[0] -= 1
        if left[0]:
            return None
        use.bounds -= 1
        if u.state == "late":
            # gathered for this use's saved tensors only: the unit was
            # trainable in its forward and is frozen now (requires_grad
            # set False between two forwards and the backward; torch drops
            # such a gradient). Released as a frozen unit's use is
            # (_frozen_input_grad), else it held a lease to the end of
            # backward and the next unit's gather was refused (E_LIMIT)
            if use.bounds == 0 and not self._trainable(u):
                u.state = "idle"
                self._release(u)
            return None
        if use.bounds == 0 and not use.unbounded and u.state == "backward":
            if u.bw_use is _UNKNOWN:
                self._adopt(u, use)
            if u.bw_use is not use:
                return None  # that use's backward has not begun (or is over)
            if u.pending == self._trainable(u):
                # none of its parameters got a gradient, its input did:
                # torch.autograd.grad(), which accumulates no .grad (the
                # unit waits, and the next gather that finds no lease says
                # so), or a unit whose forward bypasses its parameters here
                # (left to the end of backward, as before)
                use.unbounded = True
                return None
            self._finish(u)  # a parameter that got no gradient here: zeros
        return None

    def _post_forward(self, u, module, inputs, output):
        u.depth = max(u.depth - 1, 0)
        if u.depth > 0:  # the outermost one's outputs get the hook
            return
        views, u.use = u.use, None
        use = u.bw_use if u.recompute else u.fw_use
        if views is not None and not self._inputs_reached(views, output) and use is not None \
                and use is not _UNKNOWN:
            use.unbounded = True  # its inputs' gradient may never come
        if u.recompute:  # held for its backward (see _pre_forward)
            u.recompute = False
            return
        self._swap_out(u)
        if torch.is_grad_enabled():
            hook = functools.partial(self._output_grad, u, use)
            hooked = False
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
                    hooked = True
            if hooked:  # a backward will come through u (FSDP's post-forward order)
                self._bw_order.append(u)
            if u.is_root:
                return  # gathered until the end of backward, as FSDP keeps it
            if not self._trainable(u):
                self._hook_frozen_inputs(u, inputs)
            if hooked and u.grad is not None and self.module.training:
                # leased with its gradient area for its backward (_keeps),
                # which comes next: held, as the root unit is
                self._kept = u
                return
        u.state = "idle"
        if u.grad is not None:  # leased for a backward that will not come
            self._free(u)
            return
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
            _first_hook(t, t.register_hook(hook))

    def _frozen_input_grad(self, u, left, grad):
        left[0] -= 1
        if left[0] == 0 and u.state == "late":
            # a unit frozen in this forward and trainable now
            # (requires_grad set True before the backward) was reduced
            # already (late only once done): released, done still
            u.state = "idle" if not self._trainable(u) else "done"
            self._release(u)
        return None

    def _trainable(self, u):
        # a plain loop: called about 5 times per unit per step, where a
        # generator under sum() cost twice as much
        n = 0
        for e in u.entries:
            if e.param.requires_grad:
                n += 1
        return n

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
                if u.depth == 0 and not u.is_root and self._in_forward \
                        and not self._trainable(u):
                    # a frozen unit's parameter read outside its forward
                    # (held by the read until the root's forward ends):
                    # saved as a copy. Rebuilt in backward, the unit was
                    # gathered for it and held to the end of backward (a
                    # frozen unit's release waits for its own forward's
                    # inputs), which with the root unit took both leases
                    # from the next unit's backward (E_LIMIT)
                    return t.clone()
                return _Saved(u, (ptr - lo) // esz, tuple(t.size()), tuple(t.stride()),
                              u.fw_use if self._in_forward else None)
        e = self._by_param.get(id(t))
        if e is not None and t.numel() > 0:
            # a parameter of ours whose .data is not in its area now: a
            # script's forward hook computes on a copy (hook_writes.py)
            # of the same values. Saved as the parameter itself, backward
            # would read whatever its .data is then (its part of the
            # shard, once the unit is released): rebuilt from the area
            for u in self.units:
                if u.gather is not None and any(x is e for x in u.entries):
                    return _Saved(u, e.offset, tuple(t.size()), tuple(t.stride()),
                                  u.fw_use if self._in_forward else None)
        return t

    def _unpack(self, x):
        if not isinstance(x, _Saved):
            return x
        u = x.unit
        if u.state in ("idle", "forward") or (
                u.state == "done" and x.use is not None and not self._ended(x.use)):
            # backward reached a saved tensor of u before u's outputs (of
            # a forward whose use's backward has not come)
            self._pre_backward(u, x.use if x.use is not None else _UNKNOWN)
        elif u.state == "done":
            self._pre_backward(u)  # for its saved tensors only ("late")
        return u.gather.as_strided(x.size, x.stride, x.offset)


def _first_hook(t, handle):
    """Puts the hook `handle` names first among t's gradient hooks. An input
    of a frozen unit is most often the output of the unit before it, whose
    output hook (registered at that unit's post-forward, so earlier) starts
    its backward with a gather: the frozen unit must be released first, or
    that gather finds the rank's 2 leases held by the root unit and the
    frozen one (E_LIMIT, where torch trains). torch (1.13 and 2.x) keeps a
    tensor's hooks in ``Tensor._backward_hooks``, a dict its C++ side walks
    at each call in the dict's own insertion order (PyDict_Next: an
    OrderedDict's move_to_end does not change it), so the entries are put
    in again, this one first; where torch keeps them otherwise they run in
    registration order, as before."""
    hooks = getattr(t, "_backward_hooks", None)
    if not isinstance(hooks, dict) or handle.id not in hooks:
        return
    items = list(hooks.items())
    hooks.clear()
    hooks[handle.id] = dict(items)[handle.id]
    for k, v in items:
        if k != handle.id:
            hooks[k] = v
