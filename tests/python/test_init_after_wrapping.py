"""A model initialized after wrapping (transient areas, 2 ranks) gets
torch's values: ``model.apply(init_fn)`` with ``nn.init.normal_``,
timm's ``trunc_normal_`` (through a name bound before wrapping, as this
module's ``from torch.nn.init import trunc_normal_``), ``kaiming_normal_``
and ``xavier_uniform_``, every module's ``reset_parameters()``, and
``p.normal_()`` under ``no_grad``, on nanoGPT (a unit per Block), ResNet-18
(a unit per child) and LLaMA, seeded alike on every rank, as one process
of torch. Outside forward a parameter is this rank's 1-D part of the
shard: a draw on it took each part's numbers from the start of its own
generator (every part the same ones: 2.56 off torch), kaiming_* returned
without drawing on a rank whose part is empty (every later draw out of
step), and the fans of xavier_* / kaiming_* and a Linear's
reset_parameters() failed on the 1-D shape (an IndexError). The init runs
on a whole tensor of the parameter's shape on every rank, each keeping
its part. So do draws on ``p.data`` / ``p.detach()`` (HuggingFace's
``_init_weights``: ``module.weight.data.normal_()``; ``nn.init.*`` on
``p.data``), plain tensors that are the part: each rank's part drew the
same first numbers of its generator, without an error."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    from torch.nn.init import trunc_normal_  # bound before any wrapper
    import models
    import shardd.nn

MODELS = {"gpt": (lambda: models.nano_gpt(), lambda: {models.Block}),
          "resnet": (lambda: models.resnet(), lambda: "children"),
          "llama": (lambda: models.llama(), lambda: {models.LlamaDecoderLayer})}


def timm_like(m):
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(m, nn.Embedding):
        nn.init.xavier_uniform_(m.weight)


def hf_like(m):
    # HuggingFace's _init_weights: draws on ``.data``, a tensor made from
    # the parameter (each rank's part alone, before)
    if isinstance(m, nn.Linear):
        m.weight.data.normal_(mean=0.0, std=0.02)
        if m.bias is not None:
            m.bias.data.zero_()
    elif isinstance(m, nn.Embedding):
        m.weight.data.normal_(mean=0.0, std=0.02)
    elif isinstance(m, nn.LayerNorm):
        m.bias.data.zero_()
        m.weight.data.fill_(1.0)


def init(model, how):
    torch.manual_seed(7)
    if how == "hf":
        model.apply(hf_like)
    elif how == "data":  # the other tensors made from a parameter
        for n, p in model.named_parameters():
            if p.dim() >= 2:  # the original's, on a part too
                nn.init.kaiming_uniform_(p.data, a=0.5)
            else:
                p.detach().uniform_(-0.1, 0.1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                nn.init.trunc_normal_(p.data, std=0.02)
                if n.endswith("bias"):
                    p.normal_(0, 0.01)
                    p.data.add_(1.0)
    elif how == "normal":
        model.apply(lambda m: nn.init.normal_(m.weight, std=0.02)
                    if isinstance(m, nn.Linear) else None)
    elif how == "timm":
        model.apply(timm_like)
    elif how == "reset":
        model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    else:  # "method": the parameter's own draws
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("weight"):
                    p.normal_(0, 0.02)
                else:
                    p.uniform_(-0.1, 0.1)


def rank_main(rank, world, sock, job, name, how, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_init_after_wrapping rank %d" % rank)
        make, wrap = MODELS[name]
        model = make()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=wrap())
        init(model, how)
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def second_wrapper_main(rank, world, sock, job, q):
    """A wrapper built after an earlier one's client closed, the earlier
    model still alive (a notebook's second run): its part may lie at the
    address of the earlier's, unmapped by close()."""
    try:
        torch.set_num_threads(1)
        first = shardd.Client(sock, job=job + "-a", rank=rank, world=world,
                              transient_areas=True)
        old = nn.Linear(8, 4, bias=False)
        old_sm = shardd.nn.ShardedModule(first, old)
        was = old.weight.data_ptr()
        first.close()
        client = shardd.Client(sock, job=job + "-b", rank=rank, world=world,
                               transient_areas=True)
        model = nn.Linear(2, 16, bias=False)  # as many elements, another shape
        sm = shardd.nn.ShardedModule(client, model)
        q.put(("reused", rank, model.weight.data_ptr() == was))
        torch.manual_seed(7)
        nn.init.xavier_uniform_(model.weight.data)  # the fans of (16, 2)
        common.send_params(rank, q, sm)
        client.close()
        del old_sm
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class InitAfterWrappingTest(unittest.TestCase):

    def test_a_draw_on_data_after_an_earlier_client_closed_is_the_new_parameters(self):
        """The earlier wrapper's part at the same address was taken for the
        new one's: xavier's fans of the old (4, 8), not (16, 2), without a
        word."""
        world = 2
        job, sock = common.job("initreuse"), common.socket()
        got = common.launch_collect(second_wrapper_main,
                                    lambda r, q: (r, world, sock, job, q), world)
        if not any(got[("reused", r)] for r in range(world)):
            self.skipTest("the second client's areas were mapped elsewhere")
        torch.manual_seed(7)
        want = nn.init.xavier_uniform_(torch.empty(16, 2))
        self.assertTrue((got["params"]["weight"] == want.numpy()).all())

    def check(self, name, how, world=2):
        ref = MODELS[name][0]()
        init(ref, how)
        job, sock = common.job("initafter"), common.socket()
        got = common.last_params(rank_main, lambda r, q: (r, world, sock, job, name, how, q),
                                 world, timeout=120)
        for n, p in ref.named_parameters():
            self.assertTrue((got[n] == p.detach().numpy()).all(), "%s, %s: %s" % (name, how, n))

    def test_nn_init_normal_over_model_apply(self):
        self.check("gpt", "normal")

    def test_timm_like_init_with_a_name_bound_before_wrapping(self):
        self.check("gpt", "timm")
        self.check("resnet", "timm")

    def test_reset_parameters_of_every_module(self):
        self.check("gpt", "reset")
        self.check("resnet", "reset")
        self.check("llama", "reset")

    def test_a_parameters_own_draws(self):
        self.check("gpt", "method")

    def test_hf_style_init_weights_on_data(self):
        self.check("gpt", "hf")
        self.check("llama", "hf")

    def test_draws_on_data_and_detach(self):
        self.check("gpt", "data")
        self.check("llama", "data")


if __name__ == "__main__":
    unittest.main()
