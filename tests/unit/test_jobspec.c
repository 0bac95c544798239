/* test_jobspec.c — --job-spec files: the parser (from memory and from a
 * file), its refusals naming file and line, and which spec a job gets now
 * that job names are per uid (`uid =`). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "jobspec.h"

static char err[512];

static shardd_err parse(const char *text, shardd__jobspec *out) {
  return shardd__jobspec_parse("t.spec", text, strlen(text), out, err, sizeof err);
}

#define TWO_NODES "job = llm\nworld = 4\nnodes = 2\nnode_rank = 1\nrendezvous = /r\n"

Test(jobspec, parses_every_key) {
  shardd__jobspec s;
  cr_assert_eq(parse("# a layout\n" TWO_NODES "local_ranks = 2\nhost = 10.0.0.2 # me\n"
                     "uid = 1000",
                     &s),
               SHARDD_OK, "%s", err);
  cr_expect_str_eq(s.job, "llm");
  cr_expect_eq(s.world, 4);
  cr_expect_eq(s.nodes, 2);
  cr_expect_eq(s.node_rank, 1);
  cr_expect_str_eq(s.rendezvous, "/r");
  cr_expect_str_eq(s.host, "10.0.0.2");
  cr_expect_eq(s.uid, 1000);
  cr_expect_str_eq(s.path, "t.spec");
  shardd__jobspec_free(&s);
  cr_assert_eq(parse(TWO_NODES, &s), SHARDD_OK, "%s", err);
  cr_expect_eq(s.uid, -1, "no uid = : any uid's job of the name");
  cr_expect_str_eq(s.host, "127.0.0.1");
  shardd__jobspec_free(&s);
}

typedef struct {
  char text[160];
  char needle[64];
} bad_spec;

ParameterizedTestParameters(jobspec, bad_specs_are_refused_naming_the_line) {
  static bad_spec rows[] = {
      {TWO_NODES "uid = -1\n", "t.spec:6: uid = -1: not a uid"},
      {TWO_NODES "uid = 4294967296\n", "t.spec:6: uid = 4294967296"},
      {TWO_NODES "uid = root\n", "t.spec:6: uid = root"},
      {TWO_NODES "colour = 3\n", "t.spec:6: unknown key \"colour\""},
      {"job = x\nworld = 2\nnodes = 1\n", "t.spec: world, nodes and node_rank"},
      {"job = x\nworld\n", "t.spec:2: expected key = value"},
      {"world = 2\nnodes = 1\nnode_rank = 0\n", "t.spec: no job = NAME"},
      {"job = 1002/vj\nworld = 2\nnodes = 1\nnode_rank = 0\n", "may not hold a '/'"},
      {"job = x\nworld = 3\nnodes = 2\nnode_rank = 0\n",
       "t.spec: world 3 does not split evenly over 2 nodes"},
  };
  return cr_make_param_array(bad_spec, rows, sizeof rows / sizeof rows[0]);
}

ParameterizedTest(bad_spec *row, jobspec, bad_specs_are_refused_naming_the_line) {
  shardd__jobspec s;
  cr_assert_eq(parse(row->text, &s), SHARDD_E_INVAL, "%s", row->text);
  cr_expect(strstr(err, row->needle) != NULL, "%s: %s", row->needle, err);
  cr_expect_null(s.job, "a refused spec keeps nothing");
}

Test(jobspec, a_nul_byte_or_an_overlong_line_is_refused) {
  shardd__jobspec s;
  const char nul[] = "job = a\0b\nworld = 1\nnodes = 1\nnode_rank = 0\n";
  cr_assert_eq(shardd__jobspec_parse("t.spec", nul, sizeof nul - 1, &s, err, sizeof err),
               SHARDD_E_INVAL);
  cr_expect(strstr(err, "t.spec:1: holds a NUL byte"), "%s", err);
  char *big = malloc(2048);
  memset(big, 'x', 2047);
  big[2047] = '\0';
  cr_assert_eq(parse(big, &s), SHARDD_E_INVAL);
  cr_expect(strstr(err, "t.spec:1: line longer than"), "%s", err);
  free(big);
}

Test(jobspec, load_reads_the_file_as_parse_does) {
  char path[] = "/tmp/shardd-jobspec-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(fd >= 0);
  const char *text = TWO_NODES "uid = 7\n";
  cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
  shardd__jobspec s;
  cr_assert_eq(shardd__jobspec_load(path, &s, err, sizeof err), SHARDD_OK, "%s", err);
  cr_expect_eq(s.uid, 7);
  cr_expect_str_eq(s.path, path);
  shardd__jobspec_free(&s);
  unlink(path);
  cr_assert_eq(shardd__jobspec_load(path, &s, err, sizeof err), SHARDD_E_IO);
  cr_expect(strstr(err, path), "%s", err);
}

/* Job names are per uid (issue 20, item 8): a spec with uid = U is for
 * U's job of that name only; one without is for whoever's, and one with
 * the asker's uid wins over it. */
Test(jobspec, find_matches_the_uid_given) {
  shardd__jobspec s[3];
  cr_assert_eq(parse("job = a\nworld = 2\nnodes = 1\nnode_rank = 0\nuid = 1000\n", &s[0]),
               SHARDD_OK, "%s", err);
  cr_assert_eq(parse("job = a\nworld = 4\nnodes = 1\nnode_rank = 0\n", &s[1]), SHARDD_OK);
  cr_assert_eq(parse("job = b\nworld = 2\nnodes = 1\nnode_rank = 0\nuid = 1000\n", &s[2]),
               SHARDD_OK);
  cr_expect_eq(shardd__jobspec_find(s, 3, 1000, "a"), &s[0]);
  cr_expect_eq(shardd__jobspec_find(s, 3, 2000, "a"), &s[1]);
  cr_expect_eq(shardd__jobspec_find(s, 3, 0, "a"), &s[1]);
  cr_expect_eq(shardd__jobspec_find(s, 3, 1000, "b"), &s[2]);
  cr_expect_null(shardd__jobspec_find(s, 3, 2000, "b"), "uid 1000's spec is not 2000's");
  cr_expect_null(shardd__jobspec_find(s, 3, 1000, "c"));
  cr_expect(shardd__jobspec_overlap(&s[0], &s[1]), "a spec without uid meets any");
  cr_expect(!shardd__jobspec_overlap(&s[0], &s[2]), "other names");
  shardd__jobspec u2000;
  cr_assert_eq(parse("job = b\nworld = 2\nnodes = 1\nnode_rank = 0\nuid = 2000\n", &u2000),
               SHARDD_OK);
  cr_expect(!shardd__jobspec_overlap(&s[2], &u2000), "two users' specs of one name");
  shardd__jobspec_free(&u2000);
  for (int i = 0; i < 3; i++)
    shardd__jobspec_free(&s[i]);
}
