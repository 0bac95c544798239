/* test_checkpoint_while_running.c — a real daemon checkpointing while it
 * works: the loop is not held up by a checkpoint or a restore, and a
 * SIGTERM while a step runs checkpoints it whole or not at all. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "harness.h"
#include "checkpoint_fixture.h"
#include "manifest.h"
#include "optcodec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"
#include "validate.h"

TestSuite(checkpoint, .init = setup, .fini = teardown);

/* ---- what the tests share: a host daemon, one big buffer, its replies ---- */

/* Starts d on the host backend with mem of device memory, and flag val
 * after them when flag is not NULL. */
static void start_host(test_daemon *d, const char *mem, const char *flag, const char *val) {
  test_daemon_start(d, (const char *const[]){"--backend", "host", "--device-memory", mem,
                                             flag, val, NULL});
}

/* A connection that has said hello: as rank 0 of job of one, or as
 * nobody's when job is NULL. */
static void open_client(const test_daemon *d, test_raw *r, const char *job) {
  test_raw_open(d, r);
  test_raw_hello(r, job, 0, job ? 1 : 0);
}

#define BIG_NUMEL ((uint64_t)64 << 20) /* fp32: 256 MiB */

static uint32_t big_word(uint64_t i) { return (uint32_t)(i * 2654435761u) ^ 0x5bd1e995u; }

/* The only rank of job on a new connection r, with numel fp32 words of
 * big_word in its buffer "flat". */
static void join_filled(const test_daemon *d, test_raw *r, const char *job, uint64_t numel,
                        shardd_buffer_info *info) {
  open_client(d, r, job);
  test_raw_register_buffer(r, "flat", SHARDD_DTYPE_FP32, numel, info);
  for (uint64_t i = 0; i < numel; i++)
    ((uint32_t *)info->shard)[i] = big_word(i);
}

/* info's numel words are big_word's, after a restore. */
static void expect_big_words(const shardd_buffer_info *info, uint64_t numel) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < numel; i++)
    bad += ((const uint32_t *)info->shard)[i] != big_word(i);
  cr_expect_eq(bad, 0, "%llu words differ after restore", (unsigned long long)bad);
}

/* Restarts d (stopped) from checkpoint ck and checks that job's "flat"
 * buffer came back as join_filled wrote it, byte for byte (and, when
 * attached, that it was the restored buffer, not a new one); d then stops
 * cleanly. */
static void expect_restores_whole(test_daemon *d, const char *mem, const char *ck,
                                  const char *job, uint64_t numel, int attached) {
  start_host(d, mem, "--restore", ck);
  test_raw a;
  shardd_buffer_info info;
  open_client(d, &a, job);
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, numel, &info);
  if (attached)
    cr_assert_eq(info.created, 0, "attached to the restored buffer");
  expect_big_words(&info, numel);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(d), 0);
}

/* A Checkpoint of ckdir, of job (NULL: the asking client's), in req. */
static void checkpoint_request(Shardwire__Request *req, Shardwire__Checkpoint *cp,
                               const char *ckdir, const char *job) {
  *req = (Shardwire__Request)SHARDWIRE__REQUEST__INIT;
  *cp = (Shardwire__Checkpoint)SHARDWIRE__CHECKPOINT__INIT;
  cp->dir = (char *)ckdir;
  cp->job = (char *)job;
  req->body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req->checkpoint = cp;
}

static uint64_t send_checkpoint(test_raw *r, const char *ckdir, const char *job) {
  Shardwire__Request req;
  Shardwire__Checkpoint cp;
  checkpoint_request(&req, &cp, ckdir, job);
  return test_raw_send(r, &req);
}

static uint64_t send_restore(test_raw *r, const char *path) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Restore rs = SHARDWIRE__RESTORE__INIT;
  rs.dir = (char *)path;
  req.body_case = SHARDWIRE__REQUEST__BODY_RESTORE;
  req.restore = &rs;
  return test_raw_send(r, &req);
}

