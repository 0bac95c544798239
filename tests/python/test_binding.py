"""The ctypes binding: connect, buffers, views, collectives, errors, zero copy."""
import ctypes
import os
import multiprocessing as mp
import threading
import unittest

import common
import shardd

if common.HAVE_NUMPY:
    import numpy as np


def run_ranks(world, fn, timeout=30):
    """Runs fn(rank) in `world` threads (one connection each; collectives
    block in C with the GIL released). -> list of results; re-raises."""
    out = [None] * world
    errs = []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: B902
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if errs:
        raise errs[0]
    if any(t.is_alive() for t in ts):
        raise AssertionError("ranks still running after %ss" % timeout)
    return out


def zero_copy_peer(sock, job, numel, q_in, q_out):
    """Rank 1 of test_zero_copy_across_processes, in its own process."""
    try:
        import numpy as np_
        with shardd.Client(sock, job=job, rank=1, world=2, transient_areas=False) as c:
            b = c.register_buffer("zc", "fp32", numel)
            q_out.put(("registered", b.shard_numel))
            c.gather(b)  # collective with rank 0
            q_out.put(("gathered", np_.array(b.gather).tolist()))
            q_in.get(timeout=30)
    except BaseException as e:  # noqa: B902
        q_out.put(("error", repr(e)))


