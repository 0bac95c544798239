/* err.c — the error table (generated from SHARDD_ERRNO_MAP), shared by
 * daemon, library and shardctl. */
#include "shardd.h"

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
