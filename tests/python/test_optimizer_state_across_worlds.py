"""An optimizer's state saved from a wrapped model on 2 ranks continues in
another world (1 rank, 3 ranks: shard boundaries that cut the parameters
elsewhere) and in plain torch as the uninterrupted torch run does: AdamW's
exp_avg / exp_avg_sq and step land on the right elements, not just on the
right tensors. torch.optim (built after wrapping): each rank saves its own
opt.state_dict() (torch.save), which records the part of each parameter it
holds; shardd.nn.full_optim_state_dict joins every rank's into torch's
layout, which opt.load_state_dict() takes in any world (each rank keeps its
part) and a plain torch AdamW over the unwrapped model too; a plain torch
optimizer.state_dict() loads into the wrapped run the same way; a rank's
own dict loaded into another world or rank is refused, naming the
parameter, before anything changed. shardd.optim: each rank's sharded
state_dict(), every rank's as a list into the other world, and
full_state_dict() into plain torch; torch.optim's joined dict into
shardd.optim (its per-rank dicts refused there). The model goes through
model.state_dict() / load_state_dict() (FSDP's full state dict). The
reference is one process of torch applying the mean of the ranks'
micro-batch gradients (test_torch_optim's), K steps as 2 ranks, then K as
the new world."""
import os
import shutil
import tempfile
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

K = 3
HYPER = tto.HYPER if common.HAVE_TORCH else None


def make_opt(kind, params):
    if kind == "shardd":
        return shardd.optim.AdamW(params, **HYPER)
    return torch.optim.AdamW(params, foreach=False, **HYPER)


def steps(model, opt, sm, rank, world, first):
    losses = []
    for s in range(first, first + K):
        opt.zero_grad()
        losses.append(tto.backward("gpt", model, sm, s, rank, world))
        opt.step()
    return losses


def numpy_sd(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def reference(world):
    """-> (losses of both halves, final parameters, the model's and the
    optimizer's state dicts after the first half)."""
    torch.set_num_threads(1)
    model = tto.make_model("gpt")
    opt = make_opt("torch", model.parameters())
    losses = steps(model, opt, None, 0, 2, 0)
    mid = (model.state_dict(), opt.state_dict())
    mid = tuple(torch.load(_roundtrip(x)) for x in mid)
    losses += steps(model, opt, None, 0, world, K)
    return losses, numpy_sd(model), mid


def _roundtrip(obj):
    import io
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return f


def wrapped(rank, world, sock, job):
    client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                           client_name="test_optimizer_state_across_worlds rank %d" % rank)
    model = tto.make_model("gpt")
    sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
    return client, model, sm


