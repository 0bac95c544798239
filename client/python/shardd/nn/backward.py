"""Transient areas, the backward side: a unit's gather with its gradient
area before its backward, its reduce-scatter once every gradient is in,
and the end of backward (units no gradient reached, .grad None alike on
every rank)."""
import contextlib
import zlib

import torch

import shardd

from .acc_hooks import AFTER, refusal as acc_refusal
from .grads import _Grad16
from .optimizer_hook import _HELD, _PARTIAL
from .units import _UNKNOWN, _Use


def _all_zeros(t):
    """Whether every element of t is zero (-0.0 too; a NaN is not), read
    without allocating: numpy's reduction over a host fp32 tensor, about
    5x faster here than torch 1.13's any() (0.27 against 1.37 ms for 2.1M
    floats, one thread), torch's elsewhere."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return not t.numpy().any()
    return not bool(t.any())


class _BackwardHooks:
    """ShardedModule's transient-area hooks in backward."""

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

    def _pre_backward(self, u, use=None):
        """u's backward begins: gathered with its gradient area. use: the
        forward's _Use whose backward it is (_UNKNOWN: a recomputation, the
        first gradient says; None: for saved tensors only once done, or
        the root unit)."""
        unknown = _UNKNOWN
        if not self._final_queued:
            try:
                self._check_partial_grads()
            except shardd.Error:
                self._abort_backward()
                raise
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        # a unit already reduced this backward has its backward again where
        # activation checkpointing recomputes it once more (reentrant
        # checkpoints around two calls of it: each nested backward ends the
        # unit): its second share is gathered and added to the first
        trainable = self._trainable(u)
        want = trainable > 0 and (
            u.state != "done" or u.recompute or use is unknown
            or (use is not None and not self._ended(use)))
        if u.is_root:
            self._root_backward_first = all(
                v.state in ("idle", "forward") for v in self.units if v is not u)
        elif want and self._tail_next is None:
            self._tail_next = u  # the first backward after the root's
        kept = self._kept
        if kept is u:
            if want:
                self._kept = None  # its backward, with the areas it holds
            else:
                self._free_kept()  # (frozen since its forward: gathered anew)
        elif kept is not None and not self._lease_room(
                1 if u.gather is None else 0, 1 if want and u.grad is None else 0):
            self._free_kept()  # another unit's backward came first
        if not (want and u.state == "forward" and u.gather is not None
                and u.grad is not None):
            # (the root unit leased both in its forward: the values there
            # are still the gathered ones, and no gradient reached the area)
            try:
                if not self._take_prefetched(u, want):
                    u.gather, u.grad = self.client.gather_area(u.buffer, want_grad=want)
            except shardd.Error as e:
                if e.code_name == "E_MISMATCH":
                    self._abort_backward()
                    raise self._backward_mismatch(u, e) from e
                if e.code_name != "E_LIMIT":
                    raise
                err = self._backward_limit(u, e)
                self._abort_backward()
                raise err from e
        if want:
            u.state = "backward"
            u.ran = True
            u.pending = trainable
            for e in u.entries:
                e.got = False
            u.bw_use = None if u.is_root else (unknown if use is None else use)
        else:  # gathered for saved tensors only: released at the end
            u.state = "late"
        self._point(u, want)
        if want and isinstance(u.bw_use, _Use):
            self._point_leaves(u, u.bw_use)
        self._prefetch_backward(u)

    def _point_leaves(self, u, use):
        """A use with leaves of its own (a forward after the first before
        one backward): each leaf a view of the gather area, its .grad of the
        gradient area, where autograd accumulates it in place."""
        if use.leaves is None:
            return
        for e, t in zip(u.entries, use.leaves):
            if t is not None:
                t.data = u.gather[e.offset:e.offset + e.numel].view(e.shape)
                t.grad = u.grad[e.offset:e.offset + e.numel].view(e.shape)

    def _adopt(self, u, use):
        """u's backward began before anything said which forward's use it
        is (a recomputation): this one's gradient came first."""
        if use is None:  # the parameters themselves: their use
            held = u.param_use() if u.param_use is not None else None
            use = held if held is not None and not self._ended(held) else _Use(unbounded=True)
        u.bw_use = use
        self._point_leaves(u, use)
        return use

    def _same_use(self, u, use):
        """A gradient of u's use `use` (None: of the parameters
        themselves) while u's backward runs: whether it is that use's
        backward (adopted if nothing said yet). Another use's is refused:
        autograd interleaves the backwards of two forwards' uses of the
        unit, whose gradients the unit reduces one use at a time."""
        if u.is_root:
            return True
        cur = u.bw_use
        if cur is _UNKNOWN:
            self._adopt(u, use)
            return True
        if cur is use or (use is None and cur is not None and cur.leaves is None):
            return True
        if use is not None and self._ended(use):
            return False  # that use's backward is over (a late gradient hook)
        self._abort_backward()
        raise shardd.Error(
            22, "unit %r is used by several forwards before one backward, and "
            "autograd runs the backward of one use while another's is under way: "
            "each use's gradient is reduced on its own, one at a time; call "
            "backward() on each forward's loss instead" % u.name, "E_LIMIT")

    def _backward_mismatch(self, u, err):
        """The daemon's E_MISMATCH for u's gather in backward: the ranks'
        backwards reached different units, which the rank's own graph
        decides (a unit's backward starts when its output's gradient comes,
        and a unit whose output the loss does not depend on gets none)."""
        return shardd.Error(
            err.code, "unit %r's backward (its output has a gradient on this rank) "
            "gathers it, and another rank's backward did not come to it at this "
            "point: every rank's loss must depend on the outputs of the same units "
            "(a unit, e.g. an MoE expert wrapped on its own, whose output is used "
            "on some ranks only: add it to the output on every rank, even over an "
            "empty selection of tokens, or wrap it with the module around it), "
            "and every rank must run as many forwards before each backward "
            "(%s) [%s]" % (u.name, self._FORWARDS_SAME, err.message), "E_MISMATCH")

    _FORWARDS_SAME = (
        "two forwards before one backward on one rank, one on another, send "
        "different collectives: each forward's use of a unit is gathered, and "
        "reduced in backward, on its own")

    @contextlib.contextmanager
    def _same_collectives(self, what):
        """A collective of the hooks (what: which) that the daemon failed
        because the ranks' collectives differ (E_MISMATCH): the refusal
        says what in a training loop makes them differ."""
        try:
            yield
        except shardd.Error as e:
            if e.code_name != "E_MISMATCH":
                raise
            raise shardd.Error(
                e.code, "%s: the ranks' collectives differ: every rank must run the "
                "same forwards (as many, through the same units, in the same order; an "
                "evaluation under no_grad too, on every rank, not rank 0 alone) "
                "before each backward, and its loss depend on the same units' outputs "
                "(%s; a unit skipped on some ranks only, such as LayerDrop drawn per "
                "rank: draw it from a generator seeded alike on every rank, or wrap the "
                "skipped blocks with the module around them) [%s]" % (
                    what, self._FORWARDS_SAME, e.message), "E_MISMATCH") from e

    def _backward_limit(self, u, err):
        """The daemon's E_LIMIT for u's gather in backward, saying which
        units hold this rank's areas and why they wait."""
        waiting, reused = [], []
        for v in self.units:
            if v.gather is None or v is u:
                continue
            use = v.bw_use
            if v.state == "backward" and isinstance(use, _Use) and use.calls > 1 and use.bounds:
                reused.append(v.name)
                waiting.append("%r (called %d times in one forward: held from its last "
                               "call's backward to its first's)" % (v.name, use.calls))
            elif v.state == "backward":
                left = [e.name for e in v.entries if e.param.requires_grad and not e.got]
                waiting.append("%r (waits for the gradient of %s)" % (
                    v.name, ", ".join(repr(n) for n in left[:3])
                    + (" and %d more" % (len(left) - 3) if len(left) > 3 else "")))
            elif v.state == "late":
                waiting.append(
                    "%r (gathered again for the tensors a forward of it saved, with no "
                    "gradient to wait for: held until that forward's inputs of it have "
                    "their whole gradient, which, where a frozen unit's input is read by "
                    "others too or its requires_grad changed between two forwards and "
                    "this backward, may be the end of backward)" % v.name)
            else:
                waiting.append("%r (%s)" % (v.name, "the root unit, held until backward "
                                            "ends" if v.is_root else v.state))
        if reused:
            return shardd.Error(
                err.code, "unit %r's backward needs a gather area, and this rank's are "
                "held by %s: units called several times in one forward (a module reused "
                "across depth, ALBERT's shared layer) whose calls interleave need an area "
                "each at once, beside the root unit's: wrap the modules reused together "
                "in one unit (a module holding them, e.g. an nn.ModuleDict of them as "
                "auto_wrap's class), or leave all but one to the root's unit [%s]" % (
                    u.name, ", ".join(waiting), err.message), "E_LIMIT")
        return shardd.Error(
            err.code, "unit %r's backward needs a gather area, and this rank's are held "
            "by %s: a unit holds its areas until every trainable parameter of it has "
            "its gradient (or its use's inputs have theirs), which never comes where a "
            "parameter gets none (a parameter the loss does not depend on) or never "
            "in .grad (torch.autograd.grad() "
            "returns the gradients instead of accumulating them, so no unit's "
            "gradient is ever whole: use loss.backward()) [%s]" % (
                u.name, ", ".join(waiting) or "none", err.message), "E_LIMIT")

    def _abort_backward(self):
        """A backward refused midway (the exception ends autograd's run,
        and _final with it): every area this backward or its forward leased
        is released without a scatter, each parameter is its part of the
        shard again, and each .grad what it was when backward began,
        except the parameters whose .grad was set then in units already
        scattered: theirs holds part of the refused backward's gradient,
        which _check_partial_grads refuses to step or add to until a
        zero_grad()."""
        self._final_queued = False
        _HELD.discard(self)
        self._kept = self._tail_next = None
        partial = []
        for u in self.units:
            ran = u.ran
            if u.grad is not None:  # its gradient area too, unscattered
                self.client.release_all(u.buffer)
                u.gather = u.grad = None
                self._to_shard(u)
            elif u.gather is not None:
                self._release(u)
            self._end_use(u)
            if ran:
                for e in u.entries:
                    if not e.param.requires_grad:
                        continue
                    if u.state == "done" and e.kept:
                        partial.append(e)
                    else:
                        e.param.grad = self._grad_of(u, e) if e.kept else None
            u.state = "idle"
            u.ran = False
            u.depth = 0
        self._bw_serial += 1  # (after _end_use marked the uses of this one)
        self._partial = list(getattr(self, "_partial", ())) + partial
        if self._partial:
            _PARTIAL.add(self)
        try:
            self._wait_releases()
        except shardd.Error:
            pass  # the refusal says what went wrong first

    def _check_partial_grads(self):
        """Before a backward or an optimizer's step: refuses while a
        refused backward's part lies in a .grad it added to (see
        _abort_backward), until zero_grad() zeroed it or set it None."""
        left = [e for e in getattr(self, "_partial", ()) if
                e.param.grad is not None and bool(e.param.grad.detach().ne(0).any())]
        self._partial = left
        if left:
            raise shardd.Error(
                22, "the gradients (.grad) of %s hold part of a backward that was refused "
                "(its units had reduced their share into the .grad kept from before): "
                "call zero_grad() before the next backward or step" % (
                    ", ".join(repr(e.name) for e in left[:4]) +
                    (" and %d more" % (len(left) - 4) if len(left) > 4 else "")), "E_STATE")

    def _output_grad(self, u, use, grad):
        """The gradient of u's output (or of a parameter read outside its
        forward) in use `use` (None: the parameters themselves) came:
        that use's backward begins."""
        if use is None and not u.is_root and u.param_use is not None:
            use = u.param_use()  # (None: its forward's graph is gone)
        if u.state in ("idle", "forward"):
            self._pre_backward(u, use)
        elif u.state == "done" and use is not None and not self._ended(use):
            self._pre_backward(u, use)  # another forward's use of it
        elif u.state == "backward" and use is not None and not self._ended(use):
            self._same_use(u, use)
        return None

    def _grad_ready(self, u, e, use, grad_inputs, grad_outputs):
        hooks = e.acc_hooks
        if hooks is not None and len(hooks) > 1:
            # the script hooked the parameter's node after its first
            # forward: refused before its hook runs (acc_hooks.py)
            self._abort_backward()
            raise acc_refusal(e.name, AFTER)
        if u.state != "backward" or not self._same_use(u, use):
            return
        cur = u.bw_use
        if isinstance(cur, _Use) and cur.leaves is not None:
            t = cur.leaves[u.entries.index(e)]
            g = u.grad[e.offset:e.offset + e.numel]
            if t is not None and t.grad is not None and t.grad.data_ptr() != g.data_ptr():
                # accumulated before its use was known (adopted): into the area
                with torch.no_grad():
                    g.add_(t.grad.reshape(-1))
                t.grad = g.view(e.shape)
        e.got = True
        u.pending -= 1
        if u.pending == 0 and (not isinstance(cur, _Use) or cur.unbounded or not cur.bounds):
            self._finish(u)  # else its inputs' gradient ends it (_bound_inputs)

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
        red = u.buffer.reduced_tensor
        # zero_grad() zeroed the shard and nothing wrote into it since (its
        # version is the same, no scatter came): the kept .grad are zeros,
        # nothing to add back (a clone and an add of the whole shard, about
        # a millisecond per MiB here). The version does not see a write
        # through `.grad.data` or `.grad.numpy()` (a term an older script
        # adds to the gradient), so the shard is read once to be sure
        # (no allocation, a fraction of the clone's cost)
        zeroed = u.zeroed_at is not None and u.zeroed_at == red._version
        u.zeroed_at = None
        if kept:
            with torch.no_grad():
                for e in train:
                    if not e.kept:
                        e.rpart.zero_()
                if u.live_at is not None and u.live_at == self.client.steps_requested:
                    acc = True  # the daemon adds to its live reduced gradient
                elif not zeroed or not _all_zeros(red):
                    # a step consumed it: the daemon would replace it, so
                    # what the parameters kept is added back here
                    save = red.clone()
        with self._same_collectives("unit %r's reduce-scatter" % u.name):
            self.client.scatter(u.buffer, self.reduce_op,
                                no_grad=(True if len(no_grad) == len(train) else no_grad),
                                accumulate=acc)
        if save is not None:
            with torch.no_grad():
                red.add_(save)
        u.live_at = self.client.steps_requested
        u.state = "done"
        self._end_use(u)
        self._release(u)
        for e in train:
            e.param.grad = self._grad_of(u, e) if (ran and e.got) or e.kept else None

    def _ended(self, use):
        """Whether use's backward ended in this backward (a backward of a
        retained graph runs it again)."""
        return use.ended == self._bw_serial

    def _end_use(self, u):
        """u's use in backward is reduced: its leaves hold no area."""
        use, u.bw_use = u.bw_use, None
        if not isinstance(use, _Use):
            return
        use.ended = self._bw_serial
        for e, t in zip(u.entries, use.leaves or ()):
            if t is not None:
                t.grad = None
                t.data = e.part

    def _final(self):
        """End of backward: every unit scattered once per use, in reverse
        order."""
        self._final_queued = False
        _HELD.discard(self)
        if self._pending is not None:  # a backward prefetch no backward took
            self._drop_prefetch()
        self._tail, self._tail_next = self._tail_next, None
        self._scatter_rest()
        try:
            self._wait_releases()
            self._same_none_grads()
        finally:
            self._bw_serial += 1
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
        # and the ranks agree whether the next backward, and forwards after
        # prefetch="auto"'s trial, prefetch (every rank wants it)
        with self._same_collectives("the end of backward's all-reduce"):
            mx = self.client.all_reduce([n, -n, sig, -sig, -self._backward_prefetch_vote(),
                                         -self._forward_prefetch_vote()], "max")
        self._backward_prefetch_agree(-mx[4] > 0.5)
        self._forward_prefetch_agree(-mx[5] > 0.5)
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
