"""Param groups split by a parameter's number of dimensions after wrapping
train as torch: nanoGPT's configure_optimizers (weight decay for
``p.dim() >= 2``, none for ``p.dim() < 2``) and timm's
param_groups_weight_decay (none for ``p.ndim <= 1``) built over a wrapped
model's parameters (transient areas, 2 ranks) give torch's split and
torch's training, with torch.optim.AdamW and with shardd.optim.AdamW.
Outside forward a parameter is its 1-D part of the rank's shard (FSDP1's
use_orig_params), so its shape is 1-D; its dim() / ndim are its
original's, so that such a split is torch's (under FSDP1 every parameter
falls into the no-decay group, silently). The reference is one process of
torch applying the mean of the ranks' micro-batch gradients, as
test_torch_optim's (bit for bit where the ranks compute what it computes)."""
import copy
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import models
    import shardd.nn
    import shardd.optim
    import test_torch_optim as tto

STEPS = 4
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
DECAY = 0.5  # large, so that a parameter in the wrong group shows


def groups(model, how):
    """The no-decay split as the scripts write it, over
    model.named_parameters() -> torch param groups."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    if how == "nanogpt":  # nanoGPT's configure_optimizers
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
    else:  # timm's param_groups_weight_decay
        decay = [p for p in params if not p.ndim <= 1]
        no_decay = [p for p in params if p.ndim <= 1]
    return [{"params": decay, "weight_decay": DECAY},
            {"params": no_decay, "weight_decay": 0.0}]


def make_opt(kind, model, how):
    if kind == "shardd":
        return shardd.optim.AdamW(groups(model, how), **HYPER)
    return torch.optim.AdamW(groups(model, how), foreach=False, **HYPER)


def train(model, opt, sm, rank, world):
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(tto.backward("gpt", model, sm, s, rank, world))
        opt.step()
    return losses


def reference(how, world):
    torch.set_num_threads(1)
    model = models.nano_gpt()
    opt = make_opt("torch", model, how)
    sizes = [len(g["params"]) for g in opt.param_groups]
    losses = train(model, opt, None, 0, world)
    return sizes, losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def rank_main(rank, world, sock, job, how, kind, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_param_groups_by_shape rank %d" % rank)
        model = models.nano_gpt()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = make_opt(kind, model, how)  # FSDP's order: after wrapping
        sizes = [len(g["params"]) for g in opt.param_groups]
        shapes = [tuple(p.shape) for p in model.parameters()]
        losses = train(model, opt, sm, rank, world)
        sd = model.state_dict()  # collective
        q.put(("out", rank, sizes, shapes, losses,
               {k: v.detach().numpy().copy() for k, v in sd.items()} if rank == 0 else None))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def dims_main(r, world, sock, job, q):
    """dim() / ndim of every parameter outside forward, inside a unit's
    forward, of the full state dict, of a deepcopy."""
    try:
        client = shardd.Client(sock, job=job, rank=r, world=world,
                               transient_areas=True)
        model = models.nano_gpt()
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        seen = {n: (p.dim(), p.ndim) for n, p in model.named_parameters()}
        inside = {}
        # after the wrapper's pre-hook, which gathered the unit
        h = model.transformer.h[0].register_forward_pre_hook(
            lambda m, i: inside.update(
                {n: (p.dim(), p.ndim, len(p.shape)) for n, p in m.named_parameters()}))
        x, _ = models.gpt_batch(models.GPTConfig(), 0, r, world)
        model(x)
        h.remove()
        full = {k: v.dim() for k, v in model.state_dict().items()}
        w = model.lm_head.weight  # outside forward: the part, 1-D
        dup = copy.deepcopy(w)
        # what takes range(dim()) from it works on the part as it is
        norms = (float(w.norm(2)), float(w.detach().norm(2)), "Parameter containing" in repr(w))
        q.put(("dims", r, seen, inside, full, (dup.dim(), len(dup.shape)), norms))
        client.close()
        q.put(("done", r))
    except BaseException as e:
        common.rank_failed(r, q, e)


def run(how, kind, world=2):
    job = common.job("pgshape")
    sock = common.socket()
    out = {}

    def on_msg(msg):
        if msg[0] == "out":
            out[msg[1]] = msg[2:]

    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, how, kind, q),
                        world, on_msg, 150)
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ParamGroupsByShapeTest(unittest.TestCase):

    def check(self, how, kind, world=2):
        label = "%s split, %s AdamW, %d ranks" % (how, kind, world)
        want_sizes, want_losses, want = reference(how, world)
        self.assertEqual(len(want_sizes), 2)
        self.assertTrue(all(want_sizes), want_sizes)  # both groups hold some
        out = run(how, kind, world)
        losses = [sum(out[r][2][i] for r in range(world)) / world
                  for i in range(STEPS)]
        for r in range(world):
            sizes, shapes = out[r][0], out[r][1]
            self.assertEqual(sizes, want_sizes, "%s: rank %d's groups" % (label, r))
            # the parameters are still the shard's 1-D parts (FSDP1's)
            self.assertTrue(all(len(s) == 1 for s in shapes), shapes)
        rl = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        pr, at = tto.rel_diff(out[0][3], want)
        print("\n  %s: losses %.3g, parameters %.3g (%s)" % (label, rl, pr, at))
        self.assertLessEqual(rl, tto.TOL, label)
        self.assertLessEqual(pr, tto.TOL, label)
        if kind == "torch":  # the ranks compute what the reference computes
            self.assertEqual(losses, want_losses, label)
            for k, v in want.items():
                np.testing.assert_array_equal(out[0][3][k], v, err_msg="%s: %s" % (label, k))

    def test_nanogpt_no_decay_split_after_wrapping_is_torchs(self):
        self.check("nanogpt", "torch")
        self.check("nanogpt", "shardd")

    def test_timm_no_decay_split_after_wrapping_is_torchs(self):
        self.check("timm", "torch")

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_dim_of_a_wrapped_parameter_is_its_originals(self):
        """dim() and ndim outside forward, inside (gathered) and of the
        parameters a state dict or a deepcopy makes."""
        ref = models.nano_gpt()
        want = {n: p.dim() for n, p in ref.named_parameters()}
        got = {}

        job, sock = common.job("pgdim"), common.socket()
        common.launch_ranks(dims_main, lambda r, q: (r, 2, sock, job, q),
                            2, lambda m: got.__setitem__(m[1], m[2:]) if m[0] == "dims" else None)
        for r in range(2):
            seen, inside, full, dup, norms = got[r]
            self.assertEqual({n: d for n, (d, _) in seen.items()}, want)
            self.assertEqual({n: d for n, (_, d) in seen.items()}, want)
            self.assertEqual(len(inside), 12)
            for n, (d, nd, ns) in inside.items():  # gathered: the whole shape
                self.assertEqual((d, nd), (ns, ns), n)
            self.assertEqual(full["lm_head.weight"], 2)
            self.assertEqual(full["transformer.ln_f.bias"], 1)
            self.assertEqual(dup[0], dup[1])  # a copy's dim() is its own shape's
            self.assertEqual(norms[0], norms[1])
            self.assertTrue(norms[2])


if __name__ == "__main__":
    unittest.main()
