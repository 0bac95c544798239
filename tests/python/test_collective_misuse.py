"""Collective misuse fails fast and says what, on every rank: a collective
only some ranks call (sm.state_dict() on rank 0 only) fails within the
daemon's --peer-grace naming the ranks that did not call it, instead of
waiting for --collective-timeout; ranks that built different models
(other seeds) all get E_MISMATCH, not a lost peer on some."""
import time
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import shardd.nn
    import models

GRACE = 0.5
TIMEOUT = 30  # the test daemon's --collective-timeout


def partial_main(rank, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=2)
        sm = shardd.nn.ShardedModule(client, models.mlp(), auto_wrap="children")
        t0 = time.monotonic()
        try:
            if rank == 0:
                sm.state_dict()  # a collective, on rank 0 only
            else:
                client.barrier()  # rank 1 goes on to its next collective
            q.put(("result", rank, "OK", "", time.monotonic() - t0))
        except shardd.Error as e:
            q.put(("result", rank, e.code_name, e.message, time.monotonic() - t0))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def seeded_main(rank, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=2)
        try:
            # rank r seeds r: the ranks build different models
            torch.manual_seed(rank)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 4))
            sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
            opt = sm.register_optimizer("adamw", model.parameters(), lr=1e-3)
            for _ in range(2):
                sm.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                sm.step(opt)
            q.put(("result", rank, "OK", ""))
        except shardd.Error as e:
            q.put(("result", rank, e.code_name, e.message))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class CollectiveMisuseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = common.own_daemon(devices=2, extra_args=["--peer-grace", str(GRACE)])

    @classmethod
    def tearDownClass(cls):
        cls.d.cleanup()

    def run_ranks(self, main):
        got, job = {}, common.job("misuse")
        common.launch_ranks(main, lambda r, q: (r, self.d.socket, job, q),
                            2, lambda m: got.__setitem__(m[1], m[2:]), timeout=TIMEOUT + 30)
        return got

    def test_a_collective_only_rank_0_calls_fails_within_the_grace_naming_rank_1(self):
        got = self.run_ranks(partial_main)
        code, msg, waited = got[0]
        print("\n  state_dict() on rank 0 only: %s after %.2f s: %s" % (code, waited, msg))
        self.assertEqual(code, "E_MISMATCH", msg)
        self.assertIn("not by rank(s) 1", msg)
        self.assertIn("rank 1 waits in all_reduce", msg)
        self.assertLess(waited, GRACE + 2.0, "failed within the grace, not the timeout")
        code1, msg1, _ = got[1]
        self.assertEqual(code1, "E_MISMATCH", msg1)
        self.assertIn("not by rank(s) 0", msg1)

    def test_ranks_seeded_differently_all_get_e_mismatch(self):
        got = self.run_ranks(seeded_main)
        print("\n  seeds 0 and 1: %s" % {r: v[0] for r, v in got.items()})
        for r in (0, 1):
            code, msg = got[r]
            self.assertEqual(code, "E_MISMATCH", "rank %d: %s" % (r, msg))
            self.assertIn("initial values differ", msg, "rank %d" % r)


if __name__ == "__main__":
    unittest.main()