static void expect_pong(test_raw *r, uint64_t seq) {
  Shardwire__Response *resp = test_raw_expect(r, seq, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
}

/* The reply to seq is a refusal with code that says message. */
static void expect_refused(test_raw *r, uint64_t seq, shardd_err code, const char *message) {
  Shardwire__Response *resp = test_raw_expect(r, seq, code);
  cr_expect_str_eq(resp->message, message);
  shardwire__response__free_unpacked(resp, NULL);
}

/* The reply to seq is a checkpoint (or restore) of job's one buffer. */
static void expect_checkpoint_of(test_raw *r, uint64_t seq, const char *job) {
  Shardwire__Response *resp = test_raw_expect(r, seq, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_CHECKPOINT);
  cr_expect_str_eq(resp->checkpoint->job, job);
  cr_expect_eq(resp->checkpoint->buffers, 1);
  shardwire__response__free_unpacked(resp, NULL);
}

/* other is served while waiting still waits for the reply to what (a
 * checkpoint, restore, ...): other's Pong comes first. */
static void expect_served_before(test_raw *other, test_raw *waiting, const char *what) {
  test_raw_sync(other);
  struct pollfd pf = {waiting->fd, POLLIN, 0};
  cr_expect_eq(poll(&pf, 1, 0), 0, "the %s's reply came before another client's Pong", what);
}

/* ---- the loop is not held up by a checkpoint ---------------------------- */

/* A 1.6 GB checkpoint froze every client for 4.9 s (the file I/O ran on
 * the loop thread) and made another job's gather time out. Here a job with
 * a 256 MiB buffer is checkpointed with a Ping and a registration sent
 * behind it in the same write, so all three are dispatched in one loop
 * turn: the Pong and the refusal (the job may not change while it is being
 * written) must come before the checkpoint's reply, and so must the Pong of
 * another client asked meanwhile. Orders of replies, never times. The
 * checkpoint then restores byte for byte. */

/* Appends req, framed, to buf at *len (seq taken from r). */
static void frame_append(test_raw *r, Shardwire__Request *req, uint8_t *buf,
                         size_t cap, size_t *len) {
  req->seq = ++r->seq;
  size_t n = shardwire__request__get_packed_size(req);
  cr_assert_leq(*len + SHARDD_FRAME_HEADER + n, cap);
  shardd__frame_put_header(buf + *len, (uint32_t)n);
  shardwire__request__pack(req, buf + *len + SHARDD_FRAME_HEADER);
  *len += SHARDD_FRAME_HEADER + n;
}

/* A Checkpoint of ck, a Ping and the registration of a view of buffer
 * sent in one write; their seqs in seq[3]. */
static void send_checkpoint_ping_view(test_raw *r, const char *ck, uint64_t buffer,
                                      uint64_t seq[3]) {
  uint8_t buf[4096];
  size_t len = 0;
  Shardwire__Request req;
  Shardwire__Checkpoint cp;
  checkpoint_request(&req, &cp, ck, NULL);
  frame_append(r, &req, buf, sizeof buf, &len);
  seq[0] = req.seq;
  Shardwire__Request ping = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping p = SHARDWIRE__PING__INIT;
  ping.body_case = SHARDWIRE__REQUEST__BODY_PING;
  ping.ping = &p;
  frame_append(r, &ping, buf, sizeof buf, &len);
  seq[1] = ping.seq;
  Shardwire__Request rv = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView v = SHARDWIRE__REGISTER_VIEW__INIT;
  int64_t shape[1] = {8};
  v.buffer = buffer;
  v.name = "late";
  v.numel = 8;
  v.n_shape = 1;
  v.shape = shape;
  rv.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  rv.register_view = &v;
  frame_append(r, &rv, buf, sizeof buf, &len);
  seq[2] = rv.seq;
  test_raw_send_bytes(r, buf, len);
}

Test(checkpoint, a_large_checkpoint_leaves_the_loop_to_other_clients, .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/big", dir);
  test_daemon d;
  start_host(&d, "3G", NULL, NULL);
  test_raw a, b;
  shardd_buffer_info info;
  join_filled(&d, &a, "big", BIG_NUMEL, &info);
  open_client(&d, &b, NULL);

  uint64_t s[3]; /* the checkpoint, the Ping, the view */
  send_checkpoint_ping_view(&a, ck, info.id, s);
  expect_pong(&a, s[1]);
  expect_refused(&a, s[2], SHARDD_E_BUSY, "job \"big\" is being checkpointed");
  /* another client, while the 256 MiB are still being written */
  expect_served_before(&b, &a, "checkpoint");
  expect_checkpoint_of(&a, s[0], "big");
  /* and the job takes registrations again */
  test_raw_sync(&a);
  test_raw_close(&a);
  test_raw_close(&b);
  cr_assert_eq(test_daemon_stop(&d), 0);

  expect_restores_whole(&d, "3G", ck, "big", BIG_NUMEL, 1);
}

/* The client that asked leaves while its checkpoint is being written, and
 * under --job-linger 0 its job would go with it: the reply is dropped, the
 * files are still written, and the job is released only after them. */
Test(checkpoint, a_client_leaving_mid_checkpoint_keeps_its_job_until_written,
     .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/gone", dir);
  const uint64_t numel = (uint64_t)16 << 20; /* fp32: 64 MiB */
  test_daemon d;
  start_host(&d, "1G", "--job-linger", "0");
  test_raw a;
  shardd_buffer_info info;
  join_filled(&d, &a, "gone", numel, &info);
  send_checkpoint(&a, ck, NULL);
  test_raw_close(&a);
  for (double end = test_mono_s() + TEST_HANG_S;
       !test_daemon_log_has(&d, "job \"gone\" released");) {
    cr_assert_lt(test_mono_s(), end, "the job was never released");
    test_sleep_ms(10);
  }
  char *log = test_slurp(d.log);
  cr_assert_not_null(log);
  const char *written = strstr(log, "job \"gone\" checkpointed to");
  const char *released = strstr(log, "job \"gone\" released");
  cr_expect(written != NULL && written < released,
            "the job was released before its checkpoint was written:\n%s", log);
  free(log);
  cr_assert_eq(test_daemon_stop(&d), 0);

  expect_restores_whole(&d, "1G", ck, "gone", numel, 0);
}

/* Whether dir holds a data file's temporary: a write on the pool is under
 * way. */
static int writing_in(const char *path) {
  DIR *dh = opendir(path);
  int hit = 0;
  if (dh == NULL)
    return 0;
  for (struct dirent *e; !hit && (e = readdir(dh)) != NULL;)
    hit = e->d_name[0] == '.' && strstr(e->d_name, ".tmp") != NULL;
  closedir(dh);
  return hit;
}

/* `shardctl checkpoint job ck` on d's socket in a child process, its
 * output in outp; the child's pid. */
static pid_t spawn_shardctl_checkpoint(const test_daemon *d, const char *job, const char *ck,
                                       const char *outp) {
  pid_t ctl = fork();
  cr_assert_geq(ctl, 0);
  if (ctl == 0) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "exec %s --socket %s checkpoint %s %s >%s 2>&1",
             test_bin("SHARDCTL_BIN", "build/shardctl"), d->sock, job, ck, outp);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  return ctl;
}

