/* fuzz_request.c — libFuzzer target for the daemon's whole input path:
 * framing, Request decoding and dispatch, registry, validation and
 * collectives. Each input is the byte stream one client sends on a
 * connection; the server is the real one (host backend) on a loop in this
 * process, fed through shardd__server_adopt. Replies and descriptors that
 * come back are read and dropped. State (jobs) lingers 0 s, so it is
 * released when the input's connection closes. */
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "server.h"
#include "fuzz_util.h"

static uv_loop_t loop;
static shardd__server srv;

static void init_once(void) {
  static int done;
  if (done)
    return;
  done = 1;
  uv_loop_init(&loop);
  char err[256];
  shardd__backend *b;
  if (shardd__backend_host_create(2, 64u << 20, &b, err, sizeof err) != SHARDD_OK)
    abort();
  shardd__server_opts o = SHARDD__SERVER_OPTS_INIT;
  static char path[108];
  snprintf(path, sizeof path, "/tmp/shardd-fuzz-%d.sock", (int)getpid());
  o.socket_path = path;
  o.job_linger = 0;
  o.collective_timeout = 0.05;
  o.log_level = -1;
  /* Checkpoint requests write files: keep them inside a scratch folder. */
  snprintf(root, sizeof root, "/tmp/shardd-fuzz-%d.d", (int)getpid());
  mkdir(root, 0700);
  atexit(fuzz_rm_root);
  o.checkpoint_root = root;
  if (shardd__server_init(&srv, &loop, b, &o, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "fuzz: %s\n", err);
    abort();
  }
  unlink(path); /* nothing connects by path; adopt is the way in */
  /* A small request block: inputs are at most 4 KiB and a 64 KiB block
   * held every one's pieces, so the chunk code they spill into (what a
   * large batch decodes into) was never fuzzed. */
  shardd__arena_free(&srv.d.req_arena);
  shardd__arena_init(&srv.d.req_arena, 256);
}

/* Reads and drops what the daemon sent, closing any passed descriptor. */
static void drain(int fd) {
  for (;;) {
    char buf[65536];
    ssize_t n = fuzz_recv_drop(fd, buf, sizeof buf);
    if (n <= 0)
      return;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  init_once();
  /* Ids count up for the daemon's life; with no job left (the last input
   * cleaned up) they start again at 1, so a seed's small ids name the
   * objects it registers on every run, not only on the first one. */
  if (shardd__map_count(&srv.d.reg.jobs) == 0 &&
      shardd__map_count(&srv.d.reg.objects) == 0)
    srv.d.reg.next_id = 1;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return 0;
  fcntl(sv[1], F_SETFL, O_NONBLOCK);
  if (shardd__server_adopt(&srv, sv[0]) != SHARDD_OK) {
    close(sv[1]);
    return 0;
  }
  size_t off = 0;
  int shut = 0;
  for (int i = 0; i < 2000; i++) {
    if (off < size) {
      ssize_t w = send(sv[1], data + off, size - off, MSG_NOSIGNAL);
      if (w > 0)
        off += (size_t)w;
    }
    if (off == size && !shut) {
      shutdown(sv[1], SHUT_WR);
      shut = 1;
    }
    uv_run(&loop, UV_RUN_NOWAIT);
    drain(sv[1]);
    if (shut && srv.nclients == 0)
      break;
  }
  close(sv[1]);
  /* Let close callbacks and any running collective finish. */
  for (int i = 0; i < 200 && (srv.nclients > 0 || shardd__map_count(&srv.d.reg.jobs) > 0); i++) {
    uv_run(&loop, UV_RUN_NOWAIT);
    if (i > 20)
      usleep(1000);
  }
  return 0;
}