@unittest.skipUnless(common.HAVE_NUMPY, "numpy is not importable")
class BindingTest(unittest.TestCase):
    def setUp(self):
        self.sock = common.socket()

    def client(self, tag, rank=0, world=1):
        c = shardd.Client(self.sock, job=common.job(tag), rank=rank, world=world,
                          transient_areas=False)
        self.addCleanup(c.close)
        return c

    def test_connect_info_status(self):
        c = self.client("info")
        self.assertEqual(c.daemon_backend, "host")
        self.assertTrue(c.daemon_version)
        # one version string: shardd.h's, seen by the binding and the daemon
        import re
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "..", "include", "shardd.h")) as f:
            want = re.search(r'#define SHARDD_VERSION "([^"]+)"', f.read()).group(1)
        self.assertEqual(shardd.__version__, want)
        self.assertEqual(c.daemon_version, want)
        c.ping()
        st = c.status()
        self.assertIn("jobs", st)
        self.assertIsInstance(c.status_text(), str)
        self.assertTrue(shardd.library_path())

    def test_connect_failure_raises(self):
        with self.assertRaises(shardd.Error) as cm:
            shardd.Client("/nonexistent/dir/shardd.sock", job="x")
        self.assertEqual(cm.exception.code_name, "E_CONNECT")
        self.assertIn("/nonexistent/dir/shardd.sock", str(cm.exception))

    def test_buffer_areas_are_mappings(self):
        c = self.client("areas")
        b = c.register_buffer("flat", "fp32", 10)
        self.assertTrue(b.created)
        self.assertEqual((b.numel, b.padded_numel, b.shard_numel), (10, 10, 10))
        for area, n in (("shard", 10), ("gather", 10), ("grad", 10), ("reduced", 10)):
            a = b.numpy(area)
            self.assertEqual(a.shape, (n,))
            self.assertEqual(a.dtype, np.float32)
            self.assertEqual(a.ctypes.data, b.address(area), area)  # no copy
            self.assertTrue(a.flags.writeable)
            self.assertEqual(len(b.memoryview(area)), 4 * n)
        self.assertTrue(np.all(b.shard == 0), "shards start zeroed")
        b.shard[:] = np.arange(10, dtype=np.float32)
        c.gather(b)
        np.testing.assert_array_equal(b.gather, np.arange(10, dtype=np.float32))
        b.grad[:] = 2.0
        c.scatter(b, "sum")
        np.testing.assert_array_equal(b.reduced, np.full(10, 2.0, np.float32))
        info = c.inspect(b)
        self.assertEqual(info["numel"], 10)
        self.assertEqual(c.inspect("flat")["id"], b.id)
        self.assertIn("flat", c.inspect(b, text=True))

    def test_gather_async_prefetch(self):
        c = self.client("prefetch")
        bufs = [c.register_buffer("layer%d" % i, "fp32", 100) for i in range(3)]
        for i, b in enumerate(bufs):
            b.shard[:] = np.arange(100, dtype=np.float32) + 1000 * i
        tickets = [c.gather_async(b) for b in bufs]  # the third waits for the first
        c.ping()
        for i, (b, t) in enumerate(zip(bufs, tickets)):
            c.wait(t)
            np.testing.assert_array_equal(b.gather, np.arange(100, dtype=np.float32) + 1000 * i)
        with self.assertRaises(shardd.Error) as cm:
            c.wait(tickets[0])
        self.assertEqual(cm.exception.code_name, "E_INVAL")

    def test_register_mismatch_is_error(self):
        c = self.client("mismatch")
        b = c.register_buffer("flat", "fp32", 10)
        b.shard[:] = 3.0
        self.assertIs(c.register_buffer("flat", "float32", 10), b)  # same mapping kept
        self.assertEqual(float(b.shard[9]), 3.0)
        with self.assertRaises(shardd.Error) as cm:
            c.register_buffer("flat", "fp32", 11)
        self.assertEqual(cm.exception.code_name, "E_MISMATCH")
        self.assertTrue(cm.exception.message)

    def test_views_and_step(self):
        c = self.client("views")
        b = c.register_buffer("flat", "fp32", 10)
        w = c.register_view(b, "w", 0, (2, 3))
        bias = c.register_view(b, "b", 6, (4,))
        self.assertEqual(w.numpy().shape, (2, 3))
        b.shard[:] = 1.0
        c.gather(b)
        np.testing.assert_array_equal(bias.numpy(), np.ones(4, np.float32))
        opt = c.register_optimizer("sgd", [{"params": [w, bias], "lr": 0.5}], name="sgd")
        self.assertGreater(opt.id, 0)
        b.grad[:] = 1.0
        c.scatter(b, "mean")
        res = c.step(opt, max_norm=100.0)
        self.assertEqual(res.step, 1)
        self.assertAlmostEqual(res.total_norm, 10 ** 0.5, places=5)
        c.gather(b)
        np.testing.assert_allclose(b.gather, np.full(10, 0.5, np.float32))
        c.scatter(b, "mean")  # a step consumes its gradient: the next needs a scatter
        res = opt.step(lr=0.25)  # lr override for this step
        self.assertEqual(res.step, 2)
        c.gather(b)
        np.testing.assert_allclose(b.gather, np.full(10, 0.25, np.float32))
        names = [o["name"] for j in c.status()["jobs"] if j["name"] == c.job
                 for o in j["optimizers"]]
        self.assertEqual(names, ["sgd"])

    def test_register_views_batch(self):
        c = self.client("vbatch")
        b = c.register_buffer("flat", "fp32", 20000)
        specs = [(b, "p%d" % i, 2 * i, (2,)) for i in range(9000)]
        specs.append((b, "frozen", 18000, (4, 2), False))
        vs = c.register_views(specs)
        self.assertEqual(len(vs), 9001)
        self.assertEqual(len({v.id for v in vs}), 9001)
        self.assertEqual([v.name for v in vs[:3]], ["p0", "p1", "p2"])
        self.assertFalse(vs[-1].requires_grad)
        self.assertEqual(vs[-1].shape, (4, 2))
        self.assertEqual(vs[5].offset, 10)
        # the single call attaches to what the batch made
        self.assertEqual(c.register_view(b, "p7", 14, (2,)).id, vs[7].id)
        b.shard[:] = 3.0
        c.gather(b)
        np.testing.assert_array_equal(vs[100].numpy(), np.full(2, 3.0, np.float32))
        # refused: every bad entry named, nothing kept
        bad = [(b, "q0", 0, (2,)), (b, "q1", 19999, (2,)), (b, "q2", 4, (3,)),
               (b, "q3", 18000, (2,))]  # q3: trainable on frozen elements
        with self.assertRaises(shardd.Error) as cm:
            c.register_views(bad)
        e = cm.exception
        self.assertEqual(e.code_name, "E_RANGE")
        self.assertEqual(e.errors, [(1, "E_RANGE"), (3, "E_OVERLAP")])
        self.assertIn("[1] E_RANGE", e.message)
        self.assertIn('"q3"', e.message)
        q0 = c.register_view(b, "q0", 0, (2,))
        self.assertEqual(q0.generation, 1)  # not kept by the refused batch
        # unregister in one call; then they are gone
        c.unregister_views(vs[:9000])
        with self.assertRaises(shardd.Error) as cm:
            c.unregister_view(vs[0])
        self.assertEqual(cm.exception.code_name, "E_NOT_FOUND")
        with self.assertRaises(shardd.Error) as cm:
            c.unregister_views([vs[-1], vs[1]])
        self.assertEqual(cm.exception.errors, [(1, "E_NOT_FOUND")])
        c.unregister_view(vs[-1])  # the refused call left it
        with self.assertRaises(ValueError):
            c.register_views([(b, "x", 0)])
        self.assertEqual(c.register_views([]), [])

    def test_gather_and_scatter_many(self):
        """Buckets on one rank: every buffer gathered and scattered as its
        own call would; a refused bucket names every bad entry (Error.errors)
        and runs none; a transient job refuses gather buckets."""
        c = self.client("bucketpy")
        bs = c.register_buffers([("k%d" % i, "fp32", 5 + i) for i in range(70)])
        for i, b in enumerate(bs):
            b.shard[:] = i + 0.5
            b.grad[:] = 2 * i
        c.gather_many(bs)
        for i, b in enumerate(bs):
            self.assertTrue(all(float(v) == i + 0.5 for v in b.gather[:b.numel]), i)
        c.scatter_many(bs, "sum", no_grad=[None] * 70)
        for i, b in enumerate(bs):
            self.assertTrue(all(float(v) == 2 * i for v in b.reduced), i)
        with self.assertRaises(shardd.Error) as cm:
            c.gather_many([bs[0], 123456789, bs[1], bs[0]])
        e = cm.exception
        self.assertEqual(e.code_name, "E_NOT_FOUND")
        self.assertEqual(e.errors, [(1, "E_NOT_FOUND"), (3, "E_DUPLICATE")])
        self.assertIn("[3] E_DUPLICATE", e.message)
        with self.assertRaises(ValueError):
            c.scatter_many(bs[:2], "sum", no_grad=[None])
        c.gather_many([])
        t = shardd.Client(self.sock, job=common.job("bucketpyt"), transient_areas=True)
        self.addCleanup(t.close)
        tb = t.register_buffers([("a", "fp32", 8), ("b", "fp32", 8)])
        with self.assertRaises(shardd.Error) as cm:
            t.gather_many(tb)
        self.assertEqual(cm.exception.code_name, "E_STATE")
        self.assertIn("transient areas", cm.exception.message)

    def test_register_buffers_batch(self):
        c = self.client("bbatch")
        first = c.register_buffer("pre", "fp32", 8)
        specs = [("b%d" % i, "fp32" if i % 2 else "bf16", 10 + i) for i in range(600)]
        specs.append(("pre", "fp32", 8))  # held already: the same object
        bs = c.register_buffers(specs)
        self.assertEqual(len(bs), 601)
        self.assertIs(bs[-1], first)
        self.assertEqual(len({b.id for b in bs}), 601)
        self.assertEqual([b.numel for b in bs[:3]], [10, 11, 12])
        # each buffer maps its own block: a value written to each shard
        # comes back in its own gather area
        for i, b in enumerate(bs[:600]):
            b.shard[:] = i
        for i in (0, 1, 299, 599):
            c.gather(bs[i])
            self.assertEqual(float(bs[i].gather[0]), float(i))
        # the single call attaches to what the batch made
        self.assertIs(c.register_buffer("b7", "fp32", 17), bs[7])
        # refused: every bad entry named, nothing kept
        bad = [("n0", "fp32", 4), ("n1", "fp32", 0), ("b3", "fp32", 99)]
        with self.assertRaises(shardd.Error) as cm:
            c.register_buffers(bad)
        e = cm.exception
        self.assertEqual(e.code_name, "E_RANGE")
        self.assertEqual(e.errors, [(1, "E_RANGE"), (2, "E_MISMATCH")])
        self.assertIn("[2] E_MISMATCH", e.message)
        n0 = c.register_buffer("n0", "fp32", 4)
        self.assertTrue(n0.created)
        self.assertEqual(n0.generation, 1)  # not kept by the refused batch
        c.unregister_buffers(bs[:600])
        with self.assertRaises(shardd.Error) as cm:
            c.unregister_buffer(bs[0].id)
        self.assertEqual(cm.exception.code_name, "E_NOT_FOUND")
        with self.assertRaises(shardd.Error) as cm:
            c.unregister_buffers([n0, bs[1].id])
        self.assertEqual(cm.exception.errors, [(1, "E_NOT_FOUND")])
        c.unregister_buffer(n0)  # the refused call left it
        with self.assertRaises(ValueError):
            c.register_buffers([("x", "fp32")])
        self.assertEqual(c.register_buffers([]), [])

    def test_frozen_view_lora(self):
        c = self.client("lora")
        b = c.register_buffer("flat", "fp32", 12)
        base = c.register_view(b, "base.weight", 0, (2, 4), requires_grad=False)
        lora = c.register_view(b, "lora.A", 8, (4,))
        self.assertFalse(base.requires_grad)
        self.assertTrue(lora.requires_grad)
        b.shard[:] = 1.0
        # torch accepts a frozen parameter in an optimizer and skips it
        opt = c.register_optimizer("sgd", [[base, lora]], name="both", lr=0.5)
        b.grad[:] = 2.0
        c.scatter(b, "sum")
        c.step(opt)
        c.gather(b)
        np.testing.assert_array_equal(b.gather[:8], np.ones(8, np.float32))  # frozen
        np.testing.assert_array_equal(b.gather[8:], np.zeros(4, np.float32))  # 1 - 0.5*2
        self.assertEqual(c.inspect(base)["steps"], 0)
        self.assertEqual(c.inspect(lora)["steps"], 1)
        # unfrozen, it is stepped from then on; a view without a gradient
        # (no_grad) is skipped
        c.set_requires_grad(base, True)
        self.assertTrue(base.requires_grad)
        self.assertTrue(c.inspect(base)["requires_grad"])
        c.scatter(b, "sum", no_grad=[lora])
        c.step(opt)
        c.gather(b)
        np.testing.assert_array_equal(b.gather[:8], np.zeros(8, np.float32))  # 1 - 0.5*2
        np.testing.assert_array_equal(b.gather[8:], np.zeros(4, np.float32))  # skipped
        self.assertEqual(c.inspect(base)["steps"], 1)
        self.assertEqual(c.inspect(lora)["steps"], 1)
        c.scatter(b, "sum", no_grad=True)  # nothing had a gradient: nothing moves
        c.step(opt)
        c.gather(b)
        np.testing.assert_array_equal(b.gather, np.zeros(12, np.float32))
        self.assertIn("steps 1", c.inspect(b, text=True))

    def test_refusal_names_the_ref(self):
        c = self.client("refuse")
        b = c.register_buffer("flat", "fp32", 8)
        v = c.register_view(b, "enc.weight", 0, (8,))
        with self.assertRaises(shardd.Error) as cm:
            c.register_optimizer("adamw", [[v, ("fc1.weight", 0)]])
        e = cm.exception
        self.assertEqual(e.code_name, "E_NOT_OWNED")
        self.assertIn('"fc1.weight"', e.message)
        self.assertIn("param group 0, ref 1", e.message)
        self.assertIn(e.message, str(e))

    def test_long_refusal_names_every_ref(self):
        """120 stray refs in one group, or 60 groups of a good view and a
        stray ref: the message lists every one, a whole line each (libshardd
        cut it at 2,047 bytes, about 30 refs, mid-line)."""
        c = self.client("refuse-long")
        b = c.register_buffer("flat", "fp32", 240)
        views = [c.register_view(b, "ok.%d" % k, 4 * k, (4,)) for k in range(60)]
        names = ["model.layers.%d.mlp.c_fc.weight" % i for i in range(120)]
        for groups, where in (
                ([[(n, 0) for n in names]], [(0, i) for i in range(120)]),
                ([[views[k], (names[k], 0)] for k in range(60)], [(k, 1) for k in range(60)])):
            with self.assertRaises(shardd.Error) as cm:
                c.register_optimizer("adamw", groups)
            lines = cm.exception.message.split("\n")
            want = ['param group %d, ref %d ("%s"): not a shardd buffer or view '
                    "(a tensor the daemon does not own)" % (g, r, names[i])
                    for i, (g, r) in enumerate(where)]
            self.assertEqual(lines, want)

    def test_inspect_of_a_view_names_the_optimizer_of_its_buffer(self):
        c = self.client("inspect-held")
        b = c.register_buffer("flat", "fp32", 16)
        v = c.register_view(b, "enc.weight", 4, (8,))
        self.assertIsNone(c.inspect(v)["optimizer"])
        opt = c.register_optimizer("sgd", [b], name="fsdp1", lr=0.1)
        self.assertEqual(c.inspect(v)["optimizer"], opt.id)
        self.assertEqual(c.inspect(b)["optimizer"], opt.id)
        self.assertIn("optimizer: %d\n" % opt.id, c.inspect("enc.weight", text=True))

    def test_bad_hyperparameter_is_error(self):
        c = self.client("hp")
        b = c.register_buffer("flat", "fp32", 4)
        with self.assertRaises(shardd.Error) as cm:
            c.register_optimizer("adam", [b], betas=(1.5, 0.999))
        self.assertEqual(cm.exception.code_name, "E_RANGE")
        self.assertIn("beta1", cm.exception.message)
        with self.assertRaises(ValueError):
            c.register_optimizer("adam", [b], bogus=1)

    def test_bad_arguments_are_refused_not_wrapped_or_ignored(self):
        # issue 20 item 12: each of these used to be silently wrong
        c = self.client("args")
        with self.assertRaises(ValueError):  # ctypes made it a 5-element buffer
            c.register_buffer("huge", "fp32", 2**64 + 5)
        with self.assertRaises(ValueError):
            c.register_buffer("neg", "fp32", -1)
        with self.assertRaises(ValueError):  # C cut the name at the NUL
            c.register_buffer("a\0b", "fp32", 4)
        self.assertEqual([b.name for b in c.buffers.values()], [])
        b = c.register_buffer("flat", "fp32", 4)
        with self.assertRaises(ValueError):
            c.register_view(b, "v", 2**64 + 1, (1,))
        opt = c.register_optimizer("sgd", [b], lr=0.1)
        b.numpy("grad")[:] = 1.0
        before = b.numpy("shard").copy()
        with self.assertRaises(ValueError):  # was a KeyError
            c.scatter(b, "max")
        c.scatter(b, "sum")
        for lr in (-1, -0.5, float("nan"), float("inf")):
            with self.assertRaises(ValueError):  # -1 was "the registered lr"
                c.step(opt, lr=lr)
        self.assertTrue((b.numpy("shard") == before).all(), "a refused step ran")
        c.step(opt, lr=0.5)
        self.assertTrue((b.numpy("shard") == before - 0.5).all())

    def test_scatter_sum_and_mean_two_ranks(self):
        job = common.job("reduce")

        def rank(r):
            with shardd.Client(self.sock, job=job, rank=r, world=2, transient_areas=False) as c:
                b = c.register_buffer("g", "fp32", 7)  # padded to 8
                self.assertEqual((b.padded_numel, b.shard_numel), (8, 4))
                b.grad[:] = r + 1.0
                c.scatter(b, "sum")
                s = np.array(b.reduced)
                c.scatter(b, "mean")
                return s, np.array(b.reduced)

        (s0, m0), (s1, m1) = run_ranks(2, rank)
        np.testing.assert_array_equal(s0, np.full(4, 3.0, np.float32))
        np.testing.assert_array_equal(s1[:3], np.full(3, 3.0, np.float32))
        np.testing.assert_array_equal(m0, np.full(4, 1.5, np.float32))
        np.testing.assert_array_equal(m1[:3], np.full(3, 1.5, np.float32))

    def test_zero_copy_across_processes(self):
        """Rank 0 writes its shard through numpy; after gather, rank 1 (another
        process) sees it in its own gather area; rank 1 reads via its mapping."""
        job = common.job("zerocopy")
        ctx = mp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        peer = ctx.Process(target=zero_copy_peer, args=(self.sock, job, 10, q_in, q_out))
        peer.start()
        try:
            with shardd.Client(self.sock, job=job, rank=0, world=2, transient_areas=False) as c:
                b = c.register_buffer("zc", "fp32", 10)
                msg = q_out.get(timeout=30)
                self.assertEqual(msg[0], "registered", msg)
                # rank 0 writes elements [0, 5) through a numpy view of its shard
                sh = b.shard
                self.assertEqual(sh.ctypes.data, b.address("shard"))
                sh[:] = np.arange(1, 6, dtype=np.float32) * 1.5
                # and the same memory is what ctypes sees
                raw = (ctypes.c_float * 5).from_address(b.address("shard"))
                self.assertEqual(raw[4], 7.5)
                c.gather(b)
                msg = q_out.get(timeout=30)
                self.assertEqual(msg[0], "gathered", msg)
                want = [1.5, 3.0, 4.5, 6.0, 7.5, 0, 0, 0, 0, 0]
                self.assertEqual(msg[1], want)
                self.assertEqual(b.gather.tolist(), want)
                q_in.put("bye")
        finally:
            peer.join(30)
            if peer.is_alive():
                peer.terminate()
        self.assertEqual(peer.exitcode, 0)

    def test_closed_client_raises(self):
        c = shardd.Client(self.sock, job=common.job("closed"), transient_areas=False)
        b = c.register_buffer("x", "fp32", 4)
        c.close()
        self.assertTrue(c.closed)
        with self.assertRaises(shardd.Error) as cm:
            c.gather(b)
        self.assertEqual(cm.exception.code_name, "E_CLOSED")
        with self.assertRaises(shardd.Error):
            b.numpy("shard")

    def test_restore_returns_the_job_name_with_its_step(self):
        """Client.restore -> the name as before (a str: equal to it, usable
        as a job name), with .step, the step the job resumes at (C's
        shardd_restore_ex; shardctl restore prints the same)."""
        import pickle
        import shutil
        import tempfile
        job = common.job("restore-step")
        c = shardd.Client(self.sock, job=job, transient_areas=False)
        b = c.register_buffer("flat", "fp32", 8)
        w = c.register_view(b, "w", 0, (8,))
        opt = c.register_optimizer("sgd", [{"params": [w], "lr": 0.1}], name="sgd")
        for _ in range(3):
            c.gather(b)
            b.grad[:] = 1.0
            c.scatter(b, "mean")
            c.step(opt)
        c.close(finished=False)  # the job lingers, nobody connected: released below
        tmp = tempfile.mkdtemp(prefix="shardd-restore-step-")
        self.addCleanup(shutil.rmtree, tmp, True)
        ck = os.path.join(tmp, "ck")
        ctl = shardd.Client(self.sock)
        self.addCleanup(ctl.close)
        ctl.checkpoint(ck, job=job, timeout=10)
        ctl.release_job(job)
        got = ctl.restore(ck)
        self.addCleanup(ctl.release_job, job)
        self.assertEqual(got, job)
        self.assertIsInstance(got, str)
        self.assertEqual(got.step, 3)
        self.assertIsInstance(got, shardd.RestoredJob)
        self.assertEqual(str(got), job)
        back = pickle.loads(pickle.dumps(got))
        self.assertEqual((back, back.step), (job, 3))
        names = [j["name"] for j in ctl.status()["jobs"]]
        self.assertIn(got, names)

    @unittest.skipUnless(os.geteuid() == 0, "needs root to act as a second uid")
    def test_restore_returns_another_uids_longest_job_name_whole(self):
        """Root restoring uid 4250's checkpoint is told "4250/NAME": with
        the longest name (255 bytes) 266 bytes, returned whole (it was cut
        at 255, a name no release_job finds)."""
        import shutil
        import tempfile
        d = common.own_daemon(devices=1, extra_args=["--job-linger", "600"])
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        os.chmod(os.path.dirname(d.socket), 0o755)
        os.chmod(d.socket, 0o666)
        name = "n" * 255
        # the other uid's side in a forked child of this process (shardd and
        # its library already loaded): a checkout that uid cannot read (a
        # clone in a mode-0700 mktemp folder) holds nothing it must import
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgid(4250)
                os.setuid(4250)
                c = shardd.Client(d.socket, job=name, transient_areas=False)
                c.register_buffer("x", "fp32", 8)
                c.close(finished=False)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        qualified = "4250/" + name
        tmp = tempfile.mkdtemp(prefix="shardd-restore-long-")
        self.addCleanup(shutil.rmtree, tmp, True)
        ck = os.path.join(tmp, "ck")
        ctl = shardd.Client(d.socket)
        self.addCleanup(ctl.close)
        ctl.checkpoint(ck, job=qualified, timeout=10)
        ctl.release_job(qualified)
        got = ctl.restore(ck)
        self.assertEqual(got, qualified)
        self.assertEqual(ctl.release_job(got), (1, 0))


