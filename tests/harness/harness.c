/* harness.c — the test helpers harness.h declares, compiled once and linked
 * into every system test (tests/system/). */
#include "harness.h"

const char *test_bin(const char *env, const char *dflt) {
  const char *p = getenv(env);
  return p && p[0] ? p : dflt;
}

int test_can_connect(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t n = strlen(path);
  if (n >= sizeof sa.sun_path)
    n = sizeof sa.sun_path - 1;
  memcpy(sa.sun_path, path, n);
  int ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

void test_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

double test_mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int test_wait_exit(pid_t pid, int *status) {
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    if (waitpid(pid, status, WNOHANG) == pid)
      return 1;
    if (test_mono_s() > end)
      return 0;
    test_sleep_ms(10);
  }
}

void test_expect_child_ok(pid_t pid, const char *who) {
  int st;
  cr_assert(test_wait_exit(pid, &st), "the %s did not finish", who);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s step %d failed", who,
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

pid_t test_fork_with_pipes(int ready[2], int go[2]) {
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    close(ready[0]);
    close(go[1]);
    return 0;
  }
  close(ready[1]);
  close(go[0]);
  return pid;
}

void test_daemon_open_to_all(const test_daemon *d) {
  cr_assert_eq(chmod(d->dir, 0755), 0);
  cr_assert_eq(chmod(d->sock, 0666), 0);
}

