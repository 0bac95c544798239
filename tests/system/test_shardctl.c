/* test_shardctl.c — the shardctl command line as a user runs it: exit codes
 * (0 ok, 1 daemon error, 2 usage, 3 cannot reach the daemon), errors on
 * stderr prefixed "shardctl:" naming what failed, --socket and
 * $SHARDD_SOCKET, and status / inspect / ping output parsed as text and
 * JSON. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdarg.h>

#include "harness.h"

static test_daemon d;

static void start(void) {
  const char *args[] = {"--devices", "2", NULL};
  test_daemon_start(&d, args);
}

static void stop(void) { test_daemon_finish(&d); }

static int ctl(char **out, char **err, const char *fmt, const char *extra) {
  char args[512];
  snprintf(args, sizeof args, fmt, d.sock, extra ? extra : "");
  return test_shardctl(NULL, args, out, err);
}

/* `shardctl` with the printf-formatted arguments, which must exit 0 (its
 * stderr in the failure): its stdout, to free. */
static char *vctl_ok(const char *fmt, va_list ap) {
  char args[4096], *out, *err;
  vsnprintf(args, sizeof args, fmt, ap);
  cr_assert_eq(test_shardctl(NULL, args, &out, &err), 0, "%s", err);
  free(err);
  return out;
}

__attribute__((format(printf, 1, 2))) static char *ctl_ok(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *out = vctl_ok(fmt, ap);
  va_end(ap);
  return out;
}

/* As ctl_ok for a --json command: its output parsed (valid JSON, or the
 * test fails); the text itself in *text when text is not NULL (to free). */
__attribute__((format(printf, 2, 3))) static tj *ctl_json(char **text, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *out = vctl_ok(fmt, ap);
  va_end(ap);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "not valid JSON: %s", out);
  if (text)
    *text = out;
  else
    free(out);
  return j;
}

Test(shardctl, status_ok_and_ping, .init = start, .fini = stop) {
  char *out, *err;
  cr_assert_eq(ctl(&out, &err, "--socket %s status%s", NULL), 0, "%s", err);
  cr_assert_not_null(strstr(out, "backend: host\n"), "%s", out);
  cr_assert_not_null(strstr(out, "devices: 2\n"), "%s", out);
  cr_assert_str_eq(err, "");
  free(out);
  free(err);
  /* options after the command, --socket=PATH form */
  tj *j = ctl_json(NULL, "status --json --socket=%s", d.sock);
  cr_assert_eq(tj_need(j, "devices", TJ_ARR)->n, 2);
  tj_free(j);
  out = ctl_ok("--socket %s ping", d.sock);
  cr_assert_str_eq(out, "pong\n");
  free(out);
  j = ctl_json(NULL, "--socket %s --json ping", d.sock);
  cr_assert_eq(tj_need(j, "ok", TJ_BOOL)->boolean, 1);
  tj_free(j);
}

Test(shardctl, socket_from_environment, .init = start, .fini = stop) {
  char env[256], *out, *err;
  snprintf(env, sizeof env, "SHARDD_SOCKET=%s", d.sock);
  cr_assert_eq(test_shardctl(env, "status --json", &out, &err), 0, "%s", err);
  tj *j = tj_parse(out);
  cr_assert_not_null(j);
  cr_assert_str_eq(tj_need(j, "socket", TJ_STR)->str, d.sock);
  tj_free(j);
  free(out);
  free(err);
}

typedef struct {
  char args[64];
} usage_case;

