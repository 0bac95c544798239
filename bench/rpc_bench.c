/* rpc_bench.c — round trip of a no-op request through libshardd
 * (shardd_ping against a private daemon) against the floor: the same framed
 * bytes (4-byte length + the packed Request / Response the library and the
 * daemon exchange for a ping) over Unix socketpairs to an epoll echo thread
 * in this process — a minimal single-threaded event loop, as the daemon's is.
 *
 * Latency: one client, rounds of pings alternating shardd and raw so that
 * noise hits both; median and p99 over all samples. Throughput: 1, 8 and 64
 * concurrent clients (one thread and one connection each) for a fixed time
 * per round, rounds alternating, median requests/s.
 *
 * Placement decides a round trip on a small (virtual) machine: a wake-up on
 * another CPU costs far more than a switch on the same one. So the servers
 * (the daemon, every thread of it, and the echo thread) are pinned to CPU 0
 * and the clients to CPU 1 ("cross", the headline: a trainer and the daemon
 * on different cores), and latency is measured again with the clients on
 * CPU 0 too ("same"). On a 1-CPU machine there is only "same". */
#include <stdatomic.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "bench.h"
#include "proto/shardd.pb-c.h"

#define MAX_CLIENTS 64

/* ---- the floor: framed bytes over socketpairs --------------------------- */

static uint8_t req_frame[64], resp_frame[64];
static size_t req_len, resp_len;

static size_t pack_frame(uint8_t *out, const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  out[0] = (uint8_t)n;
  out[1] = (uint8_t)(n >> 8);
  out[2] = (uint8_t)(n >> 16);
  out[3] = (uint8_t)(n >> 24);
  protobuf_c_message_pack(m, out + 4);
  return n + 4;
}

static void make_frames(void) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping ping = SHARDWIRE__PING__INIT;
  req.seq = 1000; /* a 2-byte varint, as most of a session's seqs are */
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &ping;
  req_len = pack_frame(req_frame, &req.base);
  Shardwire__Response resp = SHARDWIRE__RESPONSE__INIT;
  Shardwire__Pong pong = SHARDWIRE__PONG__INIT;
  resp.seq = 1000;
  resp.code = SHARDWIRE__STATUS_CODE__OK;
  resp.body_case = SHARDWIRE__RESPONSE__BODY_PONG;
  resp.pong = &pong;
  resp_len = pack_frame(resp_frame, &resp.base);
}

typedef struct {
  int fd;
  uint8_t buf[4096];
  size_t have;
} echo_conn;

static int raw_srv_fd[MAX_CLIENTS + 1], raw_cli_fd[MAX_CLIENTS + 1];
static int echo_stop_pipe[2];

/* Reads whatever is there and answers every complete frame with one write. */
static int server_cpu = -1, client_cpu = -1;

static void *echo_thread(void *arg) {
  bench_pin(server_cpu);
  int ep = epoll_create1(EPOLL_CLOEXEC);
  echo_conn *conns = calloc(MAX_CLIENTS + 1, sizeof *conns);
  for (int i = 0; i <= MAX_CLIENTS; i++) {
    conns[i].fd = raw_srv_fd[i];
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &conns[i]};
    epoll_ctl(ep, EPOLL_CTL_ADD, raw_srv_fd[i], &ev);
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
  epoll_ctl(ep, EPOLL_CTL_ADD, echo_stop_pipe[0], &ev);
  struct epoll_event evs[MAX_CLIENTS + 2];
  for (;;) {
    int n = epoll_wait(ep, evs, MAX_CLIENTS + 2, -1);
    for (int i = 0; i < n; i++) {
      echo_conn *c = evs[i].data.ptr;
      if (c == NULL)
        goto out;
      ssize_t got = read(c->fd, c->buf + c->have, sizeof c->buf - c->have);
      if (got <= 0)
        continue;
      c->have += (size_t)got;
      size_t off = 0;
      while (c->have - off >= 4) {
        uint32_t len = (uint32_t)c->buf[off] | (uint32_t)c->buf[off + 1] << 8 |
                       (uint32_t)c->buf[off + 2] << 16 |
                       (uint32_t)c->buf[off + 3] << 24;
        if (c->have - off < 4 + (size_t)len)
          break;
        off += 4 + len;
        if (write(c->fd, resp_frame, resp_len) != (ssize_t)resp_len)
          bench_die("echo write: %s", strerror(errno));
      }
      memmove(c->buf, c->buf + off, c->have - off);
      c->have -= off;
    }
  }
out:
  free(conns);
  close(ep);
  return NULL;
}

/* split: the header and the payload in two write()s, as libshardd's
 * shardd__frame_send does — a diagnostic variant of the floor. */
