"""examples/train_mlp.py with 1 and 4 ranks against plain torch.optim.AdamW
on one process and the full batch: max relative difference < 1e-5 (fp32)."""
import os
import subprocess
import sys
import tempfile
import unittest

import common

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import train_mlp

STEPS = 50
TOL = 1e-5


def reference(cfg):
    """Plain torch: one process, the full global batch, torch.optim.AdamW."""
    torch.set_num_threads(1)
    model = train_mlp.make_model(cfg)
    x, y = train_mlp.make_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps, weight_decay=cfg.weight_decay)
    losses = []
    for s in range(cfg.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


def rel_diffs(got, want):
    """-> (max over tensors of max|a-b|/max|b|, max over elements with
    |b| >= 1e-2 of |a-b|/|b|)."""
    tw = ew = 0.0
    for n, b in want.items():
        a = got[n].astype(np.float64)
        b = b.astype(np.float64)
        d = np.abs(a - b)
        tw = max(tw, float(d.max() / np.abs(b).max()))
        big = np.abs(b) >= 1e-2
        if big.any():
            ew = max(ew, float((d[big] / np.abs(b[big])).max()))
    return tw, ew


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TrainMLPTest(unittest.TestCase):
    _ref = None

    @classmethod
    def ref(cls):
        if cls._ref is None:
            cfg = train_mlp.parser().parse_args(["--steps", str(STEPS)])
            cls._ref = reference(cfg)
        return cls._ref

    def check(self, params, losses, label):
        want, want_losses = self.ref()
        self.assertEqual(sorted(params), sorted(want))
        tw, ew = rel_diffs(params, want)
        print("\n  %s: max relative difference %.3g (per tensor), %.3g (per element, |ref| >= 1e-2); "
              "final loss %.6f (torch %.6f)" % (label, tw, ew, losses[-1], want_losses[-1]))
        self.assertLess(tw, TOL, label)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-4, err_msg=label)
        self.assertLess(losses[-1], 0.5 * losses[0], "it trains")

    def test_four_ranks_equal_full_batch(self):
        cfg = train_mlp.parser().parse_args(["--ranks", "4", "--steps", str(STEPS)])
        res = train_mlp.run(cfg, common.socket(), log=lambda *a: None, timeout=120)
        self.assertEqual([u[0] for u in res["units"]], ["0", "2", "4"])
        print("\n  4 ranks: setup %.2fs, train %.2fs, wall %.2fs"
              % (res["setup_s"], res["train_s"], res["wall_s"]))
        self.check(res["params"], res["losses"], "4 ranks, mean")

    def test_one_rank_cli_with_start_daemon(self):
        """make demo's path: the script starts its own daemon."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "final.npz")
            script = os.path.join(common.REPO, "examples", "train_mlp.py")
            p = subprocess.run([sys.executable, script, "--ranks", "1", "--steps", str(STEPS),
                                "--start-daemon", "--daemon-log", os.path.join(d, "log"),
                                "--out", out], capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("step    0  loss", p.stdout)
            self.assertIn("done: 1 ranks x %d steps" % STEPS, p.stdout)
            z = np.load(out)
            params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
            self.check(params, list(z["losses"]), "1 rank (cli)")

    def test_module_wrap_two_ranks(self):
        """One flat buffer for the whole module, 2 ranks (odd padding)."""
        cfg = train_mlp.parser().parse_args(["--ranks", "2", "--steps", str(STEPS),
                                             "--auto-wrap", "module"])
        res = train_mlp.run(cfg, common.socket(), log=lambda *a: None, timeout=120)
        self.assertEqual(len(res["units"]), 1)
        self.check(res["params"], res["losses"], "2 ranks, one buffer")


if __name__ == "__main__":
    unittest.main()
