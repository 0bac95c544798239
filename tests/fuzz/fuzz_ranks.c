/* fuzz_ranks.c — libFuzzer target for what only shows with several ranks
 * of one job: collectives and buckets waiting for the others, what a
 * queued entry keeps past its request's dispatch (the request arena is
 * rewound after each), a rank lost mid-way and one rejoining in its
 * place, replies cut short by a client that stops reading or closes.
 * The server is the real one (host backend) on a loop in this process,
 * fed through shardd__server_adopt, as in fuzz_request.c.
 *
 * Input: one byte of setup, then records. Setup bit 0: three connections
 * (else two); bit 1: the daemon's send buffer on each connection is the
 * smallest the kernel allows, so replies are written in parts; bits 2-3,
 * when the fuzzer runs as root, the uids the connections are made as
 * (uids[] below): one user, or users beside each other (and root), so a
 * job, buffer or checkpoint of one uid meets another's requests.
 * A record is one control byte, its low two bits the connection (modulo
 * the count), bits 2..4 what to do:
 *   0, 6, 7  send the next chunk (two bytes little-endian length, then
 *            the bytes: frames, or parts of them), run the loop, read;
 *   1        the same without reading the replies (they back up);
 *   2        shut the connection's writing side (EOF to the daemon);
 *   3        close it (a client gone, perhaps mid-reply);
 *   4        close it and open a fresh one in its place (a rank that
 *            comes back: its next chunk says Hello again);
 *   5        wait past the collective timeout and run the loop (the
 *            first 8 times; later ones do nothing).
 * Seeds: tests/fuzz/corpus_ranks/, written by gen_corpus.c. With
 * FUZZ_RANKS_LOG=N the daemon logs at level N and each reply read is
 * printed, to see what an input reaches. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "proto/shardd.pb-c.h"
#include "server.h"
#include "fuzz_util.h"

#define NCONN_MAX 3

static uv_loop_t loop;
static shardd__server srv;
static int log_replies; /* FUZZ_RANKS_LOG set: each reply's seq and code */

static void init_once(void) {
  static int done;
  if (done)
    return;
  done = 1;
  /* as main does: a reply written to a client gone is EPIPE, not death */
  signal(SIGPIPE, SIG_IGN);
  uv_loop_init(&loop);
  char err[256];
  shardd__backend *b;
  if (shardd__backend_host_create(2, 64u << 20, &b, err, sizeof err) != SHARDD_OK)
    abort();
  shardd__server_opts o = SHARDD__SERVER_OPTS_INIT;
  static char path[108];
  snprintf(path, sizeof path, "/tmp/shardd-fuzzr-%d.sock", (int)getpid());
  o.socket_path = path;
  o.job_linger = 0;
  /* short, so an input whose ranks never meet ends in milliseconds */
  o.collective_timeout = 0.03;
  o.peer_grace = 0.01;
  /* FUZZ_RANKS_LOG=3: the daemon's log, to see what a seed reaches */
  const char *lv = getenv("FUZZ_RANKS_LOG");
  o.log_level = lv ? atoi(lv) : -1;
  log_replies = lv != NULL;
  snprintf(root, sizeof root, "/tmp/shardd-fuzzr-%d.d", (int)getpid());
  mkdir(root, 0700);
  atexit(fuzz_rm_root);
  o.checkpoint_root = root;
  if (shardd__server_init(&srv, &loop, b, &o, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "fuzz: %s\n", err);
    abort();
  }
  unlink(path);
  /* SIGTERM and SIGINT end the fuzzing run (libFuzzer's), not the
   * daemon: its graceful stop mid-input left sessions behind, which the
   * check after each input took for a leak */
  uv_signal_stop(&srv.sigterm);
  uv_signal_stop(&srv.sigint);
}

/* Prints the replies wholly in buf (a frame split over reads is skipped:
 * this is for reading what a seed does, not a check). */
static void print_replies(int fd, const uint8_t *buf, size_t n) {
  for (size_t o = 0; n - o >= SHARDD_FRAME_HEADER;) {
    uint32_t len = (uint32_t)buf[o] | (uint32_t)buf[o + 1] << 8 |
                   (uint32_t)buf[o + 2] << 16 | (uint32_t)buf[o + 3] << 24;
    if (len > n - o - SHARDD_FRAME_HEADER)
      return;
    Shardwire__Response *r =
        shardwire__response__unpack(NULL, len, buf + o + SHARDD_FRAME_HEADER);
    if (r) {
      fprintf(stderr, "  client %d: seq %llu code %d body %d %s\n", fd,
              (unsigned long long)r->seq, (int)r->code, (int)r->body_case,
              r->message ? r->message : "");
      shardwire__response__free_unpacked(r, NULL);
    }
    o += SHARDD_FRAME_HEADER + len;
  }
}

/* Reads and drops what the daemon sent, closing any passed descriptor. */
static void drain(int fd) {
  if (fd < 0)
    return;
  for (;;) {
    char buf[65536];
    ssize_t n = fuzz_recv_drop(fd, buf, sizeof buf);
    if (n <= 0)
      return;
    if (log_replies)
      print_replies(fd, (const uint8_t *)buf, (size_t)n);
  }
}

/* By setup bits 2-3, connection k's uid (when the fuzzer runs as root). */
static const uid_t uids[4][NCONN_MAX] = {
    {0, 0, 0}, {4241, 4241, 4241}, {4241, 4242, 4241}, {0, 4241, 4242}};

/* A fresh connection handed to the server: the client's end, or -1. The
 * daemon reads its peer's uid with SO_PEERCRED, which a socketpair takes
 * from the effective ids of its maker: made as uid, it is that uid's. */
