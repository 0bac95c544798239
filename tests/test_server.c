/* test_server.c — the daemon's loop against a real shardd on a temporary
 * socket: status over shardctl --json, clean SIGTERM shutdown, many clients
 * at once, malformed / oversized frames, the Hello handshake's refusals,
 * descriptors sent by a client, the client limit. Expected values come from
 * what the test itself set up (flags, connections), never from the daemon. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <pthread.h>

#include "harness.h"

static test_daemon d;

static void stop_daemon(void) { test_daemon_finish(&d); }

static void start_default(void) {
  const char *args[] = {"--devices", "3", NULL};
  test_daemon_start(&d, args);
}

/* A libshardd control session must get a status reply now. */
static void expect_served(void) {
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  char *s = NULL;
  cr_assert_eq(shardd_status_json(c, &s), SHARDD_OK, "%s", shardd_last_error(c));
  tj *j = tj_parse(s);
  cr_assert_not_null(j, "status is not JSON: %s", s);
  tj_free(j);
  shardd_free(s);
  shardd_close(c);
}

static tj *shardctl_status(void) {
  char args[256], *out, *err;
  snprintf(args, sizeof args, "--socket %s status --json", d.sock);
  int rc = test_shardctl(NULL, args, &out, &err);
  cr_assert_eq(rc, 0, "shardctl status exited %d: %s", rc, err);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "shardctl status --json printed no valid JSON: %s", out);
  free(out);
  free(err);
  return j;
}

/* ---- status and shutdown ---------------------------------------------- */

Test(server, status_json_then_sigterm, .init = start_default, .fini = stop_daemon) {
  tj *j = shardctl_status();
  cr_assert_eq(j->kind, TJ_OBJ);
  cr_assert_str_eq(tj_need(j, "version", TJ_STR)->str, SHARDD_VERSION);
  cr_assert_eq(tj_need(j, "protocol", TJ_NUM)->num, SHARDD_PROTOCOL_VERSION);
  cr_assert_eq(tj_need(j, "pid", TJ_NUM)->num, (double)d.pid);
  cr_assert_str_eq(tj_need(j, "backend", TJ_STR)->str, "host");
  cr_assert_str_eq(tj_need(j, "socket", TJ_STR)->str, d.sock);
  cr_assert_geq(tj_need(j, "uptime_s", TJ_NUM)->num, 0.0);
  /* shardctl's own session is the one client */
  cr_assert_eq(tj_need(j, "clients", TJ_NUM)->num, 1.0);
  const tj *devs = tj_need(j, "devices", TJ_ARR);
  cr_assert_eq(devs->n, 3, "--devices 3 but %zu devices listed", devs->n);
  for (size_t i = 0; i < devs->n; i++) {
    const tj *dv = devs->kids[i];
    cr_assert_eq(tj_need(dv, "index", TJ_NUM)->num, (double)i);
    double cap = tj_need(dv, "capacity_bytes", TJ_NUM)->num;
    double used = tj_need(dv, "used_bytes", TJ_NUM)->num;
    double fr = tj_need(dv, "free_bytes", TJ_NUM)->num;
    cr_assert_eq(used, 0.0, "device %zu has %g bytes used with no job", i, used);
    cr_assert_gt(cap, 0.0);
    cr_assert_eq(fr, cap - used);
    tj_need(dv, "name", TJ_STR);
  }
  cr_assert_eq(tj_need(j, "jobs", TJ_ARR)->n, 0);
  tj_free(j);

  /* One job with two ranks connected and one buffer of 1000 fp32. */
  shardd_client_t *r0 = test_connect(&d, "alpha", 0, 2);
  shardd_client_t *r1 = test_connect(&d, "alpha", 1, 2);
  shardd_buffer_info b0, b1;
  cr_assert_eq(shardd_buffer_register(r0, "w", SHARDD_DTYPE_FP32, 1000, &b0),
               SHARDD_OK, "%s", shardd_last_error(r0));
  cr_assert_eq(shardd_buffer_register(r1, "w", SHARDD_DTYPE_FP32, 1000, &b1),
               SHARDD_OK, "%s", shardd_last_error(r1));
  cr_assert(b0.created && !b1.created);
  j = shardctl_status();
  cr_assert_eq(tj_need(j, "clients", TJ_NUM)->num, 3.0);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  const tj *job = jobs->kids[0];
  cr_assert_str_eq(tj_need(job, "name", TJ_STR)->str, "alpha");
  cr_assert_eq(tj_need(job, "world", TJ_NUM)->num, 2.0);
  cr_assert_eq(tj_need(job, "clients", TJ_NUM)->num, 2.0);
  cr_assert_eq(tj_need(job, "buffers", TJ_NUM)->num, 1.0);
  cr_assert_eq(tj_need(job, "views", TJ_NUM)->num, 0.0);
  cr_assert_eq(tj_need(job, "collectives_in_flight", TJ_NUM)->num, 0.0);
  cr_assert_geq(tj_need(job, "bytes", TJ_NUM)->num, 2 * 500 * 4 * 3.0,
                "two ranks' shard + gather + grad areas are resident");
  cr_assert_eq(tj_need(job, "optimizers", TJ_ARR)->n, 0);
  /* ranks 0 and 1 live on devices 0 and 1; device 2 holds nothing */
  devs = tj_need(j, "devices", TJ_ARR);
  cr_assert_gt(tj_need(devs->kids[0], "used_bytes", TJ_NUM)->num, 0.0);
  cr_assert_gt(tj_need(devs->kids[1], "used_bytes", TJ_NUM)->num, 0.0);
  cr_assert_eq(tj_need(devs->kids[2], "used_bytes", TJ_NUM)->num, 0.0);
  tj_free(j);

  /* The text form is key: value lines. */
  char args[256], *out;
  snprintf(args, sizeof args, "--socket %s status", d.sock);
  cr_assert_eq(test_shardctl(NULL, args, &out, NULL), 0);
  cr_assert_not_null(strstr(out, "version: " SHARDD_VERSION "\n"), "%s", out);
  cr_assert_not_null(strstr(out, "backend: host\n"), "%s", out);
  cr_assert_not_null(strstr(out, "devices: 3\n"), "%s", out);
  cr_assert_not_null(strstr(out, "job alpha: world 2 clients 2 buffers 1"), "%s", out);
  free(out);

  shardd_close(r0);
  shardd_close(r1);
  struct stat st;
  cr_assert_eq(stat(d.sock, &st), 0);
  int code = test_daemon_terminate(&d);
  cr_assert_eq(code, 0, "shardd exited %d on SIGTERM", code);
  cr_assert_neq(stat(d.sock, &st), 0, "socket %s still exists after SIGTERM", d.sock);
  cr_assert_eq(errno, ENOENT);
}

