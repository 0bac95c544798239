/* dtype.c — the element types' sizes and names, and the one table of the
 * names a user may give for each (shardctl, libshardd's callers, the Python
 * binding through shardd_dtype_parse), shared by daemon, library and
 * shardctl. The fp32/bf16/fp16 conversions themselves are dtype.h. */
#include "shardd.h"

#include <strings.h>

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

/* Every spelling any caller accepts: the Python binding parses through this
 * too, so "f32" and "f16", which it accepted alone before, are here rather
 * than refused where they used to work. */
shardd_err shardd_dtype_parse(const char *s, shardd_dtype *out) {
  static const struct {
    const char *name;
    shardd_dtype dtype;
  } names[] = {
      {"fp32", SHARDD_DTYPE_FP32},     {"float32", SHARDD_DTYPE_FP32},
      {"float", SHARDD_DTYPE_FP32},    {"f32", SHARDD_DTYPE_FP32},
      {"bf16", SHARDD_DTYPE_BF16},     {"bfloat16", SHARDD_DTYPE_BF16},
      {"fp16", SHARDD_DTYPE_FP16},     {"float16", SHARDD_DTYPE_FP16},
      {"half", SHARDD_DTYPE_FP16},     {"f16", SHARDD_DTYPE_FP16},
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
