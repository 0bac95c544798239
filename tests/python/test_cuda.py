"""The cuda backend from Python: Buffer.tensor() is a torch CUDA tensor over the
daemon's GPU memory (no copy), and shardd.nn.ShardedModule trains on it as it
does on the host backend.

CudaTest runs only where torch sees a CUDA device and `shardd --backend cuda`
starts; elsewhere each of its tests is reported skipped with the reason
(bench/gpu_check.sh runs this file on a GPU machine, where a skip of CudaTest
counts as a failure). Against a cuda daemon (--devices 1, every rank on GPU
0) it checks:
  * the areas are CUDA tensors at the addresses libshardd opened, writes
    through them (even ones queued behind a slow kernel) are what a gather
    and a scatter see, one and two ranks;
  * scatter and AdamW steps on gradients written through the tensors give the
    same bytes as a host daemon given the same values (the daemon's kernels
    are bit for bit the host's);
  * ShardedModule (examples/train_mlp.py's MLP, 1 and 2 ranks) trained with
    AdamW on the GPU matches the same training on a host daemon on the CPU
    within test_train.py's tolerances (the forward and backward are cuBLAS
    against the CPU's kernels, so not bitwise);
  * bf16 and fp16 areas round-trip bit for bit.

The other tests run everywhere. ArrayInterfaceTest reads the very
__cuda_array_interface__ dict the CUDA path gives torch.as_tensor as numpy's
__array_interface__ over a host mapping of the same area: numpy parses its
typestr as torch does (PyArray_DescrConverter), so address, length, element
type and size, writability and the bf16-through-int16 view are checked
against the real area without a GPU. NoCudaTorchTest: a device buffer under a
torch without CUDA is refused with E_NO_CUDA, never touched from the host.
"""
import threading
import unittest

import common
import shardd
import shardd.daemon
from test_binding import run_ranks

if common.HAVE_TORCH:
    import torch
    import torch.nn.functional as F
    import shardd.nn
    import train_mlp
    from test_train import TOL, rel_diffs

if common.HAVE_NUMPY:
    import numpy as np

_cuda = {"tried": False, "daemon": None, "why": None}
_lock = threading.Lock()


def cuda_daemon():
    """The module's `shardd --backend cuda --devices 1`, started on first use.
    -> (Daemon, None), or (None, why it cannot run here)."""
    with _lock:
        if not _cuda["tried"]:
            _cuda["tried"] = True
            if not common.HAVE_TORCH:
                _cuda["why"] = "torch is not importable"
            elif not torch.cuda.is_available():
                _cuda["why"] = ("no CUDA device: torch %s (CUDA %s) says torch.cuda.is_available() "
                                "is False" % (torch.__version__, torch.version.cuda))
            else:
                try:
                    _cuda["daemon"] = shardd.daemon.Daemon(
                        backend="cuda", devices=1, log_level="debug", ready_timeout=60,
                        extra_args=["--collective-timeout", "30"], env=common.daemon_env())
                except (RuntimeError, OSError) as e:
                    _cuda["why"] = "shardd --backend cuda does not start here: %s" % e
        return _cuda["daemon"], _cuda["why"]


def tearDownModule():
    d = _cuda["daemon"]
    if d is None:
        return
    _cuda["daemon"] = None
    rc = d.stop()
    log = d.log_text()
    d.cleanup()
    if rc != 0:
        raise AssertionError("the cuda daemon exited with status %s on SIGTERM; log:\n%s"
                             % (rc, log[-3000:]))