ParameterizedTestParameters(shardctl, usage_errors_exit_2) {
  static usage_case cases[] = {
      {""},                 /* no command */
      {"frobnicate"},       /* unknown command */
      {"--frobnicate status"},
      {"status extra"},     /* status takes no argument */
      {"inspect"},          /* inspect needs one */
      {"inspect a b"},
      {"status --bogus"},
      {"--socket"},         /* option without its value and no command */
  };
  return cr_make_param_array(usage_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(usage_case *uc, shardctl, usage_errors_exit_2) {
  /* no daemon needed: usage is checked before connecting */
  char *out, *err;
  int rc = test_shardctl("SHARDD_SOCKET=/nonexistent/shardd.sock", uc->args, &out, &err);
  cr_assert_eq(rc, 2, "shardctl %s exited %d (stderr: %s)", uc->args, rc, err);
  cr_assert_neq(err[0], '\0', "shardctl %s: nothing on stderr", uc->args);
  cr_assert_str_eq(out, "", "shardctl %s printed to stdout: %s", uc->args, out);
  free(out);
  free(err);
}

Test(shardctl, help_exits_0) {
  char *out, *err;
  cr_assert_eq(test_shardctl(NULL, "--help", &out, &err), 0);
  cr_assert_not_null(strstr(out, "usage: shardctl"), "%s", out);
  free(out);
  free(err);
}

typedef struct {
  char how[16];
} nodaemon_case;

ParameterizedTestParameters(shardctl, no_daemon_exits_3) {
  static nodaemon_case cases[] = {{"flag"}, {"env"}, {"stale"}};
  return cr_make_param_array(nodaemon_case, cases, 3);
}

ParameterizedTest(nodaemon_case *nc, shardctl, no_daemon_exits_3) {
  char dir[] = "/tmp/shardctl-nod-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[96], args[256], env[256];
  snprintf(path, sizeof path, "%s/shardd.sock", dir);
  if (!strcmp(nc->how, "stale")) { /* a socket file with nobody listening */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, path, strlen(path) + 1);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    close(fd);
  }
  char *out, *err;
  int rc;
  if (!strcmp(nc->how, "env")) {
    snprintf(env, sizeof env, "SHARDD_SOCKET=%s", path);
    rc = test_shardctl(env, "status", &out, &err);
  } else {
    snprintf(args, sizeof args, "--socket %s status --json", path);
    rc = test_shardctl(NULL, args, &out, &err);
  }
  unlink(path);
  rmdir(dir);
  cr_assert_eq(rc, 3, "exited %d (stderr: %s)", rc, err);
  cr_assert_eq(strncmp(err, "shardctl:", 9), 0, "stderr not prefixed: %s", err);
  cr_assert_not_null(strstr(err, path), "stderr does not name %s: %s", path, err);
  cr_assert_str_eq(out, "");
  free(out);
  free(err);
}

Test(shardctl, daemon_error_exits_1, .init = start, .fini = stop) {
  char *out, *err;
  int rc = ctl(&out, &err, "--socket %s inspect 987654%s", NULL);
  cr_assert_eq(rc, 1, "exited %d: %s", rc, err);
  cr_assert_eq(strncmp(err, "shardctl:", 9), 0, "%s", err);
  cr_assert_not_null(strstr(err, "E_NOT_FOUND"), "%s", err);
  cr_assert_not_null(strstr(err, "987654"), "%s", err);
  free(out);
  free(err);
  rc = ctl(&out, &err, "--socket %s inspect no.such.param%s", NULL);
  cr_assert_eq(rc, 1, "exited %d: %s", rc, err);
  cr_assert_not_null(strstr(err, "no.such.param"), "%s", err);
  free(out);
  free(err);
}

Test(shardctl, inspect_buffer_and_view, .init = start, .fini = stop) {
  shardd_client_t *r0 = test_connect(&d, "insp", 0, 2);
  shardd_client_t *r1 = test_connect(&d, "insp", 1, 2);
  shardd_buffer_info b0, b1;
  cr_assert_eq(shardd_buffer_register(r0, "flat", SHARDD_DTYPE_BF16, 1001, &b0), SHARDD_OK);
  cr_assert_eq(shardd_buffer_register(r1, "flat", SHARDD_DTYPE_BF16, 1001, &b1), SHARDD_OK);
  int64_t shape[2] = {10, 60};
  uint64_t vid;
  cr_assert_eq(shardd_view_register(r0, b0.id, "enc.weight", 200, 600, shape, 2, &vid),
               SHARDD_OK, "%s", shardd_last_error(r0));
  tj *j = ctl_json(NULL, "--socket %s --json inspect %llu", d.sock,
                   (unsigned long long)b0.id);
  cr_assert_str_eq(tj_need(j, "kind", TJ_STR)->str, "buffer");
  cr_assert_str_eq(tj_need(j, "name", TJ_STR)->str, "flat");
  cr_assert_str_eq(tj_need(j, "job", TJ_STR)->str, "insp");
  cr_assert_str_eq(tj_need(j, "dtype", TJ_STR)->str, "bf16");
  cr_assert_eq(tj_need(j, "numel", TJ_NUM)->num, 1001);
  cr_assert_eq(tj_need(j, "padded_numel", TJ_NUM)->num, 1002);
  cr_assert_eq(tj_need(j, "shard_numel", TJ_NUM)->num, 501);
  const tj *shards = tj_need(j, "shards", TJ_ARR);
  cr_assert_eq(shards->n, 2);
  for (size_t k = 0; k < 2; k++) {
    cr_assert_eq(tj_need(shards->kids[k], "rank", TJ_NUM)->num, (double)k);
    cr_assert_eq(tj_need(shards->kids[k], "device", TJ_NUM)->num, (double)k);
    cr_assert_eq(tj_need(shards->kids[k], "offset", TJ_NUM)->num, 501.0 * k);
    cr_assert_eq(tj_need(shards->kids[k], "numel", TJ_NUM)->num, 501);
  }
  const tj *views = tj_need(j, "views", TJ_ARR);
  cr_assert_eq(views->n, 1);
  cr_assert_str_eq(tj_need(views->kids[0], "name", TJ_STR)->str, "enc.weight");
  cr_assert_eq(tj_need(views->kids[0], "offset", TJ_NUM)->num, 200);
  const tj *shp = tj_need(views->kids[0], "shape", TJ_ARR);
  cr_assert_eq(shp->n, 2);
  cr_assert_eq(shp->kids[0]->num, 10);
  cr_assert_eq(shp->kids[1]->num, 60);
  cr_assert_eq(tj_need(j, "optimizer", TJ_NULL)->kind, TJ_NULL);
  tj_free(j);
  /* the view by name: it crosses from rank 0's shard into rank 1's */
  j = ctl_json(NULL, "--socket %s inspect --json enc.weight", d.sock);
  cr_assert_str_eq(tj_need(j, "kind", TJ_STR)->str, "view");
  cr_assert_eq(tj_need(j, "buffer", TJ_NUM)->num, (double)b0.id);
  shards = tj_need(j, "shards", TJ_ARR);
  cr_assert_eq(shards->n, 2);
  cr_assert_eq(tj_need(shards->kids[0], "offset", TJ_NUM)->num, 200);
  cr_assert_eq(tj_need(shards->kids[0], "numel", TJ_NUM)->num, 301);
  cr_assert_eq(tj_need(shards->kids[1], "offset", TJ_NUM)->num, 501);
  cr_assert_eq(tj_need(shards->kids[1], "numel", TJ_NUM)->num, 299);
  tj_free(j);
  /* text form */
  char *out = ctl_ok("--socket %s inspect enc.weight", d.sock);
  cr_assert_not_null(strstr(out, "kind: view\n"), "%s", out);
  cr_assert_not_null(strstr(out, "shape: [10, 60]\n"), "%s", out);
  free(out);
  shardd_close(r0);
  shardd_close(r1);
}

/* The optimizer holding a view is named whether it holds the view itself
 * (use_orig_params) or its whole buffer (FSDP1): inspect of a view inside a
 * buffer registered whole said "optimizer: none", as if it were free. */
Test(shardctl, inspect_of_a_view_names_the_optimizer_holding_it, .init = start,
     .fini = stop) {
  shardd_client_t *c = test_connect(&d, "held", 0, 1);
  shardd_buffer_info whole, part;
  cr_assert_eq(shardd_buffer_register(c, "whole", SHARDD_DTYPE_FP32, 64, &whole), SHARDD_OK);
  cr_assert_eq(shardd_buffer_register(c, "part", SHARDD_DTYPE_FP32, 64, &part), SHARDD_OK);
  int64_t shape[1] = {16};
  uint64_t in_whole, in_part, loose;
  cr_assert_eq(shardd_view_register(c, whole.id, "w.in", 8, 16, shape, 1, &in_whole),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_view_register(c, part.id, "p.in", 0, 16, shape, 1, &in_part),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_view_register(c, part.id, "p.loose", 32, 16, shape, 1, &loose),
               SHARDD_OK, "%s", shardd_last_error(c));
  shardd_param_ref r1 = {whole.id, "whole"}, r2 = {in_part, "p.in"};
  shardd_param_group g1 = {&r1, 1, {0}}, g2 = {&r2, 1, {0}};
  uint64_t by_buffer, by_view;
  cr_assert_eq(shardd_optimizer_register(c, "fsdp1", SHARDD_OPTIM_SGD, NULL, &g1, 1,
                                         &by_buffer),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_optimizer_register(c, "orig", SHARDD_OPTIM_SGD, NULL, &g2, 1,
                                         &by_view),
               SHARDD_OK, "%s", shardd_last_error(c));
  const struct {
    const char *name;
    uint64_t opt; /* 0: none */
  } want[] = {{"w.in", by_buffer}, {"p.in", by_view}, {"p.loose", 0}};
  for (size_t i = 0; i < 3; i++) {
    char *out, line[64];
    tj *j = ctl_json(&out, "--socket %s --json inspect %s", d.sock, want[i].name);
    cr_assert_str_eq(tj_need(j, "kind", TJ_STR)->str, "view");
    if (want[i].opt)
      cr_expect_eq(tj_need(j, "optimizer", TJ_NUM)->num, (double)want[i].opt,
                   "%s: %s", want[i].name, out);
    else
      cr_expect_eq(tj_need(j, "optimizer", TJ_NULL)->kind, TJ_NULL, "%s: %s",
                   want[i].name, out);
    tj_free(j);
    free(out);
    out = ctl_ok("--socket %s inspect %s", d.sock, want[i].name);
    if (want[i].opt)
      snprintf(line, sizeof line, "\noptimizer: %llu\n", (unsigned long long)want[i].opt);
    else
      snprintf(line, sizeof line, "\noptimizer: none\n");
    cr_expect_not_null(strstr(out, line), "%s: no \"%s\" in\n%s", want[i].name, line + 1,
                       out);
    free(out);
  }
  shardd_close(c);
}

/* A name with characters JSON must escape comes out as valid JSON. */
Test(shardctl, json_escapes_names, .init = start, .fini = stop) {
  const char *job = "we\"ird\\job\tname";
  shardd_client_t *c = test_connect(&d, job, 0, 1);
  tj *j = ctl_json(NULL, "--socket %s status --json", d.sock);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  cr_assert_str_eq(tj_need(jobs->kids[0], "name", TJ_STR)->str, job);
  tj_free(j);
  shardd_close(c);
}

/* Whether s is UTF-8 throughout (RFC 3629: shortest forms, no surrogate,
 * nothing past U+10FFFF), decoded here apart from the code under test. */
static int is_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    unsigned cp;
    int more;
    if (*p < 0x80) {
      p++;
      continue;
    } else if ((*p & 0xe0) == 0xc0) {
      cp = *p & 0x1fu, more = 1;
    } else if ((*p & 0xf0) == 0xe0) {
      cp = *p & 0x0fu, more = 2;
    } else if ((*p & 0xf8) == 0xf0) {
      cp = *p & 0x07u, more = 3;
    } else {
      return 0;
    }
    const unsigned min[] = {0, 0x80, 0x800, 0x10000};
    int len = more;
    for (p++; more > 0; more--, p++) {
      if ((*p & 0xc0) != 0x80)
        return 0;
      cp = cp << 6 | (*p & 0x3fu);
    }
    if (cp < min[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      return 0;
  }
  return 1;
}

/* Names are any bytes but NUL, UTF-8 or not: a Latin-1 job name, a
 * buffer's cut short and a view's overlong "/" came out raw in --json,
 * which is then no JSON text (RFC 8259 wants UTF-8) and a strict reader
 * refused the whole reply. Each byte that starts no UTF-8 character is
 * \ufffd; valid UTF-8 around it stays as it is. */
Test(shardctl, json_of_names_that_are_not_utf8_is_utf8, .init = start, .fini = stop) {
  const char *job = "caf\xe9-caf\xc3\xa9";
  shardd_client_t *c = test_connect(&d, job, 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "w\xc3", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  int64_t shape[1] = {8};
  uint64_t vid;
  cr_assert_eq(shardd_view_register(c, b.id, "v\xc0\xaf", 0, 8, shape, 1, &vid),
               SHARDD_OK, "%s", shardd_last_error(c));
  char *out, *err, idarg[32];
  cr_assert_eq(ctl(&out, &err, "--socket %s status --json%s", NULL), 0, "%s", err);
  cr_expect(is_utf8(out), "status --json is not UTF-8: %s", out);
  cr_expect_not_null(strstr(out, "\"name\":\"caf\\ufffd-caf\xc3\xa9\""), "%s", out);
  tj *j = tj_parse(out);
  cr_expect_not_null(j, "not valid JSON: %s", out);
  tj_free(j);
  free(out);
  free(err);
  snprintf(idarg, sizeof idarg, " %llu", (unsigned long long)b.id);
  cr_assert_eq(ctl(&out, &err, "--socket %s --json inspect%s", idarg), 0, "%s", err);
  cr_expect(is_utf8(out), "inspect --json is not UTF-8: %s", out);
  cr_expect_not_null(strstr(out, "\"name\":\"w\\ufffd\""), "%s", out);
  cr_expect_not_null(strstr(out, "\"job\":\"caf\\ufffd-caf\xc3\xa9\""), "%s", out);
  cr_expect_not_null(strstr(out, "\"name\":\"v\\ufffd\\ufffd\""), "%s", out);
  j = tj_parse(out);
  cr_expect_not_null(j, "not valid JSON: %s", out);
  tj_free(j);
  free(out);
  free(err);
  shardd_close(c);
}

/* Names are any bytes but NUL and come from other uids: the text form
 * shows control bytes as \xNN, so a job named with an escape sequence or a
 * newline neither drives the operator's terminal nor forges a report line. */
Test(shardctl, text_escapes_control_bytes_in_names, .init = start,
     .fini = stop) {
  const char *job = "evil\x1b[2J\njob forged: world 9";
  shardd_client_t *c = test_connect(&d, job, 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "bu\rf", SHARDD_DTYPE_FP32, 8, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
  int64_t shape[1] = {8};
  uint64_t vid;
  cr_assert_eq(shardd_view_register(c, b.id, "v\x07iew\\", 0, 8, shape, 1, &vid),
               SHARDD_OK, "%s", shardd_last_error(c));
  char *out = ctl_ok("--socket %s status", d.sock);
  for (const char *p = out; *p; p++)
    cr_assert(*p == '\n' || ((unsigned char)*p >= 0x20 && *p != 0x7f),
              "control byte 0x%02x in: %s", (unsigned char)*p, out);
  cr_assert_not_null(strstr(out, "job evil\\x1b[2J\\x0ajob forged: world 9: "
                                 "world 1"), "%s", out);
  cr_assert_null(strstr(out, "\njob forged"), "%s", out);
  free(out);
  out = ctl_ok("--socket %s inspect %llu", d.sock, (unsigned long long)b.id);
  cr_assert_not_null(strstr(out, "name: bu\\x0df\n"), "%s", out);
  cr_assert_not_null(strstr(out, "job: evil\\x1b[2J\\x0ajob forged"), "%s", out);
  cr_assert_not_null(strstr(out, " v\\x07iew\\\\: ["), "%s", out);
  free(out);
  shardd_close(c);
}

/* `shardctl release JOB` (issue 19): refused naming the connected ranks
 * while a trainer holds one, and refused to another uid; once the ranks
 * left (the job lingers), it frees the job now, and a restore into that
 * name, refused while the job existed, goes through. */
Test(shardctl, release_frees_a_job_nobody_holds_so_a_restore_can_follow) {
  char ck[200], *out, *err;
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  snprintf(ck, sizeof ck, "%s/ck", d.dir);
  shardd_client_t *c = test_connect(&d, "rel", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 100, &b), SHARDD_OK);
  for (int i = 0; i < 100; i++)
    ((float *)b.shard)[i] = (float)i;
  cr_assert_eq(shardd_checkpoint(c, NULL, ck), SHARDD_OK, "%s", shardd_last_error(c));

  cr_assert_eq(ctl(&out, &err, "--socket %s release rel%s", NULL), 1, "%s", out);
  cr_expect(strstr(err, "shardctl: ") && strstr(err, "job \"rel\" has 1 connected "
                                                     "rank(s): 0 (pid "),
            "%s", err);
  free(out);
  free(err);
  cr_assert_eq(ctl(&out, &err, "--socket %s release%s", NULL), 2);
  free(out);
  free(err);
  cr_assert_eq(ctl(&out, &err, "--socket %s release nosuchjob%s", NULL), 1);
  cr_expect(strstr(err, "no job \"nosuchjob\""), "%s", err);
  free(out);
  free(err);
  shardd_close(c);

  /* another uid does not even find it */
  test_daemon_open_to_all(&d);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    if (setgid(4250) != 0 || setuid(4250) != 0)
      _exit(100);
    shardd_client_t *o;
    shardd_connect_opts opts = SHARDD_CONNECT_OPTS_INIT;
    char e2[256];
    if (shardd_connect(d.sock, &opts, &o, e2, sizeof e2) != SHARDD_OK)
      _exit(101);
    shardd_err rc = shardd_release_job(o, "0/rel", NULL, NULL);
    _exit(rc == SHARDD_E_NOT_FOUND ? 0 : 102);
  }
  int st;
  cr_assert(test_wait_exit(pid, &st));
  if (geteuid() == 0) {
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid 4250's release: %d",
              WEXITSTATUS(st));
  }

  /* the job lingers: a restore into its name is refused */
  char args[512];
  snprintf(args, sizeof args, "--socket %s restore %s", d.sock, ck);
  cr_assert_eq(test_shardctl(NULL, args, &out, &err), 1, "%s", out);
  cr_expect(strstr(err, "release it before restoring"), "%s", err);
  free(out);
  free(err);

  out = ctl_ok("--socket %s release rel", d.sock);
  cr_expect_str_eq(out, "rel: released (1 buffers, 0 optimizers)\n");
  free(out);
  tj *j = ctl_json(&out, "--socket %s --json status", d.sock);
  cr_expect_eq(tj_need(j, "jobs", TJ_ARR)->n, 0, "%s", out);
  tj_free(j);
  free(out);
  cr_expect(test_daemon_log_has(&d, "job \"rel\" released by uid 0"));

  free(ctl_ok("%s", args));
  c = test_connect(&d, "rel", 0, 1);
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 100, &b), SHARDD_OK);
  cr_expect_eq(b.created, 0, "the restored buffer was made anew");
  for (int i = 0; i < 100; i++)
    cr_assert_eq(((float *)b.shard)[i], (float)i, "element %d", i);
  shardd_close(c);
  j = ctl_json(NULL, "--socket %s --json release rel", d.sock);
  cr_expect_eq(tj_need(j, "buffers", TJ_NUM)->num, 1);
  tj_free(j);
  test_daemon_finish(&d);
}

