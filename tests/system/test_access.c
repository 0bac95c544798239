/* test_access.c — access control and limits of the server: a job belongs to
 * the uid that created it, and job names are per uid: another uid's Hello
 * of the same name is its own job; it cannot see root's in status, inspect
 * checkpoint or release it (root and --admin-group may look, naming it
 * "UID/NAME"); the ids another uid holds are answered as ids never issued,
 * in every request that takes one, and pool ids count a uid's own pools;
 * and
 * --job-memory-limit refuses allocations past the quota with a clear error.
 * The other uid is a forked child that drops to nobody (tests run as root;
 * elsewhere they skip). */
#include <criterion/criterion.h>
#include <grp.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static const char *const *base_args(void) { return NULL; }

/* What the unprivileged child saw, one result per probe. */
typedef struct {
  int status_lists;  /* root's job appears in its status */
  int inspect_code;  /* inspect root's buffer by id */
  int name_code;     /* inspect root's buffer by name */
  int ckpt_code;     /* checkpoint "root-job" (its own name for it) */
  int ckpt_uid_code; /* checkpoint "0/root-job" (root's, as an admin names it) */
  int release_code;     /* shardctl release "root-job" */
  int release_uid_code; /* shardctl release "0/root-job" */
  int join_code;     /* Hello "root-job": its own job of that name */
  int join_created;  /* registering "secret" there created it (not root's) */
  int join_uid_code; /* Hello "0/root-job" */
  int own_job_code;  /* create and use its own job */
  char join_msg[512];
} probe;

/* Forks a child that becomes nobody and probes root's job (buffer
 * buf_id): looking first, with no job of its own, then joining. */
static void run_as_nobody(const test_daemon *d, uint64_t buf_id, probe *out) {
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    probe p;
    memset(&p, 0, sizeof p);
    struct passwd *pw = getpwnam("nobody");
    if (pw == NULL || setgroups(0, NULL) != 0 || setgid(pw->pw_gid) != 0 ||
        setuid(pw->pw_uid) != 0)
      _exit(3);
    shardd_client_t *c;
    char err[512];
    shardd_connect_opts ctl = SHARDD_CONNECT_OPTS_INIT;
    if (shardd_connect(d->sock, &ctl, &c, err, sizeof err) != SHARDD_OK)
      _exit(4);
    char *json = NULL;
    if (shardd_status_json(c, &json) == SHARDD_OK)
      p.status_lists = strstr(json, "\"root-job\"") != NULL &&
                       strstr(json, "\"owner_uid\":0") != NULL;
    shardd_free(json);
    char *txt = NULL;
    p.inspect_code = shardd_inspect_text(c, buf_id, NULL, &txt);
    shardd_free(txt);
    txt = NULL;
    p.name_code = shardd_inspect_text(c, 0, "secret", &txt);
    shardd_free(txt);
    p.ckpt_code = shardd_checkpoint(c, "root-job", "/tmp/shardd-access-never");
    p.ckpt_uid_code = shardd_checkpoint(c, "0/root-job", "/tmp/shardd-access-never");
    p.release_code = shardd_release_job(c, "root-job", NULL, NULL);
    p.release_uid_code = shardd_release_job(c, "0/root-job", NULL, NULL);
    shardd_close(c);
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = "root-job";
    p.join_code = shardd_connect(d->sock, &o, &c, err, sizeof err);
    if (p.join_code == SHARDD_OK) {
      shardd_buffer_info b;
      if (shardd_buffer_register(c, "secret", SHARDD_DTYPE_FP32, 100, &b) == SHARDD_OK)
        p.join_created = b.created;
      shardd_close(c);
    }
    o.job = "0/root-job";
    p.join_uid_code = shardd_connect(d->sock, &o, &c, err, sizeof err);
    snprintf(p.join_msg, sizeof p.join_msg, "%s", err);
    if (p.join_uid_code == SHARDD_OK)
      shardd_close(c);
    o.job = "nobody-job";
    p.own_job_code = shardd_connect(d->sock, &o, &c, err, sizeof err);
    if (p.own_job_code == SHARDD_OK) {
      shardd_buffer_info b;
      p.own_job_code = shardd_buffer_register(c, "mine", SHARDD_DTYPE_FP32, 10, &b);
      shardd_close(c);
    }
    if (write(fds[1], &p, sizeof p) != (ssize_t)sizeof p)
      _exit(5);
    _exit(0);
  }
  close(fds[1]);
  cr_assert_eq(read(fds[0], out, sizeof *out), (ssize_t)sizeof *out,
               "the child did not report");
  close(fds[0]);
  int st;
  waitpid(pid, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child failed (%d)", st);
}

