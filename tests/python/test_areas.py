"""Transient areas through the binding: Client(transient_areas=True),
gather_area() tensors over the leased pool areas, release(), the lease limit,
and the arguments refused before anything is sent."""
import os
import signal
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch

NUMEL = 1000


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TransientAreasTest(unittest.TestCase):
    def setUp(self):
        self.sock = common.socket()
        self.c = shardd.Client(self.sock, job=common.job("areas"), rank=0, world=1,
                               transient_areas=True)
        self.addCleanup(self.c.close)

    def filled(self, name, base=0.0):
        b = self.c.register_buffer(name, "fp32", NUMEL)
        b.shard_tensor.copy_(torch.arange(NUMEL, dtype=torch.float32) + base)
        return b

    def test_a_transient_buffer_has_no_whole_areas(self):
        self.assertTrue(self.c.transient_areas)
        b = self.filled("w")
        self.assertTrue(b.transient)
        self.assertEqual(b.address("gather"), None)
        for area in ("gather", "grad"):
            with self.assertRaises(shardd.Error) as cm:
                b.tensor(area)
            self.assertEqual(cm.exception.code_name, "E_STATE")
            self.assertIn("gather_area", cm.exception.message)
        with self.assertRaises(shardd.Error):
            b.gather_tensor
        with self.assertRaises(shardd.Error):
            b.grad  # numpy too
        # the shard and the reduced shard are in the block as ever
        self.assertEqual(b.shard_tensor.numel(), NUMEL)
        self.assertEqual(b.reduced_tensor.numel(), NUMEL)

    def test_the_gathered_tensor_is_read_only(self):
        """On the host backend the gather area is the node's one copy, which
        every local rank reads: the tensor over it cannot be written (a
        store faults, here in a forked child), the gradient area can."""
        b = self.filled("w", 0.5)
        g, gr = self.c.gather_area(b, want_grad=True)
        gr[0] = 3.0  # this rank's own
        pid = os.fork()
        if pid == 0:  # no test machinery in the child: it faults or exits 0
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            g[0] = -1.0
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        self.assertTrue(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV,
                        "a write to the gathered tensor did not fault (status %#x)" % status)
        self.assertEqual(g[0].item(), 0.5)
        self.c.release_all(b)

    def test_gather_scatter_release(self):
        b = self.filled("w", 0.5)
        g, gr = self.c.gather_area(b)
        self.assertIsNone(gr)
        self.assertEqual(g.numel(), b.padded_numel)
        self.assertEqual(g.dtype, torch.float32)
        torch.testing.assert_close(g[:NUMEL], b.shard_tensor, rtol=0, atol=0)
        self.c.release(b)
        # backward's re-gather: a zeroed gradient area, consumed by the scatter
        g, gr = self.c.gather_area(b.id, want_grad=True)
        self.assertNotEqual(g.data_ptr(), gr.data_ptr())
        self.assertTrue(torch.all(gr == 0))
        torch.testing.assert_close(g[:NUMEL], b.shard_tensor, rtol=0, atol=0)
        gr.copy_(torch.arange(NUMEL, dtype=torch.float32) * 2)
        self.c.scatter(b, "mean")
        torch.testing.assert_close(b.reduced_tensor,
                                   torch.arange(NUMEL, dtype=torch.float32) * 2,
                                   rtol=0, atol=0)
        self.c.release(b)
        with self.assertRaises(shardd.Error) as cm:
            self.c.release(b)
        self.assertEqual(cm.exception.code_name, "E_STATE")
        # the pool is mapped once: a later gather hands out tensors over it
        # again (the same tensor for the same slot)
        g2, _ = self.c.gather_area(b)
        g3, _ = self.c.gather_area(b)  # held: kept, gathered again
        self.assertEqual(g2.data_ptr(), g3.data_ptr())
        self.c.release(b)
        job = [j for j in self.c.status()["jobs"] if j["name"] == self.c.job][0]
        self.assertTrue(job["transient"])
        self.assertEqual(job["bytes"], job["pool_bytes"] + job["persistent_bytes"])

    def test_a_third_gather_is_refused_naming_what_is_held(self):
        bufs = [self.filled("l%d" % i, 10.0 * i) for i in range(3)]
        for b in bufs[:2]:
            self.c.gather_area(b)
        with self.assertRaises(shardd.Error) as cm:
            self.c.gather_area(bufs[2])
        self.assertEqual(cm.exception.code_name, "E_LIMIT")
        self.assertIn("l0", cm.exception.message)
        self.assertIn("l1", cm.exception.message)
        self.c.release(bufs[0])
        g, _ = self.c.gather_area(bufs[2])
        torch.testing.assert_close(g[:NUMEL], bufs[2].shard_tensor, rtol=0, atol=0)
        self.c.release(bufs[1])
        self.c.release(bufs[2])

    def test_async_gather_and_wait_area(self):
        b = self.filled("a", 3.0)
        t = self.c.gather_async(b)
        g, gr = self.c.wait_area(t, b)
        self.assertIsNone(gr)
        torch.testing.assert_close(g[:NUMEL], b.shard_tensor, rtol=0, atol=0)
        self.c.release(b)

    def test_arguments_are_checked(self):
        b = self.filled("w")
        with self.assertRaises(TypeError):
            self.c.gather_area(b, want_grad="yes")
        with self.assertRaises(ValueError):
            self.c.gather_area(b.id + 1000)
        with self.assertRaises(TypeError):
            self.c.release(self.c.register_view(b, "v", 0, (2,)))
        with self.assertRaises(TypeError):
            shardd.Client(self.sock, job=common.job("areas"), transient_areas="yes")
        other = shardd.Client(self.sock, job=common.job("areas"), transient_areas=True)
        self.addCleanup(other.close)
        ob = other.register_buffer("w", "fp32", 10)
        with self.assertRaises(ValueError):
            self.c.gather_area(ob)
        self.c.close()
        with self.assertRaises(shardd.Error) as cm:
            self.c.gather_area(b)
        self.assertEqual(cm.exception.code_name, "E_CLOSED")

    def test_a_resident_rank_cannot_join_a_transient_job(self):
        job = common.job("mixed")
        c0 = shardd.Client(self.sock, job=job, rank=0, world=2, transient_areas=True)
        self.addCleanup(c0.close)
        c0.register_buffer("x", "fp32", 64)
        with self.assertRaises(shardd.Error) as cm:
            shardd.Client(self.sock, job=job, rank=1, world=2, transient_areas=False)
        self.assertEqual(cm.exception.code_name, "E_MISMATCH")

    def test_the_default_is_fsdps_full_shard_and_resident_is_opt_in(self):
        """A plain Client is FULL_SHARD (transient areas), as FSDP's default;
        resident areas are asked for under FSDP's names or shardd's."""
        def made(**kw):
            c = shardd.Client(self.sock, job=common.job("model"), rank=0, world=1, **kw)
            self.addCleanup(c.close)
            return c.transient_areas, c.register_buffer("w", "fp32", 8).transient
        self.assertEqual(made(), (True, True))
        self.assertEqual(made(reshard_after_forward=False), (False, False))
        self.assertEqual(made(sharding_strategy="SHARD_GRAD_OP"), (False, False))
        self.assertEqual(made(sharding_strategy="FULL_SHARD"), (True, True))
        self.assertEqual(made(transient_areas=False), (False, False))
        with self.assertRaises(ValueError) as cm:
            made(reshard_after_forward=True, sharding_strategy="SHARD_GRAD_OP")
        self.assertIn("conflicting", str(cm.exception))
        with self.assertRaises(ValueError):
            made(sharding_strategy="NO_SHARD")
        with self.assertRaises(TypeError):
            made(reshard_after_forward="no")


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ResidentGatherAreaTest(unittest.TestCase):
    def test_resident_areas_are_the_blocks(self):
        c = shardd.Client(common.socket(), job=common.job("res"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        self.assertFalse(c.transient_areas)
        b = c.register_buffer("w", "fp32", 100)
        self.assertFalse(b.transient)
        b.shard_tensor.fill_(2.0)
        g, gr = c.gather_area(b, want_grad=True)
        self.assertEqual(g.data_ptr(), b.address("gather"))
        self.assertEqual(gr.data_ptr(), b.address("grad"))
        self.assertTrue(torch.all(b.gather_tensor == 2.0))
        with self.assertRaises(shardd.Error) as cm:
            c.release(b)
        self.assertEqual(cm.exception.code_name, "E_STATE")


if __name__ == "__main__":
    unittest.main()