static int open_conn(int small, uid_t uid) {
  int sv[2];
  int as = uid != 0 && geteuid() == 0;
  if (as && (setegid(uid) != 0 || seteuid(uid) != 0))
    abort();
  int rc = socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv);
  if (as && (seteuid(0) != 0 || setegid(0) != 0))
    abort();
  if (rc != 0)
    return -1;
  fcntl(sv[1], F_SETFL, O_NONBLOCK);
  if (small) {
    int one = 1; /* the kernel rounds it up to its minimum */
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &one, sizeof one);
  }
  if (shardd__server_adopt(&srv, sv[0]) != SHARDD_OK) {
    close(sv[1]);
    return -1;
  }
  return sv[1];
}

static void pump(int n) {
  for (int i = 0; i < n; i++)
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* What the server's 100 ms tick does, now: collectives past their timeout
 * or a lost rank's grace fail, jobs nobody holds are released (waiting
 * for the tick made each input cost 100 ms). */
static void tick(void) {
  uv_update_time(&loop);
  double now = shardd__server_now(&srv);
  shardd__dispatch_timeouts(&srv.d, now);
  shardd__dispatch_expire(&srv.d, now);
  pump(2);
}

/* Sends what the socket takes of data now, running the loop between
 * tries so a daemon that reads slowly still gets it all when it can. */
static void send_chunk(int fd, const uint8_t *data, size_t n, int read_back) {
  size_t off = 0;
  for (int tries = 0; off < n && tries < 50; tries++) {
    ssize_t w = send(fd, data + off, n - off, MSG_NOSIGNAL);
    if (w > 0)
      off += (size_t)w;
    else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return;
    pump(2);
    if (read_back)
      drain(fd);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  init_once();
  if (size < 1)
    return 0;
  /* Ids count up for the daemon's life; with no job left (the last input
   * cleaned up) they start again at 1, so a seed's small ids name the
   * objects it registers on every run, not only on the first one. */
  if (shardd__map_count(&srv.d.reg.jobs) == 0 &&
      shardd__map_count(&srv.d.reg.objects) == 0)
    srv.d.reg.next_id = 1;
  int nconn = data[0] & 1 ? 3 : 2, small = (data[0] >> 1) & 1;
  const uid_t *uid = uids[(data[0] >> 2) & 3];
  int fds[NCONN_MAX] = {-1, -1, -1};
  int reopens = 0, waits = 0;
  for (int i = 0; i < nconn; i++)
    fds[i] = open_conn(small, uid[i]);
  size_t off = 1;
  while (off < size) {
    uint8_t ctl = data[off++];
    int k = (ctl & 3) % nconn, op = (ctl >> 2) & 7;
    if (op == 0 || op == 1 || op >= 6) {
      if (size - off < 2)
        break;
      size_t n = data[off] | (size_t)data[off + 1] << 8;
      off += 2;
      if (n > size - off)
        n = size - off;
      if (fds[k] >= 0)
        send_chunk(fds[k], data + off, n, op != 1);
      off += n;
      pump(4);
      if (op != 1)
        drain(fds[k]);
    } else if (op == 2) {
      if (fds[k] >= 0)
        shutdown(fds[k], SHUT_WR);
      pump(4);
    } else if (op == 3 || op == 4) {
      if (fds[k] >= 0)
        close(fds[k]);
      fds[k] = -1;
      pump(4);
      if (op == 4 && reopens++ < 8)
        fds[k] = open_conn(small, uid[k]);
    } else if (waits++ < 8) { /* 5; more would only make the input slow */
      usleep(40 * 1000);
      tick();
      pump(4);
      for (int i = 0; i < nconn; i++)
        drain(fds[i]);
    }
  }
  /* the clients go: every rank's end closes while its replies may still
   * be queued */
  for (int i = 0; i < nconn; i++) {
    pump(2);
    drain(fds[i]);
    if (fds[i] >= 0)
      close(fds[i]);
  }
  /* Let close callbacks and any running collective finish: up to 30 s,
   * as a large copy under the sanitizers on a loaded machine may take
   * seconds; only an input that leaves something behind waits it out. */
  for (int i = 0; i < 30000 && (srv.nclients > 0 || shardd__map_count(&srv.d.reg.jobs) > 0); i++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    if (srv.nclients == 0)
      tick();
    if (i > 20)
      usleep(1000);
  }
  /* With every client gone nothing may be left: a session, a job, bytes
   * of replies or partial frames still charged (the bounds would then
   * shut out that uid for good), a uid's reply record. */
  if (srv.nclients > 0 || shardd__map_count(&srv.d.reg.jobs) > 0 ||
      srv.reply_bytes || srv.reply_fds || srv.reply_uids ||
      srv.partial_bytes || srv.partial_users || srv.partial_uids ||
      srv.room_waiters || srv.budget_waiters) {
    fprintf(stderr, "fuzz_ranks: left after every client closed: %u "
            "sessions, %zu jobs, %llu reply bytes, %llu reply fds, uid "
            "record %p, %llu partial-frame bytes (%llu of users, %u uids, "
            "%u sessions waiting, %u for room)\n", (unsigned)srv.nclients,
            (size_t)shardd__map_count(&srv.d.reg.jobs),
            (unsigned long long)srv.reply_bytes,
            (unsigned long long)srv.reply_fds, (void *)srv.reply_uids,
            (unsigned long long)srv.partial_bytes,
            (unsigned long long)srv.partial_users, (unsigned)srv.partial_uids,
            (unsigned)srv.budget_waiters, (unsigned)srv.room_waiters);
    abort();
  }
  return 0;
}