/* SIGTERM while ranks are connected and one waits in a collective. */
Test(server, sigterm_with_clients_and_pending_collective, .init = start_default,
     .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "busy", 0, 2);
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "x", SHARDD_DTYPE_FP32, 64, &b);
  test_raw_send_gather(&r, b.id);
  test_raw_sync(&r);
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  int code = test_daemon_terminate(&d);
  cr_assert_eq(code, 0, "shardd exited %d on SIGTERM", code);
  struct stat st;
  cr_assert_neq(stat(d.sock, &st), 0, "socket file left behind");
  shardd_close(c);
  test_raw_close(&r);
}

/* ---- many clients ------------------------------------------------------ */

#define NCLIENTS 64

typedef struct {
  pthread_barrier_t *bar;
  shardd_err rc_connect, rc_status;
  char err[512];
  double clients_seen;
  int json_ok;
} client_arg;

static void *client_main(void *p) {
  client_arg *a = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  shardd_client_t *c = NULL;
  pthread_barrier_wait(a->bar); /* all connect at once */
  a->rc_connect = shardd_connect(d.sock, &o, &c, a->err, sizeof a->err);
  pthread_barrier_wait(a->bar); /* all 64 are connected now */
  if (a->rc_connect == SHARDD_OK) {
    char *s = NULL;
    a->rc_status = shardd_status_json(c, &s);
    if (a->rc_status == SHARDD_OK) {
      tj *j = tj_parse(s);
      a->json_ok = j != NULL;
      const tj *n = tj_get(j, "clients");
      a->clients_seen = n && n->kind == TJ_NUM ? n->num : -1;
      tj_free(j);
    } else {
      snprintf(a->err, sizeof a->err, "%s", shardd_last_error(c));
    }
    shardd_free(s);
  }
  pthread_barrier_wait(a->bar); /* nobody leaves before all are answered */
  shardd_close(c);
  return NULL;
}

