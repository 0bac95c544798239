"""examples/train_gpt.py: a tied-embedding GPT over 2 ranks (transient areas,
shardd.optim.AdamW with a no-decay group, warmup + cosine LambdaLR,
FSDP's clip_grad_norm_, 2 backwards per step) against one process of
torch.optim.AdamW on the global batch with the same recipe: losses and
gradient norms rel <= 1e-5 (fp32). A run whose ranks are all killed (-9)
mid-run, relaunched unchanged, and a run restored from a daemon
checkpoint into a fresh daemon both continue bit-identically to the
uninterrupted run."""
import math
import os
import signal
import subprocess
import sys
import tempfile
import unittest

import common

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import train_gpt

STEPS = 12
TOL = 1e-5
# parameters: max|a-b| over the model / max|b| (measured 5e-6). Not per
# tensor: Adam turns the summation-order noise of a near-zero gradient
# element into a visible share of a small bias's few-1e-3 values (measured
# up to 9e-5 per tensor, 4e-7 absolute) while losses agree to 1e-7.
PARAM_TOL = 1e-4
BF16_TOL = 1e-3  # --bf16's losses against torch's mixed precision (measured 1.5e-4)
ARGS = ["--ranks", "2", "--steps", str(STEPS), "--accum", "2", "--warmup", "3"]


