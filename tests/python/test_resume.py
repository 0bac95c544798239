"""Resume through the daemon: a plain relaunch of the same training script
continues where the daemon's shards, optimizer state and step count are,
bit-identically to a run that was never interrupted — after kill -9 of
every rank mid-run, and after a daemon checkpoint restored into a fresh
daemon. shardd.nn attaches to existing buffers instead of writing initial
values over them (init="auto"), and refuses ranks whose initial values
differ (a different seed) naming the unit."""
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

STEPS = 8
BATCH = 16


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def make_data():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(STEPS, BATCH, 8, generator=g),
            torch.randn(STEPS, BATCH, 4, generator=g))


def script(rank, world, sock, job, transient, q, seed=0, init="auto",
           ckpt_every=0, ckpt_root=None):
    """The training script a user relaunches unchanged: build, wrap, attach
    the optimizer, go on from the daemon's step count."""
    with common.reported(rank, q):
        torch.set_num_threads(1)
        if isinstance(sock, (list, tuple)):  # one daemon per node: rank r's
            sock = sock[rank * len(sock) // world]
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient)
        model = make_model(seed)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children", init=init)
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-2, name="adamw")
        x, y = make_data()
        per = BATCH // world
        lo, hi = rank * per, (rank + 1) * per

        def step(s):
            opt.zero_grad()
            if not transient:
                sm.gather()
            loss = nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi])
            loss.backward()
            if not transient:
                sm.scatter("mean")
            opt.step()
            if ckpt_every and (s + 1) % ckpt_every == 0:
                # every rank, inside the loop: no idle ranks needed
                sm.checkpoint(os.path.join(ckpt_root, "step%d" % (s + 1)))
            return loss.item()

        common.train_loop(rank, q, STEPS, client, sm, opt, step, pause_s=0.02)


def elastic(rank, socks, job, q, pause_after=None):
    """One rank per node of a 2-node job, the elastic loop of
    test_rejoin.py: an iteration a lost peer (here: the other node's
    daemon) broke is dropped (sm.reset()) and done again from the daemon's
    step count."""
    with common.reported(rank, q):
        torch.set_num_threads(1)
        # resident areas: transient ones are single-node for now
        client = shardd.Client(socks[rank], job=job, rank=rank, world=2, transient_areas=False)
        model = make_model()
        # no constructor gather: the loop gathers, and a relaunched rank's
        # constructor gather would have no partner in the survivor's retry
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children",
                                     initial_gather=False)
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-2, name="adamw")
        x, y = make_data()
        per = BATCH // 2
        lo, hi = rank * per, (rank + 1) * per
        q.put(("start", rank, opt.steps))
        retries = 0
        while opt.steps < STEPS:
            s = opt.steps
            try:
                opt.zero_grad()
                sm.gather()
                loss = nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi])
                loss.backward()
                sm.scatter("mean")
                opt.step()
            except Exception as e:  # from a hook: autograd may wrap it
                if "E_PEER_LOST" not in str(e):
                    raise
                retries += 1
                q.put(("why", rank, s, time.monotonic(), str(e)[:400]))
                sm.reset()
                time.sleep(0.1)
                continue
            q.put(("loss", rank, s, loss.item()))
            if pause_after is not None and s >= pause_after:
                time.sleep(1.0)  # room for the parent's SIGTERM between steps
        common.send_params(rank, q, sm)
        q.put(("retries", rank, retries))
        client.close()
        q.put(("done", rank))


