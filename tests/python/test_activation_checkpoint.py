"""Activation checkpointing on per-block units (transient areas): nanoGPT
wrapped with auto_wrap={Block} whose blocks' forwards run under
torch.utils.checkpoint, reentrant and not. The recomputation in backward
runs a block's forward again: it finds its unit gathered for backward (or
gathers it so) and leaves it gathered until the unit's gradients are
reduced. Against single-process torch AdamW on the full batch; ranks are
processes (forkserver) of one job on the host backend."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import torch.utils.checkpoint
    import shardd.nn
    import shardd.optim
    import models

STEPS = 4
TOL = 1e-5        # losses and parameters (per tensor max|a-b| / max|b|), relative
ROWS = 4          # rows per rank per step
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


if common.HAVE_TORCH:
    class CheckpointedGPT(models.GPT):
        """nanoGPT whose blocks' forwards are recomputed in backward."""

        def __init__(self, cfg, reentrant):
            super().__init__(cfg)
            self.reentrant = reentrant

        def forward(self, idx):
            t = idx.shape[1]
            pos = torch.arange(t, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
            return self.lm_head(self.transformer.ln_f(x))


def make_model(reentrant):
    cfg = models.GPTConfig()
    torch.manual_seed(cfg.seed)
    if reentrant is None:
        return models.GPT(cfg)
    return CheckpointedGPT(cfg, reentrant)


def reference(world):
    """One process of torch (no checkpointing) on the ranks' gradient mean,
    summed in rank order as the reduction does. -> (parameters, the ranks'
    mean loss per step)."""
    torch.set_num_threads(1)
    model = make_model(None)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        total, grads = 0.0, None
        for r in range(world):
            opt.zero_grad()
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, ROWS)
            loss = models.gpt_loss(model, x, y)
            loss.backward()
            total += loss.item()
            g = [p.grad.clone() for p in params]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
        losses.append(total / world)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


def rank_main(rank, world, sock, job, reentrant, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               client_name="test_activation_checkpoint rank %d" % rank)
        model = make_model(reentrant)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = shardd.optim.AdamW(model.parameters(), **HYPER)
        for s in range(STEPS):
            x, y = models.gpt_batch(models.GPTConfig(), s, rank, world, ROWS)
            opt.zero_grad()
            loss = models.gpt_loss(model, x, y)
            loss.backward()
            held = [u.name for u in sm.units if u.gather is not None or u.grad is not None]
            opt.step()
            q.put(("loss", rank, s, loss.item(), held))
        params = sm.full_parameters()
        tied = model.lm_head.weight is model.transformer.wte.weight
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()},
                   [u.name for u in sm.units], tied))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(world, reentrant, timeout=150):
    job = common.job("actckpt")
    sock = common.socket()
    steps = {}
    out = {"losses": [None] * STEPS, "held": []}

    def on_msg(msg):
        if msg[0] == "loss":
            _, r, s, loss, held = msg
            out["held"].extend(held)
            steps.setdefault(s, {})[r] = loss
            if len(steps[s]) == world:
                out["losses"][s] = sum(steps.pop(s).values()) / world
        elif msg[0] == "params":
            out["params"], out["units"], out["tied"] = msg[1], msg[2], msg[3]

    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, reentrant, q),
                        world, on_msg, timeout)
    return out


def rel_diff(got, want):
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(d.max() / max(np.abs(want).max(), 1e-30))


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ActivationCheckpointTest(unittest.TestCase):
    _ref = None

    def check(self, reentrant, world=2):
        label = "%s checkpointing, %d ranks" % (
            "reentrant" if reentrant else "non-reentrant", world)
        if ActivationCheckpointTest._ref is None:
            ActivationCheckpointTest._ref = reference(world)
        want, want_losses = ActivationCheckpointTest._ref
        res = run(world, reentrant)
        self.assertEqual(res["units"], ["transformer.h.0", "transformer.h.1", "root"], label)
        self.assertTrue(res["tied"], label)
        self.assertEqual(res["held"], [], "%s: units still gathered after backward" % label)
        lr = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], want_losses))
        self.assertEqual(sorted(res["params"]), sorted(want), label)
        pr = max(rel_diff(res["params"][n], want[n]) for n in want)
        print("\n  %s: max relative loss difference %.3g, parameters %.3g" % (label, lr, pr))
        self.assertLessEqual(lr, TOL, label)
        self.assertLessEqual(pr, TOL, label)
        init = dict(make_model(None).named_parameters())
        moved = min(rel_diff(res["params"][n], init[n].detach().numpy()) for n in want)
        self.assertGreater(moved, 1e-4, "%s: every parameter trains" % label)

    def test_non_reentrant_per_block(self):
        self.check(False)

    def test_reentrant_per_block(self):
        self.check(True)


if __name__ == "__main__":
    unittest.main()
