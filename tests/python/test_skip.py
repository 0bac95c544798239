"""torch's skip semantics through shardd.nn (issue 18): frozen parameters and
parameters without a gradient, against one process of plain torch.optim on
the full batch.

torch.optim skips a parameter whose .grad is None -- frozen
(requires_grad=False), or not reached by this backward -- whole: no weight
decay, no moment update, and its own state["step"] does not advance. Ranks
are processes (forkserver) of one job, each with its slice of the global
batch and mean reduction, resident areas (the explicit loop with
zero_grad(set_to_none=True)) and transient ones (the plain torch loop)."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn

STEPS = 7
BATCH = 24
UNUSED = range(2, 5)   # steps without the branch, on every rank (k = 3)
UNFREEZE_AT = 3        # gradual unfreezing: base.weight trainable from here
TOL = 1e-5             # parameters: per tensor max|a-b| / max|b|
HYPER = {
    "adamw": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    "adam": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    "sgd": dict(lr=5e-2, momentum=0.9, weight_decay=0.01),
}
TORCH_OPT = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


# ---- models (every rank builds the same one) ---------------------------------

class _LoRA(nn.Module):
    """A frozen base layer (and head weight) with a trainable low-rank
    adapter beside it: one flat buffer mixes frozen and trainable views."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(12, 12)
        self.down = nn.Linear(12, 3, bias=False)
        self.up = nn.Linear(3, 12, bias=False)
        self.head = nn.Linear(12, 4)

    def forward(self, x, use_b=True):
        return self.head(torch.tanh(self.base(x) + self.up(self.down(x))))


def lora():
    torch.manual_seed(0)
    m = _LoRA()
    for p in (m.base.weight, m.base.bias, m.head.weight):
        p.requires_grad_(False)
    return m


FROZEN = ("base.weight", "base.bias", "head.weight")


class _Branchy(nn.Module):
    """b is a branch some steps (or ranks) do not take: its parameters get
    no gradient there. It comes first, so its backward is the last."""

    def __init__(self):
        super().__init__()
        self.b = nn.Linear(12, 12)
        self.a = nn.Linear(12, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, use_b=True):
        if use_b:
            x = x + self.b(x)
        return self.head(torch.tanh(self.a(x)))


def branchy():
    torch.manual_seed(0)
    return _Branchy()


MODELS = {"lora": lora, "branchy": branchy}


def make_data():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS, BATCH, 12, generator=g),
            torch.randn(STEPS, BATCH, 4, generator=g))


def uses_b(case, step, rank):
    """Whether rank takes the branch at step."""
    if case == "unused":
        return step not in UNUSED
    if case == "one_rank":
        return rank == 0
    return True


# case "accum": two backwards per step (gradient accumulation), each on half
# of every rank's slice; the branch is taken in these of them (every rank
# alike): it must be stepped when either backward reached it, and skipped
# when neither did
ACCUM_USES = {0: (True, True), 1: (False, True), 2: (False, False),
              3: (True, False), 4: (False, False)}


# case "nobackward": steps that run no forward, backward or scatter on any
# rank and still call the step: torch's .grad is None there (zero_grad), so
# nothing changes and no step count moves; the daemon must not apply the
# previous step's reduced gradient again
NO_BACKWARD = (2, 3)


def uses_b_mb(step, k):
    return ACCUM_USES.get(step, (True, True))[k]


def maybe_unfreeze(case, model, step):
    if case == "unfreeze" and step == UNFREEZE_AT:
        model.base.weight.requires_grad_(True)


def reference(case, model_name, kind, world):
    """One process, the full batch (rank r's slice takes the branch as rank
    r does), torch.optim with every parameter, grads set to None."""
    torch.set_num_threads(1)
    model = MODELS[model_name]()
    x, y = make_data()
    opt = getattr(torch.optim, TORCH_OPT[kind])(model.parameters(), foreach=False,
                                                 **HYPER[kind])
    per = BATCH // world
    for s in range(STEPS):
        maybe_unfreeze(case, model, s)
        opt.zero_grad(set_to_none=True)
        if case == "nobackward" and s in NO_BACKWARD:
            opt.step()
            continue
        if case == "accum":
            mb = per // 2
            for k in range(2):
                loss = sum(nn.functional.mse_loss(
                    model(x[s, r * per + k * mb:r * per + (k + 1) * mb], uses_b_mb(s, k)),
                    y[s, r * per + k * mb:r * per + (k + 1) * mb])
                    for r in range(world)) / world / 2
                loss.backward()
            opt.step()
            continue
        loss = sum(nn.functional.mse_loss(model(x[s, r * per:(r + 1) * per],
                                                uses_b(case, s, r)),
                                          y[s, r * per:(r + 1) * per])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    steps = {n: int(opt.state[p]["step"]) if "step" in opt.state[p] else 0
             for n, p in model.named_parameters()} if kind != "sgd" else {}
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, steps


# ---- one rank ------------------------------------------------------------------

def rank_main(rank, world, sock, job, case, model_name, kind, transient, auto_wrap, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient,
                               client_name="test_skip rank %d" % rank)
        model = MODELS[model_name]()
        x, y = make_data()
        per = BATCH // world
        lo, hi = rank * per, (rank + 1) * per
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap)
        # every parameter, frozen ones too, as fine-tuning scripts do
        opt = sm.register_optimizer(kind, model.parameters(), name="opt", **HYPER[kind])
        for s in range(STEPS):
            maybe_unfreeze(case, model, s)
            use = uses_b(case, s, rank)
            if case == "nobackward" and s in NO_BACKWARD:
                # no backward, no scatter: the step has no fresh gradient
                # (every .grad None, as the reference's zero_grad leaves it)
                sm.zero_grad(set_to_none=True)
            elif case == "accum":  # transient: the hooks' scatters accumulate
                # None, as the reference's (zero_grad() keeps zero gradients,
                # which a step applies, as torch's)
                sm.zero_grad(set_to_none=True)
                mb = per // 2
                for k in range(2):
                    a, b = lo + k * mb, lo + (k + 1) * mb
                    loss = nn.functional.mse_loss(model(x[s, a:b], uses_b_mb(s, k)),
                                                  y[s, a:b]) / 2
                    loss.backward()
            elif transient:  # the plain torch loop
                sm.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x[s, lo:hi], use), y[s, lo:hi])
                loss.backward()
            else:
                sm.gather()
                sm.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x[s, lo:hi], use), y[s, lo:hi])
                loss.backward()
                sm.scatter("mean")
            sm.step(opt)
        params = sm.full_parameters()
        if rank == 0:
            steps = {e.name: client.inspect(e.view.id).get("steps")
                     for u in sm.units for e in u.entries}
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()}, steps))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(case, model_name, kind, world, transient, auto_wrap="children", timeout=60):
    job = common.job("skip")
    sock = common.socket()
    out = []

    def on_msg(msg):
        if msg[0] == "params":
            out.append((msg[1], msg[2]))

    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, case, model_name,
                                                 kind, transient, auto_wrap, q),
                        world, on_msg, timeout)
    return out[-1] if out else None


