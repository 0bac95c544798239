/* test_err.c — the one error table (SHARDD_ERRNO_MAP) against the wire enum
 * generated from proto/shardd.proto, in both directions, plus the static
 * strings in common/err.c. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <string.h>

#include "proto/shardd.pb-c.h"
#include "shardd.h"

typedef struct {
  int value;
  char name[32];
} err_row;

static const err_row table[] = {
#define XX(name, val, msg) {val, #name},
    SHARDD_ERRNO_MAP(XX)
#undef XX
};
#define NTABLE (sizeof table / sizeof table[0])

Test(err, table_matches_proto_by_value) {
  const ProtobufCEnumDescriptor *d = &shardwire__status_code__descriptor;
  for (size_t i = 0; i < NTABLE; i++) {
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value(d, table[i].value);
    cr_assert_not_null(v, "SHARDD_%s = %d has no StatusCode of that value",
                       table[i].name, table[i].value);
    cr_expect_str_eq(v->name, table[i].name, "value %d: proto %s, C %s",
                     table[i].value, v->name, table[i].name);
  }
}

Test(err, proto_matches_table_by_name) {
  const ProtobufCEnumDescriptor *d = &shardwire__status_code__descriptor;
  cr_assert_eq(d->n_values, NTABLE, "proto has %u codes, C table %zu",
               d->n_values, NTABLE);
  for (unsigned i = 0; i < d->n_values; i++) {
    const ProtobufCEnumValue *v = &d->values[i];
    const err_row *found = NULL;
    for (size_t j = 0; j < NTABLE; j++)
      if (strcmp(table[j].name, v->name) == 0)
        found = &table[j];
    cr_assert_not_null(found, "StatusCode %s is missing from SHARDD_ERRNO_MAP",
                       v->name);
    cr_expect_eq(found->value, v->value, "%s: proto %d, C %d", v->name,
                 v->value, found->value);
    const ProtobufCEnumValue *byname =
        protobuf_c_enum_descriptor_get_value_by_name(d, v->name);
    cr_expect_eq(byname, v);
  }
}

Test(err, count_sentinel_follows_the_last_code) {
  int max = 0;
  for (size_t i = 0; i < NTABLE; i++)
    max = table[i].value > max ? table[i].value : max;
  cr_expect_eq(SHARDD_ERR_COUNT, max + 1);
  cr_expect_eq((size_t)SHARDD_ERR_COUNT, NTABLE, "values are dense from 0");
}

Test(err, names_and_messages_of_every_code) {
  for (size_t i = 0; i < NTABLE; i++) {
    shardd_err e = (shardd_err)table[i].value;
    cr_assert_str_eq(shardd_err_name(e), table[i].name);
    const char *m = shardd_strerror(e);
    cr_assert_not_null(m);
    cr_expect_neq(strlen(m), 0);
    cr_expect_str_neq(m, "unknown error", "%s has no message", table[i].name);
  }
  cr_expect_str_eq(shardd_strerror(SHARDD_OK), "success");
  cr_expect_str_eq(shardd_strerror(SHARDD_E_NOT_OWNED), "not owned by this job");
}

typedef struct {
  int value;
} bad_code;

ParameterizedTestParameters(err, out_of_range) {
  static bad_code codes[] = {{-1}, {-1000}, {SHARDD_ERR_COUNT},
                             {SHARDD_ERR_COUNT + 1}, {1 << 30}};
  return cr_make_param_array(bad_code, codes, sizeof codes / sizeof codes[0]);
}

ParameterizedTest(bad_code *c, err, out_of_range) {
  const char *m = shardd_strerror((shardd_err)c->value);
  const char *n = shardd_err_name((shardd_err)c->value);
  cr_assert_not_null(m);
  cr_assert_not_null(n);
  cr_expect_str_eq(m, "unknown error");
  cr_expect_str_eq(n, "E_UNKNOWN");
}

Test(err, dtype_values_match_proto) {
  cr_expect_eq(SHARDD_DTYPE_FP32, SHARDWIRE__DTYPE__FP32);
  cr_expect_eq(SHARDD_DTYPE_BF16, SHARDWIRE__DTYPE__BF16);
  cr_expect_eq(SHARDD_DTYPE_FP16, SHARDWIRE__DTYPE__FP16);
  cr_expect_eq(SHARDD_OPTIM_SGD, SHARDWIRE__OPTIM_KIND__SGD);
  cr_expect_eq(SHARDD_OPTIM_ADAM, SHARDWIRE__OPTIM_KIND__ADAM);
  cr_expect_eq(SHARDD_OPTIM_ADAMW, SHARDWIRE__OPTIM_KIND__ADAMW);
}
