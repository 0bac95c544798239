"""The objects a :class:`shardd.Client` hands out: :class:`Buffer` (a
registered flat buffer and its mapped areas), :class:`View`,
:class:`Optimizer`, :class:`StepResult`, and the optimizer refs they are
named by."""
import collections
import ctypes

from . import _lib as L
from ._convert import Error, _DTYPE_NAMES, _area_dtype, _array_interface


# applied False: the step's expect_step had been reached, nothing ran (a retry)
StepResult = collections.namedtuple("StepResult", ["step", "total_norm", "applied"],
                                    defaults=(True,))


def _ids(obj):
    """Buffer/View/Optimizer/int -> id."""
    if isinstance(obj, (Buffer, View, Optimizer)):
        return obj.id
    return int(obj)


class _CudaArea:
    """One device area as __cuda_array_interface__, for torch.as_tensor (no
    copy; torch keeps a reference to this object for as long as the tensor
    lives). stream None: nothing to synchronise on, the daemon has finished
    with an area by the time the collective that wrote it returns."""

    def __init__(self, ptr, numel, code):
        d = _array_interface(ptr, numel, code)
        d["stream"] = None
        self.__cuda_array_interface__ = d


class Buffer:
    """A registered flat buffer as seen by this rank (see shardd_buffer_info)."""

    def __init__(self, client, name, info):
        self.client = client
        self.name = name
        self.id = info.id
        self.dtype_code = info.dtype
        self.dtype = _DTYPE_NAMES.get(info.dtype, str(info.dtype))
        self.numel = info.numel
        self.padded_numel = info.padded_numel
        self.shard_numel = info.shard_numel
        self.world = info.world
        self.rank = info.rank
        self.device = info.device
        self.created = bool(info.created)
        # the shards hold trained or restored values: attach, don't init
        self.existing = bool(info.existing)
        self.generation = info.generation
        # cuda backend: the areas are CUDA device pointers (address() gives
        # them to e.g. cupy; tensor() wraps them as torch CUDA tensors); they
        # have no host view
        self.is_device = bool(info.is_device)
        # transient areas: no gather/grad area in the block; gather_area()
        # leases them from the device's pool
        self.transient = bool(info.transient)
        self._ptr = {
            "shard": (info.shard, info.shard_numel, info.dtype),
            "gather": (info.gather, info.padded_numel, info.dtype),
            "grad": (info.grad, info.padded_numel, info.dtype),
            "reduced": (info.reduced, info.shard_numel, L.DTYPE_FP32),
        }
        self._carr = {}
        self._np = {}
        self._torch = {}
        self._cuda = {}  # area -> _CudaArea behind its tensor (cuda backend)
        self._leased = {}  # (ptr, numel, code) -> tensor over a leased pool area

    def __repr__(self):
        return "<shardd.Buffer %d %r %s numel=%d padded=%d shard=%d rank=%d/%d>" % (
            self.id, self.name, self.dtype, self.numel, self.padded_numel,
            self.shard_numel, self.rank, self.world)

    @property
    def shard_offset(self):
        """Index of this rank's first shard element in the padded buffer."""
        return self.rank * self.shard_numel

    def address(self, area):
        """Raw address of an area ("shard", "gather", "grad", "reduced")."""
        return self._ptr[area][0]

    def _check_whole_area(self, area):
        if self.transient and area in ("gather", "grad"):
            raise Error(22, "buffer %d (%r) has transient areas: its %s area is "
                        "leased per gather, use Client.gather_area(buffer%s)"
                        % (self.id, self.name, area,
                           ", want_grad=True" if area == "grad" else ""), "E_STATE")

    def _ctypes_array(self, area):
        arr = self._carr.get(area)
        if arr is None:
            self.client._check_open()
            self._check_whole_area(area)
            ptr, n, code = self._ptr[area]
            if not ptr:
                raise Error(5, "buffer %d has no %s area" % (self.id, area), "E_NOT_FOUND")
            if self.is_device:
                raise Error(21, "buffer %d's %s area is GPU memory (cuda backend): "
                            "use tensor(%r) (a torch CUDA tensor) or address(%r) as a "
                            "device pointer, not a host view"
                            % (self.id, area, area, area), "E_NO_CUDA")
            ctype = ctypes.c_float if code == L.DTYPE_FP32 else ctypes.c_uint16
            arr = (ctype * n).from_address(ptr)
            self._carr[area] = arr
        return arr

    def memoryview(self, area):
        """A writable memoryview over the area (no copy)."""
        return memoryview(self._ctypes_array(area)).cast("B")

    def numpy(self, area):
        """numpy array over the area (no copy). bf16 areas are uint16."""
        a = self._np.get(area)
        if a is None:
            import numpy as np
            code = self._ptr[area][2]
            npdt = {L.DTYPE_FP32: np.float32, L.DTYPE_BF16: np.uint16,
                    L.DTYPE_FP16: np.float16}[code]
            a = np.frombuffer(self._ctypes_array(area), dtype=npdt)
            self._np[area] = a
        return a

    def tensor(self, area):
        """torch.Tensor over the area (no copy): torch.frombuffer of the host
        mapping, or on the cuda backend a CUDA tensor over the device area."""
        t = self._torch.get(area)
        if t is None:
            import torch
            if self.is_device:
                t = self._cuda_tensor(torch, area)
                self._torch[area] = t
                return t
            import warnings
            code = self._ptr[area][2]
            tdt = {L.DTYPE_FP32: torch.float32, L.DTYPE_BF16: torch.bfloat16,
                   L.DTYPE_FP16: torch.float16}[code]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(self._ctypes_array(area), dtype=tdt)
            self._torch[area] = t
        return t

    def _cuda_tensor(self, torch, area):
        """A torch CUDA tensor over a device area, through
        __cuda_array_interface__ (torch finds the GPU from the pointer)."""
        self.client._check_open()
        self._check_whole_area(area)
        ptr, n, code = self._ptr[area]
        if not ptr:
            raise Error(5, "buffer %d has no %s area" % (self.id, area), "E_NOT_FOUND")
        t, holder = self._cuda_wrap(torch, ptr, n, code, "%s area" % area)
        self._cuda[area] = holder
        return t

    def _cuda_wrap(self, torch, ptr, n, code, what):
        """-> (tensor, holder): a torch CUDA tensor over n elements at the
        device pointer ptr, and the _CudaArea it was made from."""
        where = "buffer %d's %s is GPU memory (cuda backend, GPU %d)" % (
            self.id, what, self.device)
        if not torch.cuda.is_available():
            raise Error(21, "%s, but this torch has no CUDA device (torch %s, CUDA %s)"
                        % (where, torch.__version__, torch.version.cuda), "E_NO_CUDA")
        holder = _CudaArea(ptr, n, code)
        try:
            # no device=: torch takes the GPU from the pointer (an explicit
            # index would label the tensor with it unchecked); the current
            # device is set too for torch versions that fall back on it
            with torch.cuda.device(self.device):
                raw = torch.as_tensor(holder)
        except Exception as e:  # e.g. a torch without numpy cannot read typestr
            raise Error(21, "%s: torch cannot wrap it as a CUDA tensor: %s: %s"
                        % (where, type(e).__name__, e), "E_NO_CUDA") from e
        if raw.device.type != "cuda" or raw.data_ptr() != ptr or raw.numel() != n:
            raise Error(24, "%s: torch.as_tensor made %s of %d elements at 0x%x, not a "
                        "view of the %d at 0x%x" % (where, raw.device, raw.numel(),
                                                    raw.data_ptr(), n, ptr), "E_INTERNAL")
        t = _area_dtype(torch, raw, code)
        self.client._cuda_devices.add(t.device.index)
        return t, holder

    def _leased_tensor(self, ptr, what):
        """A torch tensor over padded_numel elements of the buffer's dtype at
        ptr, a leased area in a pool mapping (valid until the client is
        closed), made once per address."""
        key = (ptr, self.padded_numel, self.dtype_code)
        t = self._leased.get(key)
        if t is None:
            import torch
            n, code = self.padded_numel, self.dtype_code
            if self.is_device:
                t, _ = self._cuda_wrap(torch, ptr, n, code, what)
            else:
                import warnings
                ctype = ctypes.c_float if code == L.DTYPE_FP32 else ctypes.c_uint16
                arr = (ctype * n).from_address(ptr)
                tdt = {L.DTYPE_FP32: torch.float32, L.DTYPE_BF16: torch.bfloat16,
                       L.DTYPE_FP16: torch.float16}[code]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = torch.frombuffer(arr, dtype=tdt)
            self._leased[key] = t
        return t

    shard = property(lambda self: self.numpy("shard"))
    gather = property(lambda self: self.numpy("gather"))
    grad = property(lambda self: self.numpy("grad"))
    reduced = property(lambda self: self.numpy("reduced"))
    shard_tensor = property(lambda self: self.tensor("shard"))
    gather_tensor = property(lambda self: self.tensor("gather"))
    grad_tensor = property(lambda self: self.tensor("grad"))
    reduced_tensor = property(lambda self: self.tensor("reduced"))

    def _forget(self):
        self._np.clear()
        self._torch.clear()
        self._carr.clear()
        self._cuda.clear()
        self._leased.clear()

    # conveniences forwarding to the client
    def do_gather(self):
        self.client.gather(self)

    def do_scatter(self, op="mean"):
        self.client.scatter(self, op)

    def unregister(self):
        self.client.unregister_buffer(self)


