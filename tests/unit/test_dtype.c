/* test_dtype.c — common/dtype.c: the dtype names a user may give, their
 * sizes and canonical names. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <string.h>

#include "shardd.h"

typedef struct {
  char text[16];
  int dtype;
} dtype_row;

ParameterizedTestParameters(dtype, parse_known) {
  static dtype_row rows[] = {
      {"fp32", SHARDD_DTYPE_FP32},     {"float32", SHARDD_DTYPE_FP32},
      {"float", SHARDD_DTYPE_FP32},    {"FP32", SHARDD_DTYPE_FP32},
      {"bf16", SHARDD_DTYPE_BF16},     {"bfloat16", SHARDD_DTYPE_BF16},
      {"BFloat16", SHARDD_DTYPE_BF16}, {"fp16", SHARDD_DTYPE_FP16},
      {"float16", SHARDD_DTYPE_FP16},  {"half", SHARDD_DTYPE_FP16},
      {"f32", SHARDD_DTYPE_FP32},      {"F16", SHARDD_DTYPE_FP16},
  };
  return cr_make_param_array(dtype_row, rows, sizeof rows / sizeof rows[0]);
}

ParameterizedTest(dtype_row *r, dtype, parse_known) {
  shardd_dtype d = 0;
  cr_assert_eq(shardd_dtype_parse(r->text, &d), SHARDD_OK, "%s", r->text);
  cr_expect_eq((int)d, r->dtype, "%s", r->text);
}

ParameterizedTestParameters(dtype, parse_unknown) {
  static dtype_row rows[] = {{"", 0},     {"fp8", 0},    {"int8", 0},
                             {"fp32 ", 0}, {" fp32", 0}, {"float64", 0},
                             {"bf", 0},   {"f", 0}};
  return cr_make_param_array(dtype_row, rows, sizeof rows / sizeof rows[0]);
}

ParameterizedTest(dtype_row *r, dtype, parse_unknown) {
  shardd_dtype d = (shardd_dtype)77;
  cr_expect_eq(shardd_dtype_parse(r->text, &d), SHARDD_E_DTYPE, "\"%s\"",
               r->text);
  cr_expect_eq((int)d, 77, "output untouched on refusal");
}

Test(dtype, parse_null) {
  shardd_dtype d;
  cr_expect_eq(shardd_dtype_parse(NULL, &d), SHARDD_E_INVAL);
  cr_expect_eq(shardd_dtype_parse("fp32", NULL), SHARDD_E_INVAL);
}

Test(dtype, size_and_name) {
  cr_expect_eq(shardd_dtype_size(SHARDD_DTYPE_FP32), 4);
  cr_expect_eq(shardd_dtype_size(SHARDD_DTYPE_BF16), 2);
  cr_expect_eq(shardd_dtype_size(SHARDD_DTYPE_FP16), 2);
  cr_expect_eq(shardd_dtype_size((shardd_dtype)0), 0);
  cr_expect_eq(shardd_dtype_size((shardd_dtype)4), 0);
  cr_expect_eq(shardd_dtype_size((shardd_dtype)-1), 0);
  cr_expect_str_eq(shardd_dtype_name(SHARDD_DTYPE_FP32), "fp32");
  cr_expect_str_eq(shardd_dtype_name(SHARDD_DTYPE_BF16), "bf16");
  cr_expect_str_eq(shardd_dtype_name(SHARDD_DTYPE_FP16), "fp16");
  cr_expect_null(shardd_dtype_name((shardd_dtype)0));
  cr_expect_null(shardd_dtype_name((shardd_dtype)9));
}

Test(dtype, names_round_trip_through_parse) {
  static const shardd_dtype all[] = {SHARDD_DTYPE_FP32, SHARDD_DTYPE_BF16,
                                     SHARDD_DTYPE_FP16};
  for (size_t i = 0; i < 3; i++) {
    shardd_dtype d;
    cr_assert_eq(shardd_dtype_parse(shardd_dtype_name(all[i]), &d), SHARDD_OK);
    cr_expect_eq(d, all[i]);
  }
}