void test_daemon_start(test_daemon *d, const char *const *extra) {
  memset(d, 0, sizeof *d);
  snprintf(d->dir, sizeof d->dir, "/tmp/shardd-test-XXXXXX");
  cr_assert_not_null(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
  snprintf(d->sock, sizeof d->sock, "%s/shardd.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/shardd.log", d->dir);
  const char *argv[32];
  int n = 0;
  argv[n++] = test_bin("SHARDD_BIN", "build/shardd");
  argv[n++] = "--socket";
  argv[n++] = d->sock;
  argv[n++] = "--log-level";
  argv[n++] = "debug";
  for (; extra && *extra && n < 30; extra++)
    argv[n++] = *extra;
  argv[n] = NULL;
  d->pid = fork();
  cr_assert(d->pid >= 0);
  if (d->pid == 0) {
    /* A test that fails an assertion never reaches test_daemon_stop: the
     * daemon must not outlive it, nor hold the runner's stdout open. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    FILE *f = freopen(d->log, "w", stderr);
    (void)f;
    f = freopen("/dev/null", "w", stdout);
    (void)f;
    execv(argv[0], (char *const *)argv);
    fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    if (test_can_connect(d->sock))
      return;
    int st;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      d->pid = 0;
      cr_assert_fail("shardd exited at start (see %s)", d->log);
    }
    if (test_mono_s() > end)
      break;
    test_sleep_ms(10);
  }
  cr_assert_fail("shardd did not listen on %s within %.0f s", d->sock, TEST_HANG_S);
}

void test_daemon_dump_log(const test_daemon *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return;
  char line[1024];
  while (fgets(line, sizeof line, f))
    cr_log_info("daemon: %s", line);
  fclose(f);
}

int test_daemon_stop(test_daemon *d) {
  int status = -1;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    if (!test_wait_exit(d->pid, &status)) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &status, 0);
      status = -1;
    }
    d->pid = 0;
  }
  unlink(d->sock);
  unlink(d->log);
  rmdir(d->dir);
  if (status == -1)
    return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int test_daemon_alive(const test_daemon *d) {
  int st;
  return d->pid > 0 && waitpid(d->pid, &st, WNOHANG) == 0;
}

shardd_client_t *test_connect(const test_daemon *d,
                              const char *job, uint32_t rank,
                              uint32_t world) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = rank;
  o.world = world;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(d->sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_OK, "connect %s rank %u: %s", job ? job : "(control)",
               rank, err);
  return c;
}

int test_daemon_terminate(test_daemon *d) {
  int status = -1;
  if (d->pid <= 0)
    return -1;
  kill(d->pid, SIGTERM);
  if (test_wait_exit(d->pid, &status)) {
    d->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  kill(d->pid, SIGKILL);
  waitpid(d->pid, &status, 0);
  d->pid = 0;
  return -1;
}

int test_daemon_log_has(const test_daemon *d, const char *needle) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return 0;
  char line[4096];
  int hit = 0;
  while (!hit && fgets(line, sizeof line, f))
    hit = strstr(line, needle) != NULL;
  fclose(f);
  return hit;
}

void test_daemon_finish(test_daemon *d) {
  int alive = 1, code = 0;
  if (d->pid > 0) { /* else the test stopped it and checked the exit itself */
    alive = test_daemon_alive(d);
    code = alive ? test_daemon_terminate(d) : -1;
  }
  int san = d->log[0] && (test_daemon_log_has(d, "Sanitizer") ||
                          test_daemon_log_has(d, "runtime error:"));
  if (!alive || code != 0 || san)
    test_daemon_dump_log(d);
  cr_expect(alive, "the daemon died during the test (log above)");
  cr_expect(!alive || code == 0, "shardd exited %d on SIGTERM (log above)", code);
  cr_expect(!san, "sanitizer report in the daemon's log (above)");
  test_daemon_stop(d);
}

void test_raw_open(const test_daemon *d, test_raw *r) {
  memset(r, 0, sizeof *r);
  r->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert(r->fd >= 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  cr_assert_lt(strlen(d->sock), sizeof sa.sun_path);
  memcpy(sa.sun_path, d->sock, strlen(d->sock) + 1);
  cr_assert_eq(connect(r->fd, (struct sockaddr *)&sa, sizeof sa), 0,
               "connect %s: %s", d->sock, strerror(errno));
  /* A reply that never comes fails the test instead of hanging it. */
  struct timeval tv = {(time_t)TEST_HANG_S, 0};
  setsockopt(r->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  shardd__frame_reader_init(&r->rd, SHARDD_MAX_FRAME);
}

void test_raw_close(test_raw *r) {
  for (int i = 0; i < r->nmaps; i++)
    munmap(r->map[i], r->maplen[i]);
  r->nmaps = 0;
  if (r->fd >= 0)
    close(r->fd);
  r->fd = -1;
  shardd__frame_reader_free(&r->rd);
}

void test_raw_send_bytes(test_raw *r, const void *p, size_t n) {
  const char *c = p;
  while (n > 0) {
    ssize_t w = send(r->fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    cr_assert(w > 0, "send: %s", strerror(errno));
    c += w;
    n -= (size_t)w;
  }
}

uint64_t test_raw_send(test_raw *r, Shardwire__Request *req) {
  if (req->seq == 0)
    req->seq = ++r->seq;
  size_t n = shardwire__request__get_packed_size(req);
  uint8_t *buf = malloc(SHARDD_FRAME_HEADER + n);
  cr_assert_not_null(buf);
  shardd__frame_put_header(buf, (uint32_t)n);
  shardwire__request__pack(req, buf + SHARDD_FRAME_HEADER);
  test_raw_send_bytes(r, buf, SHARDD_FRAME_HEADER + n);
  free(buf);
  return req->seq;
}

Shardwire__Response *test_raw_recv_fd(test_raw *r, int *fd) {
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  char err[256];
  if (fd)
    *fd = -1;
  shardd_err rc = shardd__frame_recv(r->fd, &r->rd, &payload, &len, fds, 4,
                                     &nfds, err, sizeof err);
  for (int i = 0; i < nfds; i++) {
    if (fd && *fd < 0)
      *fd = fds[i];
    else
      close(fds[i]);
  }
  if (rc == SHARDD_E_CLOSED)
    return NULL;
  cr_assert_eq(rc, SHARDD_OK, "receiving a reply: %s", err);
  Shardwire__Response *resp = shardwire__response__unpack(NULL, len, payload);
  cr_assert_not_null(resp, "the daemon's reply does not decode");
  return resp;
}

Shardwire__Response *test_raw_recv(test_raw *r) {
  return test_raw_recv_fd(r, NULL);
}

int test_raw_wait_eof(test_raw *r) {
  for (;;) {
    char buf[4096];
    ssize_t n = recv(r->fd, buf, sizeof buf, 0);
    if (n == 0)
      return 1;
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return errno == ECONNRESET;
  }
}

Shardwire__Response *test_raw_expect(test_raw *r, uint64_t seq,
                                     shardd_err code) {
  Shardwire__Response *resp = test_raw_recv(r);
  cr_assert_not_null(resp, "connection closed waiting for reply %llu",
                     (unsigned long long)seq);
  cr_assert_eq(resp->seq, seq, "reply seq %llu, expected %llu",
               (unsigned long long)resp->seq, (unsigned long long)seq);
  cr_assert_eq((int)resp->code, (int)code, "reply %llu: %s (%s), expected %s",
               (unsigned long long)seq, shardd_err_name((shardd_err)resp->code),
               resp->message ? resp->message : "", shardd_err_name(code));
  return resp;
}

uint64_t test_raw_send_hello(test_raw *r, uint32_t version,
                             const char *job, uint32_t rank,
                             uint32_t world) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Hello h = SHARDWIRE__HELLO__INIT;
  h.protocol_version = version;
  if (job) {
    h.job = (char *)job;
    h.has_rank = h.has_world = 1;
    h.rank = rank;
    h.world = world;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  return test_raw_send(r, &req);
}

void test_raw_hello(test_raw *r, const char *job, uint32_t rank,
                    uint32_t world) {
  uint64_t seq = test_raw_send_hello(r, SHARDD_PROTOCOL_VERSION, job, rank, world);
  shardwire__response__free_unpacked(test_raw_expect(r, seq, SHARDD_OK), NULL);
}

uint64_t test_raw_send_ping(test_raw *r) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping p = SHARDWIRE__PING__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_PING;
  req.ping = &p;
  return test_raw_send(r, &req);
}

void test_raw_sync(test_raw *r) {
  uint64_t seq = test_raw_send_ping(r);
  Shardwire__Response *resp = test_raw_expect(r, seq, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
}

void test_raw_sync_keep(test_raw *r, Shardwire__Response **early) {
  *early = NULL;
  uint64_t seq = test_raw_send_ping(r);
  for (;;) {
    Shardwire__Response *resp = test_raw_recv(r);
    cr_assert_not_null(resp, "connection closed waiting for a Pong");
    if (resp->seq == seq) {
      cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
      shardwire__response__free_unpacked(resp, NULL);
      return;
    }
    cr_assert_null(*early, "two replies before the Pong");
    *early = resp;
  }
}

uint64_t test_raw_send_gather(test_raw *r, uint64_t buf) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buf;
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  return test_raw_send(r, &req);
}

uint64_t test_raw_send_scatter(test_raw *r, uint64_t buf,
                               shardd_reduce_op op) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Scatter s = SHARDWIRE__SCATTER__INIT;
  s.buffer = buf;
  s.has_op = 1;
  s.op = (Shardwire__ReduceOp)op;
  req.body_case = SHARDWIRE__REQUEST__BODY_SCATTER;
  req.scatter = &s;
  return test_raw_send(r, &req);
}

uint64_t test_raw_send_step(test_raw *r, uint64_t opt) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  req.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  req.step = &st;
  return test_raw_send(r, &req);
}

uint64_t test_raw_send_checkpoint_wait(test_raw *r, const char *job,
                                       const char *ck, double wait_s) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = (char *)ck;
  cp.job = (char *)job;
  if (wait_s > 0) {
    cp.has_wait_s = 1;
    cp.wait_s = wait_s;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  return test_raw_send(r, &req);
}

void test_raw_register_buffer(test_raw *r, const char *name,
                              shardd_dtype dtype, uint64_t numel,
                              shardd_buffer_info *out) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterBuffer rb = SHARDWIRE__REGISTER_BUFFER__INIT;
  rb.name = (char *)name;
  rb.dtype = (Shardwire__DType)dtype;
  rb.numel = numel;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  uint64_t seq = test_raw_send(r, &req);
  int fd;
  Shardwire__Response *resp = test_raw_recv_fd(r, &fd);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->code, SHARDWIRE__STATUS_CODE__OK, "register %s: %s", name,
               resp->message ? resp->message : "");
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_BUFFER);
  cr_assert(fd >= 0, "no descriptor with the buffer reply");
  cr_assert_lt(r->nmaps, 8);
  const Shardwire__BufferReply *br = resp->buffer;
  void *base = mmap(NULL, br->block_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, 0);
  close(fd);
  cr_assert(base != MAP_FAILED, "mmap: %s", strerror(errno));
  r->map[r->nmaps] = base;
  r->maplen[r->nmaps++] = br->block_bytes;
  memset(out, 0, sizeof *out);
  out->id = br->id;
  out->dtype = (shardd_dtype)br->dtype;
  out->numel = br->numel;
  out->padded_numel = br->padded_numel;
  out->shard_numel = br->shard_numel;
  out->world = br->world;
  out->rank = br->rank;
  out->device = br->device;
  out->created = br->created;
  out->shard = (char *)base + br->shard_offset;
  out->gather = (char *)base + br->gather_offset;
  out->grad = (char *)base + br->grad_offset;
  out->reduced = (char *)base + br->reduced_offset;
  shardwire__response__free_unpacked(resp, NULL);
}