static int can_drop(void) {
  return geteuid() == 0 && getpwnam("nobody") != NULL;
}

static uint64_t root_job(const test_daemon *d, shardd_client_t **keep) {
  shardd_client_t *c = test_connect(d, "root-job", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "secret", SHARDD_DTYPE_FP32, 100, &b), SHARDD_OK);
  *keep = c;
  return b.id;
}

/* A daemon (args) open to every uid, root's job in it (root's client in
 * *keep), and what nobody saw of it in *p: the id of root's buffer. */
static uint64_t nobody_probes_roots_job(test_daemon *d, const char *const *args,
                                        shardd_client_t **keep, probe *p) {
  test_daemon_start(d, args);
  test_daemon_open_to_all(d);
  uint64_t id = root_job(d, keep);
  run_as_nobody(d, id, p);
  return id;
}

Test(access, another_uid_cannot_join_see_inspect_or_checkpoint) {
  if (!can_drop())
    cr_skip_test("needs root and a nobody user");
  test_daemon d;
  shardd_client_t *c;
  probe p;
  uint64_t id = nobody_probes_roots_job(&d, base_args(), &c, &p);
  cr_assert_eq(p.status_lists, 0, "another user's job shows in status");
  cr_assert_eq(p.inspect_code, SHARDD_E_NOT_FOUND, "its id reads as never issued");
  cr_assert_eq(p.name_code, SHARDD_E_NOT_FOUND, "a name search must not reveal it");
  cr_assert_eq(p.ckpt_code, SHARDD_E_NOT_FOUND, "its own name reaches only its own jobs");
  cr_assert_eq(p.ckpt_uid_code, SHARDD_E_NOT_FOUND, "UID/NAME is for root and admins");
  cr_assert_eq(p.release_code, SHARDD_E_NOT_FOUND);
  cr_assert_eq(p.release_uid_code, SHARDD_E_NOT_FOUND);
  /* Job names are per uid (issue 20, item 8): its Hello "root-job" is its
   * own job of that name, where "secret" is a new buffer, not root's. */
  cr_assert_eq(p.join_code, SHARDD_OK);
  cr_assert_eq(p.join_created, 1, "nobody's \"root-job\" attached to root's buffer");
  cr_assert_eq(p.join_uid_code, SHARDD_E_INVAL,
               "\"0/root-job\" would be a job name that reads as root's: %s", p.join_msg);
  cr_assert(strstr(p.join_msg, "holds a '/'"), "%s", p.join_msg);
  cr_assert_eq(p.own_job_code, SHARDD_OK, "its own job works");

  /* Root sees both jobs. */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *json = NULL;
  cr_assert_eq(shardd_status_json(ctl, &json), SHARDD_OK);
  cr_assert(strstr(json, "\"root-job\"") && strstr(json, "\"nobody-job\""), "%s", json);
  /* and root's "root-job" kept its one buffer: nobody's went to its own */
  shardd_buffer_info again;
  cr_assert_eq(shardd_buffer_register(c, "secret", SHARDD_DTYPE_FP32, 100, &again), SHARDD_OK);
  cr_assert_eq(again.created, 0);
  cr_assert_eq(again.id, id);
  shardd_free(json);
  shardd_close(ctl);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A Hello as uid for job; the daemon's code, its message in msg. */
static shardd_err hello_as(const test_daemon *d, uid_t uid, const char *job, char *msg,
                           size_t n) {
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    char err[512] = "";
    if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
      _exit(3);
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = job;
    shardd_client_t *c;
    int32_t rc = shardd_connect(d->sock, &o, &c, err, sizeof err);
    if (rc == SHARDD_OK) {
      shardd_buffer_info b;
      shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 10, &b);
      shardd_close(c); /* the job lingers */
    }
    if (write(fds[1], &rc, sizeof rc) != sizeof rc ||
        write(fds[1], err, sizeof err) != sizeof err)
      _exit(4);
    _exit(0);
  }
  close(fds[1]);
  int32_t rc;
  char err[512];
  cr_assert_eq(read(fds[0], &rc, sizeof rc), (ssize_t)sizeof rc, "the child did not report");
  cr_assert_eq(read(fds[0], err, sizeof err), (ssize_t)sizeof err);
  close(fds[0]);
  snprintf(msg, n, "%s", err);
  int st;
  waitpid(pid, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child failed (%d)", st);
  return (shardd_err)rc;
}

