/* server_fixture.h — the transport's system tests' shared daemon and
 * helpers (defined in harness_server.c). */
#ifndef SHARDD_TEST_SERVER_FIXTURE_H
#define SHARDD_TEST_SERVER_FIXTURE_H

#include <sys/types.h>

#include "daemon_fixture.h"
#include "harness.h"

/* --devices 3. */
void start_default(void);
/* --job-linger 0: a job goes as soon as its last client does. */
void start_linger0(void);
/* --devices 1. */
void start_one_device(void);

/* A libshardd control session must get a status reply now. */
void expect_served(void);

/* shardctl status --json, parsed (caller frees with tj_free). */
tj *shardctl_status(void);
/* What Status says the daemon charged for partial frames. */
double status_partial_bytes(void);

/* A raw connection from this process; -1 if connect failed. */
int raw_connect(const char *sock);

/* Opens d's socket to every uid, runs fn(socket) in a child (which turns
 * itself into uid 4242 first) and asserts it exited 0; its exit code
 * otherwise names the step that failed. */
void run_as_other_uid(int (*fn)(const char *sock), const char *who);

/* The daemon's resident memory, KiB (VmRSS). */
long daemon_rss_kib(pid_t pid);

#endif