char *test_slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return strdup("");
  size_t cap = 4096, n = 0;
  char *s = malloc(cap);
  int ch;
  while (s && (ch = fgetc(f)) != EOF) {
    if (n + 1 >= cap)
      s = realloc(s, cap *= 2);
    if (s)
      s[n++] = (char)ch;
  }
  fclose(f);
  if (s)
    s[n] = '\0';
  return s;
}

int test_shardctl(const char *env, const char *args, char **out,
                  char **err) {
  char dir[] = "/tmp/shardctl-test-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char o[64], e[64], cmd[2048];
  snprintf(o, sizeof o, "%s/out", dir);
  snprintf(e, sizeof e, "%s/err", dir);
  snprintf(cmd, sizeof cmd, "%s %s %s >%s 2>%s", env ? env : "",
           test_bin("SHARDCTL_BIN", "build/shardctl"), args, o, e);
  int st = system(cmd);
  if (out)
    *out = test_slurp(o);
  if (err)
    *err = test_slurp(e);
  unlink(o);
  unlink(e);
  rmdir(dir);
  cr_assert(st != -1 && WIFEXITED(st), "shardctl did not exit: %s", cmd);
  return WEXITSTATUS(st);
}

void tj_free(tj *v) {
  if (v == NULL)
    return;
  for (size_t i = 0; i < v->n; i++) {
    tj_free(v->kids[i]);
    if (v->keys)
      free(v->keys[i]);
  }
  free(v->kids);
  free(v->keys);
  free(v->str);
  free(v);
}