/* A stopped daemon (SIGSTOP): --timeout bounds the wait, the exit code is
 * 3 (cannot reach the daemon) and the message names the socket; once the
 * daemon runs again, the same command succeeds. */
Test(shardctl, stopped_daemon_exits_3_within_the_timeout, .init = start,
     .fini = stop, .timeout = 60) {
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  char *out, *err;
  double t0 = test_mono_s();
  int rc = ctl(&out, &err, "--socket %s --timeout 1 status%s", NULL);
  double took = test_mono_s() - t0;
  char want[256];
  snprintf(want, sizeof want, "daemon at %s did not answer for 1 s", d.sock);
  char env[256];
  snprintf(env, sizeof env, "SHARDD_TIMEOUT=1 SHARDD_SOCKET=%s", d.sock);
  char *out2, *err2;
  int rc3 = test_shardctl(env, "ping", &out2, &err2);
  kill(d.pid, SIGCONT);
  cr_assert_eq(rc, 3, "exit %d: %s", rc, err);
  cr_assert(took < 20, "took %.2f s", took);
  cr_assert_eq(strncmp(err, "shardctl: ", 10), 0, "%s", err);
  cr_assert_not_null(strstr(err, want), "%s", err);
  cr_assert_eq(rc3, 3, "SHARDD_TIMEOUT: exit %d: %s", rc3, err2);
  cr_assert_not_null(strstr(err2, want), "%s", err2);
  free(out);
  free(err);
  free(out2);
  free(err2);
  free(ctl_ok("--socket %s status --timeout 1", d.sock));
}

