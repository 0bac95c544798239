"""An evaluation between training steps (transient areas, 2 ranks, against
one process of torch on the ranks' slices): forwards under
``torch.inference_mode()`` (Lightning's validation) and ``torch.no_grad()``,
in eval mode and in train mode (``model.eval()`` forgotten), on nanoGPT (a
unit per Block, the tied head the root's) and LLaMA (a unit per decoder
layer): the evaluation's losses are torch's on every rank, and the
training after them is torch's bit for bit (no unit left gathered, no
parameter left pointing at an area made under inference mode)."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn

STEPS = 3
ROWS = 2  # per rank
MODELS = {"gpt": (lambda: models.nano_gpt(), lambda: {models.Block}),
          "llama": (lambda: models.llama(), lambda: {models.LlamaDecoderLayer})}
MODES = {"inference_mode": (torch.inference_mode, True),
         "no_grad": (torch.no_grad, True),
         "inference_mode in train mode": (torch.inference_mode, False)} if common.HAVE_TORCH else {}


def batch(k, r, world):
    return models.gpt_batch(models.GPTConfig(), k, r, world, rows=ROWS)


def train(model, opt, how, ranks, world):
    """-> the evaluation losses, [step][rank]."""
    no_grad, eval_mode = MODES[how]
    evals = []
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # the reference: each rank's share of the mean
            (models.gpt_loss(model, *batch(s, r, world)) / len(ranks)).backward()
        opt.step()
        if eval_mode:
            model.eval()
        with no_grad():
            evals.append([float(models.gpt_loss(model, *batch(50 + s, r, world))) for r in ranks])
        model.train()
    return evals


def rank_main(rank, world, sock, job, name, how, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_eval_between_steps rank %d" % rank)
        make, wrap = MODELS[name]
        model = make()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=wrap())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        q.put(("evals", rank, train(model, opt, how, [rank], world)))
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def rank0_eval_main(rank, world, sock, job, q):
    """An evaluation on rank 0 alone between two steps (a habit of DDP
    scripts): its gathers are collectives no other rank sends."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_eval_between_steps rank %d" % rank)
        model = models.nano_gpt()
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        err = None
        try:
            for s in range(2):
                opt.zero_grad()
                models.gpt_loss(model, *batch(s, rank, world)).backward()
                opt.step()
                if rank == 0:
                    model.eval()
                    with torch.no_grad():
                        models.gpt_loss(model, *batch(50, rank, world))
                    model.train()
        except shardd.Error as e:
            err = (e.code_name, e.message)
        q.put(("err", rank, err))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class EvalBetweenStepsTest(unittest.TestCase):

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_an_evaluation_on_rank_0_alone_is_refused_saying_so(self):
        job, sock = common.job("evalrank0"), common.socket()
        got = common.launch_collect(rank0_eval_main, lambda r, q: (r, 2, sock, job, q), 2,
                                    timeout=120)
        for r in range(2):
            code, msg = got[("err", r)]
            self.assertEqual(code, "E_MISMATCH", r)
            self.assertIn("an evaluation under no_grad too, on every rank, not rank 0 alone",
                          msg, r)

    def check(self, name, how, world=2):
        torch.set_num_threads(1)
        ref = MODELS[name][0]()
        want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), how,
                     range(world), world)
        job, sock = common.job("evalsteps"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, name, how, q),
                                    world, timeout=120)
        label = "%s, %s" % (name, how)
        for r in range(world):
            self.assertEqual([e[0] for e in got[("evals", r)]], [w[r] for w in want], label)
        for n, p in ref.named_parameters():
            self.assertTrue((got["params"][n] == p.detach().numpy()).all(), "%s: %s" % (label, n))

    def test_inference_mode_and_no_grad_evaluations(self):
        for how in MODES:
            self.check("gpt", how)

    def test_inference_mode_evaluation_on_llama(self):
        self.check("llama", "inference_mode")


if __name__ == "__main__":
    unittest.main()
