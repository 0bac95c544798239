"""Forward prefetch (FSDP's forward_prefetch, limit_all_gathers) of
transient areas, prefetch="auto"'s trial on the host backend, and backward
prefetch (FSDP's BackwardPrefetch.BACKWARD_PRE)."""
import os
import time

import torch

import shardd


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

    @staticmethod
    def _cpus():
        """The CPUs this process may run on (its affinity mask)."""
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1

    def _node_ranks(self):
        """This job's ranks on this daemon's node: the world over the
        nodes of a multi-node job (the daemon's status says), else the
        world."""
        world, first = self.client.world, 0
        try:
            while True:
                st = self.client.status(first)
                jobs = st.get("jobs", [])
                for j in jobs:
                    if j.get("name") == self.client.job:
                        return max(1, world // max(1, j.get("nodes", 1)))
                if not jobs or not st.get("jobs_more"):
                    return world
                first += len(jobs)
        except shardd.Error:
            return world

    def _spare_cpu(self):
        """Whether a CPU is left for the daemon's copy while every rank of
        the node computes: this rank's CPUs (affinity) against the node's
        ranks times this rank's torch threads (every rank alike). ->
        (spare, what was counted)."""
        seen = {"cpus": self._cpus(), "node_ranks": self._node_ranks(),
                "threads": torch.get_num_threads()}
        return seen["cpus"] > seen["node_ranks"] * seen["threads"], seen

    def _trial_outcome(self, tr):
        """What the whole trial chooses whatever its remaining steps take
        (True: prefetch), None while that is open: the choice with the
        remaining steps with prefetch taking no time and those without
        forever, and with the reverse; where both agree, the remaining
        steps cannot change it. Once all are timed the two are the one
        choice: prefetching's median lower by more than _TRIAL_MARGIN."""
        k = self._TRIAL_STEPS

        def med(v, rest):
            v = sorted(v + [rest] * (k - len(v)))
            return v[k // 2]

        inf, cut = float("inf"), 1.0 - self._TRIAL_MARGIN
        best = med(tr["on"], 0.0) < med(tr["off"], inf) * cut
        worst = med(tr["on"], inf) < med(tr["off"], 0.0) * cut
        return best if best == worst else None

    def _prefetch_trial(self):
        """prefetch="auto" on the host backend, at each training forward of
        the root once the order is known. Where the node has no spare CPU
        (_spare_cpu: its ranks' torch threads take every CPU this rank may
        run on), no prefetch and no trial: the daemon's copy of a
        prefetched gather would take its CPU from a rank's compute, and a
        trial's steps with prefetch are what would cost. Else the steps
        alternate, prefetching and not, each timed up to the next training
        forward, until the choice is certain: _TRIAL_STEPS of each, or fewer
        where the remaining ones cannot change it (_trial_outcome: two
        steps with prefetch both slower than two without end it); then
        prefetching stays on only if the median of its steps was lower by
        more than _TRIAL_MARGIN (5%): a step with prefetch is never kept
        for being as fast, so the loop after the trial is at worst as fast
        as without prefetch. Whether it pays depends on a CPU being free
        for the daemon's copy while the ranks compute, and on how long
        ranks wait for each other at each gather (a prefetched gather does
        not make them meet there): measured, not guessed.
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
        chose not to prefetch sends later or never; so a node without a
        spare CPU keeps every rank of the job from prefetching."""
        tr = self._trial
        now = self._clock()
        if tr["mode"] is None:
            tr["spare"], tr["counted"] = self._spare_cpu()
        else:
            tr[tr["mode"]].append(now - tr["t"])
        # within the margin the steps are the same, and prefetching is
        # what has more to lose: a peer's or the daemon's CPU, a second
        # gather slot (no gain in the noise of a shared machine, so off)
        chose = False if not tr["spare"] else self._trial_outcome(tr)
        if chose is not None:
            med = lambda v: sorted(v)[len(v) // 2] if v else None  # noqa: E731
            self._prefetch_on = chose
            self.prefetch_trial = {"on": tr["on"], "off": tr["off"],
                                   "on_median": med(tr["on"]), "off_median": med(tr["off"]),
                                   "prefetch": chose, "spare_cpu": tr["spare"],
                                   **tr["counted"]}
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