Test(shardctl, bad_timeout_is_a_usage_error) {
  char *err;
  cr_assert_eq(test_shardctl(NULL, "--timeout soon status", NULL, &err), 2);
  cr_assert_not_null(strstr(err, "--timeout soon: must be 0..86400 seconds"), "%s", err);
  free(err);
}

/* `shardctl restore DIR` says the step the restored job is at, the most
 * steps one of its optimizers took, in the text ("JOB: DIR (step N)") and
 * in --json ("step"): what the operator checks before relaunching the
 * trainers, without attaching one. */
Test(shardctl, restore_prints_the_step_the_job_is_at) {
  char ck[200], want[512];
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  snprintf(ck, sizeof ck, "%s/ck", d.dir);
  shardd_client_t *c = test_connect(&d, "stepped", 0, 1);
  shardd_buffer_info b;
  uint64_t v, opt;
  int64_t shape[1] = {100};
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 100, &b), SHARDD_OK);
  cr_assert_eq(shardd_view_register(c, b.id, "w", 0, 100, shape, 1, &v), SHARDD_OK,
               "%s", shardd_last_error(c));
  shardd_param_ref refs[1] = {{v, "w"}};
  shardd_param_group g = {refs, 1, {0}};
  shardd_hparams hp = {.set = SHARDD_HP_LR, .lr = 0.1};
  cr_assert_eq(shardd_optimizer_register(c, "sgd", SHARDD_OPTIM_SGD, &hp, &g, 1, &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  for (int s = 0; s < 3; s++) {
    cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
    cr_assert_eq(shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN), SHARDD_OK, "%s",
                 shardd_last_error(c));
    cr_assert_eq(shardd_step(c, opt, NULL, NULL), SHARDD_OK, "%s", shardd_last_error(c));
  }
  cr_assert_eq(shardd_checkpoint(c, NULL, ck), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);

  free(ctl_ok("--socket %s release stepped", d.sock));
  char *out = ctl_ok("--socket %s restore %s", d.sock, ck);
  snprintf(want, sizeof want, "stepped: %s (step 3)\n", ck);
  cr_expect_str_eq(out, want);
  free(out);

  free(ctl_ok("--socket %s release stepped", d.sock));
  tj *j = ctl_json(&out, "--socket %s --json restore %s", d.sock, ck);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, "stepped");
  cr_expect_str_eq(tj_need(j, "dir", TJ_STR)->str, ck);
  cr_expect_eq(tj_need(j, "step", TJ_NUM)->num, 3, "%s", out);
  tj_free(j);
  free(out);
  test_daemon_finish(&d);
}