class Launch(common.Ranks):
    """world rank processes of script()."""

    def __init__(self, sock, job, world, transient, **kw):
        super().__init__(script, lambda r, q: (r, world, sock, job, transient, q), world,
                         kwargs=kw, timeout=90)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ResumeTest(unittest.TestCase):
    _ref = {}

    def reference(self, world, transient):
        """An uninterrupted run (of the same script)."""
        key = (world, transient)
        if key not in self._ref:
            run = Launch(common.socket(), common.job("resume-ref"), world, transient).finish()
            self.assertEqual(run.errors, [])
            self._ref[key] = run
        return self._ref[key]

    def assert_same_run(self, got_losses, got_params, ref):
        want = ref.mean_losses()
        for s, v in got_losses.items():
            self.assertEqual(v, want[s], "step %d's loss" % s)
        self.assertEqual(sorted(got_params), sorted(ref.params))
        for n, v in ref.params.items():
            np.testing.assert_array_equal(got_params[n], v, err_msg=n)

    def kill_all_and_relaunch(self, world, transient):
        ref = self.reference(world, transient)
        job = common.job("resume-kill")
        first = Launch(common.socket(), job, world, transient)
        # every rank has finished step 2; they are somewhere in step 3 or 4
        first.poll(lambda s: len(s.losses.get(2, {})) == world)
        first.kill()
        self.assertEqual(first.errors, [])
        again = Launch(common.socket(), job, world, transient).finish()
        self.assertEqual(again.errors, [])
        starts = set(again.starts.values())
        self.assertEqual(len(starts), 1, "every rank resumes at the daemon's count")
        start = starts.pop()
        self.assertGreaterEqual(start, 3)
        self.assertLess(start, STEPS)
        print("\n  kill -9 of %d ranks (%s) after step 2: relaunched at step %d"
              % (world, "transient" if transient else "resident", start))
        self.assert_same_run(again.mean_losses(), again.params, ref)
        # and it is not the run from scratch (the init was not rewritten)
        self.assertTrue(all(s >= start for s in again.losses))

    def test_kill_every_rank_then_relaunch_transient(self):
        self.kill_all_and_relaunch(2, True)

    def test_kill_every_rank_then_relaunch_resident(self):
        self.kill_all_and_relaunch(3, False)

    def test_checkpoint_restore_into_a_fresh_daemon_then_relaunch(self):
        root = tempfile.mkdtemp(prefix="shardd-resume-")
        self.addCleanup(shutil.rmtree, root, True)
        os.chmod(root, 0o755)
        ref = self.reference(2, True)
        d1 = common.own_daemon(devices=2, extra_args=["--checkpoint-root", root])
        self.addCleanup(d1.cleanup)
        job = common.job("resume-ckpt")
        first = Launch(d1.socket, job, 2, True)
        first.poll(lambda s: len(s.losses.get(3, {})) == 2)
        first.kill()  # the ranks are gone: the job is idle
        ckpt = os.path.join(root, "ck")
        ctl = shardd.Client(d1.socket)
        ctl.checkpoint(ckpt, job=job, timeout=10)  # the last collectives still ending
        ctl.close()
        d1.stop()
        d2 = common.own_daemon(devices=2, extra_args=["--checkpoint-root", root])
        self.addCleanup(d2.cleanup)
        self.addCleanup(d2.stop)
        ctl = shardd.Client(d2.socket)
        self.assertEqual(ctl.restore(ckpt), job)
        ctl.close()
        again = Launch(d2.socket, job, 2, True).finish()
        self.assertEqual(again.errors, [])
        start = set(again.starts.values()).pop()
        self.assertGreaterEqual(start, 4)
        self.assert_same_run(again.mean_losses(), again.params, ref)

    def test_collective_checkpoints_while_training_then_restore_and_relaunch(self):
        """sm.checkpoint every 2 steps from inside the loop on every rank
        (no E_BUSY, no idle ranks); the run is the uninterrupted one; a
        restore of the step-4 checkpoint into a fresh daemon and a plain
        relaunch continue bit-identically from step 4."""
        root = tempfile.mkdtemp(prefix="shardd-ckpt-")
        self.addCleanup(shutil.rmtree, root, True)
        os.chmod(root, 0o755)
        ref = self.reference(2, True)
        d1 = common.own_daemon(devices=2, extra_args=["--checkpoint-root", root])
        self.addCleanup(d1.cleanup)
        job = common.job("resume-coll")
        run = Launch(d1.socket, job, 2, True, ckpt_every=2, ckpt_root=root).finish()
        self.assertEqual(run.errors, [])
        self.assert_same_run(run.mean_losses(), run.params, ref)
        self.assertEqual(sorted(os.listdir(root)), ["step2", "step4", "step6", "step8"])
        d1.stop()
        d2 = common.own_daemon(devices=2, extra_args=["--checkpoint-root", root])
        self.addCleanup(d2.cleanup)
        self.addCleanup(d2.stop)
        ctl = shardd.Client(d2.socket)
        self.assertEqual(ctl.restore(os.path.join(root, "step4")), job)
        ctl.close()
        again = Launch(d2.socket, job, 2, True).finish()
        self.assertEqual(again.errors, [])
        self.assertEqual(set(again.starts.values()), {4})
        self.assert_same_run(again.mean_losses(), again.params, ref)

    def two_node_specs(self, prefix, job):
        """A scratch root (removed at cleanup) with a rendezvous directory
        and one --job-spec per node of a 2-node, 1-rank-each job:
        -> (root, [spec of node 0, spec of node 1])."""
        root = tempfile.mkdtemp(prefix=prefix)
        self.addCleanup(shutil.rmtree, root, True)
        os.chmod(root, 0o755)
        rdv = os.path.join(root, "rdv")
        os.mkdir(rdv, 0o700)  # the daemon's alone (docs/multi-node.md)
        specs = []
        for n in range(2):
            specs.append(os.path.join(root, "node%d.spec" % n))
            with open(specs[-1], "w") as f:
                f.write("job = %s\nworld = 2\nnodes = 2\nnode_rank = %d\n"
                        "rendezvous = %s\nhost = 127.0.0.1\n" % (job, n, rdv))
        return root, specs

    def test_collective_checkpoints_of_two_nodes_then_restore_and_relaunch(self):
        """Issue 19 (c) on 2 nodes: two daemons (one --job-spec each, a
        shared rendezvous and checkpoint directory), one rank on each;
        sm.checkpoint every 2 steps writes each node's part and the job
        manifest; fresh daemons restore the step-4 checkpoint (each its own
        part, Client.restore) and a plain relaunch continues from step 4
        bit-identically to the uninterrupted 2-node run."""
        job = common.job("resume-2n")
        root, specs = self.two_node_specs("shardd-ckpt2n-", job)
        ck = os.path.join(root, "ck")
        os.mkdir(ck)

        def pair():
            ds = [common.own_daemon(devices=1, extra_args=[
                "--checkpoint-root", ck, "--job-spec", specs[n]]) for n in range(2)]
            for d in ds:
                self.addCleanup(d.cleanup)
            return ds

        d1 = pair()
        run = Launch([d.socket for d in d1], job, 2, False, ckpt_every=2,
                     ckpt_root=ck).finish()
        self.assertEqual(run.errors, [])
        # the same recipe on one daemon: 2 ranks' mean of 2 gradients is
        # one addition wherever the ranks live, so the runs agree bit for bit
        self.assert_same_run(run.mean_losses(), run.params, self.reference(2, False))
        self.assertEqual(sorted(os.listdir(ck)), ["step2", "step4", "step6", "step8"])
        self.assertEqual(sorted(os.listdir(os.path.join(ck, "step4"))),
                         ["manifest", "node-0", "node-1"])
        for d in d1:
            d.stop()
        d2 = pair()
        for d in d2:
            self.addCleanup(d.stop)
            ctl = shardd.Client(d.socket)
            self.assertEqual(ctl.restore(os.path.join(ck, "step4")), job)
            ctl.close()
        again = Launch([d.socket for d in d2], job, 2, False).finish()
        self.assertEqual(again.errors, [])
        self.assertEqual(set(again.starts.values()), {4})
        self.assert_same_run(again.mean_losses(), again.params, run)
        print("\n  2 nodes x 1 rank: sm.checkpoint every 2 steps, step 4 restored "
              "on both nodes, relaunched: steps 4..%d bit-identical" % (STEPS - 1))


    def test_a_node_daemon_restart_rejoins_the_two_node_job(self):
        """Issue 21 item 2 in Python: 2 nodes x 1 rank (resident areas).
        Node 1's daemon is stopped (SIGTERM, --checkpoint-on-exit) between
        its rank's steps 2 and 3, while rank 0 waits in step 3's first
        gather: rank 0 gets E_PEER_LOST, sm.reset()s and retries, which
        re-forms the fabric once node 1's daemon is back with --restore of
        its exit part and its rank relaunched (attaching, init="auto").
        Every step's loss and the final parameters equal the uninterrupted
        one-daemon run bit for bit."""
        ref = self.reference(2, False)
        job = common.job("rejoin-2n")
        root, specs = self.two_node_specs("shardd-rejoin2n-", job)
        ex = os.path.join(root, "exit")

        def node(n, *more):
            d = common.own_daemon(devices=1, extra_args=[
                "--job-spec", specs[n], "--checkpoint-on-exit", ex] + list(more))
            self.addCleanup(d.cleanup)
            return d

        d0, d1 = node(0), node(1)
        self.addCleanup(d0.stop)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy"])
        q = ctx.Queue()
        losses, errors, done, retries, params, whys = {}, [], set(), {}, [None], []

        def launch(rank, socks, **kw):
            p = ctx.Process(target=elastic, args=(rank, socks, job, q), kwargs=kw)
            p.start()
            return p

        def poll(until, timeout=90):
            deadline = time.monotonic() + timeout
            while not until():
                self.assertLess(time.monotonic(), deadline, "timed out: %s" % errors)
                try:
                    msg = q.get(timeout=0.2)
                except queue.Empty:
                    continue
                if msg[0] == "loss":
                    losses.setdefault(msg[2], {})[msg[1]] = msg[3]
                elif msg[0] == "params":
                    params[0] = msg[1]
                elif msg[0] == "retries":
                    retries[msg[1]] = msg[2]
                elif msg[0] == "done":
                    done.add(msg[1])
                elif msg[0] == "error":
                    errors.append(msg[1:])
                elif msg[0] == "why":
                    whys.append(msg[1:])

        p0 = launch(0, [d0.socket, d1.socket])
        p1 = launch(1, [d0.socket, d1.socket], pause_after=2)
        poll(lambda: 1 in losses.get(2, {}) or errors)
        self.assertEqual(errors, [])
        t0 = time.monotonic()
        self.assertEqual(d1.stop(), 0)  # SIGTERM: its exit part is written
        self.assertTrue(os.path.exists(os.path.join(ex, job, "node-1", "manifest")))
        poll(lambda: any(e[0] == 1 for e in errors))  # rank 1 lost its daemon
        p1.join(10)
        errors.clear()
        d1b = node(1, "--restore", ex)
        self.addCleanup(d1b.stop)
        back = time.monotonic()
        p1 = launch(1, [d0.socket, d1b.socket])
        poll(lambda: len(done) + len(errors) >= 2)
        ended = time.monotonic()
        for p in (p0, p1):
            p.join(10)
        self.assertEqual(errors, [])
        self.assertGreater(retries.get(0, 0), 0)
        # the survivor's ranks retried because node 1 went, not for a
        # re-forming gone wrong (a timeout)
        for rank, step, _, why in whys:
            self.assertEqual((rank, step), (0, 3), why)
            self.assertIn("E_PEER_LOST", why)
            self.assertNotIn("Timed out", why)
        mean = {s: sum(v.values()) / 2 for s, v in losses.items() if len(v) == 2}
        self.assertEqual(sorted(mean), list(range(STEPS)))
        self.assert_same_run(mean, params[0], ref)
        print("\n  2 nodes x 1 rank: node 1's daemon restarted after step 2 (%.2f s "
              "down), rank 0 retried %d time(s), the run ended %.2f s after: steps "
              "0..%d bit-identical" % (back - t0, retries[0], ended - back, STEPS - 1))


    def test_operator_checkpoint_while_training_then_release_and_restore(self):
        """shardctl checkpoint (Client.checkpoint with a timeout) of the job
        while its 2 ranks train: the run is the uninterrupted one; once its
        ranks finished (close()), the job is gone, so the restore into its
        name needs no release_job; then the restore and a plain relaunch
        continue bit-identically from the step the checkpoint recorded."""
        root = tempfile.mkdtemp(prefix="shardd-op-")
        self.addCleanup(shutil.rmtree, root, True)
        os.chmod(root, 0o755)
        ref = self.reference(2, True)
        d = common.own_daemon(devices=2, extra_args=["--checkpoint-root", root,
                                                     "--job-linger", "600"])
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        job = common.job("resume-op")
        run = Launch(d.socket, job, 2, True)
        run.poll(lambda s: len(s.losses.get(1, {})) == 2)
        ckpt = os.path.join(root, "op")
        ctl = shardd.Client(d.socket)
        ctl.checkpoint(ckpt, job=job, timeout=30)
        run.finish()
        self.assertEqual(run.errors, [])
        self.assert_same_run(run.mean_losses(), run.params, ref)
        deadline = time.monotonic() + 10  # the closes are read after the replies
        while job in [j["name"] for j in ctl.status()["jobs"]]:
            self.assertLess(time.monotonic(), deadline, "a finished job lingered")
            time.sleep(0.05)
        self.assertEqual(ctl.restore(ckpt), job)
        ctl.close()
        again = Launch(d.socket, job, 2, True).finish()
        self.assertEqual(again.errors, [])
        start = set(again.starts.values()).pop()
        self.assertGreaterEqual(start, 2)
        self.assert_same_run(again.mean_losses(), again.params, ref)

    def test_ranks_with_other_initial_values_are_refused_naming_the_unit(self):
        # rank 1 builds its model with another seed
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy"])
        q = ctx.Queue()
        job = common.job("resume-seed")
        procs = [ctx.Process(target=script, args=(r, 2, common.socket(), job, True, q),
                             kwargs={"seed": r}) for r in range(2)]
        for p in procs:
            p.start()
        errors = []
        deadline = time.monotonic() + 60
        # the refused rank's error, and maybe its peer's E_PEER_LOST when it
        # exits (either may come first through the queue)
        while not any(e[1] == "E_MISMATCH" for e in errors) and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg[0] == "error":
                errors.append(msg[1:])
        for p in procs:
            p.kill()
            p.join(10)
        refused = [e for e in errors if e[1] == "E_MISMATCH"]
        self.assertTrue(refused, "a rank was refused: %s" % errors)
        rank, code, message = refused[0]
        self.assertIn("initial values differ", message)
        self.assertIn(".flat_param", message)  # the unit's buffer
        self.assertIn("same seed", message)

    def test_require_existing_refuses_a_new_buffer(self):
        c = shardd.Client(common.socket(), job=common.job("resume-req"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        with self.assertRaises(shardd.Error) as cm:
            shardd.nn.ShardedModule(c, make_model(), init="require_existing")
        self.assertEqual(cm.exception.code_name, "E_STATE")
        self.assertIn("require_existing", cm.exception.message)
        with self.assertRaises(ValueError):
            shardd.nn.ShardedModule(c, make_model(), init="sometimes")


if __name__ == "__main__":
    unittest.main()
