/* test_escape.c — the one escape of names for a line of text (the daemon's
 * log, shardctl's reports): control bytes as \xNN, a backslash as \\, plain
 * bytes (UTF-8 included) as they are, and a cut where the buffer ends only
 * at a whole character, marked "..."; and which bytes start a UTF-8
 * character, for JSON text. The expected texts are written out by hand. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "escape.h"

Test(escape, plain_bytes_are_kept) {
  char out[64];
  cr_assert_str_eq(shardd__escape("job-1 w.grad", out, sizeof out), "job-1 w.grad");
  cr_assert_str_eq(shardd__escape("caf\xc3\xa9", out, sizeof out), "caf\xc3\xa9");
  cr_assert_str_eq(shardd__escape("", out, sizeof out), "");
  cr_assert_str_eq(shardd__escape(NULL, out, sizeof out), "");
}

Test(escape, control_bytes_and_backslash) {
  char out[64];
  cr_assert_str_eq(shardd__escape("a\nb", out, sizeof out), "a\\x0ab");
  cr_assert_str_eq(shardd__escape("\r\x1b[2J\x7f\x01", out, sizeof out),
                   "\\x0d\\x1b[2J\\x7f\\x01");
  /* a backslash doubled: a name "\x0a" of four plain bytes is not shown as
   * the escape of a newline */
  cr_assert_str_eq(shardd__escape("\\x0a", out, sizeof out), "\\\\x0a");
  cr_assert_str_eq(shardd__escape("a\\\n", out, sizeof out), "a\\\\\\x0a");
}

/* U+009B is CSI in UTF-8 as in 8 bits: a UTF-8 terminal starts an escape
 * sequence on c2 9b as on 1b 5b, so a name could still clear the screen */
Test(escape, c1_controls_in_utf8) {
  char out[64];
  cr_assert_str_eq(shardd__escape("a\xc2\x9b" "2Jb", out, sizeof out),
                   "a\\xc2\\x9b2Jb");
  cr_assert_str_eq(shardd__escape("\xc2\x80\xc2\x9f", out, sizeof out),
                   "\\xc2\\x80\\xc2\\x9f");
  /* the characters around them are kept: U+00A0 and U+00E9 */
  cr_assert_str_eq(shardd__escape("\xc2\xa0\xc3\xa9", out, sizeof out),
                   "\xc2\xa0\xc3\xa9");
  /* a cut leaves the pair out whole */
  char o9[9];
  cr_assert_str_eq(shardd__escape("ab\xc2\x9b", o9, sizeof o9), "ab...");
  /* 4 bytes an input byte still suffice */
  char o17[17];
  cr_assert_str_eq(shardd__escape("\xc2\x9b\xc2\x9b", o17, sizeof o17),
                   "\\xc2\\x9b\\xc2\\x9b");
}

Test(escape, four_bytes_a_byte_always_suffice) {
  char in[256], out[4 * 255 + 1];
  memset(in, '\n', 255);
  in[255] = '\0';
  shardd__escape(in, out, sizeof out);
  cr_assert_eq(strlen(out), 4 * 255);
  cr_assert(strstr(out, "...") == NULL);
  cr_assert_eq(memcmp(out + 4 * 254, "\\x0a", 4), 0);
}

Test(escape, exact_fit_is_not_cut) {
  char out[4];
  cr_assert_str_eq(shardd__escape("abc", out, sizeof out), "abc");
  char out5[5];
  cr_assert_str_eq(shardd__escape("\n", out5, sizeof out5), "\\x0a");
}

Test(escape, cut_at_a_whole_character_and_marked) {
  char out[8];
  cr_assert_str_eq(shardd__escape("abcdefgh", out, sizeof out), "abcd...");
  /* the escape that would cross the end is left out whole */
  cr_assert_str_eq(shardd__escape("ab\ncd", out, sizeof out), "ab...");
  cr_assert_str_eq(shardd__escape("abc\\d\\e", out, sizeof out), "abc...");
  cr_assert_str_eq(shardd__escape("\n\n", out, sizeof out), "\\x0a...");
}

Test(escape, tiny_buffers) {
  char out[4] = "zzz";
  cr_assert_str_eq(shardd__escape("abcd", out, 4), "...");
  cr_assert_str_eq(shardd__escape("abcd", out, 3), "");
  cr_assert_str_eq(shardd__escape("a", out, 2), "a");
  cr_assert_str_eq(shardd__escape("a", out, 1), "");
  out[0] = 'z';
  shardd__escape("a", out, 0);
  cr_assert_eq(out[0], 'z', "nothing is written to an empty buffer");
}

/* ---- UTF-8 characters, for JSON text ------------------------------------- */