static void tj_ws(const char **p) {
  while (**p == ' ' || **p == '\n' || **p == '\t' || **p == '\r')
    (*p)++;
}

static char *tj_parse_str(const char **p) {
  if (**p != '"')
    return NULL;
  (*p)++;
  size_t cap = 16, n = 0;
  char *s = malloc(cap);
  for (;;) {
    char c = *(*p)++;
    if (c == '\0' || (unsigned char)c < 0x20) {
      free(s);
      return NULL;
    }
    if (c == '"')
      break;
    if (c == '\\') {
      char e = *(*p)++;
      switch (e) {
      case '"': case '\\': case '/': c = e; break;
      case 'n': c = '\n'; break;
      case 't': c = '\t'; break;
      case 'r': c = '\r'; break;
      case 'b': c = '\b'; break;
      case 'f': c = '\f'; break;
      case 'u': {
        unsigned v = 0;
        for (int i = 0; i < 4; i++) {
          char h = *(*p)++;
          v <<= 4;
          if (h >= '0' && h <= '9') v |= (unsigned)(h - '0');
          else if (h >= 'a' && h <= 'f') v |= (unsigned)(h - 'a' + 10);
          else if (h >= 'A' && h <= 'F') v |= (unsigned)(h - 'A' + 10);
          else { free(s); return NULL; }
        }
        c = v < 0x80 ? (char)v : '?'; /* tests only need ASCII */
        break;
      }
      default:
        free(s);
        return NULL;
      }
    }
    if (n + 2 >= cap)
      s = realloc(s, cap *= 2);
    s[n++] = c;
  }
  s[n] = '\0';
  return s;
}