/* SIGTERM while `shardctl checkpoint` waits for its files: the checkpoint
 * is written whole, and shardctl says so and exits 0 (it printed E_CLOSED
 * and exited 3 for a valid checkpoint); the daemon then exits 0 and the
 * checkpoint restores byte for byte. */
Test(checkpoint, sigterm_during_an_operators_checkpoint_still_answers_it,
     .timeout = 60) {
  char ck[128], outp[160], said_ck[512];
  snprintf(ck, sizeof ck, "%s/term", dir);
  snprintf(outp, sizeof outp, "%s/shardctl.out", dir);
  test_daemon d;
  start_host(&d, "2G", NULL, NULL);
  test_raw a;
  shardd_buffer_info info;
  join_filled(&d, &a, "term", BIG_NUMEL, &info);
  pid_t ctl = spawn_shardctl_checkpoint(&d, "term", ck, outp);
  int st;
  for (double end = test_mono_s() + TEST_HANG_S; !writing_in(ck);) {
    cr_assert_eq(waitpid(ctl, &st, WNOHANG), 0, "shardctl ended before the "
                 "write was seen under way");
    cr_assert_lt(test_mono_s(), end, "the checkpoint never started writing");
    test_sleep_ms(1);
  }
  kill(d.pid, SIGTERM);
  cr_assert(test_wait_exit(ctl, &st), "shardctl hangs");
  char *said = test_slurp(outp);
  cr_assert_not_null(said);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "shardctl exited %d: %s",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, said);
  snprintf(said_ck, sizeof said_ck, "term: %s", ck);
  cr_expect(strstr(said, said_ck) != NULL, "shardctl said: %s", said);
  free(said);
  int code = -1;
  cr_assert(test_wait_exit(d.pid, &st), "the daemon did not exit");
  code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  d.pid = 0;
  cr_assert_eq(code, 0, "the daemon exited %d", code);
  test_raw_close(&a);
  test_daemon_stop(&d);

  expect_restores_whole(&d, "2G", ck, "term", BIG_NUMEL, 0);
}

