"""shardd.nn's wrap policies on the model shapes people train: auto_wrap
"children" descends through containers (nanoGPT's transformer ModuleDict and
its h ModuleList of Blocks), a set of module classes makes every instance a
unit (FSDP's transformer_auto_wrap_policy), a callable decides as FSDP's
policies do; a unit whose own module's forward never runs is gathered by
the forwards of the modules holding its parameters; a parameter shared
across units (the tied lm_head / wte weight) lives in their lowest common
ancestor's unit and stays tied. Each against single-process torch AdamW on
the full batch; ranks are processes (forkserver) of one job on the host
backend. And what is refused at construction, by its message."""
import functools
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim
    import models

STEPS = 4
TOL = 1e-5        # losses and parameters (per tensor max|a-b| / max|b|), relative
ROWS = 4          # rows per rank per step
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


# ---- models and policies (module level: the ranks unpickle them) -------------

if common.HAVE_TORCH:
    class Pair(nn.Module):
        """Two linears whose own forward the root never calls."""

        def __init__(self, dim):
            super().__init__()
            self.a = nn.Linear(dim, dim)
            self.b = nn.Linear(dim, dim)

        def forward(self, x):  # never called by DirectNet
            raise AssertionError("Pair.forward is not part of DirectNet's forward")

    class DirectNet(nn.Module):
        """The root's forward calls each Pair's submodules directly, as
        nanoGPT calls transformer.wte and the blocks of transformer.h."""

        def __init__(self, dim=16, pairs=2, read="no"):
            super().__init__()
            self.pairs = nn.ModuleList([Pair(dim) for _ in range(pairs)])
            self.out = nn.Linear(dim, dim)
            # read: how the root uses out. "no": out(x); "late": its
            # parameters read after the pairs' forwards; "early": read
            # before them, and a parameter of the root's own
            self.read = read
            if read == "early":
                self.scale = nn.Parameter(torch.ones(dim))
            if read == "gains":  # a gain per pair, and one of the root's own
                self.scale = nn.Parameter(torch.ones(dim))
                self.gains = nn.ParameterList([nn.Parameter(torch.full((dim,), 1.0 + i))
                                               for i in range(pairs)])

        def forward(self, x):
            if self.read == "early":
                w = self.out.weight
                x = x * self.scale
            if self.read == "gains":
                x = x * self.scale
                for g, p in zip(self.gains, self.pairs):
                    x = torch.tanh(p.b(torch.tanh(p.a(x * g))))
                return self.out(x)
            for p in self.pairs:
                x = torch.tanh(p.b(torch.tanh(p.a(x))))
            if self.read == "late":
                return nn.functional.linear(x, self.out.weight, self.out.bias)
            if self.read == "early":
                return nn.functional.linear(x, w, self.out.bias)
            return self.out(x)


def direct_net(read="no"):
    torch.manual_seed(0)
    return DirectNet(read=read)


def wrap_module_lists(module, recurse, nonwrapped_numel):
    """A policy that makes each ModuleList a unit (which has no forward)."""
    return recurse or isinstance(module, nn.ModuleList)


MODELS = {"gpt": models.nano_gpt, "mlp": models.mlp, "direct": direct_net,
          "read": functools.partial(direct_net, read="late"),
          "gains": functools.partial(direct_net, read="gains")} if common.HAVE_TORCH else {}


def batch(name, step, rank=0, world=1):
    """Rank `rank`'s slice of step `step`'s world*ROWS rows (world=1: all)."""
    if name == "gpt":
        return models.gpt_batch(models.GPTConfig(), step, rank, world, ROWS)
    g = torch.Generator().manual_seed(100)  # one batch: the loss falls in few steps
    x = torch.randn(world * ROWS, 16, generator=g)
    y = torch.randn(world * ROWS, 16, generator=g)
    return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]


def loss_of(name, model, x, y):
    if name == "gpt":
        return models.gpt_loss(model, x, y)
    return nn.functional.mse_loss(model(x), y)


