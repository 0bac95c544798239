"""Forward prefetch (FSDP's forward_prefetch, limit_all_gathers) of
transient areas, prefetch="auto"'s trial on the host backend, and backward
prefetch (FSDP's BackwardPrefetch.BACKWARD_PRE)."""
import time


class _Prefetch:
    """ShardedModule's forward prefetch."""

    # what the ranks chose: read-only, as every rank must send the same
    # gathers (a rank prefetching a unit its peers gather later or never
    # waits for them); the constructor's prefetch= / backward_prefetch=
    # choose, every rank the same
    @property
    def prefetch(self):
        """Whether forward prefetch is on now (it alternates during
        prefetch="auto"'s trial). Read-only: pass prefetch= to the
        constructor."""
        return self._prefetch_on

    @prefetch.setter
    def prefetch(self, v):
        raise AttributeError(
            "ShardedModule.prefetch is read-only: every rank must send the same gathers, "
            "so it is chosen by the constructor's prefetch= (the same on every rank) and, "
            "with \"auto\", by a trial the ranks agree on; a rank prefetching beside one "
            "that does not waits for a gather its peers send later or never")

    @property
    def backward_prefetch(self):
        """Whether the next backward prefetches, as every rank agreed at
        the end of the last one. Read-only: pass backward_prefetch= to
        the constructor."""
        return self._bw_agreed

    @backward_prefetch.setter
    def backward_prefetch(self, v):
        raise AttributeError(
            "ShardedModule.backward_prefetch is read-only: it is what every rank agreed at "
            "the end of the last backward (the ranks must send the same gathers, and a rank "
            "whose guess is wrong would wait for a gather its peers never send); choose with "
            "the constructor's backward_prefetch= (True, False or \"auto\", the same on "
            "every rank)")

    # -- forward prefetch (FSDP's forward_prefetch, limit_all_gathers) ------
    _GATHER_LEASES = 2  # the daemon's default gather leases per rank

    def _prefetch_after(self, u):
        """Starts the next unit's gather while u's forward runs."""
        if not self.prefetch or not self._order_done or self._pending is not None:
            return
        if self.prefetch_trial is not None and not self._fw_agreed:
            return  # the trial chose on this rank's timings: not every rank's yet
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
        # the unit kept from its forward to its backward (_keeps) is
        # prefetched with its gradient area, as its gather would lease it:
        # else this rank's backward gathered it again and its peers' not.
        # (_keeps' lease room is the same here as at its forward: the
        # current unit's gather counts where the check above allows it)
        want = nxt is self._tail and self._keeps(nxt)
        self._pending = (nxt, self.client.gather_async(nxt.buffer, want_grad=want), want)

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
        did beside peers that prefetch. Once chosen, a rank prefetches only
        while every rank chose it (_forward_prefetch_agree): a rank that
        prefetches a unit the forward does not take next (its order
        changed since the first) waits for that gather, which a peer that
        chose not to prefetch sends later or never."""
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
            self._prefetch_on = on < off * (1.0 - self._TRIAL_MARGIN)
            self.prefetch_trial = {"on": tr["on"], "off": tr["off"], "on_median": on,
                                   "off_median": off, "prefetch": self._prefetch_on}
            self._trial = None
            return
        tr["mode"] = "on" if len(tr["on"]) <= len(tr["off"]) else "off"
        self._prefetch_on = tr["mode"] == "on"
        tr["t"] = now

    def _drop_prefetch(self):
        """The gather under way was not the one needed (the order changed):
        waited for, as every rank sent it, and its areas given back."""
        nxt, ticket, grad = self._pending
        self._pending = None
        self.client.wait_area(ticket, nxt.buffer, want_grad=grad)
        if grad:  # unscattered: its gradient area goes back with it
            self.client.release_all(nxt.buffer)
        else:
            self.client.release(nxt.buffer)

    # -- backward prefetch (FSDP's BackwardPrefetch.BACKWARD_PRE) ------------
    @staticmethod
    def _backward_prefetch_option(v):
        """backward_prefetch's value: True, False or "auto"; FSDP's
        BackwardPrefetch.BACKWARD_PRE is True, None False (BACKWARD_POST,
        a prefetch after the unit's gradient is computed, is not done)."""
        if v is None:
            return False
        if v in (True, False, "auto"):
            return v
        if getattr(v, "name", None) == "BACKWARD_PRE":
            return True
        raise ValueError("backward_prefetch %r: True, False, \"auto\" or "
                         "BackwardPrefetch.BACKWARD_PRE" % (v,))

    def _backward_prefetch_vote(self):
        """Whether this rank wants the next backward to prefetch: "auto"
        where forward prefetch is on and its trial, if any, is over (the
        same question, whether a gather's copy finds a CPU while the rank
        computes, measured once)."""
        if self._bw_opt == "auto":
            return 1.0 if self.prefetch and self._trial is None else 0.0
        return 1.0 if self._bw_opt else 0.0

    def _backward_prefetch_agree(self, all_want):
        """The end of a backward: every rank learnt every rank's vote from
        the same all-reduce; the next backward prefetches where all want
        it. So the ranks send the same gathers, right guesses or wrong, in
        the same order: a rank that guessed wrong waits for its gather,
        which its peers sent too, and gives it back. (A rank prefetching
        beside one that does not is tolerated where the guess is right,
        the same gathers in the same order, a prefetched one only sooner,
        as forward prefetch relies on; but a wrong guess waited for there
        would wait for a gather the peer sends later or never.)"""
        self._bw_agreed = bool(all_want)

    def _forward_prefetch_vote(self):
        """Whether this rank's trial chose forward prefetch (1.0), for the
        same end-of-backward all-reduce."""
        return 1.0 if self.prefetch and self._trial is None else 0.0

    def _forward_prefetch_agree(self, all_want):
        """After prefetch="auto"'s trial each rank has chosen on its own
        timings; forward prefetch goes on only while every rank chose it,
        as learnt at the end of each backward (the first training forward
        after the trial does not prefetch yet). prefetch=True and the cuda
        backend's "auto" choose alike on every rank and need no
        agreement."""
        self._fw_agreed = bool(all_want)

    def _take_prefetched(self, u, want):
        """u's backward needs its areas (want: the gradient area too): True
        when the gather under way is u's (its areas are u's now). Else a
        prefetch of another unit (a wrong guess) stays under way if u's
        gather leaves it its leases (its backward may still come), and is
        dropped if not: a wrong guess costs time, never a lease past the
        limit."""
        pend = self._pending
        if pend is None:
            return False
        v, ticket, grad = pend
        if v is u and grad == want:
            self._pending = None
            u.gather, u.grad = self.client.wait_area(ticket, u.buffer, want_grad=want)
            self.backward_prefetches += 1
            return True
        need_g = (0 if u.gather is not None else 1) + 1
        need_r = (1 if want and u.grad is None else 0) + (1 if grad else 0)
        if v is u or not self._lease_room(need_g, need_r):
            self._drop_prefetch()
        return False

    def _lease_room(self, gathers, grads):
        """Whether this rank can lease that many more gather and gradient
        areas within the daemon's limit (2 of each per rank)."""
        held_g = sum(1 for v in self.units if v.gather is not None)
        held_r = sum(1 for v in self.units if v.grad is not None)
        return held_g + gathers <= self._GATHER_LEASES and held_r + grads <= self._GATHER_LEASES

    def _prefetch_backward(self, u):
        """u's backward begins (its areas are gathered): the gather of the
        unit before u in this step's forward order (FSDP's post-forward
        order, recorded every step, so a forward in another order than the
        last step's predicts its own backward) is sent now, with its
        gradient area where it has a trainable parameter, when it has no
        backward yet and both leases allow it."""
        if not self.backward_prefetch or self._pending is not None:
            return
        order = self._bw_order
        i = len(order) - 1
        while i >= 0 and order[i] is not u:  # u's last forward: its backward comes first
            i -= 1
        while i >= 0 and order[i] is u:
            i -= 1
        if i < 0:
            return
        v = order[i]
        if v.state != "idle" or v.gather is not None or v.grad is not None:
            return  # gathered (the root unit), in backward or done
        want = self._trainable(v) > 0
        if not self._lease_room(1, 1 if want else 0):
            return
        self._pending = (v, self.client.gather_async(v.buffer, want_grad=want), want)
