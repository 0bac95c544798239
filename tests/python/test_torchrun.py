"""torchrun conventions: Client defaults from RANK / WORLD_SIZE / LOCAL_RANK /
TORCHELASTIC_RUN_ID, and the job collectives barrier() and all_reduce()
across real processes, checked against torch's own reductions."""
import json
import math
import os
import subprocess
import sys
import unittest
from unittest import mock

import common
import shardd

# One trainer process as torchrun would start it: only the environment says
# who it is. It prints one JSON line of what it saw and got.
TRAINER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import shardd
c = shardd.Client()  # everything from the environment
r = c.rank
vals = json.loads(os.environ["TEST_VALUES"])[r]
if r == 0:
    time.sleep(float(os.environ["TEST_LATE_S"]))
t_enter = time.time()
c.barrier()
out = {"job": c.job, "rank": c.rank, "world": c.world, "t_enter": t_enter,
       "t_after": time.time()}
for op in ("sum", "mean", "max", "min"):
    out[op] = c.all_reduce(vals, op=op)
out["loss"] = c.all_reduce(float(vals[0]), op="mean")
c.barrier()
c.close()
print(json.dumps(out))
"""

VALUES = [
    [1.0, -2.5, 1e-17, 7.0, 0.1],
    [0.1, 3.25, 1.0, -7.0, 0.2],
    [0.2, -0.75, -1.0, 7.5, 0.3],
]


class TorchrunTest(unittest.TestCase):
    def setUp(self):
        self.sock = common.socket()

    def test_env_defaults_barrier_and_all_reduce_match_torch(self):
        world = len(VALUES)
        job = common.job("torchrun")
        late = 0.5
        procs = []
        for r in range(world):
            env = dict(os.environ)
            env.update({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                        "TORCHELASTIC_RUN_ID": job, "SHARDD_SOCKET": self.sock,
                        "TEST_VALUES": json.dumps(VALUES), "TEST_LATE_S": str(late)})
            procs.append(subprocess.Popen(
                [sys.executable, "-c", TRAINER, os.path.join(common.REPO, "client", "python")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            so, se = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, se)
            outs.append(json.loads(so.strip().splitlines()[-1]))
        for r, o in enumerate(outs):
            self.assertEqual((o["job"], o["rank"], o["world"]), (job, r, world))
        # the barrier held the others until the late rank 0 came: none left
        # it before rank 0 entered it (an order, not a duration: the
        # processes start at their own pace on a loaded machine)
        for o in outs[1:]:
            self.assertGreaterEqual(o["t_after"], outs[0]["t_enter"], o)
        if not common.HAVE_TORCH:
            self.skipTest("torch is not importable")
        import torch
        t = torch.tensor(VALUES, dtype=torch.float64)
        ref = {"sum": t.sum(0), "mean": t.mean(0), "max": t.amax(0), "min": t.amin(0)}
        for op, want in ref.items():
            for r, o in enumerate(outs):
                got = torch.tensor(o[op], dtype=torch.float64)
                self.assertTrue(torch.allclose(got, want, rtol=1e-15, atol=0),
                                "%s rank %d: %s vs torch %s" % (op, r, o[op], want.tolist()))
                # every rank the same bits, the rank-order fold
                self.assertEqual(o[op], outs[0][op])
        seq = [(VALUES[0][i] + VALUES[1][i]) + VALUES[2][i] for i in range(len(VALUES[0]))]
        self.assertEqual(outs[0]["sum"], seq)
        self.assertEqual(outs[0]["loss"], ((VALUES[0][0] + VALUES[1][0]) + VALUES[2][0]) / 3)

    def test_explicit_arguments_win_and_none_is_a_control_session(self):
        env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
               "TORCHELASTIC_RUN_ID": common.job("envjob")}
        with mock.patch.dict(os.environ, env):
            self.assertEqual(shardd.torchrun_defaults(), (env["TORCHELASTIC_RUN_ID"], 1, 2))
            with shardd.Client(self.sock, job=None) as c:
                self.assertIsNone(c.job)
                self.assertIsInstance(c.status(), dict)
            job = common.job("explicit")
            with shardd.Client(self.sock, job=job, rank=0, world=1, transient_areas=False) as c:
                self.assertEqual((c.job, c.rank, c.world), (job, 0, 1))
                self.assertEqual(c.all_reduce([2.0, -1.0], op="max"), [2.0, -1.0])
                c.barrier()

    def test_local_rank_when_rank_is_unset(self):
        env = {"LOCAL_RANK": "2", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("RANK", None)
            self.assertEqual(shardd.torchrun_defaults(), ("x", 2, 4))

    def test_bad_environment_is_refused_naming_the_variable(self):
        with mock.patch.dict(os.environ, {"RANK": "one", "WORLD_SIZE": "2",
                                          "TORCHELASTIC_RUN_ID": "j"}):
            with self.assertRaisesRegex(ValueError, r"\$RANK='one'"):
                shardd.Client(self.sock)
        with mock.patch.dict(os.environ, {"RANK": "2", "WORLD_SIZE": "2",
                                          "TORCHELASTIC_RUN_ID": common.job("bad")}):
            with self.assertRaisesRegex(ValueError, r"rank 2 is outside world 2"):
                shardd.Client(self.sock)
        with mock.patch.dict(os.environ, {"WORLD_SIZE": "0"}):
            with self.assertRaisesRegex(ValueError, r"\$WORLD_SIZE=0"):
                shardd.Client(self.sock)

    def test_all_reduce_refusals(self):
        with shardd.Client(self.sock, job=common.job("arlim"), rank=0, world=1,
                           transient_areas=False) as c:
            with self.assertRaisesRegex(ValueError, "at most 64"):
                c.all_reduce([1.0] * 65)
            with self.assertRaisesRegex(ValueError, "all_reduce op 'prod'"):
                c.all_reduce(1.0, op="prod")
            self.assertEqual(c.all_reduce(3.5, op="mean"), 3.5)
            self.assertTrue(math.isnan(c.all_reduce(float("nan"))))



def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TorchrunExampleTest(unittest.TestCase):
    # torchrun's elastic agent throws a C++ exception in a thread of its own
    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_the_torchrun_example_matches_single_process_torch(self):
        """examples/train_torchrun.py, the FSDP script ported (AdamW, LambdaLR,
        clipping, accumulation under no_sync, an eval and a full state dict
        saved), on 2 ranks under the installed torch's own torchrun, against
        the same script as one plain torch process on the global batch."""
        import shutil
        import tempfile
        script = os.path.join(common.REPO, "examples", "train_torchrun.py")
        tmp = tempfile.mkdtemp(prefix="shardd-torchrun-")
        self.addCleanup(shutil.rmtree, tmp, True)
        flags = ["--steps", "6", "--ckpt-every", "4", "--eval-every", "3",
                 "--ckpt-dir", tmp]
        ref = subprocess.run([sys.executable, script, "--ref", "--out",
                              os.path.join(tmp, "ref.json")] + flags,
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(ref.returncode, 0, ref.stderr)
        env = dict(os.environ, SHARDD_SOCKET=common.socket())
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:%d" % free_port(),
             "--rdzv_id", common.job("torchrun-example"),
             "--redirects", "2", "--tee", "2",  # Debian 12's torchrun needs them named
             script, "--out", os.path.join(tmp, "shardd.json")] + flags,
            capture_output=True, text=True, timeout=240, env=env)
        self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-3000:])
        with open(os.path.join(tmp, "ref.json")) as f:
            want = json.load(f)
        with open(os.path.join(tmp, "shardd.json")) as f:
            got = json.load(f)
        self.assertEqual([r["step"] for r in got], list(range(6)))
        for g, w in zip(got, want):
            for k in ("loss", "gnorm", "val"):
                self.assertEqual(k in g, k in w, (k, g, w))
                if k in w:
                    self.assertLessEqual(abs(g[k] - w[k]) / abs(w[k]), 1e-5, (k, g, w))
        self.assertTrue(os.path.exists(os.path.join(tmp, "shardd", "model.pt")))
        for r in range(2):
            self.assertTrue(os.path.exists(os.path.join(tmp, "shardd", "optim-r%d.pt" % r)))

if __name__ == "__main__":
    unittest.main()