Test(server, sixty_four_clients_at_once, .init = start_default, .fini = stop_daemon) {
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, NCLIENTS);
  pthread_t th[NCLIENTS];
  static client_arg args[NCLIENTS];
  for (int i = 0; i < NCLIENTS; i++) {
    memset(&args[i], 0, sizeof args[i]);
    args[i].bar = &bar;
    cr_assert_eq(pthread_create(&th[i], NULL, client_main, &args[i]), 0);
  }
  for (int i = 0; i < NCLIENTS; i++)
    pthread_join(th[i], NULL);
  pthread_barrier_destroy(&bar);
  for (int i = 0; i < NCLIENTS; i++) {
    cr_assert_eq(args[i].rc_connect, SHARDD_OK, "client %d: connect: %s", i, args[i].err);
    cr_assert_eq(args[i].rc_status, SHARDD_OK, "client %d: status: %s", i, args[i].err);
    cr_assert(args[i].json_ok, "client %d: status JSON does not parse", i);
    cr_assert_eq(args[i].clients_seen, (double)NCLIENTS,
                 "client %d saw %g clients, all %d were connected", i,
                 args[i].clients_seen, NCLIENTS);
  }
  /* all gone again */
  for (int tries = 0;; tries++) {
    tj *j = shardctl_status();
    double n = tj_need(j, "clients", TJ_NUM)->num;
    tj_free(j);
    if (n == 1.0)
      break;
    cr_assert_lt(tries, 500, "%g clients still counted after all closed", n);
    test_sleep_ms(10);
  }
}

/* ---- malformed frames --------------------------------------------------- */

typedef struct {
  char name[32];
  unsigned char bytes[32];
  size_t len;
} bad_payload;

ParameterizedTestParameters(server, malformed_frame) {
  static bad_payload cases[] = {
      {"unterminated varints", {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                0xff, 0xff, 0xff, 0xff}, 12},
      {"empty (seq missing)", {0}, 0},
      {"wire type 7", {0x0f, 0x01}, 2},
      {"length past the end", {0x08, 0x01, 0x5a, 0x7f, 0x00}, 5},
      {"text", "GET / HTTP/1.1\r\n\r\n", 18},
  };
  return cr_make_param_array(bad_payload, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(bad_payload *bp, server, malformed_frame, .init = start_default,
                  .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  unsigned char frame[64];
  shardd__frame_put_header(frame, (uint32_t)bp->len);
  memcpy(frame + SHARDD_FRAME_HEADER, bp->bytes, bp->len);
  test_raw_send_bytes(&r, frame, SHARDD_FRAME_HEADER + bp->len);
  Shardd__Response *resp = test_raw_recv(&r);
  cr_assert_not_null(resp, "%s: connection closed instead of an error reply", bp->name);
  cr_assert_eq(resp->code, SHARDD__STATUS_CODE__E_PROTOCOL, "%s: got %s", bp->name,
               shardd_err_name((shardd_err)resp->code));
  cr_assert_eq(resp->seq, 0);
  cr_assert_not_null(resp->message);
  cr_assert_neq(resp->message[0], '\0');
  shardd__response__free_unpacked(resp, NULL);
  /* another client is served meanwhile */
  expect_served();
  /* and this connection still works */
  test_raw_sync(&r);
  test_raw_close(&r);
}

/* An unknown body (a field number from the future) is answered, not fatal. */
Test(server, unknown_body_is_an_error_reply, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "j", 0, 1);
  /* seq = 7, field 99 (length-delimited, empty): unknown to this daemon */
  unsigned char frame[] = {0, 0, 0, 0, 0x08, 0x07, 0x9a, 0x06, 0x00};
  shardd__frame_put_header(frame, sizeof frame - SHARDD_FRAME_HEADER);
  test_raw_send_bytes(&r, frame, sizeof frame);
  Shardd__Response *resp = test_raw_recv(&r);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, 7);
  cr_assert_eq(resp->code, SHARDD__STATUS_CODE__E_PROTOCOL, "got %s",
               shardd_err_name((shardd_err)resp->code));
  shardd__response__free_unpacked(resp, NULL);
  test_raw_sync(&r);
  test_raw_close(&r);
}