def reference(name, world):
    """One process of torch.optim.AdamW on the ranks' gradient mean, as data
    parallelism computes it: each rank's slice's gradient, summed in rank
    order and divided by the world size (the full batch's one gradient
    rounds otherwise, and Adam's first steps, update ~ lr * g / |g|, turn
    that rounding into lr-sized differences on elements whose gradient is
    zero but for rounding: the key bias of c_attn, as softmax ignores a
    shift of every key). -> (parameters, the ranks' mean loss per step)."""
    torch.set_num_threads(1)
    model = MODELS[name]()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        total, grads = 0.0, None
        for r in range(world):
            opt.zero_grad()
            x, y = batch(name, s, r, world)
            loss = loss_of(name, model, x, y)
            loss.backward()
            total += loss.item()
            g = [p.grad.clone() for p in params]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
        losses.append(total / world)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


# ---- one rank ------------------------------------------------------------------

def rank_main(rank, world, sock, job, name, auto_wrap, transient, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient,
                               client_name="test_wrap rank %d" % rank)
        model = MODELS[name]()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap)
        units = [(u.name, type(u.module).__name__, [e.name for e in u.entries])
                 for u in sm.units]
        opt = shardd.optim.AdamW(model.parameters(), **HYPER)
        for s in range(STEPS):
            x, y = batch(name, s, rank, world)
            opt.zero_grad()
            if not transient:
                sm.gather()
            loss = loss_of(name, model, x, y)
            loss.backward()
            if not transient:
                sm.scatter("mean")
            opt.step()
            q.put(("loss", rank, s, loss.item()))
        tied = None
        if name == "gpt":
            sd = sm.state_dict()
            tied = (model.lm_head.weight is model.transformer.wte.weight,
                    sd["lm_head.weight"].numpy().copy(),
                    sd["transformer.wte.weight"].numpy().copy())
        params = sm.full_parameters()
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()}, units, tied))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(name, world, auto_wrap, transient=True, timeout=150):
    """-> dict(losses (mean over ranks per step), params, units, tied)."""
    job = common.job("wrap")
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


def rel_diff(got, want):
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(d.max() / max(np.abs(want).max(), 1e-30))


