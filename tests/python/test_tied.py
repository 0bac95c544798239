"""shardd.nn with parameters shared between modules of different units (tied
embedding and output weights, a weight two sibling children use): FSDP's
rule puts such a parameter in the unit of the users' lowest common ancestor
(the root's with auto_wrap="children"), every module attribute holds the one
replacement parameter, and training matches one process of plain
torch.optim.AdamW on the full batch, resident and transient, 2 and 4 ranks.
Ranks are processes (forkserver) of one job on the host backend."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn

STEPS = 6
TOL = 1e-5        # losses and parameters (per tensor max|a-b| / max|b|), relative
BATCH = 8
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
VOCAB, CTX, DIM, HEADS = 64, 16, 32, 4


# ---- models (every rank builds the same one) --------------------------------

if common.HAVE_TORCH:
    class _Block(nn.Module):
        """Pre-norm causal self-attention and MLP."""

        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(DIM)
            # no bias: a key bias gets a gradient that is zero but for
            # rounding (softmax ignores a shift of all keys), which Adam's
            # first steps turn into +-lr of either sign
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
            self.proj = nn.Linear(DIM, DIM)
            self.ln2 = nn.LayerNorm(DIM)
            self.fc = nn.Linear(DIM, 4 * DIM)
            self.out = nn.Linear(4 * DIM, DIM)
            self.register_buffer("mask", torch.ones(CTX, CTX).tril().bool())

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / (d // HEADS) ** 0.5
            att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(torch.tanh(self.fc(self.ln2(x))))

    class _GPT(nn.Module):
        """GPT-2 style: lm_head.weight is wte.weight."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, DIM)
            self.wpe = nn.Embedding(CTX, DIM)
            self.blocks = nn.Sequential(_Block(), _Block())
            self.ln_f = nn.LayerNorm(DIM)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.02)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1])
            x = self.blocks(self.wte(idx) + self.wpe(pos))
            return self.lm_head(self.ln_f(x))

    class _Siblings(nn.Module):
        """b.weight is a.weight; a and b keep their own biases."""

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.c = nn.Linear(8, 4)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def gpt():
    torch.manual_seed(0)
    return _GPT()


def siblings():
    torch.manual_seed(0)
    return _Siblings()


MODELS = {"gpt": gpt, "siblings": siblings}


def make_data(name):
    g = torch.Generator().manual_seed(7)
    if name == "gpt":
        # learnable: the next token follows from the current one
        x = torch.randint(0, VOCAB, (STEPS, BATCH, CTX), generator=g)
        return x, x
    return (torch.randn(STEPS, BATCH, 8, generator=g),
            torch.randn(STEPS, BATCH, 4, generator=g))


def loss_fn(name, out, y):
    if name == "gpt":
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return nn.functional.mse_loss(out, y)


def reference(name):
    """One process, the full batch, torch.optim.AdamW."""
    torch.set_num_threads(1)
    model = MODELS[name]()
    x, y = make_data(name)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(name, model(x[s]), y[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


# ---- one rank ------------------------------------------------------------------

def rank_main(rank, world, sock, job, name, auto_wrap, transient, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient,
                               client_name="test_tied rank %d" % rank)
        model = MODELS[name]()
        x, y = make_data(name)
        per = BATCH // world
        lo, hi = rank * per, (rank + 1) * per
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap)
        # what every holder of a shared parameter points at
        if name == "gpt":
            tied = model.lm_head.weight is model.wte.weight
        else:
            tied = model.b.weight is model.a.weight
        units = {u.name: [e.name for e in u.entries] for u in sm.units}
        opt = sm.register_optimizer("adamw", model.parameters(), name="adamw", **HYPER)
        for s in range(STEPS):
            if transient:  # the plain torch loop
                sm.zero_grad()
                loss = loss_fn(name, model(x[s, lo:hi]), y[s, lo:hi])
                loss.backward()
            else:  # the explicit loop of resident areas
                sm.gather()
                loss = loss_fn(name, model(x[s, lo:hi]), y[s, lo:hi])
                sm.zero_grad()
                loss.backward()
                sm.scatter("mean")
            sm.step(opt)
            q.put(("loss", rank, s, loss.item()))
        params = sm.full_parameters()
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()}, units, tied))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(name, world, auto_wrap, transient, timeout=150):
    """-> dict(losses (mean over ranks per step), params, units, tied)."""
    job = common.job("tied")
    sock = common.socket()
    steps = {}
    out = {"losses": [None] * STEPS}

    def on_msg(msg):
        if msg[0] == "loss":
            _, r, s, loss = msg
            steps.setdefault(s, {})[r] = loss
            if len(steps[s]) == world:
                out["losses"][s] = sum(steps.pop(s).values()) / world
        elif msg[0] == "params":
            out["params"], out["units"], out["tied"] = msg[1], msg[2], msg[3]

    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, name, auto_wrap,
                                                 transient, q),
                        world, on_msg, timeout)
    return out


def rel_loss_diff(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def rel_param_diff(got, want):
    """max over tensors of max|a-b| / max|b|."""
    worst = 0.0
    for n, b in want.items():
        d = np.abs(got[n].astype(np.float64) - b.astype(np.float64))
        worst = max(worst, float(d.max() / max(np.abs(b).max(), 1e-30)))
    return worst


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TiedTest(unittest.TestCase):
    _refs = {}

    def ref(self, name):
        if name not in self._refs:
            self._refs[name] = reference(name)
        return self._refs[name]

    def check(self, name, world, auto_wrap, transient):
        label = "%s, %d ranks, auto_wrap=%s, %s" % (
            name, world, auto_wrap, "transient" if transient else "resident")
        res = run(name, world, auto_wrap, transient)
        want, want_losses = self.ref(name)
        lr = rel_loss_diff(res["losses"], want_losses)
        pr = rel_param_diff(res["params"], want)
        print("\n  %s: max relative loss difference %.3g, parameters %.3g; losses %s"
              % (label, lr, pr, ", ".join("%.6f" % v for v in res["losses"])))
        self.assertTrue(res["tied"], "%s: the holders of the shared parameter differ" % label)
        self.assertEqual(sorted(res["params"]), sorted(want), label)
        self.assertLessEqual(lr, TOL, label)
        self.assertLessEqual(pr, TOL, label)
        self.assertLess(res["losses"][-1], res["losses"][0], "it trains")
        return res

    def test_gpt_children_resident(self):
        for world in (2, 4):
            res = self.check("gpt", world, "children", False)
            # the tied weight is the root's, named as torch names it; wte
            # and lm_head hold nothing else, so they are no units
            self.assertEqual(res["units"]["root"], ["wte.weight"])
            self.assertEqual(sorted(res["units"]), ["blocks", "ln_f", "root", "wpe"])

    def test_gpt_children_transient(self):
        for world in (2, 4):
            self.check("gpt", world, "children", True)

    def test_gpt_module_resident(self):
        for world in (2, 4):
            res = self.check("gpt", world, "module", False)
            self.assertEqual(list(res["units"]), ["root"])
            self.assertEqual(res["units"]["root"].count("wte.weight"), 1)

    def test_gpt_module_transient(self):
        for world in (2, 4):
            self.check("gpt", world, "module", True)

    def test_siblings_share_a_weight(self):
        for transient in (False, True):
            res = self.check("siblings", 2, "children", transient)
            self.assertEqual(res["units"], {"a": ["a.bias"], "b": ["b.bias"],
                                            "c": ["c.weight", "c.bias"],
                                            "root": ["a.weight"]})


if __name__ == "__main__":
    unittest.main()