def save_main(rank, world, sock, job, kind, d, q):
    """The first half on world ranks; each rank saves its optimizer dict,
    rank 0 the model's."""
    try:
        torch.set_num_threads(1)
        client, model, sm = wrapped(rank, world, sock, job)
        opt = make_opt(kind, model.parameters())
        losses = steps(model, opt, sm, rank, world, 0)
        msd = model.state_dict()  # collective
        if rank == 0:
            torch.save(msd, os.path.join(d, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(d, "optim.%d.pt" % rank))
        if kind == "shardd":
            full = opt.full_state_dict(rank0_only=True)
            if rank == 0:
                torch.save(full, os.path.join(d, "optim.full.pt"))
        q.put(("losses", rank, losses))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def load_main(rank, world, sock, job, kind, d, how, q, saved=None):
    """The second half on world ranks from what save_main saved (how:
    "joined", "own" (this rank's dict of the first world, as it is),
    "torch" (the reference's plain torch dicts))."""
    try:
        torch.set_num_threads(1)
        client, model, sm = wrapped(rank, world, sock, job)
        opt = make_opt(kind, model.parameters())
        if how == "torch":
            msd = torch.load(os.path.join(d, "torch_model.pt"))
            osd = torch.load(os.path.join(d, "torch_optim.pt"))
        else:
            msd = torch.load(os.path.join(d, "model.pt"))
            dicts = [torch.load(os.path.join(d, "optim.%d.pt" % r)) for r in range(2)]
            if how == "own":
                osd = dicts[min(rank, 1)]
            elif how == "list":  # every rank's dicts as they are
                osd = dicts
            elif kind == "shardd" and saved != "torch":
                osd = dicts  # every rank's sharded dicts, resharded
            else:
                osd = shardd.nn.full_optim_state_dict(dicts)
        model.load_state_dict(msd)
        before = sm.full_parameters()
        try:
            opt.load_state_dict(osd)
        except ValueError as e:
            same = all(torch.equal(before[k], v) for k, v in sm.full_parameters().items())
            q.put(("refused", rank, str(e), same, len(opt.state)))
            client.close()
            q.put(("done", rank))
            return
        losses = steps(model, opt, sm, rank, world, K)
        sd = model.state_dict()
        q.put(("losses", rank, losses))
        if rank == 0:
            q.put(("state", {k: v.detach().numpy().copy() for k, v in sd.items()}))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


if common.HAVE_TORCH:
    class Scaled(torch.nn.Module):
        """A linear layer and a 0-dim parameter (CLIP's logit_scale): its
        optimizer state is 0-dim too, like a step count."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.lin = torch.nn.Linear(6, 5)
            self.scale = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x) * self.scale


def scaled_steps(model, opt, n):
    for s in range(n):
        torch.manual_seed(100 + s)
        x = torch.randn(4, 6)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def scalar_main(rank, world, sock, job, msd, osd, q):
    """K steps of the wrapped Scaled from a plain torch model and Adam
    state dict (every rank the same batch: the mean is torch's gradient)."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = Scaled()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="module")
        model.load_state_dict(msd)
        opt = torch.optim.Adam(model.parameters(), lr=0.05, amsgrad=True, foreach=False)
        opt.load_state_dict(osd)
        scaled_steps(model, opt, K)
        full = {k: v.detach().numpy().copy() for k, v in sm.full_parameters().items()}
        if rank == 0:
            q.put(("state", full))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def collect(target, args_of, world):
    out = {"losses": {}, "refused": {}}

    def on_msg(m):
        if m[0] == "losses":
            out["losses"][m[1]] = m[2]
        elif m[0] == "state":
            out["state"] = m[1]
        elif m[0] == "refused":
            out["refused"][m[1]] = m[2:]

    common.launch_ranks(target, args_of, world, on_msg, 150)
    if len(out["losses"]) == world:  # the ranks' mean, in rank order
        out["mean"] = [sum(out["losses"][r][i] for r in range(world)) / world
                       for i in range(K)]
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class OptimizerStateAcrossWorldsTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="shardd-osd-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def save(self, kind):
        sock = common.socket()
        job = common.job("osdsave")
        out = collect(save_main, lambda r, q: (r, 2, sock, job, kind, self.dir, q), 2)
        return out["mean"]

    def load(self, kind, world, how, saved=None):
        sock = common.socket()
        job = common.job("osdload")
        return collect(load_main,
                       lambda r, q: (r, world, sock, job, kind, self.dir, how, q, saved), world)

    def same_as_torch(self, label, got_losses, got_state, want_losses, want, exact):
        rl = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses))
        pr, at = tto.rel_diff(got_state, want)
        print("\n  %s: losses %.3g, parameters %.3g (%s)" % (label, rl, pr, at))
        self.assertLessEqual(rl, tto.TOL, label)
        self.assertLessEqual(pr, tto.TOL, label)
        if exact:
            self.assertEqual(list(got_losses), list(want_losses), label)
            for k, v in want.items():
                np.testing.assert_array_equal(got_state[k], v, err_msg="%s: %s" % (label, k))

    def continue_in_plain_torch(self, kind, world, want_losses, want, exact):
        """The saved model and optimizer (joined: torch's layout) into a
        plain torch AdamW over the unwrapped model."""
        torch.set_num_threads(1)
        model = tto.make_model("gpt")
        opt = make_opt("torch", model.parameters())
        model.load_state_dict(torch.load(os.path.join(self.dir, "model.pt")))
        if kind == "shardd":
            osd = torch.load(os.path.join(self.dir, "optim.full.pt"))
        else:
            osd = shardd.nn.full_optim_state_dict(
                [torch.load(os.path.join(self.dir, "optim.%d.pt" % r)) for r in range(2)])
        opt.load_state_dict(osd)
        losses = steps(model, opt, None, 0, world, K)
        self.same_as_torch("%s: plain torch, as %d ranks" % (kind, world), losses,
                           numpy_sd(model), want_losses[K:], want, exact)

    def check(self, kind, exact):
        refs = {w: reference(w) for w in (1, 2, 3)}
        first = self.save(kind)
        for w in (1, 3):  # the first halves: 2 ranks' steps everywhere
            self.assertEqual(refs[w][0][:K], refs[2][0][:K])
        if exact:
            self.assertEqual(first, refs[2][0][:K])
        for world in (1, 3, 2):
            want_losses, want, _ = refs[world]
            out = self.load(kind, world, "joined")
            self.assertEqual(out["refused"], {})
            self.same_as_torch("%s: 2 ranks -> %d" % (kind, world), out["mean"], out["state"],
                               want_losses[K:], want, exact)
            self.continue_in_plain_torch(kind, world, want_losses, want, exact)

    def test_torch_optim_state_continues_on_one_and_three_ranks_and_in_torch(self):
        self.check("torch", exact=True)

    def test_shardd_optim_state_continues_on_one_and_three_ranks_and_in_torch(self):
        self.check("shardd", exact=False)

    def test_a_plain_torch_optimizer_state_dict_loads_into_the_wrapped_run(self):
        for world in (2, 3):
            want_losses, want, (msd, osd) = reference(world)
            torch.save(msd, os.path.join(self.dir, "torch_model.pt"))
            torch.save(osd, os.path.join(self.dir, "torch_optim.pt"))
            out = self.load("torch", world, "torch")
            self.assertEqual(out["refused"], {})
            self.same_as_torch("torch's dict -> %d ranks" % world, out["mean"], out["state"],
                               want_losses[K:], want, True)

    def test_a_ranks_own_torch_optim_dict_in_another_world_is_refused(self):
        """Rank r's dict of 2 ranks loaded as it is on 3 ranks (its tensors
        of the old parts, some of the same shape as the new ones): refused,
        naming a parameter, with nothing loaded or changed."""
        self.save("torch")
        out = self.load("torch", 3, "own")
        self.assertEqual(sorted(out["refused"]), [0, 1, 2])
        for r, (msg, same, nstate) in out["refused"].items():
            self.assertIn("full_optim_state_dict", msg)
            self.assertRegex(msg, r"rank \d of 2")
            self.assertTrue(same)
            self.assertEqual(nstate, 0)


    def test_torch_optim_dicts_into_shardd_optim_are_joined_or_refused(self):
        """Each rank's torch.optim dict into shardd.optim on 3 ranks: the
        joined dict (torch's layout) continues as torch; a rank's own dict
        as it is, or the ranks' list as it is (shardd.optim's list is of
        its own sharded dicts), is refused, naming full_optim_state_dict."""
        self.save("torch")
        want_losses, want, _ = reference(3)
        out = self.load("shardd", 3, "joined", saved="torch")
        self.assertEqual(out["refused"], {})
        self.same_as_torch("torch.optim's joined dict -> shardd.optim on 3 ranks", out["mean"],
                           out["state"], want_losses[K:], want, False)
        for how in ("own", "list"):
            out = self.load("shardd", 3, how, saved="torch")
            self.assertEqual(sorted(out["refused"]), [0, 1, 2], how)
            for r, (msg, same, _) in out["refused"].items():
                self.assertIn("full_optim_state_dict", msg)
                self.assertTrue(same)


    def test_a_zero_dim_parameters_state_from_torch_continues_in_the_wrapped_run(self):
        """Plain torch's Adam (amsgrad) state dict of a model with a 0-dim
        parameter loads into the wrapped run on 2 ranks (one rank's part of
        that parameter empty) and continues as torch: its 0-dim moments are
        the whole parameter's, sliced to each rank's part like the others'
        (its 'step', 0-dim as well, is a count, kept)."""
        torch.set_num_threads(1)
        model = Scaled()
        opt = torch.optim.Adam(model.parameters(), lr=0.05, amsgrad=True, foreach=False)
        scaled_steps(model, opt, K)
        msd = {k: v.clone() for k, v in model.state_dict().items()}
        osd = torch.load(_roundtrip(opt.state_dict()))
        scaled_steps(model, opt, K)
        want = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
        sock = common.socket()
        job = common.job("osdscalar")
        out = collect(scalar_main, lambda r, q: (r, 2, sock, job, msd, osd, q), 2)
        for k, v in want.items():
            np.testing.assert_allclose(out["state"][k], v, rtol=1e-6, atol=1e-7, err_msg=k)


if __name__ == "__main__":
    unittest.main()
