"""The attributes a script sets on a parameter, and its .grad, seen where
torch sees them (transient areas, 2 ranks against one process of torch
on the global batch, nanoGPT with a unit per Block and the untied LLaMA
with a unit per decoder layer). Attributes set before wrapping
(Mamba's `A_log._no_weight_decay = True`, read to split the optimizer's
groups) are the wrapper's parameter's (they were dropped: every parameter
decayed). With two (LLaMA: three) forwards before one backward, the
later forwards' units compute with leaf tensors of their own in the
parameters' place, which stand for the parameters: a forward hook that
adds to `p.grad` in place in each forward adds in each one (it added in
the first only, with no error), and the attributes the script set on a
parameter (`p.calls`, `p.term`) are read and written on the parameter
(the leaf had none: an AttributeError, or a write lost); a hook that
writes the parameter in place there is refused by name as in the first
forward (the rank died of SIGSEGV)."""
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
TERM = 2e-3  # what the hook adds to each .grad element per forward
TOL = 2e-5
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def make(kind):
    return models.llama() if kind == "llama" else models.nano_gpt()


def mlps_of(kind, model):
    """A Linear inside each unit, whose weight gets the hook's attributes."""
    if kind == "llama":
        return [layer.mlp.up_proj for layer in model.model.layers]
    return [b.mlp.c_fc for b in model.transformer.h]


def batch(kind, k, rank, world, rows=ROWS):
    cfg = models.LlamaConfig() if kind == "llama" else models.GPTConfig()
    return models.gpt_batch(cfg, k, rank, world, rows)


def grad_term_hook(mod, inputs, output):
    """Adds the parameter's `term` (an attribute the script set) to its
    .grad in place, once per forward, and counts the forwards on it."""
    w = mod.weight
    w.calls = w.calls + 1
    if w.grad is not None:
        with torch.no_grad():
            w.grad.add_(w.term)


def grad_hook(mod, inputs, output):
    """Adds TERM to the parameter's .grad in place, once per forward."""
    if mod.weight.grad is not None:
        with torch.no_grad():
            mod.weight.grad.add_(TERM)


def mark(mlps, case):
    """The hooks and attributes of `case` that come after wrapping (on the
    wrapper's parameters)."""
    for m in mlps:
        if case == "attrs":
            m.weight.calls = 0
            m.weight.term = TERM
        if case in ("attrs", "grad"):
            m.register_forward_hook(grad_term_hook if case == "attrs" else grad_hook)


def mark_no_decay(model):
    """Before wrapping: Mamba's `A_log._no_weight_decay = True`, on every
    parameter of fewer than 2 dimensions."""
    for p in model.parameters():
        if p.dim() < 2:
            p._no_weight_decay = True


def optimizer(model, case):
    if case != "marker":
        return torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    # the groups split by the marker (each parameter's, read after wrapping)
    params = list(model.parameters())
    no = [p for p in params if getattr(p, "_no_weight_decay", False)]
    decay = [p for p in params if not getattr(p, "_no_weight_decay", False)]
    hyper = dict(HYPER, weight_decay=0.5)
    return torch.optim.AdamW([{"params": decay}, {"params": no, "weight_decay": 0.0}],
                             foreach=False, **hyper)


def forwards(kind):
    return 3 if kind == "llama" else 2


def loss_of(kind, model, s, rank, world, rows=ROWS):
    return sum(models.gpt_loss(model, *batch(kind, s * 10 + i, rank, world, rows))
               for i in range(forwards(kind)))


def reference(kind, case):
    """One process of torch on the global batch (the mean of the ranks'
    losses: each rank's rows are as many)."""
    torch.set_num_threads(1)
    model = make(kind)
    if case == "marker":
        mark_no_decay(model)
    mlps = mlps_of(kind, model)
    mark(mlps, case)
    opt = optimizer(model, case)
    for s in range(STEPS):
        opt.zero_grad()
        loss_of(kind, model, s, 0, 1, WORLD * ROWS).backward()
        opt.step()
    return ({n: p.detach().numpy().copy() for n, p in model.named_parameters()},
            [getattr(m.weight, "calls", None) for m in mlps])


def rank_main(rank, world, sock, job, kind, case, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make(kind)
        if case == "marker":
            mark_no_decay(model)
        unit = models.LlamaDecoderLayer if kind == "llama" else models.Block
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={unit})
        mlps = mlps_of(kind, model)
        mark(mlps, case)
        opt = optimizer(model, case)
        for s in range(STEPS):
            opt.zero_grad()
            loss_of(kind, model, s, rank, world).backward()
            opt.step()
        q.put(("calls", rank, [getattr(m.weight, "calls", None) for m in mlps]))
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


class LaterClip:
    """WGAN's clipping as a forward pre-hook, from its second call on (a
    second forward before one backward, whose unit computes on leaves)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, mod, inputs):
        self.calls += 1
        if self.calls > 1:
            with torch.no_grad():
                mod.weight.clamp_(-0.01, 0.01)


def late_write_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make("gpt")
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(LaterClip())
        err = None
        try:
            loss_of("gpt", model, 0, rank, world).backward()
        except RuntimeError as e:
            err = str(e)
        q.put(("out", rank, err))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ParameterAttributesTest(unittest.TestCase):

    def check(self, kind, case):
        want, want_calls = reference(kind, case)
        job, sock = common.job("pattrs"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, kind, case, q),
                                    WORLD, 150)
        # per tensor |a-b| / |b| (L2), the attention's key bias left out
        worst, at = tto.rel_diff(got["params"], want, key_bias=False)
        print("\n  %s %s: parameters %.3g off torch's (%s), calls %s" % (
            kind, case, worst, at, [got[("calls", r)] for r in range(WORLD)]))
        for r in range(WORLD):
            self.assertEqual(got[("calls", r)], want_calls, r)
        self.assertLess(worst, TOL, at)

    def test_a_hook_adding_to_grad_in_each_forward_on_nanogpt(self):
        self.check("gpt", "grad")

    def test_a_hook_adding_to_grad_in_each_of_three_forwards_on_llama(self):
        self.check("llama", "grad")

    def test_a_hook_on_the_script_s_parameter_attributes_on_nanogpt(self):
        self.check("gpt", "attrs")

    def test_a_hook_on_the_script_s_parameter_attributes_on_llama(self):
        self.check("llama", "attrs")

    def test_a_hook_writing_the_parameter_in_a_later_forward_is_refused(self):
        """The leaf's data is the gathered copy, as the parameter's: a
        write there is refused by name as in the first forward
        (hook_writes.py), where the rank died of SIGSEGV."""
        job, sock = common.job("pattrs-write"), common.socket()
        got = common.launch_collect(late_write_main, lambda r, q: (r, WORLD, sock, job, q),
                                    WORLD, 120)
        for r in range(WORLD):
            err = got[("out", r)]
            self.assertIsNotNone(err, "rank %d: the write went through" % r)
            self.assertIn("'transformer.h.0.mlp.c_fc.weight'", err)
            self.assertIn("between steps", err)

    def test_a_marker_set_before_wrapping_splits_the_groups_on_nanogpt(self):
        """Attributes set on a parameter before wrapping are the wrapper's
        parameter's (they were dropped: every parameter decayed)."""
        self.check("gpt", "marker")

    def test_a_marker_set_before_wrapping_splits_the_groups_on_llama(self):
        self.check("llama", "marker")


if __name__ == "__main__":
    unittest.main()