class View:
    """A named original parameter inside a flat buffer."""

    def __init__(self, buffer, vid, name, offset, shape, requires_grad=True,
                 generation=0):
        self.buffer = buffer
        self.id = vid
        self.name = name
        self.offset = offset
        self.shape = tuple(shape)
        self.requires_grad = bool(requires_grad)
        self.generation = generation
        n = 1
        for d in self.shape:
            n *= d
        self.numel = n

    def __repr__(self):
        return "<shardd.View %d %r buffer=%d offset=%d shape=%s>" % (
            self.id, self.name, self.buffer.id, self.offset, self.shape)

    def numpy(self, area="gather"):
        """The view's elements in the gather or grad area (no copy)."""
        if area not in ("gather", "grad"):
            raise ValueError("a view spans the gather/grad areas, not %r" % area)
        return self.buffer.numpy(area)[self.offset:self.offset + self.numel].reshape(self.shape)

    def tensor(self, area="gather"):
        if area not in ("gather", "grad"):
            raise ValueError("a view spans the gather/grad areas, not %r" % area)
        return self.buffer.tensor(area)[self.offset:self.offset + self.numel].view(self.shape)


class Optimizer:
    def __init__(self, client, oid, name, kind):
        self.client = client
        self.id = oid
        self.name = name
        self.kind = kind

    def __repr__(self):
        return "<shardd.Optimizer %d %r %s>" % (self.id, self.name, self.kind)

    def step(self, lr=None, max_norm=None, groups=None, expect_step=None):
        return self.client.step(self, lr=lr, max_norm=max_norm, groups=groups,
                                expect_step=expect_step)

    def steps(self):
        """The daemon's step count of this optimizer now (a resumed or
        restored one keeps its count): where a relaunched loop goes on."""
        for j in self.client.status()["jobs"]:
            if j["name"] != self.client.job:
                continue
            for o in j["optimizers"]:
                if o["id"] == self.id:
                    return int(o["steps"])
        raise Error(5, "optimizer %d is not in the daemon's status of job %r"
                    % (self.id, self.client.job), "E_NOT_FOUND")

    def unregister(self):
        self.client.unregister_optimizer(self)


def _is_named_ref(g):
    return (isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str))


def _ref_of(r, gi, ri):
    """-> (id, name) for one optimizer ref."""
    if _is_named_ref(r):
        name, obj = r
        rid, _ = _ref_of(obj, gi, ri)
        return rid, name
    if isinstance(r, View):
        return r.id, r.name
    if isinstance(r, Buffer):
        return r.id, r.name
    if isinstance(r, int) and not isinstance(r, bool):
        return r, "id %d" % r
    return 0, "param group %d ref %d (%s)" % (gi, ri, _describe(r))


def _describe(obj):
    shape = getattr(obj, "shape", None)
    if shape is not None:
        return "%s of shape %s" % (type(obj).__name__, tuple(shape))
    return type(obj).__name__
