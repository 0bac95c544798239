/* test_strbuf.c — the growable string: printf growth across many doublings,
 * take/free ownership, and JSON string escaping (checked against escapes
 * written out by hand from RFC 8259). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strbuf.h"

static shardd__sb sb;

static void setup(void) { shardd__sb_init(&sb); }
static void teardown(void) { shardd__sb_free(&sb); }

TestSuite(strbuf, .init = setup, .fini = teardown);

Test(strbuf, take_of_empty_is_empty_string) {
  char *s = shardd__sb_take(&sb);
  cr_assert_not_null(s);
  cr_expect_str_eq(s, "");
  free(s);
  cr_expect_null(sb.s, "take resets the buffer");
  cr_expect_eq(sb.len, 0);
}

Test(strbuf, printf_appends) {
  shardd__sb_printf(&sb, "%s=%d", "a", 1);
  shardd__sb_printf(&sb, ", %s=%.2f", "b", 2.5);
  shardd__sb_printf(&sb, "%s", "");
  cr_expect_eq(sb.len, strlen("a=1, b=2.50"));
  char *s = shardd__sb_take(&sb);
  cr_assert_str_eq(s, "a=1, b=2.50");
  free(s);
}

Test(strbuf, printf_grows_past_many_doublings) {
  /* 10,000 appends of a 7-char item, and one append far larger than the
   * current capacity; the expected text is built with plain snprintf. */
  size_t want_len = 0;
  char *want = malloc(200000);
  cr_assert_not_null(want);
  for (int i = 0; i < 10000; i++) {
    shardd__sb_printf(&sb, "%06d,", i);
    want_len += (size_t)snprintf(want + want_len, 200000 - want_len, "%06d,", i);
  }
  cr_assert_eq(sb.len, want_len);
  cr_assert_eq(sb.len, 70000);
  char big[100001];
  memset(big, 'x', 100000);
  big[100000] = '\0';
  shardd__sb_printf(&sb, "%s", big);
  memcpy(want + want_len, big, 100000);
  want_len += 100000;
  want[want_len] = '\0';
  cr_assert_eq(sb.len, want_len);
  cr_assert_geq(sb.cap, sb.len + 1);
  char *s = shardd__sb_take(&sb);
  cr_assert_not_null(s);
  cr_assert_eq(strlen(s), want_len);
  cr_assert(memcmp(s, want, want_len + 1) == 0);
  free(s);
  free(want);
}

Test(strbuf, exact_capacity_boundary) {
  /* 127 chars fill the first 128-byte allocation with the NUL; one more must
   * grow rather than write past it (ASan catches an overrun). */
  char a[128];
  memset(a, 'a', 127);
  a[127] = '\0';
  shardd__sb_printf(&sb, "%s", a);
  cr_expect_eq(sb.len, 127);
  shardd__sb_printf(&sb, "b");
  cr_expect_eq(sb.len, 128);
  char *s = shardd__sb_take(&sb);
  cr_expect_eq(strlen(s), 128);
  cr_expect_eq(s[127], 'b');
  free(s);
}

Test(strbuf, failed_is_sticky) {
  shardd__sb_printf(&sb, "abc");
  sb.failed = 1; /* as after a failed realloc */
  shardd__sb_printf(&sb, "def");
  cr_expect_eq(sb.len, 3, "nothing appended after a failure");
  cr_expect_null(shardd__sb_take(&sb));
  cr_expect_null(sb.s, "take frees the buffer on failure");
}

typedef struct {
  char in[32];
  char out[96];
} esc_row;

ParameterizedTestParameters(strbuf, json_escape) {
  static esc_row rows[] = {
      {"", ""},
      {"plain", "plain"},
      {"a\"b", "a\\\"b"},
      {"back\\slash", "back\\\\slash"},
      {"nl\n", "nl\\n"},
      {"tab\t", "tab\\t"},
      {"cr\r", "cr\\r"},
      {"\x01\x1f", "\\u0001\\u001f"},
      {"\b\f", "\\u0008\\u000c"},
      {"/ and ' stay", "/ and ' stay"},
      {"\x7f", "\x7f"},
      {"\xc3\xa9t\xc3\xa9", "\xc3\xa9t\xc3\xa9"}, /* UTF-8 passes through */
      {"\xf0\x9f\x98\x80 \xef\xbf\xbd", "\xf0\x9f\x98\x80 \xef\xbf\xbd"},
      /* bytes that start no UTF-8 character: each one U+FFFD, escaped */
      {"a\xff" "b", "a\\ufffdb"},
      {"\xe9t\xe9", "\\ufffdt\\ufffd"},       /* Latin-1, not UTF-8 */
      {"\xc3", "\\ufffd"},                    /* cut short by the end */
      {"\xc3\"", "\\ufffd\\\""},             /* cut short by a quote */
      {"\xc0\xaf", "\\ufffd\\ufffd"},         /* overlong "/" */
      {"\xed\xa0\x80", "\\ufffd\\ufffd\\ufffd"}, /* a surrogate */
      {"\xf4\x90\x80\x80", "\\ufffd\\ufffd\\ufffd\\ufffd"}, /* past U+10FFFF */
      {"\x80\xe2\x82\xac", "\\ufffd\xe2\x82\xac"}, /* a stray continuation */
      /* a character cut short is one U+FFFD, its maximal subpart, as a
       * decoder's "replace" (Python's) gives it, not one per byte */
      {"\xe2\x82", "\\ufffd"},
      {"\xe2\x82" "a", "\\ufffda"},
      {"\xf0\x9f\x98" "a\xf0\x9f", "\\ufffda\\ufffd"},
      {"\xf0\x9f\x98\xf0\x9f\x98\x80", "\\ufffd\xf0\x9f\x98\x80"},
      {"\xe0\x80\x80", "\\ufffd\\ufffd\\ufffd"}, /* overlong: no subpart */
      {"\"\\\"", "\\\"\\\\\\\""},
  };
  return cr_make_param_array(esc_row, rows, sizeof rows / sizeof rows[0]);
}

ParameterizedTest(esc_row *r, strbuf, json_escape) {
  shardd__sb_printf(&sb, "\"");
  shardd__sb_json_str(&sb, r->in);
  shardd__sb_printf(&sb, "\"");
  char *s = shardd__sb_take(&sb);
  char want[128];
  snprintf(want, sizeof want, "\"%s\"", r->out);
  cr_assert_str_eq(s, want);
  free(s);
}

Test(strbuf, json_escape_null_is_empty) {
  shardd__sb_json_str(&sb, NULL);
  char *s = shardd__sb_take(&sb);
  cr_expect_str_eq(s, "");
  free(s);
}

Test(strbuf, json_escape_long_input_grows) {
  char in[3001];
  for (int i = 0; i < 3000; i++)
    in[i] = i % 3 == 0 ? '"' : 'q';
  in[3000] = '\0';
  shardd__sb_json_str(&sb, in);
  cr_assert_eq(sb.len, 4000, "1000 quotes become 2 bytes each");
  char *s = shardd__sb_take(&sb);
  for (int i = 0, j = 0; i < 3000; i++) {
    if (in[i] == '"') {
      cr_assert_eq(s[j], '\\');
      cr_assert_eq(s[j + 1], '"');
      j += 2;
    } else {
      cr_assert_eq(s[j++], 'q');
    }
  }
  free(s);
}