/* A frame split across many writes and several frames in one write. */
Test(server, split_and_concatenated_frames, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__Ping p = SHARDD__PING__INIT;
  uint8_t payload[300];
  for (size_t i = 0; i < sizeof payload; i++)
    payload[i] = (uint8_t)(i * 7);
  p.has_payload = 1;
  p.payload.data = payload;
  p.payload.len = sizeof payload;
  req.body_case = SHARDD__REQUEST__BODY_PING;
  req.ping = &p;
  uint8_t buf[3][512];
  size_t n[3];
  for (int k = 0; k < 3; k++) {
    req.seq = 100 + (uint64_t)k;
    n[k] = shardd__request__get_packed_size(&req);
    shardd__frame_put_header(buf[k], (uint32_t)n[k]);
    shardd__request__pack(&req, buf[k] + SHARDD_FRAME_HEADER);
    n[k] += SHARDD_FRAME_HEADER;
  }
  /* frame 100 one byte at a time */
  for (size_t i = 0; i < n[0]; i++) {
    test_raw_send_bytes(&r, buf[0] + i, 1);
    if (i % 50 == 0)
      test_sleep_ms(1);
  }
  /* frames 101 and 102 in one write */
  uint8_t both[1024];
  memcpy(both, buf[1], n[1]);
  memcpy(both + n[1], buf[2], n[2]);
  test_raw_send_bytes(&r, both, n[1] + n[2]);
  for (int k = 0; k < 3; k++) {
    Shardd__Response *resp = test_raw_expect(&r, 100 + (uint64_t)k, SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDD__RESPONSE__BODY_PONG);
    cr_assert(resp->pong->has_payload);
    cr_assert_eq(resp->pong->payload.len, sizeof payload);
    cr_assert_eq(memcmp(resp->pong->payload.data, payload, sizeof payload), 0);
    shardd__response__free_unpacked(resp, NULL);
  }
  test_raw_close(&r);
}

typedef struct {
  uint32_t len;
} big_len;