/* Root names uid N's job NAME as "N/NAME". uid 4242 named its own job
 * "4243/vj", and root's release of "4243/vj" (meant for what status
 * listed) could act on uid 4243's "vj", or the other way round. No job
 * name may hold a '/', so the string names one job. */
Test(access, a_job_name_cannot_read_as_another_uids_job) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as other uids");
  test_daemon d;
  test_daemon_start(&d, base_args());
  test_daemon_open_to_all(&d);
  char msg[512];
  cr_assert_eq(hello_as(&d, 4243, "vj", msg, sizeof msg), SHARDD_OK, "%s", msg);
  shardd_err rc = hello_as(&d, 4242, "4243/vj", msg, sizeof msg);
  cr_assert_eq(rc, SHARDD_E_INVAL, "uid 4242's job \"4243/vj\": %s (%s)",
               shardd_err_name(rc), msg);
  cr_assert(strstr(msg, "holds a '/'") && strstr(msg, "N/NAME"), "%s", msg);
  /* root may not make one either: its "4243/nothing" is no job of uid 4243 */
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "4243/nothing";
  shardd_client_t *c;
  char err[512];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_E_INVAL, "%s", err);
  /* so root's "4243/vj" is uid 4243's "vj", the one job status lists */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *json = NULL;
  cr_assert_eq(shardd_status_json(ctl, &json), SHARDD_OK);
  cr_assert(strstr(json, "4243/vj") == NULL, "a job named \"4243/vj\" exists: %s", json);
  shardd_free(json);
  uint32_t buffers = 0;
  cr_assert_eq(shardd_release_job(ctl, "4243/vj", &buffers, NULL), SHARDD_OK, "%s",
               shardd_last_error(ctl));
  cr_assert_eq(buffers, 1, "the victim's job, with its one buffer");
  shardd_close(ctl);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