static tj *tj_value(const char **p, int depth) {
  tj_ws(p);
  if (depth > 32)
    return NULL;
  tj *v = calloc(1, sizeof *v);
  if (**p == '{' || **p == '[') {
    int obj = **p == '{';
    v->kind = obj ? TJ_OBJ : TJ_ARR;
    (*p)++;
    tj_ws(p);
    if (**p == (obj ? '}' : ']')) {
      (*p)++;
      return v;
    }
    for (;;) {
      char *key = NULL;
      if (obj) {
        tj_ws(p);
        key = tj_parse_str(p);
        tj_ws(p);
        if (key == NULL || **p != ':') {
          free(key);
          tj_free(v);
          return NULL;
        }
        (*p)++;
      }
      tj *kid = tj_value(p, depth + 1);
      if (kid == NULL) {
        free(key);
        tj_free(v);
        return NULL;
      }
      v->kids = realloc(v->kids, (v->n + 1) * sizeof *v->kids);
      if (obj)
        v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
      v->kids[v->n] = kid;
      if (obj)
        v->keys[v->n] = key;
      v->n++;
      tj_ws(p);
      if (**p == ',') {
        (*p)++;
        continue;
      }
      if (**p == (obj ? '}' : ']')) {
        (*p)++;
        return v;
      }
      tj_free(v);
      return NULL;
    }
  }
  if (**p == '"') {
    v->kind = TJ_STR;
    if ((v->str = tj_parse_str(p)) == NULL) {
      tj_free(v);
      return NULL;
    }
    return v;
  }
  if (!strncmp(*p, "true", 4) || !strncmp(*p, "false", 5)) {
    v->kind = TJ_BOOL;
    v->boolean = **p == 't';
    *p += v->boolean ? 4 : 5;
    return v;
  }
  if (!strncmp(*p, "null", 4)) {
    v->kind = TJ_NULL;
    *p += 4;
    return v;
  }
  /* number: -?digits(.digits)?([eE][+-]?digits)? */
  const char *s = *p;
  if (*s == '-')
    s++;
  if (!(*s >= '0' && *s <= '9')) {
    tj_free(v);
    return NULL;
  }
  char *end;
  v->kind = TJ_NUM;
  v->num = strtod(*p, &end);
  *p = end;
  return v;
}

tj *tj_parse(const char *text) {
  const char *p = text;
  tj *v = tj_value(&p, 0);
  if (v == NULL)
    return NULL;
  tj_ws(&p);
  if (*p != '\0') {
    tj_free(v);
    return NULL;
  }
  return v;
}

const tj *tj_get(const tj *o, const char *key) {
  if (o == NULL || o->kind != TJ_OBJ)
    return NULL;
  const tj *hit = NULL;
  for (size_t i = 0; i < o->n; i++)
    if (!strcmp(o->keys[i], key)) {
      cr_assert_null(hit, "JSON object has key \"%s\" twice", key);
      hit = o->kids[i];
    }
  return hit;
}

const tj *tj_need(const tj *o, const char *key, tj_kind kind) {
  const tj *v = tj_get(o, key);
  cr_assert_not_null(v, "JSON: no key \"%s\"", key);
  cr_assert_eq(v->kind, kind, "JSON: \"%s\" has kind %d, expected %d", key,
               (int)v->kind, (int)kind);
  return v;
}