ParameterizedTestParameters(server, oversized_frame) {
  static big_len cases[] = {{SHARDD_MAX_FRAME + 1}, {0x7fffffffu}, {0xffffffffu}};
  return cr_make_param_array(big_len, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(big_len *bl, server, oversized_frame, .init = start_default,
                  .fini = stop_daemon) {
  /* a rank of a job that has a buffer, so there is state to keep */
  shardd_client_t *keep = test_connect(&d, "kept", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(keep, "b", SHARDD_DTYPE_FP32, 16, &b), SHARDD_OK);
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  unsigned char hdr[SHARDD_FRAME_HEADER + 16];
  shardd__frame_put_header(hdr, bl->len);
  memset(hdr + SHARDD_FRAME_HEADER, 0x08, 16);
  test_raw_send_bytes(&r, hdr, sizeof hdr);
  Shardd__Response *resp = test_raw_recv(&r);
  cr_assert_not_null(resp, "closed without an E_FRAME_TOO_LARGE reply");
  cr_assert_eq(resp->code, SHARDD__STATUS_CODE__E_FRAME_TOO_LARGE, "got %s",
               shardd_err_name((shardd_err)resp->code));
  cr_assert_not_null(resp->message);
  shardd__response__free_unpacked(resp, NULL);
  cr_assert(test_raw_wait_eof(&r), "the connection stays open after an oversized frame");
  test_raw_close(&r);
  /* others keep being served, new and old */
  expect_served();
  cr_assert_eq(shardd_gather(keep, b.id), SHARDD_OK, "%s", shardd_last_error(keep));
  shardd_close(keep);
}

/* ---- handshake ----------------------------------------------------------- */

typedef struct {
  char name[16];
  int body; /* Shardd__Request__BodyCase */
} early_req;

ParameterizedTestParameters(server, request_before_hello) {
  static early_req cases[] = {
      {"status", SHARDD__REQUEST__BODY_STATUS},
      {"ping", SHARDD__REQUEST__BODY_PING},
      {"inspect", SHARDD__REQUEST__BODY_INSPECT},
      {"register", SHARDD__REQUEST__BODY_REGISTER_BUFFER},
      {"gather", SHARDD__REQUEST__BODY_GATHER},
      {"step", SHARDD__REQUEST__BODY_STEP},
  };
  return cr_make_param_array(early_req, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(early_req *er, server, request_before_hello, .init = start_default,
                  .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__StatusRequest st = SHARDD__STATUS_REQUEST__INIT;
  Shardd__Ping ping = SHARDD__PING__INIT;
  Shardd__Inspect in = SHARDD__INSPECT__INIT;
  Shardd__RegisterBuffer rb = SHARDD__REGISTER_BUFFER__INIT;
  Shardd__Gather g = SHARDD__GATHER__INIT;
  Shardd__Step stp = SHARDD__STEP__INIT;
  rb.name = "x";
  rb.dtype = SHARDD__DTYPE__FP32;
  rb.numel = 4;
  g.buffer = 1;
  stp.optimizer = 1;
  in.has_id = 1;
  in.id = 1;
  req.body_case = (Shardd__Request__BodyCase)er->body;
  switch (er->body) {
  case SHARDD__REQUEST__BODY_STATUS: req.status = &st; break;
  case SHARDD__REQUEST__BODY_PING: req.ping = &ping; break;
  case SHARDD__REQUEST__BODY_INSPECT: req.inspect = &in; break;
  case SHARDD__REQUEST__BODY_REGISTER_BUFFER: req.register_buffer = &rb; break;
  case SHARDD__REQUEST__BODY_GATHER: req.gather = &g; break;
  default: req.step = &stp; break;
  }
  uint64_t seq = test_raw_send(&r, &req);
  Shardd__Response *resp = test_raw_expect(&r, seq, SHARDD_E_STATE);
  cr_assert_not_null(strstr(resp->message, "Hello"), "%s: message \"%s\"", er->name,
                     resp->message);
  shardd__response__free_unpacked(resp, NULL);
  /* the session may still say Hello and then be served */
  test_raw_hello(&r, NULL, 0, 1);
  test_raw_sync(&r);
  test_raw_close(&r);
}

typedef struct {
  uint32_t version;
} proto_ver;

ParameterizedTestParameters(server, wrong_protocol_version) {
  static proto_ver cases[] = {{0}, {SHARDD_PROTOCOL_VERSION + 1}, {0xffffffffu}};
  return cr_make_param_array(proto_ver, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(proto_ver *pv, server, wrong_protocol_version, .init = start_default,
                  .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  uint64_t seq = test_raw_send_hello(&r, pv->version, "j", 0, 1);
  Shardd__Response *resp = test_raw_expect(&r, seq, SHARDD_E_VERSION);
  char want[32];
  snprintf(want, sizeof want, "%u", pv->version);
  cr_assert_not_null(strstr(resp->message, want), "message \"%s\" does not name %s",
                     resp->message, want);
  shardd__response__free_unpacked(resp, NULL);
  /* refused Hello leaves the session before Hello */
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__StatusRequest st = SHARDD__STATUS_REQUEST__INIT;
  req.body_case = SHARDD__REQUEST__BODY_STATUS;
  req.status = &st;
  seq = test_raw_send(&r, &req);
  shardd__response__free_unpacked(test_raw_expect(&r, seq, SHARDD_E_STATE), NULL);
  /* and the failed Hello did not claim rank 0 of job j */
  shardd_client_t *c = test_connect(&d, "j", 0, 1);
  shardd_close(c);
  test_raw_close(&r);
}

Test(server, hello_twice_is_refused, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "j", 0, 2);
  uint64_t seq = test_raw_send_hello(&r, SHARDD_PROTOCOL_VERSION, "j", 1, 2);
  shardd__response__free_unpacked(test_raw_expect(&r, seq, SHARDD_E_STATE), NULL);
  /* rank 1 is still free: the second Hello claimed nothing */
  shardd_client_t *c = test_connect(&d, "j", 1, 2);
  shardd_close(c);
  test_raw_close(&r);
}

typedef struct {
  uint32_t rank, world;
  int code;
} bad_rank;

ParameterizedTestParameters(server, rank_out_of_range) {
  static bad_rank cases[] = {
      {4, 4, SHARDD_E_RANGE}, {5, 4, SHARDD_E_RANGE}, {1, 1, SHARDD_E_RANGE},
      {0xffffffffu, 2, SHARDD_E_RANGE}, {0, 0, SHARDD_E_RANGE}};
  return cr_make_param_array(bad_rank, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(bad_rank *br, server, rank_out_of_range, .init = start_default,
                  .fini = stop_daemon) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "ranks";
  o.rank = br->rank;
  o.world = br->world;
  shardd_client_t *c = NULL;
  char err[512] = "";
  shardd_err rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, (shardd_err)br->code, "rank %u world %u: %s (%s)", br->rank,
               br->world, shardd_err_name(rc), err);
  cr_assert_null(c);
  cr_assert_neq(err[0], '\0', "no reason given");
  expect_served();
}

Test(server, same_rank_twice, .init = start_default, .fini = stop_daemon) {
  shardd_client_t *a = test_connect(&d, "dup", 1, 2);
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "dup";
  o.rank = 1;
  o.world = 2;
  shardd_client_t *b = NULL;
  char err[512] = "";
  shardd_err rc = shardd_connect(d.sock, &o, &b, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_STATE, "second rank 1: %s (%s)", shardd_err_name(rc), err);
  cr_assert_not_null(strstr(err, "rank 1"), "message \"%s\" does not name the rank", err);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)getpid());
  cr_assert_not_null(strstr(err, pid), "message \"%s\" does not name the holder", err);
  /* the first connection is unaffected */
  cr_assert_eq(shardd_ping(a), SHARDD_OK, "%s", shardd_last_error(a));
  /* a world mismatch for the same job is refused too */
  o.rank = 0;
  o.world = 3;
  rc = shardd_connect(d.sock, &o, &b, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_MISMATCH, "world 3 for a world-2 job: %s (%s)",
               shardd_err_name(rc), err);
  /* once the holder leaves, the rank can be taken again */
  shardd_close(a);
  o.rank = 1;
  o.world = 2;
  for (int tries = 0;; tries++) {
    rc = shardd_connect(d.sock, &o, &b, err, sizeof err);
    if (rc == SHARDD_OK)
      break;
    cr_assert_eq(rc, SHARDD_E_STATE, "%s", err);
    cr_assert_lt(tries, 500, "rank 1 never freed after its holder closed");
    test_sleep_ms(10);
  }
  shardd_close(b);
}

Test(server, control_session_cannot_register, .init = start_default, .fini = stop_daemon) {
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  shardd_buffer_info b;
  shardd_err rc = shardd_buffer_register(c, "x", SHARDD_DTYPE_FP32, 16, &b);
  cr_assert_eq(rc, SHARDD_E_STATE, "got %s: %s", shardd_err_name(rc), shardd_last_error(c));
  cr_assert_not_null(strstr(shardd_last_error(c), "control session"), "%s",
                     shardd_last_error(c));
  cr_assert_eq(shardd_gather(c, 1), SHARDD_E_STATE);
  uint64_t id;
  cr_assert_eq(shardd_view_register(c, 1, "v", 0, 1, NULL, 0, &id), SHARDD_E_STATE);
  /* status still works on it */
  char *s;
  cr_assert_eq(shardd_status_text(c, &s), SHARDD_OK);
  shardd_free(s);
  shardd_close(c);
}

/* ---- descriptors from a client ------------------------------------------ */

Test(server, client_sending_fd_is_closed, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, NULL, 0, 1);
  /* a valid Ping frame carrying a pipe's descriptor */
  Shardd__Request req = SHARDD__REQUEST__INIT;
  Shardd__Ping ping = SHARDD__PING__INIT;
  req.seq = 42;
  req.body_case = SHARDD__REQUEST__BODY_PING;
  req.ping = &ping;
  uint8_t frame[64];
  size_t n = shardd__request__get_packed_size(&req);
  shardd__frame_put_header(frame, (uint32_t)n);
  shardd__request__pack(&req, frame + SHARDD_FRAME_HEADER);
  int p[2];
  cr_assert_eq(pipe(p), 0);
  union {
    struct cmsghdr align;
    char space[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct iovec iov = {frame, SHARDD_FRAME_HEADER + n};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.space;
  msg.msg_controllen = sizeof ctl.space;
  struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &p[0], sizeof(int));
  cr_assert_eq(sendmsg(r.fd, &msg, MSG_NOSIGNAL), (ssize_t)(SHARDD_FRAME_HEADER + n),
               "sendmsg: %s", strerror(errno));
  close(p[0]);
  Shardd__Response *resp = test_raw_recv(&r);
  cr_assert_not_null(resp, "closed without an error reply");
  cr_assert_eq(resp->code, SHARDD__STATUS_CODE__E_PROTOCOL, "got %s",
               shardd_err_name((shardd_err)resp->code));
  cr_assert_not_null(strstr(resp->message, "descriptor"), "%s", resp->message);
  shardd__response__free_unpacked(resp, NULL);
  /* the ping itself is not answered: the connection closes */
  cr_assert(test_raw_wait_eof(&r), "the connection stays open");
  test_raw_close(&r);
  /* the daemon dropped the descriptor: the pipe's read end is closed, so a
   * write fails with EPIPE once the daemon let go of it */
  signal(SIGPIPE, SIG_IGN);
  int gone = 0;
  for (int tries = 0; tries < 500 && !gone; tries++) {
    gone = write(p[1], "x", 1) < 0 && errno == EPIPE;
    if (!gone)
      test_sleep_ms(10);
  }
  close(p[1]);
  cr_assert(gone, "the daemon still holds the descriptor the client sent");
  expect_served();
}

/* ---- limits and a second daemon ----------------------------------------- */

static void start_limited(void) {
  const char *args[] = {"--max-clients", "2", NULL};
  test_daemon_start(&d, args);
}

Test(server, client_limit, .init = start_limited, .fini = stop_daemon) {
  shardd_client_t *a = test_connect(&d, NULL, 0, 1);
  shardd_client_t *b = test_connect(&d, NULL, 0, 1);
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  shardd_client_t *c = NULL;
  char err[512];
  shardd_err rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_LIMIT, "third client: %s (%s)", shardd_err_name(rc), err);
  cr_assert_not_null(strstr(err, "2"), "%s", err);
  shardd_close(a);
  /* a slot frees up once a client leaves */
  for (int tries = 0;; tries++) {
    rc = shardd_connect(d.sock, &o, &c, err, sizeof err);
    if (rc == SHARDD_OK)
      break;
    cr_assert_eq(rc, SHARDD_E_LIMIT, "%s", err);
    cr_assert_lt(tries, 500);
    test_sleep_ms(10);
  }
  cr_assert_eq(shardd_ping(b), SHARDD_OK);
  shardd_close(b);
  shardd_close(c);
}

Test(server, second_daemon_on_a_live_socket_refuses, .init = start_default,
     .fini = stop_daemon) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --socket %s 2>%s/second.log",
           test_bin("SHARDD_BIN", "build/shardd"), d.sock, d.dir);
  int st = system(cmd);
  cr_assert(WIFEXITED(st));
  cr_assert_eq(WEXITSTATUS(st), 1, "a second daemon exited %d", WEXITSTATUS(st));
  char log[128];
  snprintf(log, sizeof log, "%s/second.log", d.dir);
  char *text = test_slurp(log);
  unlink(log);
  cr_assert_not_null(strstr(text, d.sock), "its error does not name the socket: %s", text);
  free(text);
  /* the first one still serves on its socket */
  expect_served();
}

