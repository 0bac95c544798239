"""ctypes declarations of libshardd (include/shardd.h) and how the library is found.

Search order for libshardd.so:
  1. $SHARDD_LIB (a path to the .so),
  2. the repository build next to this package (../../../build/libshardd.so
     relative to client/python/shardd/),
  3. ctypes.util.find_library("shardd") (an installed libshardd).
"""
import ctypes
import ctypes.util
import os

c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p
c_int = ctypes.c_int
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_int64 = ctypes.c_int64
c_size_t = ctypes.c_size_t
c_double = ctypes.c_double

# enums (values are wire values, see shardd.h)
DTYPE_FP32, DTYPE_BF16, DTYPE_FP16 = 1, 2, 3
OPTIM_MASTER = 0xFFFFFFFF  # SHARDD_OPTIM_MASTER: the fp32 master as a state array
OPTIM_SGD, OPTIM_ADAM, OPTIM_ADAMW = 1, 2, 3
REDUCE_SUM, REDUCE_MEAN, REDUCE_MAX, REDUCE_MIN = 0, 1, 2, 3
ALL_REDUCE_MAX = 64  # SHARDD_ALL_REDUCE_MAX

HP_BITS = {
    "lr": 1 << 0,
    "momentum": 1 << 1,
    "dampening": 1 << 2,
    "weight_decay": 1 << 3,
    "nesterov": 1 << 4,
    "maximize": 1 << 5,
    "beta1": 1 << 6,
    "beta2": 1 << 7,
    "eps": 1 << 8,
    "amsgrad": 1 << 9,
}


class ConnectOpts(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("job", c_char_p),
        ("rank", c_uint32),
        ("world", c_uint32),
        ("client_name", c_char_p),
        ("max_inflight_gathers", c_uint32),
        ("transient_areas", c_int),
        ("timeout_s", ctypes.c_double),
    ]


class BufferInfo(ctypes.Structure):
    _fields_ = [
        ("id", c_uint64),
        ("dtype", c_int),
        ("numel", c_uint64),
        ("padded_numel", c_uint64),
        ("shard_numel", c_uint64),
        ("world", c_uint32),
        ("rank", c_uint32),
        ("device", c_uint32),
        ("created", c_int),
        ("shard", c_void_p),
        ("gather", c_void_p),
        ("grad", c_void_p),
        ("reduced", c_void_p),
        ("generation", c_uint64),
        ("is_device", c_int),
        ("transient", c_int),
        ("existing", c_int),
    ]


class OptimStateInfo(ctypes.Structure):
    _fields_ = [("nstate", c_uint32), ("numel", c_uint64), ("steps", c_uint64),
                ("optimizer_steps", c_uint64)]


class BufferOpts(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("has_init_checksum", c_int),
                ("init_checksum", c_uint64)]


class BufferSpec(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("name", c_char_p), ("dtype", c_int),
                ("numel", c_uint64), ("has_init_checksum", c_int),
                ("init_checksum", c_uint64)]


class Area(ctypes.Structure):
    _fields_ = [("gather", c_void_p), ("grad", c_void_p), ("pool", c_uint64)]


class ViewOpts(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("requires_grad", c_int),
                ("buffer_generation", c_uint64)]


class ViewInfo(ctypes.Structure):
    _fields_ = [("id", c_uint64), ("generation", c_uint64), ("created", c_int)]


class ViewSpec(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("buffer", c_uint64), ("name", c_char_p),
                ("offset", c_uint64), ("numel", c_uint64), ("shape", ctypes.POINTER(c_int64)),
                ("ndim", c_int), ("requires_grad", c_int),
                ("buffer_generation", c_uint64)]