/* Restore, as the write: the payloads of a large
 * checkpoint are read off the loop thread, so another client's Pong comes
 * before the restore's reply, and while they load the job is refused to
 * whoever would join or checkpoint it. Orders of replies, never times.
 * The restored values are the checkpoint's, byte for byte, and a daemon
 * stopped mid-load still exits cleanly. */

/* Waits until r's Status lists job: a restore's manifest is read on the
 * pool, and its job registered (as being restored) once it is read. */
static void wait_job_listed(test_raw *r, const char *job) {
  for (double end = test_mono_s() + TEST_HANG_S;; test_sleep_ms(2)) {
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__StatusRequest st = SHARDWIRE__STATUS_REQUEST__INIT;
    req.body_case = SHARDWIRE__REQUEST__BODY_STATUS;
    req.status = &st;
    Shardwire__Response *resp = test_raw_expect(r, test_raw_send(r, &req), SHARDD_OK);
    int found = 0;
    for (size_t i = 0; i < resp->status->n_jobs; i++)
      found |= !strcmp(resp->status->jobs[i]->name, job);
    shardwire__response__free_unpacked(resp, NULL);
    if (found)
      return;
    cr_assert_lt(test_mono_s(), end, "job \"%s\" was never registered", job);
  }
}

Test(checkpoint, a_large_restore_leaves_the_loop_to_other_clients, .timeout = 60) {
  char ck[128], ck2[128];
  snprintf(ck, sizeof ck, "%s/bigr", dir);
  snprintf(ck2, sizeof ck2, "%s/bigr2", dir);
  test_daemon d;
  start_host(&d, "3G", NULL, NULL);
  test_raw a, b, e;
  shardd_buffer_info info;
  join_filled(&d, &a, "bigr", BIG_NUMEL, &info);
  shardwire__response__free_unpacked(
      test_raw_expect(&a, send_checkpoint(&a, ck, NULL), SHARDD_OK), NULL);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* a 256 MiB load from the page cache can end between the Status that
   * lists the job and the next request (it did, with the suite's binaries
   * three at a time): the load is held 2 s, so the refusals below are seen */
  setenv("SHARDD_TEST_RESTORE_PAUSE_MS", "2000", 1);
  start_host(&d, "3G", NULL, NULL);
  unsetenv("SHARDD_TEST_RESTORE_PAUSE_MS");
  open_client(&d, &a, NULL);
  test_raw_open(&d, &b);
  open_client(&d, &e, NULL);
  /* the Restore, then a Ping behind it on the same connection: the Pong
   * says the restore was taken; once Status lists the job, its manifest
   * was read and applied and the load started */
  uint64_t s_rs = send_restore(&a, ck);
  expect_pong(&a, test_raw_send_ping(&a));
  wait_job_listed(&e, "bigr");
  /* while the 256 MiB load: nobody joins the job, nobody checkpoints it */
  expect_refused(&b, test_raw_send_hello(&b, SHARDD_PROTOCOL_VERSION, "bigr", 0, 1),
                 SHARDD_E_BUSY, "job \"bigr\" is being restored");
  expect_refused(&e, send_checkpoint(&e, ck2, "bigr"), SHARDD_E_BUSY,
                 "job \"bigr\" is being restored");
  /* another client, while the payload is still being read */
  expect_served_before(&e, &a, "restore");
  expect_checkpoint_of(&a, s_rs, "bigr");
  /* loaded: the refused client joins now, and finds every byte */
  test_raw_hello(&b, "bigr", 0, 1);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, BIG_NUMEL, &info);
  cr_assert_eq(info.created, 0, "attached to the restored buffer");
  expect_big_words(&info, BIG_NUMEL);
  test_raw_close(&a);
  test_raw_close(&b);
  test_raw_close(&e);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* stopped while it loads: the daemon waits for the load, then exits */
  start_host(&d, "3G", NULL, NULL);
  open_client(&d, &a, NULL);
  send_restore(&a, ck);
  test_raw_sync(&a);
  cr_assert_eq(test_daemon_stop(&d), 0, "a daemon stopped mid-restore failed");
  test_raw_close(&a);
}