static void raw_ping(int fd, int split) {
  if (split) {
    if (write(fd, req_frame, 4) != 4 ||
        write(fd, req_frame + 4, req_len - 4) != (ssize_t)(req_len - 4))
      bench_die("raw write: %s", strerror(errno));
  } else if (write(fd, req_frame, req_len) != (ssize_t)req_len) {
    bench_die("raw write: %s", strerror(errno));
  }
  uint8_t buf[64];
  size_t have = 0;
  while (have < resp_len) {
    ssize_t got = read(fd, buf + have, sizeof buf - have);
    if (got <= 0)
      bench_die("raw read: %s", got == 0 ? "EOF" : strerror(errno));
    have += (size_t)got;
  }
}

/* ---- clients ------------------------------------------------------------ */

typedef enum { KIND_SHARDD = 0, KIND_RAW = 1, KIND_RAW_SPLIT = 2 } kind_t;
static const char *kind_name[] = {"shardd", "raw", "raw_split_write"};

static shardd_client_t *clients[MAX_CLIENTS];
static atomic_int stop_flag;

typedef struct {
  int index;
  kind_t kind;
  pthread_barrier_t *start;
  uint64_t count;
} tput_arg;

static void one_ping(kind_t k, int i) {
  if (k == KIND_SHARDD) {
    if (shardd_ping(clients[i]) != SHARDD_OK)
      bench_die("shardd_ping: %s", shardd_last_error(clients[i]));
  } else {
    raw_ping(raw_cli_fd[i + 1], k == KIND_RAW_SPLIT);
  }
}

static void *tput_thread(void *p) {
  tput_arg *a = p;
  bench_pin(client_cpu);
  pthread_barrier_wait(a->start);
  uint64_t n = 0;
  while (!atomic_load_explicit(&stop_flag, memory_order_relaxed)) {
    one_ping(a->kind, a->index);
    n++;
  }
  a->count = n;
  return NULL;
}

static double tput_round(kind_t k, int nclients, double seconds) {
  pthread_t th[MAX_CLIENTS];
  tput_arg args[MAX_CLIENTS];
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)nclients + 1);
  atomic_store(&stop_flag, 0);
  for (int i = 0; i < nclients; i++) {
    args[i] = (tput_arg){i, k, &start, 0};
    pthread_create(&th[i], NULL, tput_thread, &args[i]);
  }
  pthread_barrier_wait(&start);
  double t0 = bench_now();
  usleep((useconds_t)(seconds * 1e6));
  atomic_store(&stop_flag, 1);
  double t1 = bench_now();
  uint64_t total = 0;
  for (int i = 0; i < nclients; i++) {
    pthread_join(th[i], NULL);
    total += args[i].count;
  }
  pthread_barrier_destroy(&start);
  return (double)total / (t1 - t0);
}

