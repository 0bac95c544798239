"""A frozen unit (a LoRA-style base block, requires_grad=False before
wrapping) whose parameter the root's forward reads itself (outside every
forward that gathers the unit: ``x @ block.attn.c_proj.weight``), on
transient areas, 2 ranks against one process of torch on the ranks'
mean gradient: nanoGPT with a unit per Block and the untied LLaMA with a unit per
decoder layer. The read's saved parameter was rebuilt in backward from
the unit gathered again, which a frozen unit held to the end of backward:
with the root unit that took both of the rank's gather leases, and the
next unit's backward was refused (E_LIMIT) with one forward per
backward. The read's saved values are a copy now, and it trains as
torch."""
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
TOL = 1e-6  # bit for bit here: the same sums in the same order
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


if common.HAVE_TORCH:
    class ReadGPT(models.GPT):
        """nanoGPT whose root forward mixes in the first block's
        attention projection read from the module itself."""

        def forward(self, idx):
            t = idx.shape[1]
            pos = torch.arange(t, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            x = x + 0.1 * x @ self.transformer.h[0].attn.c_proj.weight
            return self.lm_head(self.transformer.ln_f(x))

    class ReadLlama(models.Llama):
        def forward(self, idx):
            h = self.model(idx)
            h = h + 0.1 * h @ self.model.layers[0].self_attn.o_proj.weight
            return self.lm_head(h)


def make(kind):
    if kind == "llama":
        cfg = models.LlamaConfig()
        torch.manual_seed(cfg.seed)
        model = ReadLlama(cfg)
        frozen = model.model.layers[0]
    else:
        cfg = models.GPTConfig()
        torch.manual_seed(cfg.seed)
        model = ReadGPT(cfg)
        frozen = model.transformer.h[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    return model


def batch(kind, s, rank, world, rows=ROWS):
    cfg = models.LlamaConfig() if kind == "llama" else models.GPTConfig()
    return models.gpt_batch(cfg, s, rank, world, rows)


def optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                             foreach=False, **HYPER)


def reference(kind):
    """One process of torch on the mean of the ranks' gradients (summed
    in rank order, as the reduce-scatter sums them)."""
    torch.set_num_threads(1)
    model = make(kind)
    opt = optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for s in range(STEPS):
        opt.zero_grad()
        grads = None
        for r in range(WORLD):
            for p in params:
                p.grad = None
            models.gpt_loss(model, *batch(kind, s, r, WORLD)).backward()
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
        model = make(kind)
        unit = models.LlamaDecoderLayer if kind == "llama" else models.Block
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={unit})
        opt = optimizer(model)
        for s in range(STEPS):
            opt.zero_grad()
            models.gpt_loss(model, *batch(kind, s, rank, world)).backward()
            opt.step()
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class FrozenReadsTest(unittest.TestCase):

    def check(self, kind):
        want = reference(kind)
        job, sock = common.job("frozenread"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, kind, q),
                                    WORLD, 150)
        worst, at = tto.rel_diff(got["params"], want, key_bias=False)
        print("\n  %s: parameters %.3g off torch's (%s)" % (kind, worst, at))
        self.assertLess(worst, TOL, at)

    def test_a_frozen_block_read_by_the_root_on_nanogpt(self):
        self.check("gpt")

    def test_a_frozen_layer_read_by_the_root_on_llama(self):
        self.check("llama")


if __name__ == "__main__":
    unittest.main()