/* A manifest is read, its seal checked and its lines split on libuv's
 * pool, not on the loop thread: a 1.5 GB manifest froze every client for
 * 4-6 s. Here 96 MiB of lines under a wrong seal, which used to be read
 * and refused on the loop thread before the next frame was looked at: the
 * Ping sent behind the Restore is answered first now, and another client's
 * Ping too, while the manifest is still being read. Orders, never times. */
static void write_big_manifest(const char *path, size_t bytes) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs("shardd-checkpoint 4\n", f);
  char line[128];
  int n = snprintf(line, sizeof line, "view 0 filler 0 1 1 1 0 0 %*s\n", 60, "x");
  for (size_t done = 0; done < bytes; done += (size_t)n)
    fwrite(line, 1, (size_t)n, f);
  fputs("end 00000000\n", f);
  cr_assert_eq(fclose(f), 0);
}

Test(checkpoint, a_large_manifest_is_read_off_the_loop, .timeout = 120) {
  char ck[128], man[160];
  snprintf(ck, sizeof ck, "%s/bigman", dir);
  cr_assert_eq(mkdir(ck, 0700), 0);
  snprintf(man, sizeof man, "%s/manifest", ck);
  write_big_manifest(man, (size_t)96 << 20);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", NULL});
  test_raw a, e;
  open_client(&d, &a, NULL);
  open_client(&d, &e, NULL);
  /* both frames in flight at once: the loop takes the Restore first */
  uint64_t s_rs = send_restore(&a, ck);
  uint64_t s_ping = test_raw_send_ping(&a);
  Shardwire__Response *resp = test_raw_recv(&a);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, s_ping, "the Restore's reply (%s) came before the "
               "Ping sent behind it: the manifest was read on the loop thread",
               resp->message ? resp->message : "ok");
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
  /* another client is served while the manifest is read */
  expect_served_before(&e, &a, "restore");
  resp = test_raw_expect(&a, s_rs, SHARDD_E_INVAL);
  cr_expect(strstr(resp->message, "checksum 00000000") != NULL,
            "not refused by its seal: %s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  /* the refused restore left nothing: the daemon serves on */
  test_raw_sync(&e);
  test_raw_close(&a);
  test_raw_close(&e);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A manifest larger than SHARDD__MANIFEST_MAX is refused on its size,
 * before a byte of it is read or held, naming the bound; so is one part of
 * a multi-node job's checkpoint. Sparse files: a terabyte costs nothing
 * on disk, and a daemon that read it would run out of memory instead. */
Test(checkpoint, a_manifest_past_the_bound_is_refused_unread, .timeout = 60) {
  char ck[128], man[160], want[64];
  snprintf(ck, sizeof ck, "%s/hugeman", dir);
  cr_assert_eq(mkdir(ck, 0700), 0);
  snprintf(man, sizeof man, "%s/manifest", ck);
  snprintf(want, sizeof want, "the %zu MiB a manifest may have",
           SHARDD__MANIFEST_MAX >> 20);
  const off_t sizes[] = {(off_t)SHARDD__MANIFEST_MAX + 1, (off_t)1 << 40};
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", NULL});
  test_raw a;
  open_client(&d, &a, NULL);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    int fd = open(man, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    const char head[] = "shardd-checkpoint 4\njob big 1 0\n";
    cr_assert_eq(write(fd, head, sizeof head - 1), (ssize_t)sizeof head - 1);
    cr_assert_eq(ftruncate(fd, sizes[i]), 0);
    close(fd);
    Shardwire__Response *resp =
        test_raw_expect(&a, send_restore(&a, ck), SHARDD_E_LIMIT);
    cr_expect(strstr(resp->message, want) != NULL && strstr(resp->message, man),
              "the refusal names neither the bound nor the file: %s",
              resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);
  /* in process, as --restore at start reads it: the same refusal */
  char err[512];
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err),
               SHARDD_E_LIMIT, "%s", err);
  cr_expect(strstr(err, want) != NULL, "%s", err);
}

