/* err.c — the error table (generated from SHARDD_ERRNO_MAP) and the dtype
 * names, shared by daemon, library and shardctl. */
#include "shardd.h"

#include <string.h>
#include <strings.h>

const char *shardd_strerror(shardd_err err) {
  switch (err) {
#define XX(name, val, msg) \
  case SHARDD_##name:      \
    return msg;
    SHARDD_ERRNO_MAP(XX)
#undef XX
  default:
    return "unknown error";
  }
}

const char *shardd_err_name(shardd_err err) {
  switch (err) {
#define XX(name, val, msg) \
  case SHARDD_##name:      \
    return #name;
    SHARDD_ERRNO_MAP(XX)
#undef XX
  default:
    return "E_UNKNOWN";
  }
}

size_t shardd_dtype_size(shardd_dtype dtype) {
  switch (dtype) {
  case SHARDD_DTYPE_FP32:
    return 4;
  case SHARDD_DTYPE_BF16:
  case SHARDD_DTYPE_FP16:
    return 2;
  }
  return 0;
}

const char *shardd_dtype_name(shardd_dtype dtype) {
  switch (dtype) {
  case SHARDD_DTYPE_FP32:
    return "fp32";
  case SHARDD_DTYPE_BF16:
    return "bf16";
  case SHARDD_DTYPE_FP16:
    return "fp16";
  }
  return NULL;
}

shardd_err shardd_dtype_parse(const char *s, shardd_dtype *out) {
  static const struct {
    const char *name;
    shardd_dtype dtype;
  } names[] = {
      {"fp32", SHARDD_DTYPE_FP32},    {"float32", SHARDD_DTYPE_FP32},
      {"float", SHARDD_DTYPE_FP32},   {"bf16", SHARDD_DTYPE_BF16},
      {"bfloat16", SHARDD_DTYPE_BF16}, {"fp16", SHARDD_DTYPE_FP16},
      {"float16", SHARDD_DTYPE_FP16}, {"half", SHARDD_DTYPE_FP16},
  };
  if (s == NULL || out == NULL)
    return SHARDD_E_INVAL;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    if (strcasecmp(s, names[i].name) == 0) {
      *out = names[i].dtype;
      return SHARDD_OK;
    }
  }
  return SHARDD_E_DTYPE;
}
