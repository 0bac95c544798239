"""The daemon stopped mid-step: a trainer learns whether its step ran and
retries it without ever applying it twice (issue 21, item 5).

Each step is sent with the count it makes (Step.expect_step). The daemon
runs with --checkpoint-on-exit DIR --restore DIR; it is SIGTERMed at step
HOLD and restarted. Each rank reconnects (new Client, module, optimizer:
init="auto" attaches to the restored shards), asks the daemon's count
(opt.steps) and retries:

- "queued": rank 0's step is queued in the daemon (status shows the
  collective in flight) while rank 1 holds back, when the SIGTERM comes:
  the step never ran, the checkpoint holds count HOLD, and both ranks redo
  iteration HOLD (its reply says applied).
- "replied": both ranks' step HOLD ran; the SIGTERM comes before the
  trainer's next request, and the trainer acts as if the reply had been
  lost (what a SIGTERM while the step's update runs on the pool does: the
  step is applied and checkpointed, the client sees the connection close):
  its retry of step HOLD with expect_step HOLD + 1 is answered applied
  False at count HOLD + 1, and nothing changes.

Either way every step's loss and the final parameters are bit-identical to
an uninterrupted run, and the count ends at STEPS (no double step)."""
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim

STEPS = 6
HOLD = 3
BATCH = 16
WORLD = 2
GONE = ("E_CLOSED", "E_SHUTDOWN", "E_PEER_LOST", "E_CONNECT")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS, BATCH, 8, generator=g),
            torch.randn(STEPS, BATCH, 4, generator=g))


class LostReply(Exception):
    """The trainer behaves as if its step's reply never came."""


def attach(rank, sock, job):
    """Connect (the daemon may still be restarting) and build the module."""
    deadline = time.monotonic() + 60
    while True:
        try:
            client = shardd.Client(sock, job=job, rank=rank, world=WORLD,
                                   transient_areas=True)
            break
        except shardd.Error as e:
            if e.code_name not in GONE + ("E_STATE", "E_BUSY") or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    model = make_model()
    sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
    opt = shardd.optim.AdamW(model.parameters(), lr=1e-2, name="adamw")
    return client, model, sm, opt