def same_bits(a, b):
    """a and b (any devices) hold the same bytes."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    it = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(it), b.view(it))


@unittest.skipUnless(common.HAVE_TORCH and common.HAVE_NUMPY,
                     "torch or numpy (torch reads __cuda_array_interface__ with it) is not importable")
class CudaTest(unittest.TestCase):
    def setUp(self):
        d, why = cuda_daemon()
        if d is None:
            self.skipTest(why)
        self.sock = d.socket
        # fp32 matmuls in full fp32 (no TF32: torch's default) for the
        # comparisons with the CPU; set only where something changed it
        old = torch.get_float32_matmul_precision()
        if old != "highest":
            torch.set_float32_matmul_precision("highest")
            self.addCleanup(torch.set_float32_matmul_precision, old)

    def client(self, tag, rank=0, world=1, sock=None, job=None):
        c = shardd.Client(sock or self.sock, job=job or common.job(tag), rank=rank, world=world,
                          transient_areas=False)
        self.addCleanup(c.close)
        return c

    def test_areas_are_cuda_tensors(self):
        c = self.client("areas")
        self.assertEqual(c.daemon_backend, "cuda")
        b = c.register_buffer("flat", "fp32", 1000)
        self.assertTrue(b.is_device)
        dev = torch.device("cuda", b.device)
        for area, n in (("shard", b.shard_numel), ("gather", b.padded_numel),
                        ("grad", b.padded_numel), ("reduced", b.shard_numel)):
            t = b.tensor(area)
            self.assertTrue(t.is_cuda, area)
            self.assertEqual(t.device, dev, area)
            self.assertEqual(t.data_ptr(), b.address(area), "%s: no copy" % area)
            self.assertEqual(tuple(t.shape), (n,), area)
            self.assertEqual(t.dtype, torch.float32, area)
            self.assertIs(b.tensor(area), t, "one tensor per area")
            for host_view in (b.numpy, b.memoryview):
                with self.assertRaises(shardd.Error) as cm:
                    host_view(area)
                self.assertEqual(cm.exception.code_name, "E_NO_CUDA")
                self.assertIn("GPU memory", cm.exception.message)
        self.assertTrue(bool(torch.all(b.shard_tensor == 0)), "shards start zeroed")
        vals = torch.arange(1000, dtype=torch.float32, device=dev) * 0.5
        b.shard_tensor.copy_(vals)
        c.gather(b)
        self.assertTrue(same_bits(b.gather_tensor, vals))
        b.grad_tensor.fill_(2.0)
        c.scatter(b, "sum")
        self.assertTrue(same_bits(b.reduced_tensor, torch.full((1000,), 2.0, device=dev)))
        # a view's tensor is its slice of the gather / grad area
        w = c.register_view(b, "w", 10, (2, 5))
        self.assertTrue(same_bits(w.tensor(), vals[10:20].view(2, 5)))
        self.assertEqual(w.tensor("grad").data_ptr(), b.address("grad") + 40)
        # unregister and close forget the tensors (libshardd closes the handles)
        c.unregister_buffer(b)
        self.assertEqual((b._torch, b._cuda), ({}, {}))
        b2 = c.register_buffer("other", "fp32", 8)
        self.assertTrue(b2.gather_tensor.is_cuda)
        c.close()
        self.assertEqual((b2._torch, b2._cuda), ({}, {}))
        with self.assertRaises(shardd.Error) as cm:
            b2.tensor("gather")
        self.assertEqual(cm.exception.code_name, "E_CLOSED")

    @unittest.skipUnless(common.HAVE_TORCH and hasattr(torch.cuda, "_sleep"),
                         "this torch has no torch.cuda._sleep")
    def test_queued_writes_are_complete_before_the_gather(self):
        """A write queued behind a slow kernel on torch's stream is finished
        before the daemon reads the shard: the binding synchronises first."""
        c = self.client("sync")
        n = 1 << 20
        b = c.register_buffer("big", "fp32", n)
        dev = b.shard_tensor.device
        vals = torch.full((n,), 3.0, device=dev)
        torch.cuda.synchronize(dev)
        for k in range(3):
            torch.cuda._sleep(50 * 1000 * 1000)  # ~25-50 ms of GPU time
            b.shard_tensor.copy_(vals + k)
            c.gather(b)  # must wait for the sleep and the copy
            self.assertTrue(bool(torch.all(b.gather_tensor == 3.0 + k)), "round %d" % k)
            torch.cuda._sleep(50 * 1000 * 1000)
            b.grad_tensor.fill_(1.0 + k)
            c.scatter(b, "sum")
            self.assertTrue(bool(torch.all(b.reduced_tensor == 1.0 + k)), "round %d" % k)

    def test_two_ranks_gather_and_scatter(self):
        job = common.job("two")

        def rank(r):
            with shardd.Client(self.sock, job=job, rank=r, world=2, transient_areas=False) as c:
                b = c.register_buffer("g", "fp32", 1001)  # padded to 1002
                self.assertEqual((b.padded_numel, b.shard_numel), (1002, 501))
                dev = b.shard_tensor.device
                b.shard_tensor.copy_(torch.arange(501, dtype=torch.float32, device=dev) + 1000 * r)
                c.gather(b)
                got = b.gather_tensor.cpu().clone()
                b.grad_tensor.fill_(r + 1.0)
                c.scatter(b, "mean")
                return got, b.reduced_tensor.cpu().clone()

        out = run_ranks(2, rank, timeout=60)
        want = torch.cat([torch.arange(501, dtype=torch.float32),
                          torch.arange(501, dtype=torch.float32) + 1000])
        for r, (got, red) in enumerate(out):
            self.assertTrue(same_bits(got, want), "rank %d" % r)
            self.assertTrue(same_bits(red, torch.full((501,), 1.5)), "rank %d" % r)

    def run_adamw_steps(self, sock, world, dtype):
        """world ranks: the same shards and gradients (fixed seeds) written
        through the area tensors, then 4 x (scatter mean, AdamW step,
        gather). -> per rank (gather area, reduced shard) on the CPU."""
        job = common.job("steps")

        def rank(r):
            with shardd.Client(sock, job=job, rank=r, world=world, transient_areas=False) as c:
                b = c.register_buffer("flat", dtype, 3001)
                w = c.register_view(b, "w.weight", 0, (60, 50))
                bias = c.register_view(b, "w.bias", 3000, (1,))
                opt = c.register_optimizer("adamw", [w, bias], name="adamw", lr=1e-2,
                                           weight_decay=0.1, amsgrad=True)
                g = torch.Generator().manual_seed(100 + r)
                dt = b.shard_tensor.dtype
                b.shard_tensor.copy_(torch.randn(b.shard_numel, generator=g).to(dt))
                for _ in range(4):
                    b.grad_tensor.copy_(torch.randn(b.padded_numel, generator=g).to(dt))
                    c.scatter(b, "mean")
                    c.step(opt)
                    c.gather(b)
                return b.gather_tensor.cpu().clone(), b.reduced_tensor.cpu().clone()

        return run_ranks(world, rank, timeout=60)

    def test_steps_match_host_bitwise(self):
        for world, dtype in ((1, "fp32"), (2, "fp32"), (2, "bf16")):
            cu = self.run_adamw_steps(self.sock, world, dtype)
            ho = self.run_adamw_steps(common.socket(), world, dtype)
            for r in range(world):
                self.assertTrue(same_bits(cu[r][0], ho[r][0]),
                                "%s world %d rank %d: gathered parameters differ" % (dtype, world, r))
                self.assertTrue(same_bits(cu[r][1], ho[r][1]),
                                "%s world %d rank %d: reduced gradients differ" % (dtype, world, r))

    def train(self, sock, world, steps, auto_wrap):
        """train_mlp's model and data, world ranks as threads of this process.
        -> (rank 0's final parameters as numpy, per-step mean loss, devices)"""
        cfg = train_mlp.parser().parse_args(["--ranks", str(world), "--steps", str(steps),
                                             "--auto-wrap", auto_wrap])
        x, y = train_mlp.make_data(cfg)
        models = [train_mlp.make_model(cfg) for _ in range(world)]  # seeds the global RNG
        per = cfg.batch // world
        job = common.job("train")

        def rank(r):
            with shardd.Client(sock, job=job, rank=r, world=world, transient_areas=False) as c:
                model = models[r]
                sm = shardd.nn.ShardedModule(c, model, auto_wrap=auto_wrap)
                dev = sm.device
                opt = sm.register_optimizer("adamw", model.parameters(), name="adamw",
                                            **train_mlp.adamw_hyper(cfg))
                xs, ys = x[:, r * per:(r + 1) * per].to(dev), y[:, r * per:(r + 1) * per].to(dev)
                losses = []
                for s in range(steps):
                    sm.gather()
                    loss = F.mse_loss(model(xs[s]), ys[s])
                    sm.zero_grad()
                    loss.backward()
                    for u in sm.units:  # autograd accumulated into the grad area
                        for e in u.entries:
                            assert e.param.grad.data_ptr() == e.grad_view.data_ptr(), e.name
                    sm.scatter("mean")
                    res = sm.step(opt)
                    assert res.step == s + 1, (res.step, s + 1)
                    losses.append(loss.item())
                sm.gather()
                params = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
                devs = {str(p.device) for p in model.parameters()}
                return params, losses, dev, devs

        out = run_ranks(world, rank, timeout=120)
        losses = [sum(o[1][s] for o in out) / world for s in range(steps)]
        return out[0][0], losses, {str(o[2]) for o in out} | set().union(*(o[3] for o in out))

    def test_sharded_module_trains_like_host(self):
        steps = 20
        for world, wrap in ((1, "children"), (2, "module")):
            label = "%d rank(s), auto_wrap=%s" % (world, wrap)
            cu_p, cu_l, cu_dev = self.train(self.sock, world, steps, wrap)
            ho_p, ho_l, ho_dev = self.train(common.socket(), world, steps, wrap)
            self.assertEqual(cu_dev, {"cuda:0"}, label)
            self.assertEqual(ho_dev, {"cpu"}, label)
            self.assertEqual(sorted(cu_p), sorted(ho_p))
            tw, ew = rel_diffs(cu_p, ho_p)
            print("\n  cuda vs host, %s: max relative difference %.3g (per tensor), %.3g (per "
                  "element, |ref| >= 1e-2); final loss %.6f (host %.6f)"
                  % (label, tw, ew, cu_l[-1], ho_l[-1]))
            self.assertLess(tw, TOL, label)
            np.testing.assert_allclose(cu_l, ho_l, rtol=1e-4, err_msg=label)
            self.assertLess(cu_l[-1], 0.8 * cu_l[0], "it trains: " + label)

    def test_transient_accumulation_matches_torch(self):
        """The plain torch loop over transient areas (FSDP's hooks, the cuda
        backend's IPC pools) with two backwards a step, whose second scatter
        adds to the first's reduced gradient (the backend's reduce_add):
        test_fsdp's 16-unit MLP, ranks as processes (as threads they would
        share autograd's one CUDA thread per device, and one rank's hook
        waiting in a collective would hold the other's backward), against
        single-process torch on the CPU."""
        import test_fsdp
        for world in (1, 2):
            out = test_fsdp.run(self.sock, "mlp16", world, accum=2, timeout=180)
            params, losses = test_fsdp.reference("mlp16", accum=2, world=world)
            dl = test_fsdp.rel_loss_diff(out["losses"], losses)
            dp = test_fsdp.rel_param_diff(out["params"], params)
            print("\n  transient cuda, %d rank(s), 2 backwards a step, vs torch on the "
                  "CPU: losses %.3g, parameters %.3g (relative)" % (world, dl, dp))
            self.assertLess(dl, 1e-4, "world %d losses" % world)
            self.assertLess(dp, 1e-3, "world %d parameters" % world)

    def test_half_precision_round_trip(self):
        c = self.client("half")
        for dtype, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            b = c.register_buffer("h-" + dtype, dtype, 777)
            dev = torch.device("cuda", b.device)
            for area in ("shard", "gather", "grad"):
                t = b.tensor(area)
                self.assertEqual((t.dtype, t.device, t.data_ptr()), (tdt, dev, b.address(area)),
                                 "%s %s" % (dtype, area))
            self.assertEqual(b.reduced_tensor.dtype, torch.float32)
            vals = torch.randn(777, generator=torch.Generator().manual_seed(3)).to(tdt)
            vals[:6] = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, 8.0])
            b.shard_tensor.copy_(vals.to(dev))
            c.gather(b)
            self.assertTrue(same_bits(b.gather_tensor, vals), dtype)
            self.assertEqual(b.gather_tensor[:6].tolist(), [1.0, -2.0, 0.5, 3.0, 0.0, 8.0])
            b.grad_tensor.copy_(vals.to(dev))
            c.scatter(b, "sum")  # one rank: the gradient widened to fp32, exactly
            self.assertTrue(same_bits(b.reduced_tensor, vals.float()), dtype)