if __name__ == "__main__":
    unittest.main()


class DtypeNamesTest(unittest.TestCase):
    """The binding accepts exactly the dtype names libshardd's one table
    does (shardd_dtype_parse), each to the same code, torch's spellings too."""

    NAMES = ["fp32", "float32", "float", "f32", "FP32", "bf16", "bfloat16",
             "BFloat16", "fp16", "float16", "half", "f16", "F16",
             "fp8", "int8", "float64", "", " fp32", "bf", "f"]

    def c_parse(self, name):
        code = ctypes.c_int(0)
        rc = shardd._lib.load().shardd_dtype_parse(name.encode(), ctypes.byref(code))
        return code.value if rc == 0 else None

    def py_parse(self, name):
        try:
            return shardd._dtype_code(name)
        except ValueError:
            return None

    def test_the_binding_accepts_what_libshardd_accepts(self):
        for name in self.NAMES:
            with self.subTest(name=name):
                self.assertEqual(self.py_parse(name), self.c_parse(name))
        self.assertEqual(self.py_parse("f32"), shardd.DTYPES["fp32"])
        self.assertEqual(self.py_parse("f16"), shardd.DTYPES["fp16"])

    def test_torch_dtypes_and_codes(self):
        self.assertEqual(self.py_parse("torch.bfloat16"), shardd.DTYPES["bf16"])
        self.assertEqual(self.py_parse("torch.float16"), shardd.DTYPES["fp16"])
        self.assertEqual(self.py_parse(shardd.DTYPES["bf16"]), shardd.DTYPES["bf16"])
        self.assertIsNone(self.py_parse("fp32\0junk"))
        self.assertIsNone(self.py_parse(99))


class LivenessTest(unittest.TestCase):
    """A stopped daemon (SIGSTOP) fails a call with E_TIMEOUT naming its
    socket within the client's timeout, instead of blocking forever."""

    def test_stopped_daemon_times_out_naming_the_socket(self):
        import signal
        import time
        d = common.own_daemon(devices=1)
        try:
            c = shardd.Client(d.socket, job=None, timeout=1)
            c.ping()
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with self.assertRaises(shardd.Error) as cm:
                    c.ping()
                took = time.monotonic() - t0
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            self.assertEqual(cm.exception.code_name, "E_TIMEOUT")
            self.assertIn("daemon at %s did not answer for 1 s" % d.socket,
                          str(cm.exception))
            self.assertLess(took, 20)
            c.ping()  # served again
            c.close()
            with self.assertRaises(ValueError):
                shardd.Client(d.socket, job=None, timeout=-1)
        finally:
            d.stop()
