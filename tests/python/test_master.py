"""16-bit buffers with an fp32 master, as FSDP's mixed precision: the
master starts from the exact fp32 values the trainer had, not from their
bf16 rounding. One rank, bf16 compute, AdamW: the daemon's parameters are
bit-identical to torch keeping fp32 master weights and copying them into a
bf16 model every step (with the master widened from bf16, as before, about
30% of the elements differ after the first step)."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim

STEPS = 5


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 32, 16, generator=g), torch.randn(STEPS, 32, 8, generator=g)


ADD_AT = 2  # add_param_group: the last layer's group joins before this step


def reference(add_group=False):
    """torch mixed precision: fp32 master weights stepped by AdamW on the
    fp32 casts of bf16 gradients; the bf16 model is their rounding.
    add_group: AdamW over the first layer, the last joins at ADD_AT."""
    torch.set_num_threads(1)
    x, y = data()
    master = [p.detach().clone() for p in model().parameters()]
    rb = model().to(torch.bfloat16)
    opt = torch.optim.AdamW(master[:2] if add_group else master, lr=1e-2, foreach=False)
    out = []
    for s in range(STEPS):
        if add_group and s == ADD_AT:
            opt.add_param_group({"params": master[2:], "lr": 3e-3})
        with torch.no_grad():
            for p, q in zip(rb.parameters(), master):
                p.copy_(q)
                p.grad = None
        loss = nn.functional.mse_loss(rb(x[s].bfloat16()).float(), y[s])
        loss.backward()
        for q, p in zip(master, rb.parameters()):
            q.grad = p.grad.float()
        opt.step()
        out.append((loss.item(), torch.cat([q.detach().bfloat16().reshape(-1) for q in master]),
                    [q.detach().clone() for q in master]))
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MasterTest(unittest.TestCase):
    def run_bf16(self, transient):
        c = shardd.Client(common.socket(), job=common.job("master"), rank=0, world=1,
                          transient_areas=transient)
        self.addCleanup(c.close)
        m = model()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children", dtype="bf16")
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        x, y = data()
        want = reference()
        for s in range(STEPS):
            opt.zero_grad()
            if not transient:
                sm.gather()
            loss = nn.functional.mse_loss(m(x[s].bfloat16()).float(), y[s])
            loss.backward()
            if not transient:
                sm.scatter()
            opt.step()
            got = torch.cat([t.reshape(-1) for t in sm.full_parameters().values()])
            self.assertEqual(loss.item(), want[s][0], "step %d's loss" % s)
            diff = (got != want[s][1]).sum().item()
            self.assertEqual(diff, 0, "step %d: %d of %d elements differ" % (s, diff, got.numel()))

    def test_bf16_resident_matches_torch_mixed_precision_bit_for_bit(self):
        self.run_bf16(False)

    def test_bf16_transient_matches_torch_mixed_precision_bit_for_bit(self):
        self.run_bf16(True)

    def train(self, c, sm, m, opt, steps, want, add_group=False):
        x, y = data()
        for s in steps:
            if add_group and s == ADD_AT:
                opt.add_param_group({"params": list(m[2].parameters()), "lr": 3e-3})
            opt.zero_grad()
            sm.gather()
            loss = nn.functional.mse_loss(m(x[s].bfloat16()).float(), y[s])
            loss.backward()
            sm.scatter()
            opt.step()
            got = torch.cat([t.reshape(-1) for t in sm.full_parameters().values()])
            self.assertEqual(loss.item(), want[s][0], "step %d's loss" % s)
            diff = (got != want[s][1]).sum().item()
            self.assertEqual(diff, 0, "step %d: %d of %d elements differ" % (s, diff, got.numel()))

    def test_bf16_state_dicts_carry_the_master(self):
        """A bf16 run's state dicts after 2 steps into a fresh job (fresh
        init, model then optimizer loaded): the continuation is bit for bit
        torch's mixed precision, because the optimizer's dict carries the
        fp32 master (the model's holds only its bf16 rounding)."""
        want = reference()
        c = shardd.Client(common.socket(), job=common.job("master4"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        m = model()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children", dtype="bf16")
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        self.train(c, sm, m, opt, range(2), want)
        osd, msd = opt.state_dict(), sm.state_dict()
        self.assertEqual(osd["state"]["0.weight"]["master"].dtype, torch.float32)
        full = opt.full_state_dict()
        self.assertEqual(full["state"][0]["master"].shape, m[0].weight.shape)
        self.assertFalse(torch.equal(full["state"][0]["master"].bfloat16().float(),
                                     full["state"][0]["master"]), "the master is not bf16")
        c2 = shardd.Client(common.socket(), job=common.job("master5"), rank=0, world=1,
                           transient_areas=False)
        self.addCleanup(c2.close)
        torch.manual_seed(7)  # another init: the dicts must replace it
        m2 = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
        sm2 = shardd.nn.ShardedModule(c2, m2, auto_wrap="children", dtype="bf16")
        opt2 = shardd.optim.AdamW(m2.parameters(), lr=1e-2)
        sm2.load_state_dict(msd)
        opt2.load_state_dict(osd)
        self.train(c2, sm2, m2, opt2, range(2, STEPS), want)

    def test_the_fp32_state_dict_is_torchs_fp32_master(self):
        """opt.fp32_state_dict() (DeepSpeed's zero_to_fp32) of a bf16 run
        after 3 steps: torch's fp32 master weights bit for bit, under
        torch's keys, where sm.state_dict() gives their bf16 rounding
        (which differs from the master in most elements)."""
        want = reference()
        c = shardd.Client(common.socket(), job=common.job("master-fp32"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        m = model()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children", dtype="bf16")
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        self.train(c, sm, m, opt, range(3), want)
        got, plain = opt.fp32_state_dict(), sm.state_dict()
        names = [n for n, _ in model().named_parameters()]
        self.assertEqual(list(got), list(plain))
        for n, q in zip(names, want[2][2]):
            self.assertEqual(got[n].dtype, torch.float32, n)
            self.assertTrue(torch.equal(got[n], q), n)
            self.assertEqual(plain[n].dtype, torch.bfloat16, n)
            self.assertFalse(torch.equal(plain[n].float(), q), n)

    def test_bf16_add_param_group_carries_the_master(self):
        """add_param_group in a bf16 run re-registers the daemon's
        optimizer: the first group's fp32 master goes with it (bit for bit
        torch's mixed precision, which adds the group to the same
        optimizer over its fp32 masters)."""
        want = reference(add_group=True)
        c = shardd.Client(common.socket(), job=common.job("master6"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        m = model()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="module", dtype="bf16")
        opt = shardd.optim.AdamW(m[0].parameters(), lr=1e-2)
        self.train(c, sm, m, opt, range(STEPS), want, add_group=True)

    def test_seed_after_the_optimizer_and_fp32_refused(self):
        c = shardd.Client(common.socket(), job=common.job("master1"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        b = c.register_buffer("w", "bf16", 4)
        v = c.register_view(b, "w.v", 0, (4,))
        opt = c.register_optimizer("sgd", [[v]], name="sgd", lr=1.0)
        exact = torch.tensor([1.0029, -3.0117, 0.10003, 7.0313])  # not bf16 values
        b.shard_tensor.copy_(exact.bfloat16())
        c.seed_master(b, exact)
        self.assertTrue(torch.all(b.reduced_tensor == 0), "the reduced area is zeroed")
        c.gather(b)
        g = torch.tensor([0.0078, 0.0039, 0.0004, 0.03]).bfloat16()
        b.grad_tensor.copy_(g)
        c.scatter(b, "sum")
        c.step(opt)
        # SGD lr 1: from the exact master, not from its bf16 rounding
        seeded = (exact - g.float()).bfloat16()
        widened = (exact.bfloat16().float() - g.float()).bfloat16()
        self.assertTrue(bool(torch.any(seeded != widened)), "the case tells them apart")
        self.assertEqual(b.shard_tensor.tolist(), seeded.tolist())
        # the trainer writes the 16-bit shard after a step: the next step
        # starts from what it wrote (adopted into the master), never
        # silently back from the master's old value
        written = torch.tensor([0.5, 2.0, -4.0, 8.0]).bfloat16()
        b.shard_tensor.copy_(written)
        c.gather(b)
        b.grad_tensor.zero_()
        c.scatter(b, "sum")
        c.step(opt)  # SGD, zero gradient: the values stay
        self.assertEqual(b.shard_tensor.tolist(), written.tolist())
        f = c.register_buffer("f", "fp32", 4)
        with self.assertRaises(shardd.Error) as cm:
            c.seed_master(f, torch.zeros(4))
        self.assertEqual(cm.exception.code_name, "E_INVAL")
        self.assertIn("its own master", cm.exception.message)

    def test_the_master_is_readable_and_writable(self):
        """The fp32 master (a state dict of a bf16 run needs it): read as
        an OptimState array, refused for fp32 and before it exists; a
        write before the first step takes the rest from the shard."""
        c = shardd.Client(common.socket(), job=common.job("master2"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        b = c.register_buffer("w", "bf16", 6)
        v = c.register_view(b, "w.v", 0, (4,))
        u = c.register_view(b, "w.u", 4, (2,))
        opt = c.register_optimizer("sgd", [[v, u]], name="sgd", lr=1.0)
        exact = torch.tensor([1.0029, -3.0117, 0.10003, 7.0313, 0.3333, -0.7777])
        b.shard_tensor.copy_(exact.bfloat16())
        with self.assertRaises(shardd.Error) as cm:
            c.optim_master(opt, v)
        self.assertEqual(cm.exception.code_name, "E_STATE")
        self.assertIn("no fp32 master yet", cm.exception.message)
        c.seed_master(b, exact)
        self.assertEqual(c.optim_master(opt, v).tolist(), exact[:4].tolist())
        self.assertEqual(c.optim_master(opt, u, offset=1).tolist(), exact[5:].tolist())
        c.gather(b)
        g = torch.tensor([0.0078, 0.0039, 0.0004, 0.03, 0.5, 0.25]).bfloat16()
        b.grad_tensor.copy_(g)
        c.scatter(b, "sum")
        c.step(opt)
        self.assertEqual(c.optim_master(opt, v).tolist(), (exact - g.float())[:4].tolist())
        # written: the next step updates it
        m = torch.tensor([0.1234567, 2.7182817])
        c.set_optim_master(opt, u, m)
        c.gather(b)
        b.grad_tensor.zero_()
        c.scatter(b, "sum")
        c.step(opt)
        self.assertEqual(c.optim_master(opt, u).tolist(), m.tolist())
        # a view the optimizer does not hold: its master is readable
        # (the exact seed), not writable, and has no step count to set
        w = c.register_view(b, "w.w", 4, (2,))
        self.assertEqual(c.optim_master(opt, w).tolist(), m.tolist())
        with self.assertRaises(shardd.Error) as cm:
            c.set_optim_master(opt, w, m)
        self.assertEqual(cm.exception.code_name, "E_NOT_FOUND")
        other = c.register_buffer("o", "bf16", 2)
        with self.assertRaises(shardd.Error) as cm:
            c.optim_master(opt, c.register_view(other, "o.v", 0, (2,)))
        self.assertEqual(cm.exception.code_name, "E_NOT_FOUND")
        # a new optimizer over the trained buffer has no master until a
        # write takes it from the shard (then the written part)
        c.unregister_optimizer(opt)
        opt2 = c.register_optimizer("sgd", [[v, u]], name="sgd2", lr=1.0)
        with self.assertRaises(shardd.Error):
            c.optim_master(opt2, v)
        c.set_optim_master(opt2, u, m)
        self.assertEqual(c.optim_master(opt2, u).tolist(), m.tolist())
        self.assertEqual(c.optim_master(opt2, v).tolist(),
                         b.shard_tensor[:4].float().tolist())
        f = c.register_buffer("f", "fp32", 4)
        fv = c.register_view(f, "f.v", 0, (4,))
        fopt = c.register_optimizer("sgd", [[fv]], name="sgdf", lr=1.0)
        with self.assertRaises(shardd.Error) as cm:
            c.optim_master(fopt, fv, count=0)
        self.assertEqual(cm.exception.code_name, "E_INVAL")
        self.assertIn("its own master", cm.exception.message)

    def test_a_write_to_a_frozen_view_is_adopted_when_it_is_unfrozen(self):
        """Steps skip a frozen view (no adoption then); once unfrozen, the
        value the trainer wrote into its 16-bit shard while it was frozen
        is what the step starts from, not the master's old value."""
        c = shardd.Client(common.socket(), job=common.job("master3"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        b = c.register_buffer("w", "bf16", 8)
        live = c.register_view(b, "w.a", 0, (4,))
        frozen = c.register_view(b, "w.b", 4, (4,), requires_grad=False)
        opt = c.register_optimizer("sgd", [[live, frozen]], name="sgd", lr=1.0)
        b.shard_tensor.copy_(torch.arange(8).float().bfloat16())

        def step():
            c.gather(b)
            b.grad_tensor.zero_()
            c.scatter(b, "sum")
            c.step(opt)  # SGD, zero gradient: the values stay

        step()
        step()
        written = torch.tensor([0.5, 2.0, -4.0, 8.0]).bfloat16()
        b.shard_tensor[4:8].copy_(written)
        step()  # frozen: skipped
        self.assertEqual(b.shard_tensor[4:8].tolist(), written.tolist())
        c.set_requires_grad(frozen, True)
        step()
        self.assertEqual(b.shard_tensor[4:8].tolist(), written.tolist())
        self.assertEqual(c.optim_master(opt, frozen).tolist(), written.float().tolist())
        self.assertEqual(c.optim_state(opt, frozen, arrays=False)["steps"], 1)


if __name__ == "__main__":
    unittest.main()


def _page(n):
    return (n + 4095) // 4096 * 4096


def _job_bytes(c):
    st = c.status()
    (job,) = [j for j in st["jobs"] if j["name"] == c.job]
    return (job["bytes"], sum(d["used_bytes"] for d in st["devices"]),
            sum(d["peak_bytes"] for d in st["devices"]))


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MasterMemoryTest(unittest.TestCase):
    """A 16-bit unit holds its 16-bit shard, its fp32 reduced gradient and
    the optimizer's state (the fp32 master, the moments): no fp32 copy of
    the initial values beside the master, before the first step or after,
    and the move of that copy into the master at the optimizer's
    registration never holds both (the device's peak)."""

    def test_bf16_unit_holds_no_copy_beside_its_master(self):
        d = common.own_daemon(devices=1)
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        c = shardd.Client(d.socket, job=common.job("master-mem"), rank=0, world=1)
        self.addCleanup(c.close)
        m = model()
        sm = shardd.nn.ShardedModule(c, m, dtype="bf16")
        (b,) = sm.buffers
        n = b.shard_numel  # one rank: the whole unit
        block = _page(2 * n) + _page(4 * n)  # bf16 shard, fp32 reduced gradient
        arr = _page(4 * n)                   # one fp32 array of the shard
        # wrapped, no optimizer: the exact fp32 values wait in one array
        self.assertEqual(_job_bytes(c), (block + arr,) * 3)
        self.assertEqual(sm.memory_stats()["shard_bytes"], block + arr)
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        # the optimizer's master took them: master + exp_avg + exp_avg_sq,
        # and the device never held both
        state = 3 * arr
        self.assertEqual(_job_bytes(c), (block + state,) * 3)
        self.assertEqual(sm.memory_stats()["shard_bytes"], block + state)
        # the pools' slots, made as leased: the unit's gathered copy and
        # its gradient area, each in bf16 (2 of each at most)
        pool = 2 * _page(2 * n)
        x, y = data()
        want = reference()
        for s in range(STEPS):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x[s].bfloat16()).float(), y[s])
            loss.backward()
            opt.step()
            self.assertEqual(loss.item(), want[s][0], "step %d's loss" % s)
            self.assertEqual(_job_bytes(c), (block + state + pool,) * 3, "step %d" % s)
            self.assertEqual(sm.memory_stats()["trainer_bytes"], 0)
        got = torch.cat([t.reshape(-1) for t in sm.full_parameters().values()])
        self.assertEqual((got != want[-1][1]).sum().item(), 0)

    def test_the_seed_moves_between_optimizers_before_the_first_step(self):
        """Seeded before any optimizer: a region of its own until the first
        optimizer's master takes it; a second optimizer over the same shard
        copies that master; unregistering both gives it back; the
        optimizer registered then still starts from the exact values."""
        d = common.own_daemon(devices=1)
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        c = shardd.Client(d.socket, job=common.job("master-move"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        b = c.register_buffer("w", "bf16", 4)
        v = c.register_view(b, "w.v", 0, (2,))
        u = c.register_view(b, "w.u", 2, (2,))
        block = _job_bytes(c)[0]
        page = 4096  # 4 fp32 values: one page
        exact = torch.tensor([1.0029, -3.0117, 0.10003, 7.0313])  # not bf16 values
        b.shard_tensor.copy_(exact.bfloat16())
        c.seed_master(b, exact)
        self.assertEqual(_job_bytes(c), (block + page,) * 3)
        o1 = c.register_optimizer("sgd", [[v]], name="o1", lr=1.0)
        self.assertEqual(_job_bytes(c), (block + page,) * 3, "moved, not copied")
        o2 = c.register_optimizer("sgd", [[u]], name="o2", lr=1.0)
        self.assertEqual(_job_bytes(c)[0], block + 2 * page)
        self.assertEqual(c.optim_master(o1, v).tolist(), exact[:2].tolist())
        self.assertEqual(c.optim_master(o2, u).tolist(), exact[2:].tolist())
        c.unregister_optimizer(o1)
        self.assertEqual(c.optim_master(o2, u).tolist(), exact[2:].tolist())
        c.unregister_optimizer(o2)
        self.assertEqual(_job_bytes(c)[:2], (block + page,) * 2, "back in its own region")
        o3 = c.register_optimizer("sgd", [[v, u]], name="o3", lr=1.0)
        self.assertEqual(_job_bytes(c)[:2], (block + page,) * 2)
        self.assertEqual(c.optim_master(o3, v).tolist(), exact[:2].tolist())
        c.gather(b)
        g = torch.tensor([0.0078, 0.0039, 0.0004, 0.03]).bfloat16()
        b.grad_tensor.copy_(g)
        c.scatter(b, "sum")
        c.step(o3)
        # SGD lr 1: from the exact master, not from its bf16 rounding
        self.assertEqual(b.shard_tensor.tolist(), (exact - g.float()).bfloat16().tolist())
        self.assertEqual(_job_bytes(c)[:2], (block + page,) * 2)


class _Scaled(nn.Module):
    """model()'s layers and a floating buffer (FSDP's buffer_dtype casts it)
    and an integer one (never cast)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8) + 1e-3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.net(x) * self.scale


class _MP:  # what torch's MixedPrecision holds (its module does not import here)
    def __init__(self, **kw):
        self.param_dtype = self.reduce_dtype = self.buffer_dtype = None
        self.keep_low_precision_grads = False
        self.__dict__.update(kw)


def scaled_reference():
    """torch's bf16 recipe, FSDP's MixedPrecision(param_dtype=bf16,
    reduce_dtype=fp32, buffer_dtype=bf16): fp32 master weights stepped by
    AdamW on the fp32 casts of the bf16 gradients; the model's bf16 copy
    and buffer compute on bf16 casts of the inputs."""
    torch.set_num_threads(1)
    x, y = data()
    master = [p.detach().clone() for p in _Scaled().parameters()]
    rb = _Scaled().to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=1e-2, foreach=False)
    out = []
    for s in range(STEPS):
        with torch.no_grad():
            for p, q in zip(rb.parameters(), master):
                p.copy_(q)
                p.grad = None
        loss = nn.functional.mse_loss(rb(x[s].bfloat16()).float(), y[s])
        loss.backward()
        for q, p in zip(master, rb.parameters()):
            q.grad = p.grad.float()
        opt.step()
        out.append((loss.item(), torch.cat([q.detach().bfloat16().reshape(-1) for q in master]),
                    [q.detach().clone() for q in master]))
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MixedPrecisionTest(unittest.TestCase):
    """FSDP's MixedPrecision knobs as ShardedModule options."""

    def run_knobs(self, **kw):
        c = shardd.Client(common.socket(), job=common.job("mp"), rank=0, world=1)
        self.addCleanup(c.close)
        m = _Scaled()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children", **kw)
        self.assertEqual(m.scale.dtype, torch.bfloat16, "buffer_dtype casts the buffer")
        self.assertEqual(m.calls.dtype, torch.long, "not an integer one")
        self.assertEqual(sm.buffers[0].dtype, "bf16")
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        x, y = data()
        want = scaled_reference()
        for s in range(STEPS):
            opt.zero_grad()
            out = m(x[s])  # fp32 inputs: cast to param_dtype, as FSDP casts them
            self.assertEqual(out.dtype, torch.bfloat16)
            loss = nn.functional.mse_loss(out.float(), y[s])
            loss.backward()
            opt.step()
            got = torch.cat([t.reshape(-1) for t in sm.full_parameters().values()])
            self.assertEqual(loss.item(), want[s][0], "step %d's loss" % s)
            diff = (got != want[s][1]).sum().item()
            self.assertEqual(diff, 0, "step %d: %d of %d elements differ" % (s, diff, got.numel()))
        sd = m.state_dict()
        self.assertEqual(sd["scale"].dtype, torch.float32, "full precision in a full state dict")
        self.assertEqual(sd["scale"].tolist(), _Scaled().scale.bfloat16().float().tolist())
        self.assertEqual(m.scale.dtype, torch.bfloat16, "and bf16 on the module still")

    def test_param_reduce_buffer_dtype_match_torchs_bf16_recipe(self):
        self.run_knobs(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                       buffer_dtype=torch.bfloat16)

    def test_a_mixed_precision_object_is_taken(self):
        self.run_knobs(mixed_precision=_MP(param_dtype=torch.bfloat16,
                                           buffer_dtype=torch.bfloat16))

    def test_what_the_daemon_does_not_do_is_refused(self):
        c = shardd.Client(common.socket(), job=common.job("mp-no"), rank=0, world=1)
        self.addCleanup(c.close)
        cases = [
            (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), "reduce_dtype"),
            (dict(reduce_dtype=torch.float16), "reduces gradients in fp32"),
            (dict(dtype="fp16", param_dtype=torch.bfloat16), "differ"),
            (dict(param_dtype=torch.float64), "not supported"),
            (dict(mixed_precision=_MP(param_dtype=torch.bfloat16), param_dtype=torch.bfloat16),
             "given twice"),
            (dict(mixed_precision=_MP(param_dtype=torch.bfloat16,
                                      keep_low_precision_grads=True)),
             "keep_low_precision_grads"),
        ]
        for kw, words in cases:
            m = _Scaled()
            with self.assertRaises(ValueError, msg=str(kw)) as cm:
                shardd.nn.ShardedModule(c, m, **kw)
            self.assertIn(words, str(cm.exception))
            self.assertEqual(m.scale.dtype, torch.float32, "nothing was changed")
        # fp32 units reduce in fp32: reduce_dtype fp32 with fp32 params is taken
        m = _Scaled()
        shardd.nn.ShardedModule(c, m, param_dtype=torch.float32, reduce_dtype=torch.float32)
        self.assertEqual(m.net[0].weight.dtype, torch.float32)


def two_rank_reference(world):
    """scaled_reference() on world ranks' slices of each batch: each
    rank's bf16 gradients cast to fp32 and their mean taken in fp32
    (FSDP's reduce_dtype=torch.float32), summed in rank order."""
    torch.set_num_threads(1)
    x, y = data()
    per = x.shape[1] // world
    master = [p.detach().clone() for p in _Scaled().parameters()]
    rb = _Scaled().to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=1e-2, foreach=False)
    out = []
    for s in range(STEPS):
        total = [None] * len(master)
        losses = []
        for r in range(world):
            with torch.no_grad():
                for p, q in zip(rb.parameters(), master):
                    p.copy_(q)
                    p.grad = None
            xs, ys = x[s, r * per:(r + 1) * per], y[s, r * per:(r + 1) * per]
            loss = nn.functional.mse_loss(rb(xs.bfloat16()).float(), ys)
            loss.backward()
            losses.append(loss.item())
            for i, p in enumerate(rb.parameters()):
                g = p.grad.float()
                total[i] = g if total[i] is None else total[i] + g
        for q, t in zip(master, total):
            q.grad = t / world
        opt.step()
        out.append((losses, torch.cat([q.detach().bfloat16().reshape(-1) for q in master])))
    return out


def mp_rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        c = shardd.Client(sock, job=job, rank=rank, world=world)
        m = _Scaled()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children", param_dtype=torch.bfloat16,
                                     reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        x, y = data()
        per = x.shape[1] // world
        losses, params = [], []
        for s in range(STEPS):
            opt.zero_grad()
            xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
            loss = nn.functional.mse_loss(m(xs).float(), ys)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            # plain lists: a tensor on the queue outlives its rank's process badly
            params.append(torch.cat([t.reshape(-1) for t in sm.full_parameters().values()])
                          .float().tolist())
        q.put(("result", rank, losses, params))
        c.close()
        q.put(("done", rank))
    except BaseException as e:  # noqa: BLE001
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MixedPrecisionRanksTest(unittest.TestCase):
    def test_two_ranks_match_torchs_bf16_recipe_with_an_fp32_reduce(self):
        """2 ranks: the daemon's fp32 reduction of the ranks' bf16
        gradients is FSDP's reduce_dtype=torch.float32, bit for bit."""
        world, job, sock = 2, common.job("mp2"), common.socket()
        got = {}
        common.launch_ranks(mp_rank_main, lambda r, q: (r, world, sock, job, q), world,
                            lambda msg: got.__setitem__(msg[1], msg[2:]))
        want = two_rank_reference(world)
        for r in range(world):
            losses, params = got[r]
            for s in range(STEPS):
                self.assertEqual(losses[s], want[s][0][r], "rank %d step %d's loss" % (r, s))
                diff = (torch.tensor(params[s]) != want[s][1].float()).sum().item()
                self.assertEqual(diff, 0, "rank %d step %d: %d elements differ" % (r, s, diff))


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MasterQuotaTest(unittest.TestCase):
    def test_a_refused_optimizer_leaves_the_seeds_and_a_smaller_one_fits(self):
        """Under --job-memory-limit 90K, two seeded bf16 buffers (resident
        blocks of 16 KiB and 40 KiB, seeds of 4 and 16 KiB: 76 KiB held).
        AdamW over both fits the first shard's state (its seed moved into
        it) but not the second's: refused, and both seeds are back where
        they were, the job at 76 KiB. SGD's masters then fit only because a
        seed moves into its master instead of staying beside it (76 KiB:
        a copy would make it 96) and start from the exact values."""
        d = common.own_daemon(devices=1, extra_args=["--job-memory-limit", "90K"])
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        c = shardd.Client(d.socket, job=common.job("master-quota"), rank=0, world=1,
                          transient_areas=False)
        self.addCleanup(c.close)
        K = 1024
        bufs, views, exact = [], [], []
        for name, n in (("a", 1024), ("b", 4096)):
            b = c.register_buffer(name, "bf16", n)
            views.append(c.register_view(b, name + ".v", 0, (n,)))
            e = torch.linspace(-3.0117, 7.0313, n) + 1e-4  # not bf16 values
            b.shard_tensor.copy_(e.bfloat16())
            c.seed_master(b, e)
            bufs.append(b)
            exact.append(e)
        self.assertEqual(_job_bytes(c)[0], 76 * K)
        with self.assertRaises(shardd.Error) as cm:
            c.register_optimizer("adamw", [views], name="adamw", lr=1e-3)
        self.assertEqual(cm.exception.code_name, "E_NO_MEMORY")
        self.assertIn("--job-memory-limit", cm.exception.message)
        self.assertEqual(_job_bytes(c)[:2], (76 * K,) * 2)
        sgd = c.register_optimizer("sgd", [views], name="sgd", lr=1.0)
        self.assertEqual(_job_bytes(c)[:2], (76 * K,) * 2)
        for v, e in zip(views, exact):
            self.assertEqual(c.optim_master(sgd, v).tolist(), e.tolist())