/* s as shell text that yields its bytes: "$(printf '\ooo...')", every byte
 * but a letter or digit in octal (a trailing newline would be dropped by
 * the shell: none of these names ends in one). */
static void sh_bytes(const char *s, char *out, size_t n) {
  size_t k = (size_t)snprintf(out, n, "\"$(printf '");
  for (const unsigned char *p = (const unsigned char *)s; *p && k + 8 < n; p++)
    k += (size_t)snprintf(out + k, n - k, (*p >= '0' && *p <= '9') ||
                                                  (*p >= 'a' && *p <= 'z') ||
                                                  (*p >= 'A' && *p <= 'Z')
                                              ? "%c"
                                              : "\\%03o",
                          *p);
  snprintf(out + k, n - k, "')\"");
}

/* Every byte of out is printable or a line's end, and out has lines lines. */
static void expect_plain_lines(const char *out, int lines) {
  int nl = 0;
  for (const char *p = out; *p; p++) {
    cr_expect(*p == '\n' || ((unsigned char)*p >= 0x20 && *p != 0x7f),
              "control byte 0x%02x in: %s", (unsigned char)*p, out);
    nl += *p == '\n';
  }
  cr_expect_eq(nl, lines, "%d lines in: %s", nl, out);
}

/* checkpoint, restore and release print the job's name and the directory
 * as status does: escaped in the text (a control byte neither drives the
 * terminal nor forges a line), inside proper JSON strings with --json; the
 * daemon's errors quoting a name are escaped on stderr too. */