Test(access, admin_group_may_look_but_not_join) {
  if (!can_drop())
    cr_skip_test("needs root and a nobody user");
  struct passwd *pw = getpwnam("nobody");
  char gid[32];
  snprintf(gid, sizeof gid, "%u", (unsigned)pw->pw_gid);
  test_daemon d;
  shardd_client_t *c;
  probe p;
  nobody_probes_roots_job(&d, (const char *const[]){"--admin-group", gid, NULL}, &c, &p);
  cr_assert_eq(p.status_lists, 1, "the admin group sees every job");
  cr_assert_eq(p.inspect_code, SHARDD_OK);
  cr_assert_eq(p.name_code, SHARDD_OK);
  cr_assert_eq(p.ckpt_code, SHARDD_E_NOT_FOUND, "it has no \"root-job\" of its own");
  cr_assert_eq(p.ckpt_uid_code, SHARDD_E_PERMISSION, "looking is not writing");
  cr_assert_eq(p.release_code, SHARDD_E_NOT_FOUND);
  cr_assert_eq(p.release_uid_code, SHARDD_E_PERMISSION, "looking is not releasing");
  cr_assert_eq(p.join_code, SHARDD_OK, "its own \"root-job\"");
  cr_assert_eq(p.join_created, 1);
  cr_assert_eq(p.join_uid_code, SHARDD_E_PERMISSION, "only root joins another's job");
  cr_assert(strstr(p.join_msg, "belongs to another user"), "%s", p.join_msg);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

Test(access, job_memory_limit_refuses_past_the_quota) {
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--job-memory-limit", "1M", NULL});
  shardd_client_t *c = test_connect(&d, "quota", 0, 1);
  shardd_buffer_info b;
  /* 64 Ki fp32 = 256 KiB per area: the block of ~768 KiB fits once. */
  cr_assert_eq(shardd_buffer_register(c, "a", SHARDD_DTYPE_FP32, 65536, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(shardd_buffer_register(c, "b", SHARDD_DTYPE_FP32, 65536, &b),
               SHARDD_E_NO_MEMORY);
  cr_assert(strstr(shardd_last_error(c), "--job-memory-limit") != NULL, "%s",
            shardd_last_error(c));
  /* Another job has its own quota. */
  shardd_client_t *c2 = test_connect(&d, "quota2", 0, 1);
  cr_assert_eq(shardd_buffer_register(c2, "a", SHARDD_DTYPE_FP32, 65536, &b), SHARDD_OK);
  shardd_close(c2);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* Issue 20, item 8: --job-memory-limit is per job, so 21 jobs of one user
 * exhausted device memory for everyone. By default one uid other than
 * root holds at most a quarter of the devices' memory over all its jobs
 * (--uid-memory-limit); the child is uid 4242. Exit code: 0 when its
 * second job's buffer is refused naming the flag (expect_refused), or
 * both fit (!expect_refused); else the step that failed. */
static int two_jobs_as_other_uid(const char *sock, int expect_refused) {
  if (setgroups(0, NULL) != 0 || setgid(4242) != 0 || setuid(4242) != 0)
    return 10;
  shardd_client_t *c[2];
  char err[512];
  shardd_buffer_info b;
  for (int k = 0; k < 2; k++) {
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    o.job = k ? "second" : "first";
    if (shardd_connect(sock, &o, &c[k], err, sizeof err) != SHARDD_OK)
      return 11 + k;
  }
  /* 64 Ki fp32: a block of ~768 KiB, as in the job limit's test */
  if (shardd_buffer_register(c[0], "a", SHARDD_DTYPE_FP32, 65536, &b) != SHARDD_OK)
    return 13;
  shardd_err rc = shardd_buffer_register(c[1], "a", SHARDD_DTYPE_FP32, 65536, &b);
  if (!expect_refused)
    return rc == SHARDD_OK ? 0 : 14;
  if (rc != SHARDD_E_NO_MEMORY)
    return 15;
  if (strstr(shardd_last_error(c[1]), "--uid-memory-limit") == NULL ||
      strstr(shardd_last_error(c[1]), "uid 4242") == NULL)
    return 16;
  return 0;
}

static void expect_child(const test_daemon *d, int expect_refused) {
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(two_jobs_as_other_uid(d->sock, expect_refused));
  test_expect_child_ok(pid, "uid 4242");
}

Test(access, uid_memory_limit_spans_a_users_jobs) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  test_daemon d;
  /* 4 MiB of device memory: the default share is 1 MiB */
  test_daemon_start(&d, (const char *const[]){"--devices", "1", "--device-memory", "4M",
                                              NULL});
  test_daemon_open_to_all(&d);
  expect_child(&d, 1);
  /* root is not bound by it: two such buffers in two jobs */
  shardd_client_t *c = test_connect(&d, "root-a", 0, 1);
  shardd_client_t *c2 = test_connect(&d, "root-b", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "a", SHARDD_DTYPE_FP32, 65536, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(shardd_buffer_register(c2, "a", SHARDD_DTYPE_FP32, 65536, &b), SHARDD_OK,
               "%s", shardd_last_error(c2));
  shardd_close(c2);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
  /* --uid-memory-limit 0: no per-user bound */
  test_daemon_start(&d, (const char *const[]){"--devices", "1", "--device-memory", "4M",
                                              "--uid-memory-limit", "0", NULL});
  test_daemon_open_to_all(&d);
  expect_child(&d, 0);
  cr_assert_eq(test_daemon_stop(&d), 0);
  /* and an explicit size */
  test_daemon_start(&d, (const char *const[]){"--uid-memory-limit", "1M", NULL});
  test_daemon_open_to_all(&d);
  expect_child(&d, 1);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A transient job's gather and gradient areas come from one pool per
 * device, made at its first gather and sized for its largest unit. The
 * memory limits count that pool from the registration that needs it, so
 * a job over a limit is refused when it registers the buffer, naming the
 * flag, and never learns it at its first gather. 48 Ki fp32: rank blocks
 * of 384 KiB (shard and reduced gradient) fit 1 MiB, but with the pool's
 * 4 areas of 192 KiB (768 KiB) they do not; 16 Ki: 128 KiB and 256 KiB
 * fit, and gather. Exit code: 0 as expected, else the step that failed. */
static int pooled_job_over_a_limit(const char *sock, uid_t uid, const char *flag) {
  if (uid != 0 && (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0))
    return 10;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "pooled";
  o.transient_areas = 1;
  shardd_client_t *c;
  char err[512];
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK)
    return 11;
  shardd_buffer_info b;
  if (shardd_buffer_register(c, "big", SHARDD_DTYPE_FP32, 49152, &b) != SHARDD_E_NO_MEMORY)
    return 12;
  const char *why = shardd_last_error(c);
  if (strstr(why, flag) == NULL || strstr(why, "gather and gradient areas") == NULL)
    return 13;
  if (shardd_buffer_register(c, "small", SHARDD_DTYPE_FP32, 16384, &b) != SHARDD_OK)
    return 14;
  shardd_area a;
  if (shardd_gather_area(c, b.id, 1, &a) != SHARDD_OK || shardd_release(c, b.id) != SHARDD_OK)
    return 15;
  /* another unit of that size needs no larger pool: its blocks alone */
  if (shardd_buffer_register(c, "small2", SHARDD_DTYPE_FP32, 16384, &b) != SHARDD_OK)
    return 16;
  shardd_close(c);
  return 0;
}

static void expect_pooled(const test_daemon *d, uid_t uid, const char *flag) {
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(pooled_job_over_a_limit(d->sock, uid, flag));
  char who[32];
  snprintf(who, sizeof who, "uid %d", (int)uid);
  test_expect_child_ok(pid, who);
}

Test(access, a_transient_jobs_areas_count_against_the_limits_at_registration) {
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--job-memory-limit", "1M", NULL});
  expect_pooled(&d, geteuid(), "--job-memory-limit");
  cr_assert_eq(test_daemon_stop(&d), 0);
  if (geteuid() != 0)
    return; /* the per-uid limit needs a second uid */
  /* 4 MiB of device memory: the default share of a uid is 1 MiB */
  test_daemon_start(&d, (const char *const[]){"--devices", "1", "--device-memory", "4M",
                                              NULL});
  test_daemon_open_to_all(&d);
  expect_pooled(&d, 4242, "--uid-memory-limit");
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* ---- ids of another uid ------------------------------------------------
 * Ids are one counter for the daemon, so an attacker can name ids another
 * uid holds. What it is told for them must be what it is told for an id
 * never issued: the same code and the same message but for the number, in
 * every request that takes an id (a distinct answer showed that the id was
 * live, and its kind). The victim (uid 4242) holds a buffer, a view, an
 * optimizer and a freed buffer id; the attacker (uid 4243) probes each of
 * them and an id never issued. */

#define VICTIM_UID 4242
#define ATTACKER_UID 4243
#define NPROBE 18
#define NIDS 5 /* buffer, view, optimizer, freed buffer, never issued */
#define UNUSED_ID 1000000007ull

typedef struct {
  int code[NIDS][NPROBE];
  char msg[NIDS][NPROBE][200];
} id_answers;

static const char *const probe_name[NPROBE] = {
    "gather", "scatter", "view register on it", "buffer unregister",
    "view unregister", "optimizer unregister", "step", "set requires_grad",
    "inspect", "optimizer register over it", "optim state get",
    "optim state get (ref)", "seed master", "clip grad norm", "release",
    "gather checked", "buffers unregister", "optim steps set"};

static int become(uid_t uid) {
  return setgroups(0, NULL) == 0 && setgid(uid) == 0 && setuid(uid) == 0;
}

/* In a child: becomes uid and connects as job's (transient: with
 * transient areas); 0 with the client in *c, else the child's exit code:
 * fail when it cannot become uid, fail + 1 when it cannot connect. */
static int connect_as(const char *sock, uid_t uid, const char *job, int transient, int fail,
                      shardd_client_t **c) {
  if (!become(uid))
    return fail;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.transient_areas = transient;
  char err[512];
  return shardd_connect(sock, &o, c, err, sizeof err) == SHARDD_OK ? 0 : fail + 1;
}

static int write_full(int fd, const void *p, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = write(fd, (const char *)p + done, n - done);
    if (k <= 0)
      return 0;
    done += (size_t)k;
  }
  return 1;
}

static int read_full(int fd, void *p, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = read(fd, (char *)p + done, n - done);
    if (k <= 0)
      return 0;
    done += (size_t)k;
  }
  return 1;
}

/* The victim: its objects' ids down ids_fd, then it waits (holding them)
 * until go_fd closes. */
static int victim_main(const char *sock, int ids_fd, int go_fd) {
  shardd_client_t *c;
  int rc = connect_as(sock, VICTIM_UID, "victim-job", 0, 10, &c);
  if (rc)
    return rc;
  shardd_buffer_info b, g;
  uint64_t ids[4];
  int64_t shape[1] = {8};
  shardd_param_ref ref = {0, "w.v"};
  shardd_param_group grp = {&ref, 1, {0}};
  if (shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 64, &b) != SHARDD_OK ||
      shardd_view_register(c, b.id, "w.v", 0, 8, shape, 1, &ids[1]) != SHARDD_OK)
    return 12;
  ref.id = ids[1];
  if (shardd_optimizer_register(c, "opt", SHARDD_OPTIM_SGD, NULL, &grp, 1,
                                &ids[2]) != SHARDD_OK ||
      shardd_buffer_register(c, "gone", SHARDD_DTYPE_FP32, 64, &g) != SHARDD_OK ||
      shardd_buffer_unregister(c, g.id) != SHARDD_OK)
    return 13;
  ids[0] = b.id;
  ids[3] = g.id;
  if (!write_full(ids_fd, ids, sizeof ids))
    return 14;
  char byte;
  (void)read(go_fd, &byte, 1); /* EOF: the attacker is done */
  shardd_close(c);
  return 0;
}

/* msg with every decimal occurrence of id replaced by "#". */
static void unnumbered(const char *msg, uint64_t id, char *out, size_t len) {
  char num[32];
  int k = snprintf(num, sizeof num, "%" PRIu64, id);
  size_t o = 0;
  for (const char *p = msg; *p && o + 1 < len;) {
    if (strncmp(p, num, (size_t)k) == 0 && (p == msg || p[-1] < '0' || p[-1] > '9') &&
        (p[k] < '0' || p[k] > '9')) {
      out[o++] = '#';
      p += k;
    } else {
      out[o++] = *p++;
    }
  }
  out[o] = '\0';
}

static void probe_id(shardd_client_t *c, uint64_t own_opt, uint64_t id, int *code,
                     char (*msg)[200]) {
  int64_t shape[1] = {1};
  uint64_t vid;
  shardd_param_ref ref = {id, "t"};
  shardd_param_group grp = {&ref, 1, {0}};
  shardd_step_opts so = SHARDD_STEP_OPTS_INIT;
  shardd_optim_state_info info;
  double norm;
  uint64_t oid;
  char *txt = NULL;
  shardd_err errs[1];
  for (int k = 0; k < NPROBE; k++) {
    shardd_err rc = SHARDD_OK;
    switch (k) {
    case 0: rc = shardd_gather(c, id); break;
    case 1: rc = shardd_scatter(c, id, SHARDD_REDUCE_SUM); break;
    case 2: rc = shardd_view_register(c, id, "v", 0, 1, shape, 1, &vid); break;
    case 3: rc = shardd_buffer_unregister(c, id); break;
    case 4: rc = shardd_view_unregister(c, id); break;
    case 5: rc = shardd_optimizer_unregister(c, id); break;
    case 6: rc = shardd_step(c, id, &so, NULL); break;
    case 7: rc = shardd_view_set_requires_grad(c, id, 0); break;
    case 8: rc = shardd_inspect_text(c, id, NULL, &txt); shardd_free(txt); txt = NULL; break;
    case 9: rc = shardd_optimizer_register(c, "t", SHARDD_OPTIM_SGD, NULL, &grp, 1, &oid); break;
    case 10: rc = shardd_optim_state_get(c, id, id, 0, 0, 0, NULL, &info); break;
    case 11: rc = shardd_optim_state_get(c, own_opt, id, 0, 0, 0, NULL, &info); break;
    case 12: rc = shardd_seed_master(c, id); break;
    case 13: rc = shardd_clip_grad_norm(c, id, 0, &norm); break;
    case 14: rc = shardd_release(c, id); break;
    case 15: rc = shardd_gather_checked(c, id, 1); break;
    case 16: rc = shardd_buffers_unregister(c, 1, &id, NULL, errs); break;
    case 17: rc = shardd_optim_steps_set(c, id, id, 1, 1); break;
    }
    code[k] = rc;
    unnumbered(rc == SHARDD_OK ? "" : shardd_last_error(c), id, msg[k], sizeof msg[k]);
  }
}

/* The attacker: in a job of its own, every probe of every id. */
static int attacker_main(const char *sock, const uint64_t *ids, int out_fd) {
  shardd_client_t *c;
  int rc = connect_as(sock, ATTACKER_UID, "attacker-job", 0, 20, &c);
  if (rc)
    return rc;
  shardd_buffer_info b;
  uint64_t opt;
  shardd_param_ref ref = {0, "mine"};
  shardd_param_group grp = {&ref, 1, {0}};
  if (shardd_buffer_register(c, "mine", SHARDD_DTYPE_FP32, 64, &b) != SHARDD_OK)
    return 22;
  ref.id = b.id;
  if (shardd_optimizer_register(c, "own", SHARDD_OPTIM_SGD, NULL, &grp, 1, &opt) !=
      SHARDD_OK)
    return 23;
  static id_answers a;
  for (int i = 0; i < NIDS; i++)
    probe_id(c, opt, ids[i], a.code[i], a.msg[i]);
  shardd_close(c);
  return write_full(out_fd, &a, sizeof a) ? 0 : 24;
}

Test(access, ids_of_another_uid_read_as_never_issued) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two other uids");
  test_daemon d;
  test_daemon_start(&d, base_args());
  test_daemon_open_to_all(&d);
  /* root's objects first, so the victim's ids are not numbers like the
   * counts of a message ("1 of 1 ...") */
  shardd_client_t *rc0 = test_connect(&d, "root-job", 0, 1);
  shardd_buffer_info rb;
  cr_assert_eq(shardd_buffer_register(rc0, "pad", SHARDD_DTYPE_FP32, 1000, &rb), SHARDD_OK);
  for (int i = 0; i < 100; i++) {
    char n[16];
    int64_t one[1] = {1};
    uint64_t vid;
    snprintf(n, sizeof n, "p%d", i);
    cr_assert_eq(shardd_view_register(rc0, rb.id, n, (uint64_t)i, 1, one, 1, &vid),
                 SHARDD_OK);
  }
  int idp[2], gop[2], outp[2];
  pid_t victim = test_fork_with_pipes(idp, gop);
  if (victim == 0)
    _exit(victim_main(d.sock, idp[1], gop[0]));
  cr_assert_eq(pipe(outp), 0);
  uint64_t ids[NIDS];
  cr_assert(read_full(idp[0], ids, 4 * sizeof ids[0]), "the victim did not report");
  ids[4] = UNUSED_ID;
  pid_t attacker = fork();
  cr_assert(attacker >= 0);
  if (attacker == 0) {
    close(outp[0]);
    _exit(attacker_main(d.sock, ids, outp[1]));
  }
  close(outp[1]);
  static id_answers a;
  int got = read_full(outp[0], &a, sizeof a);
  test_expect_child_ok(attacker, "attacker");
  cr_assert(got, "the attacker did not report");
  close(gop[1]); /* the victim may go */
  test_expect_child_ok(victim, "victim");
  static const char *const what[NIDS - 1] = {"buffer", "view", "optimizer",
                                             "freed buffer"};
  for (int k = 0; k < NPROBE; k++) {
    cr_expect_neq(a.code[NIDS - 1][k], SHARDD_OK, "%s of an unused id", probe_name[k]);
    for (int i = 0; i < NIDS - 1; i++) {
      cr_expect_eq(a.code[i][k], a.code[NIDS - 1][k],
                   "%s of the victim's %s: %s (\"%s\"), of an unused id %s (\"%s\")",
                   probe_name[k], what[i], shardd_err_name(a.code[i][k]),
                   a.msg[i][k], shardd_err_name(a.code[NIDS - 1][k]),
                   a.msg[NIDS - 1][k]);
      cr_expect_str_eq(a.msg[i][k], a.msg[NIDS - 1][k],
                       "%s of the victim's %s: \"%s\", of an unused id \"%s\"",
                       probe_name[k], what[i], a.msg[i][k], a.msg[NIDS - 1][k]);
    }
  }
  close(idp[0]);
  close(outp[0]);
  shardd_close(rc0);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* Pool ids count the uid's own pools: another uid's transient jobs do not
 * move them (a global counter told how many pools others had made). */
static int first_pool_as(const char *sock, uid_t uid, const char *job, int hold_fd) {
  shardd_client_t *c;
  int rc = connect_as(sock, uid, job, 1, 30, &c);
  if (rc)
    return rc;
  shardd_buffer_info b;
  shardd_area area;
  if (shardd_buffer_register(c, "w", SHARDD_DTYPE_FP32, 1024, &b) != SHARDD_OK ||
      shardd_gather_area(c, b.id, 0, &area) != SHARDD_OK)
    return 32;
  uint64_t pool = area.pool;
  if (!write_full(hold_fd, &pool, sizeof pool))
    return 33;
  char byte;
  (void)read(hold_fd, &byte, 1); /* hold the pool until told */
  shardd_close(c);
  return 0;
}

Test(access, pool_ids_count_only_the_uid_s_own_pools) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as two other uids");
  test_daemon d;
  test_daemon_start(&d, base_args());
  test_daemon_open_to_all(&d);
  uint64_t pool[3];
  pid_t pid[3];
  int sp[3][2];
  const uid_t uid[3] = {VICTIM_UID, VICTIM_UID, ATTACKER_UID};
  const char *job[3] = {"first", "second", "attacker"};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sp[i]), 0);
    pid[i] = fork();
    cr_assert(pid[i] >= 0);
    if (pid[i] == 0) {
      for (int j = 0; j <= i; j++)
        close(sp[j][0]); /* the earlier children see EOF when the test closes */
      _exit(first_pool_as(d.sock, uid[i], job[i], sp[i][1]));
    }
    close(sp[i][1]);
    cr_assert(read_full(sp[i][0], &pool[i], sizeof pool[i]), "child %d did not report", i);
  }
  for (int i = 0; i < 3; i++) {
    close(sp[i][0]);
    int st;
    cr_assert(test_wait_exit(pid[i], &st), "child %d did not finish", i);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child %d step %d failed", i,
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  }
  cr_expect_eq(pool[0], 1, "the victim's first pool");
  cr_expect_eq(pool[1], 2, "its second job's pool is another one");
  cr_expect_eq(pool[2], 1, "the attacker's first pool is its first, whatever others hold");
  cr_assert_eq(test_daemon_stop(&d), 0);
}