def script(rank, sock, job, q, mode, go):
    try:
        torch.set_num_threads(1)
        x, y = make_data()
        per = BATCH // WORLD
        lo, hi = rank * per, (rank + 1) * per
        pending = None  # the iteration whose step's reply was lost
        held = False
        while True:
            client, model, sm, opt = attach(rank, sock, job)
            try:
                s = opt.steps  # ask: where is the daemon?
                q.put(("start", rank, s, pending))
                if pending is not None:
                    if s == pending + 1:
                        # it ran: the blind retry must change nothing
                        opt.step(expect_step=pending + 1)
                        r = opt.last_step
                        q.put(("retry", rank, pending, r.applied, r.step))
                    elif s != pending:
                        raise AssertionError("daemon at %d after step %d was lost" % (s, pending))
                    pending = None
                while s < STEPS:
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi])
                    loss.backward()
                    pending = s
                    if mode == "queued" and s == HOLD and rank == 1 and not held:
                        held = True
                        q.put(("held", rank))
                        go.wait(60)  # the daemon was stopped and restarted meanwhile
                    opt.step(expect_step=s + 1)
                    r = opt.last_step
                    q.put(("stepped", rank, s, r.applied, r.step, loss.item()))
                    if mode == "replied" and s == HOLD and not held:
                        held = True
                        q.put(("held", rank))
                        go.wait(60)
                        raise LostReply()
                    pending = None
                    s += 1
                common.send_params(rank, q, sm)
                q.put(("end", rank, opt.steps))
                client.close()
                q.put(("done", rank))
                return
            except LostReply:
                pass
            except shardd.Error as e:
                if e.code_name not in GONE:
                    raise
                q.put(("lost", rank, s, e.code_name, e.message))
            try:
                client.close()
            except Exception:
                pass
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class RetryTest(unittest.TestCase):
    def launch(self, ctx, sock, job, q, mode, go):
        ps = [ctx.Process(target=script, args=(r, sock, job, q, mode, go)) for r in range(WORLD)]
        for p in ps:
            p.start()
        return ps

    def collect(self, q, until, log, timeout=120):
        deadline = time.monotonic() + timeout
        while not until(log):
            if time.monotonic() > deadline:
                raise RuntimeError("timed out; got %r" % (log[-10:],))
            try:
                m = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if m[0] == "error":
                raise RuntimeError("rank %d failed: %s" % (m[1], m[2]))
            log.append(m)

    @staticmethod
    def count(log, kind):
        return sum(1 for m in log if m[0] == kind)

    def reference(self, ctx, sock):
        q = ctx.Queue()
        log = []
        go = ctx.Event()  # unused, but alive until the ranks have unpickled it
        ps = self.launch(ctx, sock, common.job("retry-ref"), q, None, go)
        self.collect(q, lambda lg: self.count(lg, "done") == WORLD, log)
        for p in ps:
            p.join(10)
        return log

    @staticmethod
    def losses(log):
        out = {}
        for m in log:  # the later run of a step replaces the earlier one
            if m[0] == "stepped":
                out.setdefault(m[2], {})[m[1]] = m[5]
        return out

    def interrupted(self, mode):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy"])
        ckdir = tempfile.mkdtemp(prefix="shardd-retry-")
        self.addCleanup(shutil.rmtree, ckdir, True)
        d = common.own_daemon(devices=2, extra_args=["--checkpoint-on-exit", ckdir,
                                                     "--restore", ckdir])
        self.addCleanup(d.cleanup)
        ref = self.reference(ctx, d.socket)
        ref_params = next(m[1] for m in ref if m[0] == "params")
        job = common.job("retry-" + mode)
        q, go = ctx.Queue(), ctx.Event()
        log = []
        ps = self.launch(ctx, d.socket, job, q, mode, go)
        if mode == "queued":
            self.collect(q, lambda lg: self.count(lg, "held") == 1, log)
            # rank 0's step HOLD is in the daemon, waiting for rank 1
            ctl = shardd.Client(d.socket, job=None)
            deadline = time.monotonic() + 60
            while True:
                js = [j for j in ctl.status()["jobs"] if j["name"] == job]
                if js and js[0]["collectives_in_flight"] >= 1:
                    break
                self.assertLess(time.monotonic(), deadline, "rank 0's step never queued")
                time.sleep(0.01)
            ctl.close()
        else:
            self.collect(q, lambda lg: self.count(lg, "held") == WORLD, log)
        t0 = time.monotonic()
        rc = d.stop()
        took = time.monotonic() - t0
        self.assertEqual(rc, 0, d.log_text()[-3000:])
        self.assertTrue(os.path.exists(os.path.join(ckdir, job, "manifest")),
                        "no checkpoint on exit: %s" % os.listdir(ckdir))
        d.start()
        go.set()
        self.collect(q, lambda lg: self.count(lg, "done") == WORLD, log)
        for p in ps:
            p.join(10)

        starts = [m for m in log if m[0] == "start" and m[3] is not None]
        retries = [m for m in log if m[0] == "retry"]
        redone = [m for m in log if m[0] == "stepped" and m[2] == HOLD]
        print("\n  %s: SIGTERM to exit %.2f s; after the restart the ranks found the "
              "daemon at step %s for lost step %d; retries %s"
              % (mode, took, sorted({m[2] for m in starts}), HOLD,
                 [(m[1], m[3], m[4]) for m in retries]))
        self.assertEqual(len(starts), WORLD, log)
        if mode == "queued":
            # the step never ran: both redo it, and it runs once
            for m in starts:
                self.assertEqual(m[2], HOLD, m)
            self.assertEqual(retries, [])
            self.assertEqual(sorted(m[1] for m in redone), [0, 1], redone)
            for m in redone:
                self.assertTrue(m[3], m)
                self.assertEqual(m[4], HOLD + 1, m)
        else:
            # it ran: each blind retry is answered "not applied" at HOLD + 1
            for m in starts:
                self.assertEqual(m[2], HOLD + 1, m)
            self.assertEqual(sorted(m[1] for m in retries), [0, 1], retries)
            for m in retries:
                self.assertFalse(m[3], m)
                self.assertEqual(m[4], HOLD + 1, m)
        for m in log:
            if m[0] == "end":
                self.assertEqual(m[2], STEPS, "the daemon's count at the end")
        got, want = self.losses(log), self.losses(ref)
        for s in range(STEPS):
            self.assertEqual(got.get(s), want[s], "step %d" % s)
        params = next(m[1] for m in log if m[0] == "params")
        for n, v in ref_params.items():
            np.testing.assert_array_equal(params[n], v, err_msg=n)

    def test_sigterm_while_a_step_is_queued_then_restore_and_retry(self):
        self.interrupted("queued")

    def test_step_applied_but_reply_lost_then_restore_and_retry_is_a_no_op(self):
        self.interrupted("replied")


if __name__ == "__main__":
    unittest.main()