Test(shardctl, checkpoint_restore_and_release_escape_names_and_dirs) {
  const char *job = "ev\"il\\\x1b[2J\njob forged: x";
  const char *job_text = "ev\"il\\\\\\x1b[2J\\x0ajob forged: x";
  char ck[256], ck_text[256], ckj[256], jarg[256], ckarg[1024], ckjarg[1024];
  char args[4096], want[1024], *out, *err;
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  snprintf(ck, sizeof ck, "%s/ck\x1b]0;t\x07\n\"q\\", d.dir);
  snprintf(ck_text, sizeof ck_text, "%s/ck\\x1b]0;t\\x07\\x0a\"q\\\\", d.dir);
  snprintf(ckj, sizeof ckj, "%s/j\x01\"\\", d.dir);
  sh_bytes(job, jarg, sizeof jarg);
  sh_bytes(ck, ckarg, sizeof ckarg);
  sh_bytes(ckj, ckjarg, sizeof ckjarg);
  shardd_client_t *c = test_connect(&d, job, 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  shardd_close(c); /* the job lingers */

  out = ctl_ok("--socket %s checkpoint %s %s", d.sock, jarg, ckarg);
  expect_plain_lines(out, 1);
  snprintf(want, sizeof want, "%s: %s\n", job_text, ck_text);
  cr_expect_str_eq(out, want);
  free(out);
  tj *j = ctl_json(NULL, "--socket %s --json checkpoint %s %s", d.sock, jarg, ckjarg);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, job);
  cr_expect_str_eq(tj_need(j, "dir", TJ_STR)->str, ckj);
  tj_free(j);

  snprintf(args, sizeof args, "--socket %s release %s", d.sock, jarg);
  out = ctl_ok("%s", args);
  expect_plain_lines(out, 1);
  snprintf(want, sizeof want, "%s: released (1 buffers, 0 optimizers)\n", job_text);
  cr_expect_str_eq(out, want);
  free(out);
  /* the daemon's error names the job: escaped on stderr */
  cr_assert_eq(test_shardctl(NULL, args, &out, &err), 1, "%s", out);
  expect_plain_lines(err, 1);
  snprintf(want, sizeof want, "no job \"%s\"", job_text);
  cr_expect_not_null(strstr(err, want), "%s", err);
  free(out);
  free(err);

  out = ctl_ok("--socket %s restore %s", d.sock, ckarg);
  expect_plain_lines(out, 1);
  snprintf(want, sizeof want, "%s: %s (step 0)\n", job_text, ck_text);
  cr_expect_str_eq(out, want);
  free(out);
  j = ctl_json(NULL, "--socket %s --json release %s", d.sock, jarg);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, job);
  tj_free(j);
  j = ctl_json(NULL, "--socket %s --json restore %s", d.sock, ckjarg);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, job);
  cr_expect_str_eq(tj_need(j, "dir", TJ_STR)->str, ckj);
  cr_expect_eq(tj_need(j, "step", TJ_NUM)->num, 0);
  tj_free(j);
  test_daemon_finish(&d);
}

