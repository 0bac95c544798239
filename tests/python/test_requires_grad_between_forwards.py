"""A unit frozen between two forwards before one backward (transient
areas, 2 ranks, against one process of torch on the ranks' mean
gradient): torch takes requires_grad as it is at backward, so the first
forward's gradient of the unit is dropped. nanoGPT with a unit per Block;
the first forward runs every Block, then Block 1 is frozen and the second
forward skips it (LayerDrop drawn alike on every rank). In backward the
unit was gathered for the first forward's saved tensors, trainable then
and frozen now, and held to the end of backward, so Block 0's backward
was refused (E_LIMIT); it is released once that forward's use of it is
through (its inputs' gradient whole), and trains as torch."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn
    import test_torch_optim as tto

WORLD = 2
STEPS = 3
ROWS = 4
TOL = 1e-5
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


if common.HAVE_TORCH:
    class SkipGPT(models.GPT):
        """nanoGPT whose forward may skip a Block."""

        def forward(self, idx, skip=None):
            t = idx.shape[1]
            pos = torch.arange(t, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for i, block in enumerate(self.transformer.h):
                if i != skip:
                    x = block(x)
            return self.lm_head(self.transformer.ln_f(x))


def make():
    cfg = models.GPTConfig()
    torch.manual_seed(cfg.seed)
    return SkipGPT(cfg)


def loss(model, x, y, skip=None):
    logits = model(x, skip)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))


def step(model, s, rank, world, toggle="freeze"):
    """Two forwards, one backward. "freeze": Block 1 frozen between them
    (the second skips it), trainable again after. "unfreeze": Block 1
    frozen in the first forward and trainable in the second, which runs
    it (its gradient is the second forward's alone, as torch's)."""
    (x1, y1), (x2, y2) = (models.gpt_batch(models.GPTConfig(), s * 10 + i, rank, world, ROWS)
                          for i in (0, 1))
    h1 = model.transformer.h[1]
    if toggle == "freeze":
        a = loss(model, x1, y1)
        h1.requires_grad_(False)
        b = loss(model, x2, y2, skip=1)
    else:
        h1.requires_grad_(False)
        a = loss(model, x1, y1)
        h1.requires_grad_(True)
        b = loss(model, x2, y2)
    (a + b).backward()
    h1.requires_grad_(True)


def reference(toggle):
    torch.set_num_threads(1)
    model = make()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    for s in range(STEPS):
        opt.zero_grad()
        grads = [None] * len(params)
        for r in range(WORLD):
            for p in params:
                p.grad = None
            step(model, s, r, WORLD, toggle)
            grads = [g if p.grad is None else (p.grad.clone() if g is None else g + p.grad)
                     for g, p in zip(grads, params)]
        for p, g in zip(params, grads):
            p.grad = None if g is None else g / WORLD
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def rank_main(rank, world, sock, job, q, toggle):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
        for s in range(STEPS):
            opt.zero_grad()
            step(model, s, rank, world, toggle)
            opt.step()
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class RequiresGradBetweenForwardsTest(unittest.TestCase):

    def check(self, toggle):
        want = reference(toggle)
        job, sock = common.job("rg" + toggle), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, q, toggle),
                                    WORLD, 150)
        worst, at = tto.rel_diff(got["params"], want, key_bias=False)
        print("\n  parameters %.3g off torch's (%s)" % (worst, at))
        self.assertLess(worst, TOL, at)

    def test_a_unit_frozen_between_two_forwards(self):
        self.check("freeze")

    def test_a_unit_unfrozen_between_two_forwards(self):
        # frozen in the first forward, reduced from the second's use alone:
        # the first use, done, was held "late" for its saved tensors to the
        # end of backward (E_LIMIT at Block 0's gather)
        self.check("unfreeze")

if __name__ == "__main__":
    unittest.main()