/* ---- SIGTERM while a step runs -------------------------------------------
 * Both ranks send a step of a 64 MiB buffer and the daemon is SIGTERMed
 * right behind them, with --checkpoint-on-exit: depending on where the
 * signal lands the step ran (and its reply may or may not have left) or
 * it did not. Whichever: the checkpoint holds every element before the
 * step or every element after it, with the matching count, never a torn
 * mix; and after --restore each rank's retry with expect_step 1 (a
 * scatter first where the step did not run) leaves exactly one step
 * applied. No timing is asserted: every outcome is checked for what it
 * must be. */

#define RUN_NUMEL ((uint64_t)16 << 20)

static uint64_t raw_step_expect(test_raw *r, uint64_t opt, uint64_t expect) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  st.has_expect_step = 1;
  st.expect_step = expect;
  req.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  req.step = &st;
  return test_raw_send(r, &req);
}

/* The next reply, or NULL when the connection ended (closed or reset). */
static Shardwire__Response *raw_next_or_gone(test_raw *r) {
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  char err[256];
  if (shardd__frame_recv(r->fd, &r->rd, &payload, &len, fds, 4, &nfds, err, sizeof err) !=
      SHARDD_OK)
    return NULL;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return shardwire__response__unpack(NULL, len, payload);
}

static void fill_big(const shardd_buffer_info *b, float shard, float grad) {
  for (uint64_t i = 0; i < b->shard_numel; i++)
    ((float *)b->shard)[i] = shard;
  for (uint64_t j = 0; j < b->padded_numel; j++)
    ((float *)b->grad)[j] = grad;
}

/* Ranks 0 and 1 of job "run" on new connections a and b, each with its
 * RUN_NUMEL-word buffer "flat". */
static void join_run(const test_daemon *d, test_raw *a, test_raw *b, shardd_buffer_info *ia,
                     shardd_buffer_info *ib) {
  test_raw_open(d, a);
  test_raw_open(d, b);
  test_raw_hello(a, "run", 0, 2);
  test_raw_hello(b, "run", 1, 2);
  test_raw_register_buffer(a, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, ia);
  test_raw_register_buffer(b, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, ib);
}

/* Shards 1 and 2, gradients 1 and 3, reduced to their mean 2: SGD lr 0.5
 * then takes 1 off every element. */