int main(int argc, char **argv) {
  int full = bench_full(argc, argv);
  int rounds = full ? 10 : 5;
  int per_round = full ? 10000 : 4000;
  double tput_s = full ? 1.0 : 0.4;
  int tput_rounds = full ? 5 : 3;
  signal(SIGPIPE, SIG_IGN);
  make_frames();

  if (bench_ncpu() >= 2) {
    server_cpu = 0;
    client_cpu = 1;
  }
  bench_daemon d;
  bench_daemon_start_on(&d, 1, "64M", server_cpu);
  for (int i = 0; i < MAX_CLIENTS; i++)
    clients[i] = bench_connect(&d, NULL, 0, 1); /* control sessions */
  for (int i = 0; i <= MAX_CLIENTS; i++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
      bench_die("socketpair: %s", strerror(errno));
    raw_cli_fd[i] = sv[0];
    raw_srv_fd[i] = sv[1];
  }
  if (pipe(echo_stop_pipe) != 0)
    bench_die("pipe: %s", strerror(errno));
  pthread_t echo;
  pthread_create(&echo, NULL, echo_thread, NULL);

  /* Latency, one client (client 0 / socketpair 1), per placement. */
  int nplace = bench_ncpu() >= 2 ? 2 : 1;
  static const char *place_name[2] = {"cross", "same"};
  size_t nsamp = (size_t)rounds * (size_t)per_round;
  double *lat[3];
  for (int k = 0; k < 3; k++)
    lat[k] = calloc(nsamp, sizeof(double));
  double med[2][3], p99[2][3]; /* [placement][kind] */
  for (int pl = 0; pl < nplace; pl++) {
    bench_pin(nplace == 1 ? -1 : pl == 0 ? 1 : 0);
    for (int k = 0; k < 3; k++)
      for (int i = 0; i < 2000; i++)
        one_ping((kind_t)k, 0);
    size_t at = 0;
    for (int r = 0; r < rounds; r++) {
      for (int k = 0; k < 3; k++) {
        for (int i = 0; i < per_round; i++) {
          double t0 = bench_now();
          one_ping((kind_t)k, 0);
          lat[k][at + (size_t)i] = bench_now() - t0;
        }
      }
      at += (size_t)per_round;
    }
    for (int k = 0; k < 3; k++) {
      p99[pl][k] = bench_quantile(lat[k], nsamp, 0.99) * 1e6;
      med[pl][k] = bench_median(lat[k], nsamp) * 1e6;
    }
  }

  /* Throughput. */
  static const int ncl[] = {1, 8, 64};
  double rps[3][2];
  for (int c = 0; c < 3; c++) {
    double v[2][16];
    for (int r = 0; r < tput_rounds; r++)
      for (int k = 0; k < 2; k++)
        v[k][r] = tput_round((kind_t)k, ncl[c], tput_s);
    for (int k = 0; k < 2; k++)
      rps[c][k] = bench_median(v[k], (size_t)tput_rounds);
  }

  if (write(echo_stop_pipe[1], "x", 1) != 1)
    bench_die("pipe write");
  pthread_join(echo, NULL);
  for (int i = 0; i < MAX_CLIENTS; i++)
    shardd_close(clients[i]);
  bench_daemon_stop(&d);

  char cpu[256];
  bench_cpu_model(cpu, sizeof cpu);
  printf("\nRPC round trip — no-op request, %s (%ld CPUs)\n", cpu, bench_ncpu());
  printf("request %zu B, response %zu B framed; %zu samples each\n", req_len,
         resp_len, nsamp);
  printf("%-28s %12s %12s %12s %14s\n", "", "shardd_ping", "raw floor", "ratio",
         "raw, 2 writes");
  for (int pl = 0; pl < nplace; pl++) {
    const char *pn = nplace == 1 ? "" : pl == 0 ? ", cross-CPU" : ", same CPU";
    char label[64];
    snprintf(label, sizeof label, "median latency (us)%s", pn);
    printf("%-28s %12.2f %12.2f %11.2fx %14.2f\n", label, med[pl][0], med[pl][1],
           med[pl][0] / med[pl][1], med[pl][2]);
    snprintf(label, sizeof label, "p99 latency (us)%s", pn);
    printf("%-28s %12.2f %12.2f %11.2fx %14.2f\n", label, p99[pl][0], p99[pl][1],
           p99[pl][0] / p99[pl][1], p99[pl][2]);
  }
  for (int c = 0; c < 3; c++) {
    char label[64];
    snprintf(label, sizeof label, "req/s, %d client%s", ncl[c], ncl[c] > 1 ? "s" : "");
    printf("%-28s %12.0f %12.0f %11.2fx\n", label, rps[c][0], rps[c][1],
           rps[c][1] / rps[c][0]);
  }
  printf("(raw, 2 writes: the floor with the header and payload written apart, as "
         "libshardd sends them)\n");
  printf("(latency ratio = shardd/raw; throughput ratio = raw/shardd: both >= 1 "
         "mean shardd is slower;\n servers on CPU %d, clients on CPU %d except \"same "
         "CPU\" latency)\n", server_cpu, client_cpu);

  FILE *f = bench_json_open("rpc", full);
  fprintf(f, ",\n  \"request_bytes\": %zu,\n  \"response_bytes\": %zu,\n"
             "  \"samples\": %zu,\n  \"server_cpu\": %d,\n  \"client_cpu\": %d,\n"
             "  \"placements\": {",
          req_len, resp_len, nsamp, server_cpu, client_cpu);
  for (int pl = 0; pl < nplace; pl++)
    fprintf(f, "%s\n    \"%s\": {\"shardd_median_us\": %.3f, \"shardd_p99_us\": %.3f, "
               "\"raw_median_us\": %.3f, \"raw_p99_us\": %.3f, \"ratio_median\": %.4f, "
               "\"ratio_p99\": %.4f, \"raw_split_write_median_us\": %.3f}",
            pl ? "," : "", nplace == 1 ? "same" : place_name[pl], med[pl][0], p99[pl][0],
            med[pl][1], p99[pl][1], med[pl][0] / med[pl][1], p99[pl][0] / p99[pl][1],
            med[pl][2]);
  fprintf(f, "\n  },\n  \"latency_us\": {\n");
  for (int k = 0; k < 2; k++)
    fprintf(f, "    \"%s\": {\"median\": %.3f, \"p99\": %.3f}%s\n", kind_name[k],
            med[0][k], p99[0][k], k == 0 ? "," : "");
  fprintf(f, "  },\n  \"latency_ratio_median\": %.4f,\n"
             "  \"latency_ratio_p99\": %.4f,\n  \"throughput\": [\n",
          med[0][0] / med[0][1], p99[0][0] / p99[0][1]);
  for (int c = 0; c < 3; c++)
    fprintf(f, "    {\"clients\": %d, \"shardd_rps\": %.0f, \"raw_rps\": %.0f, "
               "\"raw_over_shardd\": %.4f}%s\n",
            ncl[c], rps[c][0], rps[c][1], rps[c][1] / rps[c][0], c < 2 ? "," : "");
  fprintf(f, "  ]");
  bench_json_close(f, "rpc");
  for (int k = 0; k < 3; k++)
    free(lat[k]);
  return 0;
}
