"""Conversions between Python values and libshardd's: dtype, optimizer and
reduction names, names and counts checked before ctypes sees them,
hyperparameter dicts, the array interfaces of mapped areas, and libshardd's
error codes (:class:`shardd.Error`)."""
import ctypes
import os

from . import _lib as L


DTYPES = {"fp32": L.DTYPE_FP32, "bf16": L.DTYPE_BF16, "fp16": L.DTYPE_FP16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ELEM_SIZE = {L.DTYPE_FP32: 4, L.DTYPE_BF16: 2, L.DTYPE_FP16: 2}
# Array-interface type strings. bf16 has no standard one: its areas are
# described as little-endian int16 and the tensor viewed as torch.bfloat16
# (same element size, no copy).
_TYPESTR = {L.DTYPE_FP32: "<f4", L.DTYPE_BF16: "<i2", L.DTYPE_FP16: "<f2"}
OPTIMIZERS = {"sgd": L.OPTIM_SGD, "adam": L.OPTIM_ADAM, "adamw": L.OPTIM_ADAMW}
REDUCE_OPS = {"sum": L.REDUCE_SUM, "mean": L.REDUCE_MEAN}
# all_reduce takes these too (scatter only sum and mean)
ALL_REDUCE_OPS = {"sum": L.REDUCE_SUM, "mean": L.REDUCE_MEAN,
                  "max": L.REDUCE_MAX, "min": L.REDUCE_MIN}


def _env_int(name, low):
    """An integer >= low from environment variable name, or None if unset."""
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        n = int(v.strip(), 10)
    except ValueError:
        raise ValueError("$%s=%r is not an integer" % (name, v)) from None
    if n < low:
        raise ValueError("$%s=%d: must be >= %d" % (name, n, low))
    return n


# torch.optim param-group keys that have no meaning for the daemon; ignored
# when false/None so that groups copied from a torch optimizer are accepted.
_TORCH_ONLY_KEYS = ("foreach", "capturable", "differentiable", "fused", "initial_lr")


class Error(Exception):
    """A libshardd/daemon failure: code_name (e.g. "E_NOT_OWNED") and message."""

    def __init__(self, code, message, code_name=None):
        self.code = int(code)
        if code_name is None:
            code_name = _err_name(self.code)
        self.code_name = code_name
        self.message = message
        super().__init__("%s: %s" % (code_name, message))


def _err_name(code):
    try:
        return L.load().shardd_err_name(code).decode()
    except OSError:
        return "E_%d" % code


def _b(s):
    if s is None:
        return None
    b = s if isinstance(s, bytes) else str(s).encode()
    if b"\0" in b:  # C would cut the name there, silently
        raise ValueError("name %r holds a NUL byte" % (s,))
    return b


def _u64(v, what):
    """v as an unsigned 64-bit count; ctypes wraps larger ones silently
    (numel=2**64+5 registered 5 elements)."""
    n = int(v)
    if n < 0 or n >= 1 << 64:
        raise ValueError("%s %d is outside [0, 2**64)" % (what, n))
    return n


def _dtype_code(dtype):
    if isinstance(dtype, int):
        if dtype not in _DTYPE_NAMES:
            raise ValueError("unknown dtype code %r" % dtype)
        return dtype
    s = str(dtype)
    if s.startswith("torch."):
        s = s[len("torch."):]
    # The names are libshardd's one table (common/dtype.c), shardctl's too.
    code = ctypes.c_int(0)
    if "\0" in s or L.load().shardd_dtype_parse(s.encode(), ctypes.byref(code)) != 0:
        raise ValueError("unknown dtype %r (fp32, bf16, fp16)" % (dtype,))
    return code.value


def _hparams(kw, where):
    """torch-style hyperparameter dict -> HParams (only keys given are set)."""
    hp = L.HParams()
    hp.set = 0
    for key, val in kw.items():
        if key == "params":
            continue
        if key in _TORCH_ONLY_KEYS:
            if val:
                raise ValueError("%s: %s=%r is not supported by shardd" % (where, key, val))
            continue
        if key == "betas":
            b1, b2 = val
            hp.beta1, hp.beta2 = float(b1), float(b2)
            hp.set |= L.HP_BITS["beta1"] | L.HP_BITS["beta2"]
            continue
        if key not in L.HP_BITS:
            raise ValueError("%s: unknown hyperparameter %r" % (where, key))
        if val is None:
            continue
        if key in ("nesterov", "maximize", "amsgrad"):
            setattr(hp, key, 1 if val else 0)
        else:
            setattr(hp, key, float(val))
        hp.set |= L.HP_BITS[key]
    return hp


def _array_interface(ptr, numel, code):
    """The fields __cuda_array_interface__ (version 3) shares with numpy's
    __array_interface__: numel elements of dtype code at ptr, one writable
    C-contiguous dimension (strides None)."""
    return {"shape": (int(numel),), "typestr": _TYPESTR[code],
            "data": (int(ptr), False), "strides": None, "version": 3}


def _area_dtype(torch, raw, code):
    """The tensor raw made from an _array_interface(...) of dtype code, as
    the torch dtype of code (bf16: int16 viewed as bfloat16, no copy)."""
    return raw.view(torch.bfloat16) if code == L.DTYPE_BF16 else raw