Test(escape, utf8_characters_of_each_length) {
  cr_assert_eq(shardd__utf8_len("a"), 1);
  cr_assert_eq(shardd__utf8_len("\x7f"), 1);
  cr_assert_eq(shardd__utf8_len(""), 1, "the NUL is a character of its own");
  cr_assert_eq(shardd__utf8_len("\xc2\x80"), 2);        /* U+0080, the first */
  cr_assert_eq(shardd__utf8_len("\xdf\xbf"), 2);        /* U+07FF */
  cr_assert_eq(shardd__utf8_len("\xe0\xa0\x80"), 3);    /* U+0800 */
  cr_assert_eq(shardd__utf8_len("\xed\x9f\xbf"), 3);    /* U+D7FF */
  cr_assert_eq(shardd__utf8_len("\xee\x80\x80"), 3);    /* U+E000 */
  cr_assert_eq(shardd__utf8_len("\xef\xbf\xbd"), 3);    /* U+FFFD */
  cr_assert_eq(shardd__utf8_len("\xf0\x90\x80\x80"), 4); /* U+10000 */
  cr_assert_eq(shardd__utf8_len("\xf4\x8f\xbf\xbf"), 4); /* U+10FFFF, the last */
  cr_assert_eq(shardd__utf8_len("\xc3\xa9xyz"), 2, "only the character's bytes");
}

Test(escape, bytes_that_start_no_utf8_character) {
  cr_assert_eq(shardd__utf8_len("\x80"), 0, "a continuation byte alone");
  cr_assert_eq(shardd__utf8_len("\xbf\xbf"), 0);
  cr_assert_eq(shardd__utf8_len("\xc0\x80"), 0, "overlong NUL");
  cr_assert_eq(shardd__utf8_len("\xc1\xbf"), 0, "overlong U+007F");
  cr_assert_eq(shardd__utf8_len("\xe0\x9f\xbf"), 0, "overlong U+07FF");
  cr_assert_eq(shardd__utf8_len("\xf0\x8f\xbf\xbf"), 0, "overlong U+FFFF");
  cr_assert_eq(shardd__utf8_len("\xed\xa0\x80"), 0, "U+D800, a surrogate");
  cr_assert_eq(shardd__utf8_len("\xed\xbf\xbf"), 0, "U+DFFF, a surrogate");
  cr_assert_eq(shardd__utf8_len("\xf4\x90\x80\x80"), 0, "U+110000");
  cr_assert_eq(shardd__utf8_len("\xf5\x80\x80\x80"), 0);
  cr_assert_eq(shardd__utf8_len("\xff"), 0);
  cr_assert_eq(shardd__utf8_len("\xe9t"), 0, "Latin-1 e-acute");
  cr_assert_eq(shardd__utf8_len("\xe2\x82" "a"), 0, "a 3-byte character cut short");
  cr_assert_eq(shardd__utf8_len("\xf0\x9f\x98" "a"), 0, "a 4-byte one cut short");
}

/* A character cut short by the string's end is none, and nothing past the
 * NUL is read: each input ends its allocation (ASan sees a read past). */
Test(escape, a_cut_character_reads_nothing_past_the_end) {
  static const char *cut[] = {"\xc3", "\xe2", "\xe2\x82", "\xf0", "\xf0\x9f",
                              "\xf0\x9f\x98"};
  for (size_t i = 0; i < sizeof cut / sizeof cut[0]; i++) {
    size_t n = strlen(cut[i]) + 1;
    char *s = malloc(n);
    cr_assert_not_null(s);
    memcpy(s, cut[i], n);
    cr_expect_eq(shardd__utf8_len(s), 0, "input %zu", i);
    free(s);
  }
}

/* What one U+FFFD stands for where no character starts: a character cut
 * short whole (as Python's decode(errors="replace") takes it), any other
 * byte alone; each input ends its allocation (ASan sees a read past). */
Test(escape, a_cut_character_is_replaced_whole) {
  static const struct {
    const char *in;
    size_t want;
  } rows[] = {
      {"\xc3", 1},         {"\xe2\x82", 2},      {"\xe2\x82" "a", 2},
      {"\xf0\x9f\x98", 3}, {"\xf0\x9f" "a", 2},  {"\xf4\x8f\xbf" "a", 3},
      {"\xe0\x80\x80", 1}, /* overlong: no character starts so */
      {"\xed\xa0\x80", 1}, /* a surrogate */
      {"\xf4\x90\x80", 1}, /* past U+10FFFF */
      {"\x80\x80", 1},     {"\xff", 1},          {"\xc0\xaf", 1},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    size_t n = strlen(rows[i].in) + 1;
    char *s = malloc(n);
    cr_assert_not_null(s);
    memcpy(s, rows[i].in, n);
    cr_expect_eq(shardd__utf8_len(s), 0, "input %zu starts a character", i);
    cr_expect_eq(shardd__utf8_bad_len(s), rows[i].want, "input %zu: %zu bytes, wanted %zu",
                 i, shardd__utf8_bad_len(s), rows[i].want);
    free(s);
  }
}
