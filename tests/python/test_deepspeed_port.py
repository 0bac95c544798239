"""docs/deepspeed.md's worked example, run as written: its Python block
(a DeepSpeed ZeRO-3 script ported: nanoGPT with a unit per Block, AdamW,
clipping, accumulation 2, a WarmupLR, an embedding row zeroed under
gathered_parameters, a checkpoint saved, restored and resumed, the fp32
state dict) as 2 rank processes against a daemon, with only SHARDD_SOCKET
and PYTHONPATH set as the page sets them. What it prints and saves is
checked against the same recipe in one plain torch process on both ranks'
batches, and the resumed run against the first."""
import os
import re
import sys
import tempfile
import unittest

import common

PAGE = os.path.join(common.REPO, "docs", "deepspeed.md")
WORLD, STEPS, GAS, CLIP, SAVE_AT = 2, 6, 2, 1.0, 3
LINE = re.compile(r"^step (\d+) loss ([0-9.]+) norm ([0-9.]+)$", re.M)


def port_source():
    """The ```python block of shardd's under the page's '## Worked example'
    (the one before it is DeepSpeed's)."""
    with open(PAGE) as f:
        text = f.read()
    section = text.split("\n## Worked example", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "import shardd" in b]
    if len(blocks) != 1:
        raise AssertionError("docs/deepspeed.md: not one ```python block importing shardd "
                             "under '## Worked example'")
    return blocks[0]


def torch_reference():
    """The recipe in one torch process: the same model and write, each
    micro-batch both ranks' rows together, torch's clipping, AdamW and
    LambdaLR. -> ([(loss, norm)] per step, state_dict)."""
    import torch
    import models
    torch.set_num_threads(1)
    model = models.nano_gpt(models.GPTConfig(layers=2))
    with torch.no_grad():
        model.transformer.wte.weight[0].zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(GAS):
            xs, ys = zip(*[models.gpt_batch(model.cfg, step * GAS + micro, r, WORLD)
                           for r in range(WORLD)])
            loss = models.gpt_loss(model, torch.cat(xs), torch.cat(ys)) / GAS
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        out.append((total, float(norm)))
    return out, model.state_dict()


@unittest.skipUnless(common.HAVE_TORCH, "needs torch")
class DeepSpeedPortTest(unittest.TestCase):
    def run_phase(self, path, d, phase, ranks):
        env = dict(os.environ, SHARDD_SOCKET=common.socket(),
                   PYTHONPATH=os.pathsep.join([os.path.join(common.REPO, "client", "python"),
                                               os.path.join(common.REPO, "tests", "python")]))
        outs = common.run_processes([[sys.executable, path, str(r), str(WORLD), phase, d]
                                     for r in range(ranks)], d, env)
        for r, (rc, out, err) in enumerate(outs):
            self.assertEqual(rc, 0, "%s rank %d:\n%s%s" % (phase, r, out, err))
        return outs[0][1]

    def test_the_pages_port_trains_as_torch_and_resumes_from_its_checkpoint(self):
        import torch
        src = port_source()
        with tempfile.TemporaryDirectory() as tmp:
            d = os.path.join(tmp, common.job("dsport"))  # the job is named after it
            os.mkdir(d)
            path = os.path.join(tmp, "ds_port.py")
            with open(path, "w") as f:
                f.write(src)
            first = LINE.findall(self.run_phase(path, d, "train", WORLD))
            restored = self.run_phase(path, d, "restore", 1)
            self.assertIn("resumes at step %d" % SAVE_AT, restored)
            resumed = LINE.findall(self.run_phase(path, d, "resume", WORLD))
            got_first = torch.load(os.path.join(d, "train.pt"))
            got_resumed = torch.load(os.path.join(d, "resume.pt"))
        want, want_sd = torch_reference()
        self.assertEqual([int(s) for s, _, _ in first], list(range(STEPS)))
        for s, loss, norm in first:
            self.assertAlmostEqual(float(loss), want[int(s)][0], delta=1e-6, msg="step " + s)
            self.assertAlmostEqual(float(norm), want[int(s)][1], delta=1e-6, msg="step " + s)
        self.assertEqual(resumed, first[SAVE_AT:], "the resumed steps are the first run's")
        self.assertEqual(list(got_first), list(want_sd), "torch's keys")
        for k, v in want_sd.items():
            self.assertEqual(got_first[k].dtype, torch.float32, k)
            scale = max(v.abs().max().item(), 1.0)
            self.assertLessEqual((got_first[k] - v).abs().max().item(), 1e-5 * scale, k)
            self.assertTrue(torch.equal(got_resumed[k], got_first[k]), k)


if __name__ == "__main__":
    unittest.main()
