"""Forward prefetch (FSDP's forward_prefetch, limit_all_gathers) of
transient areas, and prefetch="auto"'s trial on the host backend."""
import time


class _Prefetch:
    """ShardedModule's forward prefetch."""

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