/* Root restoring another uid's checkpoint is told the job as "UID/NAME":
 * with a name of the longest (255 bytes) that is 266 bytes, and `shardctl
 * restore` prints it whole (it was cut at 255, a name no release finds). */
Test(shardctl, restore_prints_another_uids_longest_job_name_whole, .timeout = 60) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  char name[256], qualified[300], ck[200], want[1024];
  memset(name, 'n', 255);
  name[255] = '\0';
  snprintf(qualified, sizeof qualified, "4250/%s", name);
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  snprintf(ck, sizeof ck, "%s/ck", d.dir);
  test_daemon_open_to_all(&d);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) { /* uid 4250 makes the job, which lingers */
    if (setgid(4250) != 0 || setuid(4250) != 0)
      _exit(100);
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = name;
    shardd_client_t *c;
    char e[256];
    shardd_buffer_info b;
    if (shardd_connect(d.sock, &o, &c, e, sizeof e) != SHARDD_OK)
      _exit(101);
    if (shardd_buffer_register(c, "x", SHARDD_DTYPE_FP32, 8, &b) != SHARDD_OK)
      _exit(102);
    shardd_close(c);
    _exit(0);
  }
  int st;
  cr_assert(test_wait_exit(pid, &st));
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid 4250: %d", WEXITSTATUS(st));

  free(ctl_ok("--socket %s checkpoint %s %s", d.sock, qualified, ck));
  free(ctl_ok("--socket %s release %s", d.sock, qualified));
  char *out = ctl_ok("--socket %s restore %s", d.sock, ck);
  snprintf(want, sizeof want, "%s: %s (step 0)\n", qualified, ck);
  cr_expect_str_eq(out, want);
  free(out);
  /* the name it printed is the one release takes */
  tj *j = ctl_json(NULL, "--socket %s --json release %s", d.sock, qualified);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, qualified);
  tj_free(j);
  j = ctl_json(NULL, "--socket %s --json restore %s", d.sock, ck);
  cr_expect_str_eq(tj_need(j, "job", TJ_STR)->str, qualified);
  tj_free(j);
  test_daemon_finish(&d);
}