class HParams(ctypes.Structure):
    _fields_ = [
        ("set", c_uint32),
        ("lr", c_double),
        ("momentum", c_double),
        ("dampening", c_double),
        ("weight_decay", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("nesterov", c_int),
        ("maximize", c_int),
        ("amsgrad", c_int),
    ]


class ParamRef(ctypes.Structure):
    _fields_ = [("id", c_uint64), ("name", c_char_p)]


class ParamGroup(ctypes.Structure):
    _fields_ = [
        ("refs", ctypes.POINTER(ParamRef)),
        ("nrefs", c_size_t),
        ("overrides", HParams),
    ]


class ScatterOpts(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("op", c_int),
        ("generation", c_uint64),
        ("no_grad", ctypes.POINTER(c_uint64)),
        ("nno_grad", c_size_t),
        ("no_grad_all", c_int),
        ("accumulate", c_int),
    ]


class StepOpts(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("lr", c_double), ("max_norm", c_double),
                ("groups", ctypes.POINTER(HParams)), ("ngroups", c_size_t),
                ("expect_step", c_uint64), ("skipped", ctypes.POINTER(ctypes.c_int))]


class StepResult(ctypes.Structure):
    _fields_ = [("step", c_uint64), ("total_norm", c_double)]


def _candidates():
    env = os.environ.get("SHARDD_LIB")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.normpath(os.path.join(here, "..", "..", "..", "build", "libshardd.so"))
    found = ctypes.util.find_library("shardd")
    if found:
        yield found


def _declare(lib):
    P = ctypes.POINTER
    client_p = c_void_p
    sigs = {
        "shardd_strerror": (c_char_p, [c_int]),
        "shardd_err_name": (c_char_p, [c_int]),
        "shardd_dtype_size": (c_size_t, [c_int]),
        "shardd_dtype_name": (c_char_p, [c_int]),
        "shardd_dtype_parse": (c_int, [c_char_p, P(c_int)]),
        "shardd_connect": (c_int, [c_char_p, P(ConnectOpts), P(client_p), c_char_p, c_size_t]),
        "shardd_close": (None, [client_p]),
        "shardd_finish": (c_int, [client_p]),
        "shardd_resumed": (c_int, [client_p, P(c_uint64)]),
        "shardd_last_error": (c_char_p, [client_p]),
        "shardd_version": (c_char_p, []),
        "shardd_daemon_version": (c_char_p, [client_p]),
        "shardd_daemon_backend": (c_char_p, [client_p]),
        "shardd_ping": (c_int, [client_p]),
        "shardd_status_json": (c_int, [client_p, P(c_void_p)]),
        "shardd_checkpoint": (c_int, [client_p, c_char_p, c_char_p]),
        "shardd_checkpoint_collective": (c_int, [client_p, c_char_p]),
        "shardd_checkpoint_wait": (c_int, [client_p, c_char_p, c_char_p, c_double]),
        "shardd_release_job": (c_int, [client_p, c_char_p, P(c_uint32), P(c_uint32)]),
        "shardd_restore": (c_int, [client_p, c_char_p, c_uint32, c_char_p, c_size_t]),
        "shardd_restore_ex": (c_int, [client_p, c_char_p, c_uint32, c_char_p, c_size_t,
                                      P(c_uint64)]),
        "shardd_status_text": (c_int, [client_p, P(c_void_p)]),
        "shardd_status_json_from": (c_int, [client_p, c_uint32, P(c_void_p)]),
        "shardd_status_text_from": (c_int, [client_p, c_uint32, P(c_void_p)]),
        "shardd_inspect_json": (c_int, [client_p, c_uint64, c_char_p, P(c_void_p)]),
        "shardd_inspect_text": (c_int, [client_p, c_uint64, c_char_p, P(c_void_p)]),
        "shardd_free": (None, [c_void_p]),
        "shardd_buffer_register": (c_int, [client_p, c_char_p, c_int, c_uint64, P(BufferInfo)]),
        "shardd_buffer_register_opts": (c_int, [client_p, c_char_p, c_int, c_uint64,
                                                P(BufferOpts), P(BufferInfo)]),
        "shardd_buffer_unregister": (c_int, [client_p, c_uint64]),
        "shardd_buffers_register": (c_int, [client_p, c_size_t, P(BufferSpec),
                                            P(BufferInfo), P(c_int)]),
        "shardd_buffers_unregister": (c_int, [client_p, c_size_t, P(c_uint64),
                                              P(c_uint64), P(c_int)]),
        "shardd_view_register": (c_int, [client_p, c_uint64, c_char_p, c_uint64, c_uint64,
                                         P(c_int64), c_int, P(c_uint64)]),
        "shardd_view_register_ex": (c_int, [client_p, c_uint64, c_char_p, c_uint64, c_uint64,
                                            P(c_int64), c_int, P(ViewOpts), P(ViewInfo)]),
        "shardd_view_unregister": (c_int, [client_p, c_uint64]),
        "shardd_views_register": (c_int, [client_p, c_size_t, P(ViewSpec), P(ViewInfo),
                                          P(c_int)]),
        "shardd_views_unregister": (c_int, [client_p, c_size_t, P(c_uint64), P(c_uint64),
                                            P(c_int)]),
        "shardd_optimizer_register": (c_int, [client_p, c_char_p, c_int, P(HParams),
                                              P(ParamGroup), c_size_t, P(c_uint64)]),
        "shardd_optimizer_unregister": (c_int, [client_p, c_uint64]),
        "shardd_gather": (c_int, [client_p, c_uint64]),
        "shardd_gather_async": (c_int, [client_p, c_uint64, P(c_uint64)]),
        "shardd_gather_area_async": (c_int, [client_p, c_uint64, c_int, P(c_uint64)]),
        "shardd_wait": (c_int, [client_p, c_uint64]),
        "shardd_release_async": (c_int, [client_p, c_uint64, P(c_uint64)]),
        "shardd_gather_area": (c_int, [client_p, c_uint64, c_int, P(Area)]),
        "shardd_wait_area": (c_int, [client_p, c_uint64, P(Area)]),
        "shardd_release": (c_int, [client_p, c_uint64]),
        "shardd_scatter": (c_int, [client_p, c_uint64, c_int]),
        "shardd_scatter_accumulate": (c_int, [client_p, c_uint64, c_int]),
        "shardd_scatter_ex": (c_int, [client_p, c_uint64, P(ScatterOpts)]),
        "shardd_gather_many": (c_int, [client_p, c_size_t, P(c_uint64), P(c_int)]),
        "shardd_scatter_many": (c_int, [client_p, c_size_t, P(c_uint64), c_int, P(c_int)]),
        "shardd_scatter_many_ex": (c_int, [client_p, c_size_t, P(c_uint64),
                                           P(ScatterOpts), P(c_int)]),
        "shardd_view_set_requires_grad": (c_int, [client_p, c_uint64, c_int]),
        "shardd_step": (c_int, [client_p, c_uint64, P(StepOpts), P(StepResult)]),
        "shardd_clip_grad_norm": (c_int, [client_p, c_uint64, c_double, P(c_double)]),
        "shardd_all_reduce": (c_int, [client_p, P(c_double), c_size_t, c_int]),
        "shardd_barrier": (c_int, [client_p]),
        "shardd_seed_master": (c_int, [client_p, c_uint64]),
        "shardd_release_all": (c_int, [client_p, c_uint64]),
        "shardd_optim_state_get": (c_int, [client_p, c_uint64, c_uint64, c_uint32, c_uint64,
                                           c_uint64, P(ctypes.c_float), P(OptimStateInfo)]),
        "shardd_optim_state_set": (c_int, [client_p, c_uint64, c_uint64, c_uint32, c_uint64,
                                           c_uint64, P(ctypes.c_float)]),
        "shardd_optim_steps_set": (c_int, [client_p, c_uint64, c_uint64, c_uint64, c_uint64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


_lib = None
_lib_path = None


def load():
    """Returns the loaded libshardd (loaded once)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    tried = []
    for cand in _candidates():
        if os.path.sep in cand and not os.path.exists(cand):
            tried.append("%s (missing)" % cand)
            continue
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            tried.append("%s (%s)" % (cand, e))
            continue
        _lib = _declare(lib)
        _lib_path = cand
        return _lib
    raise OSError("libshardd not found; build it with `make` or set $SHARDD_LIB. Tried: "
                  + "; ".join(tried or ["nothing"]))


def path():
    load()
    return _lib_path