Test(server, stale_socket_file_is_replaced) {
  /* a socket file nobody listens on, as a crashed daemon leaves */
  char dir[] = "/tmp/shardd-stale-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/s.sock", dir);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  close(fd);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    int nul = open("/dev/null", O_WRONLY);
    dup2(nul, 2);
    execl(test_bin("SHARDD_BIN", "build/shardd"), "shardd", "--socket", path, (char *)NULL);
    _exit(127);
  }
  int up = 0;
  for (int i = 0; i < 500 && !up; i++) {
    up = test_can_connect(path);
    if (!up)
      test_sleep_ms(10);
  }
  kill(pid, SIGTERM);
  int st;
  waitpid(pid, &st, 0);
  unlink(path);
  rmdir(dir);
  cr_assert(up, "shardd did not take over a stale socket file");
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* A job outlives its clients for --job-linger seconds (ranks may come back
 * to their shards), then goes with all its memory. */
static void start_linger(void) {
  const char *args[] = {"--job-linger", "1", NULL};
  test_daemon_start(&d, args);
}

static size_t job_count(void) {
  tj *st = shardctl_status();
  size_t n = tj_need(st, "jobs", TJ_ARR)->n;
  tj_free(st);
  return n;
}

Test(server, job_lingers_then_is_released, .init = start_linger, .fini = stop_daemon) {
  shardd_client_t *c = test_connect(&d, "linger", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  ((float *)b.shard)[3] = 42.0f;
  uint64_t id = b.id;
  shardd_close(c);

  /* Back within the linger time: same buffer, same bytes. */
  test_sleep_ms(200);
  cr_assert_eq(job_count(), 1);
  c = test_connect(&d, "linger", 0, 1);
  cr_assert_eq(shardd_buffer_register(c, "p", SHARDD_DTYPE_FP32, 8, &b), SHARDD_OK);
  cr_assert_eq(b.created, 0);
  cr_assert_eq(b.id, id);
  cr_assert_eq(((float *)b.shard)[3], 42.0f);
  shardd_close(c);

  /* Gone for longer: released, memory and all. */
  int released = 0;
  for (int i = 0; i < 60 && !released; i++) {
    test_sleep_ms(100);
    released = job_count() == 0;
  }
  cr_assert(released, "the job outlived --job-linger 1 by 5 s");
  tj *st = shardctl_status();
  const tj *devs = tj_need(st, "devices", TJ_ARR);
  for (size_t i = 0; i < devs->n; i++)
    cr_assert_eq(tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num, 0);
  tj_free(st);
}

/* A client that pipelines collectives nobody else joins is held to the
 * per-session limit (64): the rest are refused at once with E_LIMIT
 * instead of queueing without bound. */
Test(server, pipelined_collectives_are_bounded, .init = start_default, .fini = stop_daemon) {
  test_raw r;
  test_raw_open(&d, &r);
  test_raw_hello(&r, "bounded", 0, 2); /* rank 1 never comes */
  shardd_buffer_info b;
  test_raw_register_buffer(&r, "p", SHARDD_DTYPE_FP32, 16, &b);
  uint64_t seqs[80];
  for (int i = 0; i < 80; i++)
    seqs[i] = test_raw_send_scatter(&r, b.id, SHARDD_REDUCE_SUM);
  /* The 16 over the limit are answered now; the 64 queued ones are not. */
  for (int i = 64; i < 80; i++) {
    Shardd__Response *resp = test_raw_recv(&r);
    cr_assert_not_null(resp);
    cr_assert_eq(resp->seq, seqs[i]);
    cr_assert_eq(resp->code, SHARDD__STATUS_CODE__E_LIMIT, "%s",
                 resp->message ? resp->message : "");
    cr_assert(strstr(resp->message, "limit 64") != NULL, "%s", resp->message);
    shardd__response__free_unpacked(resp, NULL);
  }
  tj *st = shardctl_status();
  const tj *jobs = tj_need(st, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1);
  cr_assert_eq(tj_need(jobs->kids[0], "collectives_in_flight", TJ_NUM)->num, 64);
  tj_free(st);
  test_raw_close(&r);
}

/* A Hello refused after it created its job leaves nothing behind: the
 * empty job is released like one whose clients left. */
static void start_linger0(void) {
  const char *args[] = {"--job-linger", "0", NULL};
  test_daemon_start(&d, args);
}

Test(server, refused_hello_leaves_no_job, .init = start_linger0, .fini = stop_daemon) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "never";
  o.rank = 5;
  o.world = 2;
  shardd_client_t *c = NULL;
  char err[256];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_E_RANGE, "%s", err);
  cr_assert_eq(job_count(), 0);
}

/* New job names are capped (--max-jobs): lingering jobs count, so a client
 * reconnecting under fresh names cannot grow the daemon without bound. */
static void start_max_jobs(void) {
  const char *args[] = {"--max-jobs", "3", NULL};
  test_daemon_start(&d, args);
}

Test(server, job_count_is_capped, .init = start_max_jobs, .fini = stop_daemon) {
  char err[256];
  for (int i = 0; i < 3; i++) {
    char job[16];
    snprintf(job, sizeof job, "j%d", i);
    shardd_client_t *c = test_connect(&d, job, 0, 1);
    shardd_close(c); /* the job lingers */
  }
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "one-too-many";
  shardd_client_t *c = NULL;
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_E_LIMIT, "%s", err);
  cr_assert(strstr(err, "--max-jobs") != NULL, "%s", err);
  o.job = "j1"; /* an existing job can still be joined */
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_close(c);
}
