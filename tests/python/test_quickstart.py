"""The README's quick start, run as a new user runs it: its Python block
written to quickstart.py and started as 2 rank processes against a daemon,
with only SHARDD_SOCKET and PYTHONPATH set as the README sets them. What it
prints and saves is checked against the same recipe in one plain torch
process (the global batch of both ranks, torch's clipping and AdamW), so
the README's code must both run and train what torch trains."""
import os
import re
import sys
import tempfile
import unittest

import common

README = os.path.join(common.REPO, "README.md")
WORLD = 2


def quickstart_source():
    """The first ```python block under the README's '## Quick start'."""
    with open(README) as f:
        text = f.read()
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    if m is None:
        raise AssertionError("README.md: no ```python block under '## Quick start'")
    return m.group(1)


def torch_reference(steps):
    """The quick start's recipe in one process: the model seeded alike, each
    step the two ranks' batches together (equal halves, so MSE's mean is the
    mean of the ranks' means), the global norm clipped, torch's AdamW."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(WORLD)]
    losses = []
    for _ in range(steps):
        xs = [torch.randn(32, 16, generator=g) for g in gens]
        opt.zero_grad()
        per_rank = [torch.nn.functional.mse_loss(model(x), x[:, :4]) for x in xs]
        loss = sum(per_rank) / WORLD
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(sum(v.item() for v in per_rank) / WORLD)
    return losses, model.state_dict()


@unittest.skipUnless(common.HAVE_TORCH, "needs torch")
class QuickStartTest(unittest.TestCase):
    def test_the_readmes_quick_start_trains_and_saves_what_torch_does(self):
        import torch
        src = quickstart_source()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "quickstart.py")
            with open(path, "w") as f:
                f.write(src)
            env = dict(os.environ, SHARDD_SOCKET=common.socket(),
                       PYTHONPATH=os.path.join(common.REPO, "client", "python"))
            outs = common.run_processes([[sys.executable, path, str(r), str(WORLD)]
                                         for r in range(WORLD)], d, env)
            for r, (rc, out, err) in enumerate(outs):
                self.assertEqual(rc, 0, "rank %d:\n%s%s" % (r, out, err))
            printed = [(int(s), float(v)) for s, v in
                       re.findall(r"^step (\d+)\s+loss ([0-9.]+)$", outs[0][1], re.M)]
            self.assertTrue(printed, "rank 0 printed no loss line:\n" + outs[0][1])
            steps = printed[-1][0] + 1
            want_losses, want = torch_reference(steps)
            for s, v in printed:
                self.assertAlmostEqual(v, want_losses[s], delta=6e-5,  # printed %.4f
                                       msg="step %d: printed %s, torch %.6f"
                                       % (s, v, want_losses[s]))
            self.assertLess(printed[-1][1], 0.5 * printed[0][1], "it trains")
            got = torch.load(os.path.join(d, "model.pt"))
            self.assertEqual(list(got), list(want), "model.pt's keys are torch's")
            print("\n  quick start, %d steps on %d ranks against torch:" % (steps, WORLD))
            for k in want:
                diff = (got[k] - want[k]).abs().max().item()
                scale = want[k].abs().max().item()
                print("    %-9s max |diff| %.2e (of %.2e)" % (k, diff, scale))
                self.assertLessEqual(diff, 1e-5 * max(scale, 1.0), k)


if __name__ == "__main__":
    unittest.main()
