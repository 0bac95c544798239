"""shardd.nn.ShardedModule: parameters are gather-area views, grads land in
the grad area, optimizers over non-shardd tensors are refused by name, and
a write into a parameter while its unit is gathered (the node's read-only
copy) names the line that wrote."""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from unittest import mock

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn


def small_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def in_area(t, buf, area):
    lo = buf.address(area)
    elem = t.element_size()
    n = buf.padded_numel if area in ("gather", "grad") else buf.shard_numel
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * elem <= lo + n * elem


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ShardedModuleTest(unittest.TestCase):
    def setUp(self):
        self.sock = common.socket()
        self.c = shardd.Client(self.sock, job=common.job("nn"), rank=0, world=1,
                               transient_areas=False)
        self.addCleanup(self.c.close)

    def test_params_are_gather_views(self):
        model = small_model()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        sm = shardd.nn.ShardedModule(self.c, model, auto_wrap="children")
        self.assertEqual([u.name for u in sm.units], ["0", "2"])
        for u in sm.units:
            for e in u.entries:
                self.assertIsInstance(e.param, nn.Parameter)
                self.assertTrue(in_area(e.param, u.buffer, "gather"), e.name)
                self.assertEqual(e.view.name, e.name)
        # the constructor's gather brought the initial values back
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), init[n], rtol=0, atol=0)
        # the daemon knows each original parameter as a view
        info = self.c.inspect("2.weight")
        self.assertEqual(info["kind"], "view")
        self.assertEqual(info["shape"], [2, 5])
        # the forward uses daemon data: change the shard, gather, see it
        u = sm.units[1]
        u.buffer.shard_tensor.fill_(0.5)
        sm.gather()
        self.assertTrue(torch.all(model[2].weight == 0.5))
        x = torch.ones(1, 3)
        with torch.no_grad():
            h = torch.tanh(model[0](x))
            out = model(x)
        torch.testing.assert_close(out, (0.5 * h.sum() + 0.5).expand(1, 2))

    def test_the_wrapper_is_called_as_fsdps_and_reached_from_import_shardd(self):
        # an FSDP user's two first habits: ``import shardd`` then
        # ``shardd.nn.X`` (as ``torch.nn``), and calling the wrapper
        import os
        import subprocess
        import sys
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(shardd.__file__)))
        out = subprocess.run(
            [sys.executable, "-c", "import shardd; print(shardd.nn.ShardedModule.__name__, "
             "shardd.optim.AdamW.__name__)"], capture_output=True, text=True, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["ShardedModule", "AdamW"])
        model = small_model()
        sm = shardd.nn.ShardedModule(self.c, model, auto_wrap="children")
        x = torch.randn(4, 3)
        with torch.no_grad():
            torch.testing.assert_close(sm(x), model(x), rtol=0, atol=0)
        sm(x).square().sum().backward()
        self.assertTrue(all(p.grad is not None for p in model.parameters()))

    def test_a_control_session_is_refused_saying_why(self):
        # a torchrun script started as plain python: Client() has no job
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        with mock.patch.dict(os.environ, env, clear=True):
            c = shardd.Client(self.sock)
        self.addCleanup(c.close)
        self.assertIsNone(c.job)
        with self.assertRaises(ValueError) as cm:
            shardd.nn.ShardedModule(c, small_model())
        self.assertIn("TORCHELASTIC_RUN_ID", str(cm.exception))
        self.assertIn("job=", str(cm.exception))

    def test_grads_land_in_grad_area(self):
        model = small_model()
        sm = shardd.nn.ShardedModule(self.c, model)
        self.assertEqual(len(sm.units), 1)
        buf = sm.units[0].buffer
        x = torch.randn(4, 3)
        sm.zero_grad()
        model(x).square().sum().backward()
        for p in model.parameters():
            self.assertTrue(in_area(p.grad, buf, "grad"), "grad accumulated in place")
        ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(buf.grad_tensor[:ref.numel()], ref, rtol=0, atol=0)
        # if something replaces .grad, scatter copies it into the grad area
        model.zero_grad(set_to_none=True)
        model(2 * x).square().sum().backward()
        ref2 = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        sm.scatter("mean")
        torch.testing.assert_close(buf.grad_tensor[:ref2.numel()], ref2, rtol=0, atol=0)
        torch.testing.assert_close(buf.reduced_tensor[:ref2.numel()], ref2, rtol=0, atol=0)

    def test_optimizer_over_plain_parameter_is_refused(self):
        model = small_model()
        orig_first = next(model.parameters())
        sm = shardd.nn.ShardedModule(self.c, model, auto_wrap="children")
        # an ordinary nn.Parameter on the module, not managed by shardd
        model.head_scale = nn.Parameter(torch.ones(2))
        with self.assertRaises(shardd.Error) as cm:
            sm.register_optimizer("adamw", model.parameters(), lr=1e-3)
        e = cm.exception
        self.assertEqual(e.code_name, "E_NOT_OWNED")
        self.assertIn('"head_scale"', e.message)
        self.assertIn("not a shardd buffer or view", e.message)
        self.assertIn("head_scale", str(e))
        # torch-style param groups; the stray is in group 1
        stray = nn.Parameter(torch.zeros(3))
        groups = [{"params": list(sm.parameters()), "lr": 1e-3},
                  {"params": [stray], "weight_decay": 0.0}]
        with self.assertRaises(shardd.Error) as cm:
            sm.register_optimizer("adamw", groups)
        self.assertIn("param group 1, ref 0", cm.exception.message)
        # the original (pre-wrap) parameter is refused under its name
        with self.assertRaises(shardd.Error) as cm:
            sm.register_optimizer("sgd", [orig_first])
        self.assertIn('"0.weight (the original parameter', cm.exception.message)
        # nothing was registered; the managed ones alone are accepted
        jobs = [j for j in self.c.status()["jobs"] if j["name"] == self.c.job]
        self.assertEqual(jobs[0]["optimizers"], [])
        opt = sm.register_optimizer("adamw", [{"params": list(sm.parameters()), "lr": 1e-3,
                                               "betas": (0.9, 0.99), "foreach": None}])
        self.assertGreater(opt.id, 0)

    def test_refusal_of_many_strays_names_every_one(self):
        """120 plain parameters of a second, unwrapped model: each is named,
        every line whole (the message was cut at 2,047 bytes)."""
        sm = shardd.nn.ShardedModule(self.c, small_model(), auto_wrap="children")
        other = nn.ModuleList(nn.Linear(2, 2) for _ in range(60))
        strays = list(other.named_parameters())
        self.assertEqual(len(strays), 120)
        with self.assertRaises(shardd.Error) as cm:
            sm.register_optimizer("adamw", list(sm.parameters()) + strays, lr=1e-3)
        lines = cm.exception.message.split("\n")
        self.assertEqual(len(lines), 120, cm.exception.message[-300:])
        base = len(list(sm.parameters()))
        for i, (line, (name, _)) in enumerate(zip(lines, strays)):
            self.assertEqual(line, 'param group 0, ref %d ("%s"): not a shardd buffer or view '
                             "(a tensor the daemon does not own)" % (base + i, name))

    def test_bf16_buffer_as_torch(self):
        b = self.c.register_buffer("bf", "bf16", 6)
        t = b.shard_tensor
        self.assertEqual(t.dtype, torch.bfloat16)
        self.assertEqual(t.data_ptr(), b.address("shard"))
        self.assertEqual(b.shard.dtype.name, "uint16")  # numpy has no bf16
        t.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, 8.0]))
        self.c.gather(b)
        self.assertEqual(b.gather_tensor.tolist(), [1.0, -2.0, 0.5, 3.0, 0.0, 8.0])
        self.assertEqual(b.reduced_tensor.dtype, torch.float32)


