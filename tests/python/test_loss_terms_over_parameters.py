"""A loss term computed from the parameters (an L2 penalty,
``wd * sum(p.pow(2).sum() for p in model.parameters())``) on transient
areas, 2 ranks, nanoGPT with a unit per Block and the untied LLaMA with a
unit per decoder layer. Added after the forward, the units' parameters
are their 1-D parts of the shard: the backward is refused with a
RuntimeError naming parameters and saying what to do (it was torch's
"Function PowBackward0 returned an invalid gradient ... got [4096] but
expected shape compatible with [32, 128]"), and once refused the loop
goes on. What it says to do trains as torch on the ranks' mean gradient:
the term computed in a forward pre-hook on each unit's module (its
parameters whole there), the root unit's parameters' after the forward
(gathered until the end of backward)."""
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
WD = 1e-2
TOL = 1e-6
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def make(kind):
    model = models.llama() if kind == "llama" else models.nano_gpt()
    blocks = list(model.model.layers if kind == "llama" else model.transformer.h)
    return model, blocks


def batch(kind, s, rank, world):
    cfg = models.LlamaConfig() if kind == "llama" else models.GPTConfig()
    return models.gpt_batch(cfg, s, rank, world, ROWS)


def l2(params):
    return sum(p.pow(2).sum() for p in params)


def reference(kind):
    """One process of torch on the mean of the ranks' gradients of
    loss + WD * ||params||^2."""
    torch.set_num_threads(1)
    model, _ = make(kind)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    for s in range(STEPS):
        opt.zero_grad()
        grads = None
        for r in range(WORLD):
            for p in params:
                p.grad = None
            (models.gpt_loss(model, *batch(kind, s, r, WORLD)) + WD * l2(params)).backward()
            g = [p.grad.clone() for p in params]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / WORLD
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def rank_main(rank, world, sock, job, kind, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model, blocks = make(kind)
        unit = models.LlamaDecoderLayer if kind == "llama" else models.Block
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={unit})
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
        x, y = batch(kind, 0, rank, world)
        err = None
        try:  # the penalty after the forward: refused
            loss = models.gpt_loss(model, x, y) + WD * l2(model.parameters())
            loss.backward()
        except RuntimeError as e:
            err = str(e)
        del loss
        # what it says: each unit's term in a forward pre-hook on its
        # module, the root unit's parameters' after the forward
        terms = []
        for b in blocks:
            b.register_forward_pre_hook(lambda m, i: terms.append(l2(m.parameters())))
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_blocks]
        for s in range(STEPS):
            opt.zero_grad()
            terms.clear()
            loss = models.gpt_loss(model, *batch(kind, s, rank, world))
            (loss + WD * (sum(terms) + l2(root))).backward()
            opt.step()
        q.put(("out", rank, err))
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class LossTermsOverParametersTest(unittest.TestCase):

    def check(self, kind):
        want = reference(kind)
        job, sock = common.job("l2terms"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, kind, q),
                                    WORLD, 150)
        for r in range(WORLD):
            err = got[("out", r)]
            self.assertIsNotNone(err, "rank %d: the penalty after forward went through" % r)
            print("\n  %s rank %d: %s" % (kind, r, err[:240]))
            self.assertIn("shardd: the backward reached parameter '", err)
            self.assertIn("outside the forward", err)
            self.assertIn("weight_decay", err)
        worst, at = tto.rel_diff(got["params"], want, key_bias=False)
        print("  %s: the penalty in the forward: parameters %.3g off torch's (%s)"
              % (kind, worst, at))
        self.assertLess(worst, TOL, at)

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_an_l2_penalty_on_nanogpt(self):
        self.check("gpt")

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_an_l2_penalty_on_llama(self):
        self.check("llama")


if __name__ == "__main__":
    unittest.main()
