"""Job identity cannot mix runs: a run whose ranks all close() is finished
(the daemon frees its job at once, and a rerun under its name starts
fresh); a run whose ranks were killed (kill -9) lingers, and its relaunch
resumes it and says so on every rank; torchrun's TORCHELASTIC_RUN_ID=none
never becomes a shared job name."""
import os
import re
import time
import signal
import unittest
import warnings
from unittest import mock

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import shardd.nn
    import shardd.optim
    import models

STEPS = 3
WORLD = 2


def rank_main(rank, sock, job, end, q):
    """STEPS AdamW steps on the nested MLP; end "finish": close(), "kill":
    SIGKILL itself (no close: the connection just drops)."""
    try:
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            client = shardd.Client(sock, job=job, rank=rank, world=WORLD)
        told = [str(w.message) for w in ws if issubclass(w.category, shardd.ResumedJobWarning)]
        model = models.mlp()
        shardd.nn.ShardedModule(client, model, auto_wrap="module")
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-2, name="adamw")
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        q.put(("run", rank, client.resumed_step, told, losses))
        if end == "finish":
            client.close()
            q.put(("done", rank))
            return
        q.put(("done", rank))
        q.close()
        q.join_thread()  # the messages are out before the kill
        os.kill(os.getpid(), signal.SIGKILL)
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class JobIdentityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # a linger no test outlasts: only a finished job may go
        cls.d = common.own_daemon(devices=2, extra_args=["--job-linger", "600"])

    @classmethod
    def tearDownClass(cls):
        cls.d.cleanup()

    def run_ranks(self, job, end):
        got = {}
        common.launch_ranks(rank_main, lambda r, q: (r, self.d.socket, job, end, q), WORLD,
                            lambda m: got.__setitem__(m[1], m[2:]), timeout=120)
        return got

    def jobs(self):
        with shardd.Client(self.d.socket, job=None) as ctl:
            return [j["name"] for j in ctl.status()["jobs"]]

    def test_a_finished_run_is_released_and_a_rerun_starts_fresh(self):
        job = common.job("finished")
        first = self.run_ranks(job, "finish")
        for _ in range(50):  # the closes are read after the last replies
            if job not in self.jobs():
                break
            time.sleep(0.05)
        self.assertNotIn(job, self.jobs(), "a finished job lingered")
        again = self.run_ranks(job, "finish")
        for r in range(WORLD):
            step, told, losses = again[r]
            self.assertIsNone(step, "rank %d: a rerun was told it resumes" % r)
            self.assertEqual(told, [])
            self.assertEqual(losses, first[r][2], "rank %d: the rerun did not start "
                             "fresh (the finished run's weights)" % r)

    def test_a_killed_run_lingers_and_its_relaunch_resumes_saying_so(self):
        job = common.job("killed")
        first = self.run_ranks(job, "kill")
        self.assertIn(job, self.jobs(), "a killed run's job went")
        again = self.run_ranks(job, "finish")
        print("\n  relaunch after kill -9: %s" % again[0][1])
        for r in range(WORLD):
            step, told, losses = again[r]
            self.assertEqual(step, STEPS, "rank %d" % r)
            self.assertEqual(len(told), 1, "rank %d: not told it resumes" % r)
            self.assertIn("resuming job %r at step %d" % (job, STEPS), told[0])
            self.assertNotEqual(losses[0], first[r][2][0], "rank %d: did not resume" % r)


class TorchrunRunIdTest(unittest.TestCase):
    def test_torchrun_run_id_none_is_refused_not_a_shared_job(self):
        """torchrun without --rdzv_id sets TORCHELASTIC_RUN_ID=none for every
        launch: as a job name a rerun would continue the previous run."""
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
               "TORCHELASTIC_RUN_ID": "none"}
        with mock.patch.dict(os.environ, env):
            with self.assertRaises(ValueError) as cm:
                shardd.Client(common.socket())
        msg = str(cm.exception)
        self.assertIn("TORCHELASTIC_RUN_ID", msg)
        self.assertIn("job=", msg)
        # the flag it names is one this torch's torchrun takes (1.13 knows
        # only --rdzv_id; 2.x takes --rdzv-id too)
        flag = re.search(r"(--rdzv\S*?)=RUN_ID", msg).group(1)
        self.assertEqual(flag, "--rdzv_id")
        if common.HAVE_TORCH:
            from torch.distributed.run import get_args_parser
            args = get_args_parser().parse_args([flag + "=r1", "t.py"])
            self.assertEqual(args.rdzv_id, "r1")
        with mock.patch.dict(os.environ, env):  # an explicit job is taken
            c = shardd.Client(common.socket(), job=common.job("explicit"), rank=0, world=1)
            self.assertIsNone(c.resumed_step)
            c.close()


if __name__ == "__main__":
    unittest.main()