GPT_BLOCK = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
             "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
             "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class WrapPolicyTrainingTest(unittest.TestCase):
    _refs = {}

    def ref(self, name, world):
        if (name, world) not in self._refs:
            self._refs[name, world] = reference(name, world)
        return self._refs[name, world]

    def check(self, name, world, auto_wrap, transient=True):
        label = "%s, %d ranks, auto_wrap=%s, %s" % (
            name, world, auto_wrap, "transient" if transient else "resident")
        res = run(name, world, auto_wrap, transient)
        want, want_losses = self.ref(name, world)
        lr = rel_loss_diff(res["losses"], want_losses)
        self.assertEqual(sorted(res["params"]), sorted(want), label)
        pr = max(rel_diff(res["params"][n], want[n]) for n in want)
        print("\n  %s: max relative loss difference %.3g, parameters %.3g"
              % (label, lr, pr))
        self.assertLessEqual(lr, TOL, label)
        self.assertLessEqual(pr, TOL, label)
        init = dict(MODELS[name]().named_parameters())
        moved = min(rel_diff(res["params"][n], init[n].detach().numpy()) for n in want)
        self.assertGreater(moved, 1e-4, "%s: every parameter trains" % label)
        if name == "gpt":  # the tie survives: one parameter, torch's values
            same, head, wte = res["tied"]
            self.assertTrue(same, "%s: lm_head.weight is no longer transformer.wte.weight"
                            % label)
            np.testing.assert_array_equal(head, wte)
            self.assertLessEqual(rel_diff(head, want["transformer.wte.weight"]), TOL, label)
        return res

    def test_children_descends_through_module_dict_and_list(self):
        """nanoGPT: one unit per Block of transformer.h, wpe and ln_f; the
        root's unit holds the weight lm_head and wte share (their lowest
        common ancestor), so wte and lm_head have no unit."""
        for world, transient in ((2, True), (4, True), (2, False)):
            res = self.check("gpt", world, "children", transient)
            self.assertEqual(
                res["units"],
                [("transformer.wpe", "Embedding", ["transformer.wpe.weight"]),
                 ("transformer.h.0", "Block", ["transformer.h.0." + n for n in GPT_BLOCK]),
                 ("transformer.h.1", "Block", ["transformer.h.1." + n for n in GPT_BLOCK]),
                 ("transformer.ln_f", "LayerNorm",
                  ["transformer.ln_f.weight", "transformer.ln_f.bias"]),
                 ("root", "GPT", ["transformer.wte.weight"])])

    def test_children_of_a_module_list_of_sequentials(self):
        res = self.check("mlp", 2, "children")
        self.assertEqual([(n, c) for n, c, _ in res["units"]],
                         [("inp", "Linear"), ("layers.0", "Sequential"),
                          ("layers.1", "Sequential"), ("layers.2", "Sequential"),
                          ("out", "Linear")])

    def test_class_set_wraps_every_block(self):
        """auto_wrap={Block}: a unit per Block at any depth; the root's unit
        keeps the rest (embeddings, the tied head, ln_f)."""
        res = self.check("gpt", 2, {models.Block})
        self.assertEqual([(n, c) for n, c, _ in res["units"]],
                         [("transformer.h.0", "Block"), ("transformer.h.1", "Block"),
                          ("root", "GPT")])
        self.assertEqual(res["units"][-1][2], ["transformer.wte.weight",
                                               "transformer.wpe.weight",
                                               "transformer.ln_f.weight",
                                               "transformer.ln_f.bias"])

    def test_size_based_policy(self):
        """FSDP's size_based_auto_wrap_policy: each module of at least 5000
        parameters not wrapped below it (a Block's MLP), and never a
        container."""
        pol = functools.partial(shardd.nn.size_based_auto_wrap_policy, min_num_params=5000)
        res = self.check("gpt", 2, pol)
        self.assertEqual([(n, c) for n, c, _ in res["units"]],
                         [("transformer.h.0.mlp", "MLP"), ("transformer.h.1.mlp", "MLP"),
                          ("root", "GPT")])

    def test_unit_whose_module_has_no_forward_is_gathered(self):
        """A policy that makes transformer.h (a ModuleList: no forward of
        its own) a unit: the Blocks' forwards gather it."""
        res = self.check("gpt", 2, wrap_module_lists)
        self.assertEqual([(n, c) for n, c, _ in res["units"]],
                         [("transformer.h", "ModuleList"), ("root", "GPT")])

    def test_unit_whose_submodules_the_root_calls_directly_is_gathered(self):
        """Each Pair is a unit whose own forward never runs: the root calls
        pair.a and pair.b, whose forwards gather (and release) it."""
        for transient in (True, False):
            res = self.check("direct", 2, "children", transient)
            self.assertEqual([(n, c) for n, c, _ in res["units"]],
                             [("pairs.0", "Pair"), ("pairs.1", "Pair"), ("out", "Linear")])

    def test_parameter_the_root_reads_directly_is_gathered(self):
        """The root computes F.linear(x, self.out.weight, self.out.bias)
        itself: out's unit is gathered by the read and its gradient
        reduced, though out's forward never runs."""
        res = self.check("read", 2, "children")
        self.assertEqual([n for n, _, _ in res["units"]], ["pairs.0", "pairs.1", "out"])

    def test_children_leaves_a_parameter_list_to_the_root(self):
        """A ParameterList child (no forward: the root reads its parameters
        between the pairs' forwards) is no unit of its own under
        "children": its parameters are the root's unit's."""
        res = self.check("gains", 2, "children")
        self.assertEqual([(n, c) for n, c, _ in res["units"]],
                         [("pairs.0", "Pair"), ("pairs.1", "Pair"), ("out", "Linear"),
                          ("root", "DirectNet")])
        self.assertEqual(res["units"][-1][2], ["scale", "gains.0", "gains.1"])

    def test_nested_units_resident(self):
        """Units nest (FSDP's nested wrapping): each Block's unit holds the
        parameters its MLP's unit does not."""
        res = self.check("gpt", 2, {models.Block, models.MLP}, transient=False)
        units = {n: p for n, _, p in res["units"]}
        self.assertEqual(sorted(units), ["root", "transformer.h.0", "transformer.h.0.mlp",
                                         "transformer.h.1", "transformer.h.1.mlp"])
        self.assertEqual(units["transformer.h.0.mlp"],
                         ["transformer.h.0." + n for n in GPT_BLOCK if n.startswith("mlp.")])
        self.assertEqual(units["transformer.h.0"],
                         ["transformer.h.0." + n for n in GPT_BLOCK
                          if not n.startswith("mlp.")])


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class WrapRefusalTest(unittest.TestCase):
    """Refused at construction, before any buffer is registered."""

    def client(self, transient=True):
        c = shardd.Client(common.socket(), job=common.job("wrap1"), rank=0, world=1,
                          transient_areas=transient)
        self.addCleanup(c.close)
        return c

    def test_unknown_policy(self):
        with self.assertRaisesRegex(ValueError, "auto_wrap must be 'module', 'children', "
                                    "a set of nn.Module classes or a callable"):
            shardd.nn.ShardedModule(self.client(), models.mlp(), auto_wrap="blocks")

    def test_nested_units_need_more_leases_than_transient_areas_give(self):
        model = models.nano_gpt()
        with self.assertRaisesRegex(
                ValueError, r"unit 'transformer.h.0.mlp' is nested in unit "
                r"'transformer.h.0': .* needs 3 at once \('transformer.h.0.mlp' in "
                r"'transformer.h.0' in 'root'\)"):
            shardd.nn.ShardedModule(self.client(), model, auto_wrap={models.Block, models.MLP})
        # nothing was replaced
        self.assertIsInstance(model.transformer.h[0].mlp.c_fc.weight, nn.Parameter)
        self.assertEqual(model.transformer.h[0].mlp.c_fc.weight.shape, (128, 32))

    def test_read_that_would_need_a_third_gather_area(self):
        """The root reads out.weight before the pairs' forwards, beside its
        own unit: the first pair's gather would need a third area."""
        model = direct_net(read="early")
        sm = shardd.nn.ShardedModule(self.client(), model, auto_wrap="children")
        with self.assertRaisesRegex(
                shardd.Error, r"unit 'pairs.0' needs a gather area for its forward, and "
                r"this rank's 2 are held by units \['out', 'root'\] \('out' by a read of "
                r"its parameter 'weight'\): a parameter read outside the forwards that "
                r"gather its unit"):
            model(torch.randn(2, 16))
        self.assertEqual([u.name for u in sm.units], ["pairs.0", "pairs.1", "out", "root"])

    def test_a_parameter_shared_outside_the_wrapped_module(self):
        """Wrapping nanoGPT's transformer alone would untie lm_head from
        wte: refused, naming the parameter and both holders."""
        model = models.nano_gpt()
        with self.assertRaisesRegex(
                ValueError, r"parameter 'wte.weight' of the wrapped module is also "
                r"'lm_head.weight' of the GPT holding both \(the wrapped module is "
                r"its 'transformer'\), outside it: wrapping would untie them; "
                r"wrap their common ancestor"):
            shardd.nn.ShardedModule(self.client(), model.transformer, auto_wrap="children")
        self.assertIs(model.lm_head.weight, model.transformer.wte.weight)


if __name__ == "__main__":
    unittest.main()