rel = common.max_rel


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class SkipTest(unittest.TestCase):
    def check(self, case, model_name, kind, world, transient, auto_wrap="children"):
        label = "%s %s %s, %d ranks, %s, %s" % (case, model_name, kind, world,
                                                "transient" if transient else "resident",
                                                auto_wrap)
        got, steps = run(case, model_name, kind, world, transient, auto_wrap)
        want, want_steps = reference(case, model_name, kind, world)
        self.assertEqual(sorted(got), sorted(want))
        worst = max(rel(got[n], want[n]) for n in want)
        print("\n  %s: parameters max rel %.3g; view steps %s" % (label, worst, steps))
        for n in want:
            self.assertLessEqual(rel(got[n], want[n]), TOL, "%s: %s" % (label, n))
        # torch's per-parameter step counts are the daemon's per-view ones
        for n, k in want_steps.items():
            self.assertEqual(steps[n], k, "%s: steps of %s" % (label, n))
        return got, want

    def check_lora(self, world, transient, auto_wrap):
        got, want = self.check("lora", "lora", "adamw", world, transient, auto_wrap)
        init = dict(lora().named_parameters())
        for n in FROZEN:  # AdamW's decay never touched them
            np.testing.assert_array_equal(got[n], init[n].detach().numpy(), err_msg=n)
        for n in ("down.weight", "up.weight", "head.bias"):
            self.assertFalse(np.array_equal(got[n], init[n].detach().numpy()), n)

    def test_lora_frozen_base_two_ranks(self):
        self.check_lora(2, False, "module")
        self.check_lora(2, True, "children")

    def test_lora_frozen_base_four_ranks(self):
        self.check_lora(4, True, "module")
        self.check_lora(4, False, "children")

    def test_unused_on_every_rank_for_k_steps(self):
        for kind in ("adamw", "adam", "sgd"):
            got, want = self.check("unused", "branchy", kind, 2, False)
        self.check("unused", "branchy", "adamw", 2, True)
        self.check("unused", "branchy", "adam", 4, True, "module")

    def test_gradient_accumulation_skips_only_what_no_backward_reached(self):
        """Two backwards per step: a parameter one of them reached is
        stepped, one neither reached is skipped (its step count stays)."""
        self.check("accum", "branchy", "adamw", 2, True)
        self.check("accum", "branchy", "adam", 2, True, "module")

    def test_gradual_unfreezing(self):
        self.check("unfreeze", "lora", "adamw", 2, False)
        self.check("unfreeze", "lora", "adamw", 2, True, "module")
        # a unit that was wholly frozen gets a backward once unfrozen
        self.check("unfreeze", "lora", "adamw", 2, True, "children")

    def test_a_view_used_on_one_rank_is_stepped(self):
        got, _ = self.check("one_rank", "branchy", "adamw", 2, False)
        init = dict(branchy().named_parameters())
        self.assertFalse(np.array_equal(got["b.weight"], init["b.weight"].detach().numpy()))
        # transient: every rank gathers every unit it calls (a collective), so
        # the branch lives in the one unit all ranks gather, unused on rank 1
        self.check("one_rank", "branchy", "adam", 2, True, "module")

    def test_a_step_without_a_backward_since_the_last_changes_nothing(self):
        """Resident areas: no scatter since the last step; transient: no
        backward. Both as torch's step with every .grad None."""
        self.check("nobackward", "branchy", "adamw", 2, False)
        self.check("nobackward", "branchy", "sgd", 2, True)


if __name__ == "__main__":
    unittest.main()