@unittest.skipUnless(common.HAVE_TORCH and common.HAVE_NUMPY, "torch or numpy is not importable")
class ArrayInterfaceTest(unittest.TestCase):
    def test_interface_describes_the_area(self):
        c = shardd.Client(common.socket(), job=common.job("cai"), transient_areas=False)
        self.addCleanup(c.close)
        lib = shardd._lib.load()

        class HostArray:  # numpy reads __array_interface__ from the instance
            def __init__(self, d):
                self.__array_interface__ = d

        # what torch must make of each typestr before the bf16 view
        raw_dtypes = {shardd.DTYPES["fp32"]: torch.float32, shardd.DTYPES["bf16"]: torch.int16,
                      shardd.DTYPES["fp16"]: torch.float16}
        for dtype in ("fp32", "bf16", "fp16"):
            b = c.register_buffer("cai-" + dtype, dtype, 37)
            for area in ("shard", "gather", "grad", "reduced"):
                label = "%s %s" % (dtype, area)
                ptr, n, code = b._ptr[area]
                raw_dt = raw_dtypes[code]
                d = dict(shardd._CudaArea(ptr, n, code).__cuda_array_interface__)
                # version 3: None is "no synchronisation needed" (0 would be invalid)
                self.assertIsNone(d.pop("stream"), label)
                a = np.asarray(HostArray(d))
                self.assertEqual(a.ctypes.data, b.address(area), label)
                self.assertEqual(a.shape, (n,), label)
                self.assertTrue(a.flags.writeable and a.flags.c_contiguous, label)
                self.assertIn(a.dtype.byteorder, ("<", "="), label)  # little-endian host
                self.assertEqual(a.dtype.itemsize, lib.shardd_dtype_size(code), label)
                raw = torch.from_numpy(a)  # the dtype torch gives that typestr
                self.assertEqual(raw.dtype, raw_dt, label)
                t = shardd._area_dtype(torch, raw, code)
                want = b.tensor(area)
                self.assertEqual((t.dtype, t.data_ptr(), t.numel()),
                                 (want.dtype, want.data_ptr(), want.numel()), label)
                with torch.no_grad():
                    want.copy_(torch.linspace(-3, 3, n).to(want.dtype))
                    self.assertTrue(torch.equal(t, want), label)
                    t.fill_(0.25)
                    self.assertTrue(bool(torch.all(want == 0.25)), label)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class NoCudaTorchTest(unittest.TestCase):
    @unittest.skipIf(common.HAVE_TORCH and torch.cuda.is_available(),
                     "this torch has CUDA (CudaTest covers the device path)")
    def test_device_buffer_without_cuda_torch_is_refused(self):
        """A cuda daemon's areas under a torch without CUDA: tensor(), numpy()
        and memoryview() refuse with E_NO_CUDA naming the area. (Played on a
        host buffer marked as a device one: nothing may touch its memory.)"""
        c = shardd.Client(common.socket(), job=common.job("nocuda"), transient_areas=False)
        self.addCleanup(c.close)
        b = c.register_buffer("dev", "bf16", 16)
        b.is_device = True
        for area in ("shard", "gather", "grad", "reduced"):
            for fn in (b.tensor, b.numpy, b.memoryview):
                with self.assertRaises(shardd.Error) as cm:
                    fn(area)
                self.assertEqual(cm.exception.code_name, "E_NO_CUDA", (area, fn))
                self.assertIn("buffer %d's %s area is GPU memory" % (b.id, area),
                              cm.exception.message)
        self.assertEqual((b._torch, b._cuda, b._np, b._carr), ({}, {}, {}, {}))
        self.assertEqual(c._cuda_devices, set(), "nothing to synchronise")
        c.gather(b)  # collectives still work (no torch.cuda call is made)


if __name__ == "__main__":
    unittest.main()