def reference(cfg):
    """Plain torch, one process, the global batch; the k-th backward of a
    step over the k-th micro-batch of every rank's slice (so the ranks'
    micro-batches and the reference's hold the same sequences)."""
    torch.set_num_threads(1)
    model = train_gpt.make_model(cfg)
    tok = train_gpt.make_data(cfg)
    opt = torch.optim.AdamW(train_gpt.param_groups(model, cfg), lr=cfg.lr,
                            betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train_gpt.lr_lambda(cfg))
    per, mb = cfg.batch // cfg.ranks, cfg.batch // cfg.ranks // cfg.accum
    losses, norms, lrs = [], [], []
    for s in range(cfg.steps):
        opt.zero_grad()
        total = 0.0
        for k in range(cfg.accum):
            rows = [r * per + k * mb + i for r in range(cfg.ranks) for i in range(mb)]
            x = tok[s][rows]
            logits = model(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab),
                                               x[:, 1:].reshape(-1)) / cfg.accum
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(total)
    return losses, norms, lrs, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def rel_params(got, want):
    """-> (max|a-b| over the model / max|b|, the worst tensor's own ratio)."""
    diff = top = tensor = 0.0
    for n, b in want.items():
        d = float(np.abs(got[n].astype(np.float64) - b.astype(np.float64)).max())
        m = float(np.abs(b).max())
        diff, top = max(diff, d), max(top, m)
        tensor = max(tensor, d / max(m, 1e-30))
    return diff / top, tensor


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TrainGPTTest(unittest.TestCase):
    _runs = {}

    def cfg(self, *extra):
        return train_gpt.parser().parse_args(ARGS + list(extra))

    def uninterrupted(self):
        """The 2-rank run never interrupted (shared by the tests)."""
        if "full" not in self._runs:
            self._runs["full"] = train_gpt.run(self.cfg(), common.socket(),
                                               log=lambda *a: None, timeout=120)
        return self._runs["full"]

    def assert_continues(self, got, label):
        """got's steps from its start on, and its final parameters, are the
        uninterrupted run's, bit for bit."""
        full = self.uninterrupted()
        start = got["start"]
        self.assertGreater(start, 0, label)
        self.assertLess(start, STEPS, label)
        self.assertTrue(all(v is None for v in got["losses"][:start]), label)
        for s in range(start, STEPS):
            self.assertEqual(got["losses"][s], full["losses"][s], "%s: step %d's loss" % (label, s))
            self.assertEqual(got["norms"][s], full["norms"][s], "%s: step %d's norm" % (label, s))
            self.assertEqual(got["lrs"][s], full["lrs"][s], "%s: step %d's lr" % (label, s))
        self.assertEqual(sorted(got["params"]), sorted(full["params"]))
        for n, v in full["params"].items():
            np.testing.assert_array_equal(got["params"][n], v, err_msg="%s: %s" % (label, n))

    def test_two_ranks_equal_torch_on_the_global_batch(self):
        cfg = self.cfg()
        res = self.uninterrupted()
        losses, norms, lrs, params = reference(cfg)
        lr_, nr = rel(res["losses"], losses), rel(res["norms"], norms)
        pr, pt = rel_params(res["params"], params)
        print("\n  2 ranks vs torch: max relative difference: losses %.3g, grad norms %.3g, "
              "parameters %.3g (worst tensor %.3g); loss %.4f -> %.4f; wall %.1fs"
              % (lr_, nr, pr, pt, res["losses"][0], res["losses"][-1], res["wall_s"]))
        # the recipe is what the test means: one unit per block, the tied
        # weight in the root's unit, clipping active, the schedule's shape
        self.assertEqual([u[0] for u in res["units"]], ["wpe", "h0", "h1", "ln_f", "root"])
        self.assertEqual(sorted(res["params"]), sorted(params))
        self.assertNotIn("lm_head.weight", params)  # tied: one parameter, wte.weight
        self.assertTrue(any(n > cfg.clip for n in norms), "clipping is exercised")
        self.assertAlmostEqual(lrs[2], cfg.lr, places=12)  # end of warmup
        self.assertLess(lrs[-1], 0.5 * cfg.lr)             # down the cosine
        self.assertEqual(res["lrs"], lrs)
        self.assertLessEqual(lr_, TOL)
        self.assertLessEqual(nr, TOL)
        self.assertLessEqual(pr, PARAM_TOL)
        self.assertLess(res["losses"][-1], 0.9 * res["losses"][0], "it trains")

    def test_bf16_with_an_fp32_master_tracks_torch_mixed_precision(self):
        """--bf16 over 2 ranks against one process of torch.optim.AdamW
        over fp32 master weights copied into a bf16 model each step
        (gradients accumulated in fp32). Losses rel <= BF16_TOL (measured
        1.5e-4; grad norms 1.4e-2, parameters 7.6e-3 of the largest): the
        ranks' bf16 gradients of their slices round otherwise than the
        global batch's. One rank without clipping is torch's exactly, every
        loss and every parameter bit over all the steps: the master starts
        from the exact fp32 values (from their bf16 rounding, step 1 would
        differ) and the host AdamW fuses the multiply-adds torch's CPU
        kernels fuse (before it did not, and that 1-2 ulp difference
        flipped bf16 roundings from step 5 on)."""
        cfg = self.cfg("--bf16")
        res = train_gpt.run(cfg, common.socket(), log=lambda *a: None, timeout=120)
        losses, norms, lrs, params = train_gpt.reference_train(cfg)
        lr_, nr = rel(res["losses"], losses), rel(res["norms"], norms)
        pr, pt = rel_params(res["params"], params)
        print("\n  bf16, 2 ranks vs torch mixed precision: losses %.3g, grad norms %.3g, "
              "parameters %.3g (worst tensor %.3g)" % (lr_, nr, pr, pt))
        for v in res["params"].values():  # bf16 values
            t = torch.from_numpy(v)
            self.assertTrue(torch.equal(t.bfloat16().float(), t))
        self.assertEqual(res["lrs"], lrs)
        self.assertLessEqual(lr_, BF16_TOL)
        self.assertLessEqual(nr, 0.1)
        self.assertLessEqual(pr, 0.1)
        self.assertLess(res["losses"][-1], 0.9 * res["losses"][0], "it trains")
        one = train_gpt.parser().parse_args(["--ranks", "1", "--steps", str(STEPS),
                                             "--accum", "1", "--warmup", "3", "--bf16",
                                             "--clip", "inf"])
        got = train_gpt.run(one, common.socket(), log=lambda *a: None, timeout=120)
        want, _, _, want_params = train_gpt.reference_train(one)
        print("  bf16, 1 rank, no clipping, %d steps: losses rel %.3g, parameters %.3g"
              % (STEPS, rel(got["losses"], want), rel_params(got["params"], want_params)[0]))
        self.assertEqual(got["losses"], want)
        self.assertEqual(sorted(got["params"]), sorted(want_params))
        for k, v in want_params.items():
            a, b = (np.ascontiguousarray(x, dtype=np.float32)
                    for x in (got["params"][k], v))
            self.assertTrue(np.array_equal(a.view(np.uint32), b.view(np.uint32)), k)

    def test_no_decay_group_is_biases_and_norms(self):
        cfg = self.cfg()
        model = train_gpt.make_model(cfg)
        names = {id(p): n for n, p in model.named_parameters()}
        decay, no_decay = (sorted(names[id(p)] for p in g["params"])
                           for g in train_gpt.param_groups(model, cfg))
        self.assertEqual(len(decay) + len(no_decay), len(names))
        self.assertTrue(all(n.endswith("bias") or ".ln" in n or n.startswith("ln_f")
                            for n in no_decay), no_decay)
        self.assertTrue(all(n.endswith("weight") and ".ln" not in n and
                            not n.startswith("ln_f") for n in decay), decay)
        self.assertIn("wte.weight", decay)

    def test_kill_every_rank_mid_run_then_relaunch(self):
        self.uninterrupted()
        cfg = self.cfg()
        cfg.job = common.job("gpt-kill")
        procs = []

        def kill(s):
            if s == 3:  # the ranks are somewhere in step 4 or 5 now
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)

        with self.assertRaisesRegex(RuntimeError, "exited with -9"):
            train_gpt.run(cfg, common.socket(), log=lambda *a: None, timeout=120,
                          on_start=procs.extend, on_step=kill)
        again = train_gpt.run(cfg, common.socket(), log=lambda *a: None, timeout=120)
        print("\n  kill -9 of 2 ranks after step 3: relaunched at step %d" % again["start"])
        self.assertGreaterEqual(again["start"], 4)
        self.assert_continues(again, "relaunch after kill -9")

    def test_checkpoint_then_restore_into_a_fresh_daemon_cli(self):
        """--checkpoint-every in one daemon, then docs/nn.md's command:
        --start-daemon --restore (another daemon) continues the job."""
        full = self.uninterrupted()
        d = tempfile.mkdtemp(prefix="shardd-gpt-")
        self.addCleanup(subprocess.run, ["rm", "-rf", d])
        os.chmod(d, 0o755)
        ck = os.path.join(d, "ck")
        os.mkdir(ck)
        d1 = common.own_daemon(devices=2, extra_args=["--checkpoint-root", ck])
        self.addCleanup(d1.cleanup)
        self.addCleanup(d1.stop)
        cfg = self.cfg("--checkpoint-every", "5", "--checkpoint-dir", ck)
        lines = []
        first = train_gpt.run(cfg, d1.socket, log=lines.append, timeout=120)
        self.assertEqual(first["checkpoints"], [os.path.join(ck, "step-000005"),
                                                os.path.join(ck, "step-000010")])
        self.assertIn("checkpoint after step 5: %s/step-000005" % ck, lines)
        # checkpointing does not change the run
        self.assertEqual(first["losses"], full["losses"])
        d1.stop()

        out = os.path.join(d, "out.npz")
        script = os.path.join(common.REPO, "examples", "train_gpt.py")
        p = subprocess.run([sys.executable, script] + ARGS +
                           ["--restore", os.path.join(ck, "step-000005"), "--start-daemon",
                            "--out", out, "--timeout", "120"],
                           capture_output=True, text=True, timeout=150)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("resuming at step 5", p.stdout)
        # said once, not again per rank as "a new run needs a job name of its own"
        self.assertNotIn("ResumedJobWarning", p.stderr)
        self.assertRegex(p.stdout, r"step +5  loss \d+\.\d+  tokens/s +\d+  lr \d\.\d+e-\d+")
        z = np.load(out)
        again = {k: [None if math.isnan(v) else float(v) for v in z[k]]
                 for k in ("losses", "norms", "lrs")}
        again["start"] = int(z["start"])
        again["params"] = {k[6:]: z[k] for k in z.files if k.startswith("param/")}
        self.assertEqual(again["start"], 5)
        self.assert_continues(again, "restore of the step-5 checkpoint")

if __name__ == "__main__":
    unittest.main()
