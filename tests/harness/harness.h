/* harness.h — the system tests' helpers (defined once, in harness.c): start a real shardd on a temporary socket, wait
 * until it accepts, stop it with SIGTERM and collect its exit status. The
 * binary is $SHARDD_BIN (set by scripts/run_tests.sh), else build/shardd. */
#ifndef SHARDD_TEST_HARNESS_H
#define SHARDD_TEST_HARNESS_H

#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardd.h"

typedef struct {
  pid_t pid;
  char dir[64];
  char sock[128];
  char log[128];
} test_daemon;

const char *test_bin(const char *env, const char *dflt);

int test_can_connect(const char *path);

void test_sleep_ms(int ms);

/* Waits here only guard against a hang, never measure speed: a sanitizer
 * build on a loaded 2-core machine may take seconds for what takes
 * milliseconds elsewhere, so every hang guard is this long. */
#define TEST_HANG_S 30.0

/* Monotonic seconds, for hang-guard deadlines. */
double test_mono_s(void);

/* Waits for pid to exit for up to TEST_HANG_S; 1 and *status if it did. */
int test_wait_exit(pid_t pid, int *status);

/* pid (a child acting as who) finishes within TEST_HANG_S, with exit code
 * 0: else the test fails with "the <who> did not finish" or "<who> step N
 * failed" (its exit code names the step). */
void test_expect_child_ok(pid_t pid, const char *who);

/* Pipes ready (child to test) and go (test to child), and a child process:
 * 0 in the child, which keeps ready[1] and go[0]; the test keeps ready[0]
 * and go[1] (so a child whose test failed reads EOF and leaves instead of
 * outliving it). */
pid_t test_fork_with_pipes(int ready[2], int go[2]);

/* Starts shardd with extra args (NULL-terminated list). */
void test_daemon_start(test_daemon *d, const char *const *extra);

/* Opens d's socket (and its directory) to every uid, as a socket of a
 * shared group would be under systemd: for tests that act as other uids. */
void test_daemon_open_to_all(const test_daemon *d);

/* The daemon's log, line by line, into the test's output. */
void test_daemon_dump_log(const test_daemon *d);

/* SIGTERM, then waits up to TEST_HANG_S; returns the exit status (-1 if
 * killed). */
int test_daemon_stop(test_daemon *d);

/* Whether the daemon process is still running. */
int test_daemon_alive(const test_daemon *d);

shardd_client_t *test_connect(const test_daemon *d, const char *job,
                              uint32_t rank, uint32_t world);

/* ---- more helpers (server / collective / shardctl tests) ----------------
 * A raw client speaks the wire protocol itself (frames built with
 * protobuf-c), so tests can send what libshardd never would and pipeline
 * requests: sending a collective and then a Ping on one connection, the Pong
 * proves the daemon has queued the collective. */

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>

#include "frame.h"
#include "proto/shardd.pb-c.h"

/* SIGTERM and wait, keeping the temp dir (test_daemon_stop cleans up after). */
int test_daemon_terminate(test_daemon *d);

/* Whether the daemon's log holds needle (e.g. a sanitizer report). */
int test_daemon_log_has(const test_daemon *d, const char *needle);

/* For .fini: the daemon must still be running, exit 0 on SIGTERM and leave
 * no sanitizer report (LeakSanitizer reports at exit) in its log; then the
 * temp files go. */
void test_daemon_finish(test_daemon *d);

typedef struct {
  int fd;
  uint64_t seq;
  shardd__frame_reader rd;
  void *map[8];
  size_t maplen[8];
  int nmaps;
} test_raw;

void test_raw_open(const test_daemon *d, test_raw *r);

void test_raw_close(test_raw *r);

void test_raw_send_bytes(test_raw *r, const void *p, size_t n);

/* Sends req; a seq of 0 is replaced by the next one. Returns the seq. */
uint64_t test_raw_send(test_raw *r, Shardwire__Request *req);

/* Next response (caller frees with shardwire__response__free_unpacked), or
 * NULL when the daemon closed the connection. A descriptor that came with it
 * is stored in *fd when fd is not NULL (else closed). */
Shardwire__Response *test_raw_recv_fd(test_raw *r, int *fd);

Shardwire__Response *test_raw_recv(test_raw *r);

/* Waits for the daemon to close the connection; 1 if it did. */
int test_raw_wait_eof(test_raw *r);

/* Receives the reply to seq (skipping none: replies must come in order for
 * these tests unless noted) and checks its code; returns it. */
Shardwire__Response *test_raw_expect(test_raw *r, uint64_t seq,
                                     shardd_err code);

uint64_t test_raw_send_hello(test_raw *r, uint32_t version, const char *job,
                             uint32_t rank, uint32_t world);

void test_raw_hello(test_raw *r, const char *job, uint32_t rank,
                    uint32_t world);

uint64_t test_raw_send_ping(test_raw *r);

/* Ping round trip; every earlier request on r has been dispatched once it
 * returns (replies to collectives still waiting are not consumed). */
void test_raw_sync(test_raw *r);

/* As test_raw_sync, but one reply to an earlier request that arrives before
 * the Pong is handed back in *early (NULL when none came). */
void test_raw_sync_keep(test_raw *r, Shardwire__Response **early);

uint64_t test_raw_send_gather(test_raw *r, uint64_t buf);

uint64_t test_raw_send_scatter(test_raw *r, uint64_t buf,
                               shardd_reduce_op op);

uint64_t test_raw_send_step(test_raw *r, uint64_t opt);

/* An operator's Checkpoint of job into ck that may wait wait_s for the
 * job's quiescent point (0: none). */
uint64_t test_raw_send_checkpoint_wait(test_raw *r, const char *job,
                                       const char *ck, double wait_s);

/* RegisterBuffer on a raw client, mapping the rank block as libshardd does. */
void test_raw_register_buffer(test_raw *r, const char *name,
                              shardd_dtype dtype, uint64_t numel,
                              shardd_buffer_info *out);

/* A file's whole text (caller-freed; "" when it cannot be opened). */
char *test_slurp(const char *path);

/* Runs `$SHARDCTL_BIN args` (args is shell text; keep it to safe paths).
 * Returns the exit status; *out / *err (when not NULL) get stdout / stderr,
 * caller-freed. */
int test_shardctl(const char *env, const char *args, char **out, char **err);

/* ---- a small JSON reader: enough of RFC 8259 to check shardctl --json ---- */

typedef enum { TJ_NULL, TJ_BOOL, TJ_NUM, TJ_STR, TJ_ARR, TJ_OBJ } tj_kind;

typedef struct tj {
  tj_kind kind;
  double num;
  int boolean;
  char *str;        /* TJ_STR */
  struct tj **kids; /* TJ_ARR, TJ_OBJ values */
  char **keys;      /* TJ_OBJ */
  size_t n;
} tj;

void tj_free(tj *v);

/* Parses one JSON document (trailing whitespace allowed); NULL if invalid. */
tj *tj_parse(const char *text);

/* Member key of an object, or NULL. Duplicate keys fail the test. */
const tj *tj_get(const tj *o, const char *key);

/* The member must exist with that kind; fails the test otherwise. */
const tj *tj_need(const tj *o, const char *key, tj_kind kind);

#endif /* SHARDD_TEST_HARNESS_H */
