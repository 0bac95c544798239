"""A step with no backward since the last one, on a transient client (the
default, FSDP's FULL_SHARD), against one process of plain torch, 2 ranks,
nanoGPT (tied embeddings) with a unit per Block: torch's step applies
the .grad the parameters hold (the last backward's again with no
zero_grad() since; zeros after zero_grad(), which momentum and weight
decay still turn into a move), and clip_grad_norm_ before it clips that
.grad. The daemon takes a buffer no scatter reached since its last step
for consumed (torch's None .grad) and skips it, so the .grad held has to
be handed to it again first. Every way to ask for the step does so and
trains as torch: shardd.optim's opt.step(), sm.step(opt) over an
optimizer registered through the module, and client.step(opt) asked of
the Client directly, below the wrapper; likewise sm.clip_grad_norm_ and
client.clip_grad_norm(opt) before such a step."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn
    import shardd.optim

WORLD = 2
ROWS = 8
TOL = 1e-5
HYPER = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
CLIP = 0.2  # below the gradient norms (0.86, 1.07), so that clipping scales
# per step: whether it begins with zero_grad() and has a backward. Step 1
# applies step 0's .grad again, step 2 the zeroed .grad
PLAN = [(True, True), (False, False), (True, False), (True, True)]


def make_model():
    cfg = models.GPTConfig()
    torch.manual_seed(cfg.seed)
    return models.GPT(cfg)


def loss_of(model, k, rank, world):
    """Step k's loss over this rank's rows of the ROWS the ranks share
    (world 1: the whole batch)."""
    x, y = models.gpt_batch(models.GPTConfig(), k, rank, world, ROWS // world)
    return models.gpt_loss(model, x, y)


def reference(clip):
    """Plain torch, one process, the whole batch: (norms, parameters)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **HYPER)
    norms = []
    for s, (zero, backward) in enumerate(PLAN):
        if zero:
            opt.zero_grad()
        if backward:
            loss_of(model, s, 0, 1).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_main(rank, world, sock, job, path, clip, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world)
        model = make_model()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        if path == "optim":
            opt = shardd.optim.SGD(model.parameters(), **HYPER)
            zero_grad, step = opt.zero_grad, opt.step
            clip_norm = lambda: float(sm.clip_grad_norm_(CLIP))  # noqa: E731
        else:
            opt = sm.register_optimizer("sgd", model.parameters(), **HYPER)
            zero_grad = sm.zero_grad
            if path == "module":
                step = lambda: sm.step(opt)  # noqa: E731
                clip_norm = lambda: float(sm.clip_grad_norm_(CLIP))  # noqa: E731
            else:  # the Client's, below the wrapper
                step = lambda: client.step(opt)  # noqa: E731
                clip_norm = lambda: client.clip_grad_norm(opt, CLIP)  # noqa: E731
        norms = []
        for s, (zero, backward) in enumerate(PLAN):
            if zero:
                zero_grad()
            if backward:
                loss_of(model, s, rank, world).backward()
            if clip:
                norms.append(clip_norm())
            step()
        common.send_params(rank, q, sm)
        q.put(("norms", rank, norms))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class StepWithoutBackward(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        common.daemon()

    def check(self, path, clip=False):
        got = {}

        def on_msg(m):
            if m[0] == "params":
                got["params"] = m[1]
            else:
                got[(m[0], m[1])] = m[2]

        sock, job = common.socket(), common.job("nobackward-%s%s" % (path, "-clip" * clip))
        common.launch_ranks(rank_main, lambda r, q: (r, WORLD, sock, job, path, clip, q),
                            WORLD, on_msg)
        ref_norms, ref_params = reference(clip)
        for r in range(WORLD):
            norms = got[("norms", r)]
            self.assertEqual(len(norms), len(ref_norms))
            for s, (a, b) in enumerate(zip(norms, ref_norms)):
                self.assertAlmostEqual(a, b, delta=TOL * b, msg="rank %d step %d norm" % (r, s))
        for n, p in ref_params.items():
            d = float((torch.from_numpy(got["params"][n]) - p).abs().max()) / \
                max(float(p.abs().max()), 1e-12)
            self.assertLess(d, TOL, "%s (%s)" % (n, path))

    def test_shardd_optim_step_applies_the_grad_held_as_torch(self):
        self.check("optim")

    def test_module_step_applies_the_grad_held_as_torch(self):
        self.check("module")

    def test_client_step_applies_the_grad_held_as_torch(self):
        self.check("client")

    def test_shardd_optim_clip_then_step_clips_the_grad_held_as_torch(self):
        self.check("optim", clip=True)

    def test_module_clip_then_step_clips_the_grad_held_as_torch(self):
        self.check("module", clip=True)

    def test_client_clip_then_step_clips_the_grad_held_as_torch(self):
        self.check("client", clip=True)


if __name__ == "__main__":
    unittest.main()