static void scatter_mean_grads(test_raw *a, test_raw *b, const shardd_buffer_info *ia,
                               const shardd_buffer_info *ib) {
  fill_big(ia, 1.0f, 1.0f);
  fill_big(ib, 2.0f, 3.0f);
  uint64_t s0 = test_raw_send_scatter(a, ia->id, SHARDD_REDUCE_MEAN);
  uint64_t s1 = test_raw_send_scatter(b, ib->id, SHARDD_REDUCE_MEAN);
  shardwire__response__free_unpacked(test_raw_expect(a, s0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(b, s1, SHARDD_OK), NULL);
}

/* every element of the shard is v: -> the first that is not, or -1 */
static int64_t first_not(const shardd_buffer_info *b, float v) {
  for (uint64_t i = 0; i < b->shard_numel; i++)
    if (((const float *)b->shard)[i] != v)
      return (int64_t)i;
  return -1;
}

Test(checkpoint, sigterm_while_a_step_runs_checkpoints_it_whole_or_not_at_all,
     .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/running", dir);
  test_daemon d;
  start_host(&d, "2G", "--checkpoint-on-exit", ck);
  test_raw a, b;
  shardd_buffer_info ia, ib;
  join_run(&d, &a, &b, &ia, &ib);
  uint64_t opt = raw_sgd(&a, ia.id);
  cr_assert_eq(raw_sgd(&b, ib.id), opt);
  scatter_mean_grads(&a, &b, &ia, &ib);
  uint64_t t[2] = {raw_step_expect(&a, opt, 1), raw_step_expect(&b, opt, 1)};
  cr_assert_eq(test_daemon_stop(&d), 0); /* SIGTERM right behind the steps */
  test_raw *rr[2] = {&a, &b};
  int replied = 0;
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = raw_next_or_gone(rr[k]);
    if (resp && resp->seq == t[k] && resp->code == SHARDWIRE__STATUS_CODE__OK)
      replied++;
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    test_raw_close(rr[k]);
  }

  start_host(&d, "2G", "--restore", ck);
  uint64_t steps = job_steps(&d);
  cr_log_info("SIGTERM behind the steps: %d rank(s) had the reply; the checkpoint holds "
              "%" PRIu64 " step(s)", replied, steps);
  cr_assert(steps <= 1, "%" PRIu64 " steps from one", steps);
  cr_assert(replied == 0 || steps == 1, "a rank was told the step ran; the checkpoint says not");
  join_run(&d, &a, &b, &ia, &ib);
  cr_assert(!ia.created && !ib.created);
  cr_assert_eq(raw_sgd(&a, ia.id), raw_sgd(&b, ib.id));
  int64_t i0 = first_not(&ia, steps ? 0.0f : 1.0f), i1 = first_not(&ib, steps ? 1.0f : 2.0f);
  cr_assert_eq(i0, -1, "rank 0's shard is torn at %" PRId64 " (count %" PRIu64 ")", i0, steps);
  cr_assert_eq(i1, -1, "rank 1's shard is torn at %" PRId64 " (count %" PRIu64 ")", i1, steps);
  if (steps == 0) /* the gradients are the trainer's to send again */
    scatter_mean_grads(&a, &b, &ia, &ib);
  t[0] = raw_step_expect(&a, opt, 1);
  t[1] = raw_step_expect(&b, opt, 1);
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = test_raw_expect(rr[k], t[k], SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_STEP);
    cr_assert_eq(resp->step->step, 1);
    cr_assert_eq(resp->step->has_applied && !resp->step->applied, steps == 1,
                 "rank %d: the retry %s", k, steps == 1 ? "ran again" : "was skipped");
    shardwire__response__free_unpacked(resp, NULL);
  }
  cr_assert_eq(first_not(&ia, 0.0f), -1, "rank 0: not exactly one step");
  cr_assert_eq(first_not(&ib, 1.0f), -1, "rank 1: not exactly one step");
  cr_assert_eq(job_steps(&d), 1);
  test_raw_close(&a);
  test_raw_close(&b);
  cr_assert_eq(test_daemon_stop(&d), 0);
}