# a script whose module's forward writes into a gathered parameter, as an
# init or a weight clamp inside forward would (the same write from a
# forward hook is refused by name: test_hook_writes)
_WRITER = textwrap.dedent("""\
    import sys
    import torch
    from torch import nn
    import shardd
    import shardd.nn
    c = shardd.Client(sys.argv[1], job=sys.argv[2], rank=0, world=1,
                      transient_areas=True)
    class Halving(nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.mul_(0.5)
            return super().forward(x)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), Halving(5, 2))
    sm = shardd.nn.ShardedModule(c, model, auto_wrap="children")
    model(torch.randn(4, 3))
    print("the write went through")
""")


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
@unittest.skipIf(common.UNDER_ASAN, "ASan's own SEGV handler reports the fault")
class GatheredWriteTest(unittest.TestCase):
    def test_a_write_into_a_gathered_parameter_names_its_line(self):
        """The host backend's gathered parameters are the node's one copy,
        mapped read-only: the write faults, and the wrapper has Python's
        faulthandler on, so the process says where before it dies."""
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "writer.py")
            with open(path, "w") as f:
                f.write(_WRITER)
            env = dict(os.environ, PYTHONPATH=os.path.join(common.REPO, "client", "python"))
            env.pop("PYTHONFAULTHANDLER", None)
            r = subprocess.run([sys.executable, path, common.socket(), common.job("writer")],
                               env=env, capture_output=True, text=True, timeout=60)
        self.assertNotIn("the write went through", r.stdout)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("Segmentation fault", r.stderr)
        line = _WRITER.splitlines().index("            self.weight.mul_(0.5)") + 1
        self.assertIn('File "%s", line %d in forward' % (path, line), r.stderr)


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class StateDictTest(unittest.TestCase):
    """ShardedModule.state_dict() is torch's (tied weights under each name,
    buffers kept) and load_state_dict() writes it into the shards."""

    def model(self):
        torch.manual_seed(3)
        m = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 10, bias=False))
        m[2].weight = m[0].weight  # tied, as an LM's embedding and head
        return m

    def test_state_dict_type_set_by_a_call_or_for_a_with_block(self):
        # FSDP's set_state_dict_type is a call, its state_dict_type a
        # context: both forms work (a plain call used to change nothing)
        c = shardd.Client(common.socket(), job=common.job("nn-sdt"), rank=0, world=1)
        self.addCleanup(c.close)
        m = self.model()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children")
        self.assertEqual(m.state_dict()["2.weight"].shape, (10, 4))
        with sm.state_dict_type("local"):
            self.assertEqual(m.state_dict()["2.weight"].shape, (40,))
        self.assertEqual(m.state_dict()["2.weight"].shape, (10, 4))  # back after the block
        sm.state_dict_type("local")
        self.assertEqual(m.state_dict()["2.weight"].shape, (40,))
        sm.state_dict_type("full", shardd.nn.FullStateDictConfig(offload_to_cpu=True))
        self.assertEqual(m.state_dict()["2.weight"].shape, (10, 4))

    def test_keys_values_and_a_round_trip(self):
        for transient in (False, True):
            c = shardd.Client(common.socket(), job=common.job("nn-sd"), rank=0, world=1,
                              transient_areas=transient)
            self.addCleanup(c.close)
            ref, m = self.model(), self.model()
            sm = shardd.nn.ShardedModule(c, m, auto_wrap="children")
            sd = sm.state_dict()
            want = ref.state_dict()
            self.assertEqual(list(sd), list(want))  # both tied names, the buffers
            for k, v in want.items():
                torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
            # other values in, and back out; plain torch loads them too
            other = {k: (v + 1 if v.is_floating_point() else v) for k, v in want.items()}
            other["2.weight"] = other["0.weight"]
            sm.load_state_dict(other)
            back = sm.state_dict()
            for k, v in other.items():
                torch.testing.assert_close(back[k], v, rtol=0, atol=0, msg=k)
            ref.load_state_dict(back)
            with self.assertRaises(RuntimeError):
                sm.load_state_dict({k: v for k, v in other.items() if k != "1.bias"})
