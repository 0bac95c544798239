/* test_fmt.c — shardctl's renderings of a Status reply (fmt.c): in the text
 * form every string of the reply is escaped (shardd__escape), not only the
 * names clients chose: the socket path is any bytes --socket was given, and
 * a newline in it forged a line of the report. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "fmt.h"

/* No byte of text is a control byte but a line's end. */
static void expect_plain(const char *text) {
  for (const char *p = text; *p; p++)
    cr_expect(*p == '\n' || ((unsigned char)*p >= 0x20 && *p != 0x7f),
              "control byte 0x%02x in: %s", (unsigned char)*p, text);
}

Test(fmt, status_text_escapes_the_socket_path_and_every_string) {
  Shardwire__StatusReply st = SHARDWIRE__STATUS_REPLY__INIT;
  Shardwire__JobStatus job = SHARDWIRE__JOB_STATUS__INIT;
  Shardwire__NodeStatus node = SHARDWIRE__NODE_STATUS__INIT;
  Shardwire__JobStatus *jobs[1] = {&job};
  Shardwire__NodeStatus *nodes[1] = {&node};
  st.daemon_version = "0.9\x1b[1m";
  st.backend = "host\r";
  st.socket_path = "/run/s\x1b[2J\nclients: 99";
  st.n_jobs = 1;
  st.jobs = jobs;
  job.name = "j";
  job.world = 2;
  job.has_nodes = 1;
  job.nodes = 2;
  job.fabric = "gl\x07oo";
  job.n_node_states = 1;
  job.node_states = nodes;
  node.ranks = 1;
  node.state = "up\nforged";
  char *text = shardd__fmt_status_text(&st);
  cr_assert_not_null(text);
  expect_plain(text);
  cr_expect_not_null(strstr(text, "version: 0.9\\x1b[1m\n"), "%s", text);
  cr_expect_not_null(strstr(text, "backend: host\\x0d\n"), "%s", text);
  cr_expect_not_null(strstr(text, "socket: /run/s\\x1b[2J\\x0aclients: 99\n"), "%s",
                     text);
  cr_expect_null(strstr(text, "\nclients: 99"), "%s", text);
  cr_expect_not_null(strstr(text, " fabric gl\\x07oo\n"), "%s", text);
  cr_expect_not_null(strstr(text, " up\\x0aforged\n"), "%s", text);
  free(text);
}

Test(fmt, inspect_text_escapes_its_kind) {
  Shardwire__InspectReply ir = SHARDWIRE__INSPECT_REPLY__INIT;
  ir.id = 7;
  ir.kind = "view\n";
  ir.name = "n";
  ir.job = "j";
  char *text = shardd__fmt_inspect_text(&ir);
  cr_assert_not_null(text);
  expect_plain(text);
  cr_expect_not_null(strstr(text, "kind: view\\x0a\n"), "%s", text);
  free(text);
}

/* A page from --from N says the jobs it lists are not all there are: past
 * the end it said "jobs: 0" while jobs existed. */
Test(fmt, a_later_page_counts_every_job) {
  Shardwire__StatusReply st = SHARDWIRE__STATUS_REPLY__INIT;
  st.has_first_job = 1;
  st.first_job = 7;
  char *text = shardd__fmt_status_text(&st);
  cr_assert_not_null(text);
  cr_expect_not_null(strstr(text, "jobs: 0 of 7 (from 7)\n"), "%s", text);
  free(text);
  Shardwire__JobStatus job = SHARDWIRE__JOB_STATUS__INIT;
  Shardwire__JobStatus *jobs[1] = {&job};
  job.name = "j";
  job.world = 1;
  st.first_job = 2;
  st.n_jobs = 1;
  st.jobs = jobs;
  st.has_jobs_more = 1;
  st.jobs_more = 3;
  text = shardd__fmt_status_text(&st);
  cr_assert_not_null(text);
  cr_expect_not_null(strstr(text, "jobs: 1 of 6 (from 2)\n"), "%s", text);
  free(text);
  st.has_first_job = 0; /* the first page, as before */
  st.has_jobs_more = 0;
  text = shardd__fmt_status_text(&st);
  cr_expect_not_null(strstr(text, "jobs: 1\n"), "%s", text);
  free(text);
}
