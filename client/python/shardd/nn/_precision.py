"""Dtypes: FSDP's MixedPrecision knobs mapped onto shardd's unit dtypes,
the casts of the root's inputs, and the checksum of a unit's initial
values."""
import zlib

import torch


_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_OF = {v: k for k, v in _TORCH_DTYPES.items()}


def _dtype_name(dt, what):
    """"fp32" / "bf16" / "fp16" of a torch dtype or of one of those names."""
    if isinstance(dt, torch.dtype):
        if dt not in _TORCH_DTYPES:
            raise ValueError("%s %s is not supported by shardd (torch.float32, "
                             "torch.bfloat16 or torch.float16)" % (what, dt))
        return _TORCH_DTYPES[dt]
    if dt not in _DTYPE_OF:
        raise ValueError("%s %r: fp32, bf16, fp16 or a torch dtype" % (what, dt))
    return dt


def _mixed_precision(dtype, mixed_precision, param_dtype, reduce_dtype, buffer_dtype):
    """FSDP's MixedPrecision knobs (given as an object with those attributes,
    such as torch's MixedPrecision, or one by one) mapped onto shardd:
    -> (the units' dtype or None, buffer dtype or None, input dtype or None).

    param_dtype is the units' dtype (a 16-bit unit computes in it; its fp32
    master and reduced gradient are the daemon's), and the root's floating
    inputs are cast to it, as FSDP casts them. The daemon reduces every
    gradient in fp32 into the fp32 reduced-gradient shard (16-bit gradients
    widened first): FSDP's reduce_dtype=torch.float32, so that, None, or the
    param_dtype when it is fp32 are taken; a 16-bit reduce_dtype is refused.
    buffer_dtype casts the module's floating buffers (full precision again
    in a full state dict, as FSDP's)."""
    if mixed_precision is not None:
        for k, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                     ("buffer_dtype", buffer_dtype)):
            if v is not None:
                raise ValueError("%s given twice: in mixed_precision and as an "
                                 "argument" % k)
        param_dtype = getattr(mixed_precision, "param_dtype", None)
        reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
        buffer_dtype = getattr(mixed_precision, "buffer_dtype", None)
        if getattr(mixed_precision, "keep_low_precision_grads", False):
            raise ValueError("keep_low_precision_grads: a 16-bit unit's reduced "
                             "gradient is the daemon's fp32 one")
    pdt = None if param_dtype is None else _dtype_name(param_dtype, "param_dtype")
    if pdt is not None and dtype is not None and _dtype_name(dtype, "dtype") != pdt:
        raise ValueError("dtype %r and param_dtype %r differ (param_dtype is the "
                         "units' dtype: pass one)" % (dtype, param_dtype))
    if reduce_dtype is not None:
        rdt = _dtype_name(reduce_dtype, "reduce_dtype")
        if rdt != "fp32":
            raise ValueError(
                "reduce_dtype %s: shardd reduces gradients in fp32 (a 16-bit unit's "
                "widened) into the fp32 reduced-gradient shard, FSDP's "
                "reduce_dtype=torch.float32; a %s reduction is not offered "
                "(pass torch.float32 or None)" % (reduce_dtype, rdt))
    bdt = None if buffer_dtype is None else _DTYPE_OF[_dtype_name(buffer_dtype, "buffer_dtype")]
    return (pdt if pdt is not None else dtype, bdt,
            None if pdt is None else _DTYPE_OF[pdt])


def _cast_floats(obj, dt):
    """obj with its floating tensors (in tuples, lists, dicts) cast to dt."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dt) if obj.is_floating_point() and obj.dtype != dt else obj
    if isinstance(obj, tuple):
        return type(obj)(*[_cast_floats(x, dt) for x in obj]) if hasattr(obj, "_fields") \
            else tuple(_cast_floats(x, dt) for x in obj)
    if isinstance(obj, list):
        return [_cast_floats(x, dt) for x in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dt) for k, v in obj.items()}
    return obj


def _checksum(flat):
    """crc32 of the flattened initial values' bytes: equal on every rank
    exactly when the ranks built the same model."""
    return zlib.crc32(flat.contiguous().view(torch.uint8).cpu().numpy())
