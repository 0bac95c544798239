/* fmt.c — text and JSON renderings of Status and Inspect (see fmt.h). */
#include "fmt.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "escape.h"
#include "shardd.h"
#include "strbuf.h"

/* Names and paths in the text form come from other uids' requests (a job,
 * buffer or optimizer name is any bytes but NUL): shown escaped
 * (shardd__escape), so a control byte cannot drive the operator's terminal
 * or forge a line of the report. A name is at most 256 bytes escaped whole;
 * a longer one or a path is cut, marked "...", where the buffer ends. */
#define VIS_NAME (4 * 256 + 4)
#define VIS_PATH (4 * 4096 + 4)
static const char *dtype_word(Shardwire__DType d) {
  const char *n = shardd_dtype_name((shardd_dtype)d);
  return n ? n : "?";
}

static const char *kind_word(Shardwire__OptimKind k) {
  switch (k) {
  case SHARDWIRE__OPTIM_KIND__SGD:
    return "sgd";
  case SHARDWIRE__OPTIM_KIND__ADAM:
    return "adam";
  case SHARDWIRE__OPTIM_KIND__ADAMW:
    return "adamw";
  default:
    return "?";
  }
}

/* Human sizes for the text form; JSON keeps exact byte counts. */
/* A device's free bytes: the daemon's figure (cuda: cudaMemGetInfo, which
 * counts other processes too), else capacity minus shardd's use. */
static uint64_t device_free(const Shardwire__DeviceStatus *d) {
  if (d->has_free_bytes)
    return d->free_bytes;
  return d->capacity_bytes > d->used_bytes ? d->capacity_bytes - d->used_bytes
                                           : 0;
}

static void human(char *out, size_t n, uint64_t bytes) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(out, n, "%" PRIu64 " B", bytes);
  else
    snprintf(out, n, "%.1f %s", v, units[u]);
}

/* Ranks as "0-3,5" (a world of thousands stays one short line); "none". */
static void rank_list(shardd__sb *sb, const uint32_t *r, size_t n) {
  if (n == 0) {
    shardd__sb_printf(sb, "none");
    return;
  }
  for (size_t i = 0; i < n;) {
    size_t k = i;
    while (k + 1 < n && r[k + 1] == r[k] + 1)
      k++;
    shardd__sb_printf(sb, "%s%" PRIu32, i ? "," : "", r[i]);
    if (k > i)
      shardd__sb_printf(sb, "-%" PRIu32, r[k]);
    i = k + 1;
  }
}

static void json_u32s(shardd__sb *sb, const char *key, const uint32_t *r, size_t n) {
  shardd__sb_printf(sb, ",\"%s\":[", key);
  for (size_t i = 0; i < n; i++)
    shardd__sb_printf(sb, "%s%" PRIu32, i ? "," : "", r[i]);
  shardd__sb_printf(sb, "]");
}

/* A list the daemon cut (a huge world's ranks): how many it left out. */
static void more_note(shardd__sb *sb, int has, uint32_t n) {
  if (has && n > 0)
    shardd__sb_printf(sb, " (and %" PRIu32 " more)", n);
}

/* The same in JSON: "key":n when the daemon cut the list. */
static void json_more(shardd__sb *sb, const char *key, int has, uint32_t n) {
  if (has)
    shardd__sb_printf(sb, ",\"%s\":%" PRIu32, key, n);
}

/* Who holds the job's ranks, and what each collective waits on: why a
 * job is stuck, read off one status. Nothing from a daemon that predates
 * the fields (it sends no ranks at all). */
static void job_waits_text(shardd__sb *sb, const Shardwire__JobStatus *j) {
  char v[VIS_NAME], path[VIS_PATH], kind[VIS_NAME];
  if (j->n_connected_ranks + j->n_missing_ranks > 0) {
    shardd__sb_printf(sb, "  ranks connected: ");
    rank_list(sb, j->connected_ranks, j->n_connected_ranks);
    more_note(sb, j->has_connected_ranks_more, j->connected_ranks_more);
    shardd__sb_printf(sb, " missing: ");
    rank_list(sb, j->missing_ranks, j->n_missing_ranks);
    more_note(sb, j->has_missing_ranks_more, j->missing_ranks_more);
    shardd__sb_printf(sb, "\n");
    for (size_t k = 0; k < j->n_missing_ranks && k < j->n_missing_for_s; k++)
      if (j->missing_for_s[k] >= 0)
        shardd__sb_printf(sb, "  rank %" PRIu32 ": disconnected %.1f s ago\n",
                          j->missing_ranks[k], j->missing_for_s[k]);
  }
  for (size_t k = 0; k < j->n_collectives; k++) {
    const Shardwire__CollectiveStatus *c = j->collectives[k];
    shardd__escape(c->kind, kind, sizeof kind);
    if (strcmp(c->kind, "all_reduce") == 0) /* target: how many values */
      shardd__sb_printf(sb, "  collective %s of %" PRIu64 " values (%s)", kind,
                        c->target, shardd__escape(c->name, v, sizeof v));
    else
      shardd__sb_printf(sb, "  collective %s %s %" PRIu64 " (%s)", kind,
                        strcmp(c->kind, "step") == 0 ? "optimizer" : "buffer",
                        c->target, shardd__escape(c->name, v, sizeof v));
    shardd__sb_printf(sb, ": %s %.1f s, arrived ", c->running ? "running" : "waiting",
                      c->waited_s);
    rank_list(sb, c->arrived, c->n_arrived);
    more_note(sb, c->has_arrived_more, c->arrived_more);
    if (!c->running) {
      shardd__sb_printf(sb, ", waiting for ");
      rank_list(sb, c->waiting_for, c->n_waiting_for);
      more_note(sb, c->has_waiting_for_more, c->waiting_for_more);
    }
    shardd__sb_printf(sb, "\n");
  }
  for (size_t k = 0; k < j->n_pending_checkpoints; k++) {
    const Shardwire__PendingCheckpoint *p = j->pending_checkpoints[k];
    shardd__sb_printf(sb, "  checkpoint to %s: waiting %.1f s of %.1f s for the "
                      "job's quiescent point\n",
                      shardd__escape(p->dir, path, sizeof path), p->waited_s, p->wait_s);
  }
}

static void json_key_str(shardd__sb *sb, const char *key, const char *val,
                         int comma) {
  shardd__sb_printf(sb, "%s\"%s\":\"", comma ? "," : "", key);
  shardd__sb_json_str(sb, val);
  shardd__sb_printf(sb, "\"");
}

char *shardd__fmt_status_text(const Shardwire__StatusReply *st) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  char a[32], b[32], v[VIS_NAME], path[VIS_PATH], ver[VIS_NAME], be[VIS_NAME];
  /* the socket path is any bytes --socket was given; the version and the
   * backend's name are escaped too, as every string of the reply is */
  shardd__sb_printf(&sb,
                    "version: %s\nprotocol: %" PRIu32 "\npid: %" PRIu64
                    "\nuptime_s: %.1f\nbackend: %s\nsocket: %s\nclients: %" PRIu32
                    "\n",
                    shardd__escape(st->daemon_version, ver, sizeof ver),
                    st->protocol_version, st->pid, st->uptime_s,
                    shardd__escape(st->backend, be, sizeof be),
                    shardd__escape(st->socket_path, path, sizeof path), st->clients);
  if (st->has_partial_frame_bytes)
    shardd__sb_printf(&sb, "partial_frame_bytes: %" PRIu64 "\n",
                      st->partial_frame_bytes);
  if (st->has_unread_reply_bytes)
    shardd__sb_printf(&sb, "unread_reply_bytes: %" PRIu64 "\n",
                      st->unread_reply_bytes);
  if (st->has_unread_reply_fds)
    shardd__sb_printf(&sb, "unread_reply_fds: %" PRIu64 "\n",
                      st->unread_reply_fds);
  shardd__sb_printf(&sb, "devices: %zu\n", st->n_devices);
  for (size_t i = 0; i < st->n_devices; i++) {
    const Shardwire__DeviceStatus *d = st->devices[i];
    char t[32];
    human(t, sizeof t, d->capacity_bytes);
    human(a, sizeof a, d->used_bytes);
    human(b, sizeof b, device_free(d));
    shardd__sb_printf(&sb, "device %" PRIu32 ": %s total %s used %s free %s",
                      d->index, shardd__escape(d->name, v, sizeof v), t, a, b);
    if (d->has_peak_bytes) {
      human(t, sizeof t, d->peak_bytes);
      shardd__sb_printf(&sb, " peak %s", t);
    }
    shardd__sb_printf(&sb, "\n");
  }
  if (st->has_first_job) /* a later page: its jobs are not all there are */
    shardd__sb_printf(&sb, "jobs: %zu of %" PRIu64 " (from %" PRIu32 ")\n",
                      st->n_jobs,
                      (uint64_t)st->first_job + st->n_jobs +
                          (st->has_jobs_more ? st->jobs_more : 0),
                      st->first_job);
  else
    shardd__sb_printf(&sb, "jobs: %zu\n", st->n_jobs);
  for (size_t i = 0; i < st->n_jobs; i++) {
    const Shardwire__JobStatus *j = st->jobs[i];
    human(a, sizeof a, j->bytes);
    shardd__sb_printf(&sb,
                      "job %s: world %" PRIu32 " clients %" PRIu32
                      " buffers %" PRIu32 " views %" PRIu32
                      " resident %s collectives_in_flight %" PRIu32 "\n",
                      shardd__escape(j->name, v, sizeof v), j->world, j->clients, j->buffers,
                      j->views, a, j->collectives_in_flight);
    if (j->has_owner_uid)
      shardd__sb_printf(&sb, "  owner: uid %" PRIu32 "\n", j->owner_uid);
    if (j->has_transient && j->transient) {
      human(a, sizeof a, j->has_pool_bytes ? j->pool_bytes : 0);
      human(b, sizeof b, j->bytes - (j->has_pool_bytes ? j->pool_bytes : 0));
      shardd__sb_printf(&sb, "  transient areas: pools %s, persistent %s", a, b);
      if (j->has_pool_reserved_bytes && j->pool_reserved_bytes) {
        human(a, sizeof a, j->pool_reserved_bytes);
        shardd__sb_printf(&sb, ", reserved for pools %s", a);
      }
      shardd__sb_printf(&sb, "\n");
      if (j->has_gather_pool_bytes) {
        human(a, sizeof a, j->gather_pool_bytes);
        human(b, sizeof b, j->gathered_bytes);
        shardd__sb_printf(&sb, "  gathered copies: %s (%s), %" PRIu32
                          " held now (%s); gradient areas: the rest, per rank\n",
                          a, j->gather_shared ? "the node's: one read-only copy "
                          "of a unit for every local rank" : "per rank",
                          j->gathered_units, b);
      }
    }
    if (j->has_nodes) {
      shardd__sb_printf(&sb, "  nodes %" PRIu32 " (this daemon: node %" PRIu32
                        ") fabric %s\n",
                        j->nodes, j->node_rank,
                        shardd__escape(j->fabric ? j->fabric : "none", v, sizeof v));
      for (size_t k = 0; k < j->n_node_states; k++) {
        const Shardwire__NodeStatus *n = j->node_states[k];
        shardd__sb_printf(&sb, "  node %" PRIu32 ": ranks %" PRIu32 "..%" PRIu32
                          " %s\n",
                          n->node, n->first_rank, n->first_rank + n->ranks - 1,
                          shardd__escape(n->state, v, sizeof v));
      }
      if (j->fabric_error)
        shardd__sb_printf(&sb, "  fabric_error: %s\n",
                          shardd__escape(j->fabric_error, path, sizeof path));
    }
    job_waits_text(&sb, j);
    for (size_t k = 0; k < j->n_optimizers; k++) {
      const Shardwire__OptimizerStatus *o = j->optimizers[k];
      shardd__sb_printf(&sb,
                        "  optimizer %" PRIu64 " %s: %s params %" PRIu32
                        " steps %" PRIu64 "\n",
                        o->id, shardd__escape(o->name, v, sizeof v), kind_word(o->kind),
                        o->params, o->steps);
    }
    if (j->has_optimizers_more && j->optimizers_more > 0)
      shardd__sb_printf(&sb, "  and %" PRIu32 " more optimizers\n", j->optimizers_more);
  }
  if (st->has_jobs_more && st->jobs_more > 0)
    shardd__sb_printf(&sb, "and %" PRIu32 " more jobs: shardctl status --from %"
                      PRIu64 "\n", st->jobs_more,
                      (uint64_t)(st->has_first_job ? st->first_job : 0) + st->n_jobs);
  return shardd__sb_take(&sb);
}

char *shardd__fmt_status_json(const Shardwire__StatusReply *st) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "{");
  json_key_str(&sb, "version", st->daemon_version, 0);
  shardd__sb_printf(&sb, ",\"protocol\":%" PRIu32 ",\"pid\":%" PRIu64
                    ",\"uptime_s\":%.3f",
                    st->protocol_version, st->pid, st->uptime_s);
  json_key_str(&sb, "backend", st->backend, 1);
  json_key_str(&sb, "socket", st->socket_path, 1);
  shardd__sb_printf(&sb, ",\"clients\":%" PRIu32, st->clients);
  if (st->has_partial_frame_bytes)
    shardd__sb_printf(&sb, ",\"partial_frame_bytes\":%" PRIu64,
                      st->partial_frame_bytes);
  if (st->has_unread_reply_bytes)
    shardd__sb_printf(&sb, ",\"unread_reply_bytes\":%" PRIu64,
                      st->unread_reply_bytes);
  if (st->has_unread_reply_fds)
    shardd__sb_printf(&sb, ",\"unread_reply_fds\":%" PRIu64,
                      st->unread_reply_fds);
  shardd__sb_printf(&sb, ",\"devices\":[");
  for (size_t i = 0; i < st->n_devices; i++) {
    const Shardwire__DeviceStatus *d = st->devices[i];
    shardd__sb_printf(&sb, "%s{\"index\":%" PRIu32, i ? "," : "", d->index);
    json_key_str(&sb, "name", d->name, 1);
    shardd__sb_printf(&sb,
                      ",\"capacity_bytes\":%" PRIu64 ",\"used_bytes\":%" PRIu64
                      ",\"free_bytes\":%" PRIu64,
                      d->capacity_bytes, d->used_bytes, device_free(d));
    if (d->has_peak_bytes)
      shardd__sb_printf(&sb, ",\"peak_bytes\":%" PRIu64, d->peak_bytes);
    if (d->has_allocs)
      shardd__sb_printf(&sb, ",\"allocs\":%" PRIu64, d->allocs);
    shardd__sb_printf(&sb, "}");
  }
  shardd__sb_printf(&sb, "],\"jobs\":[");
  for (size_t i = 0; i < st->n_jobs; i++) {
    const Shardwire__JobStatus *j = st->jobs[i];
    shardd__sb_printf(&sb, "%s{", i ? "," : "");
    json_key_str(&sb, "name", j->name, 0);
    if (j->has_owner_uid)
      shardd__sb_printf(&sb, ",\"owner_uid\":%" PRIu32, j->owner_uid);
    if (j->has_transient && j->transient)
      shardd__sb_printf(&sb, ",\"transient\":true,\"pool_bytes\":%" PRIu64
                        ",\"persistent_bytes\":%" PRIu64,
                        j->pool_bytes, j->bytes - j->pool_bytes);
    if (j->has_transient && j->transient && j->has_pool_reserved_bytes)
      shardd__sb_printf(&sb, ",\"pool_reserved_bytes\":%" PRIu64,
                        j->pool_reserved_bytes);
    if (j->has_transient && j->transient && j->has_gather_pool_bytes)
      shardd__sb_printf(&sb, ",\"gather_pool_bytes\":%" PRIu64
                        ",\"gathered_bytes\":%" PRIu64 ",\"gathered_units\":%"
                        PRIu32 ",\"gather_shared\":%s",
                        j->gather_pool_bytes, j->gathered_bytes, j->gathered_units,
                        j->gather_shared ? "true" : "false");
    shardd__sb_printf(&sb,
                      ",\"world\":%" PRIu32 ",\"clients\":%" PRIu32
                      ",\"buffers\":%" PRIu32 ",\"views\":%" PRIu32
                      ",\"bytes\":%" PRIu64 ",\"collectives_in_flight\":%" PRIu32
                      ",\"optimizers\":[",
                      j->world, j->clients, j->buffers, j->views, j->bytes,
                      j->collectives_in_flight);
    for (size_t k = 0; k < j->n_optimizers; k++) {
      const Shardwire__OptimizerStatus *o = j->optimizers[k];
      shardd__sb_printf(&sb, "%s{\"id\":%" PRIu64, k ? "," : "", o->id);
      json_key_str(&sb, "name", o->name, 1);
      json_key_str(&sb, "kind", kind_word(o->kind), 1);
      shardd__sb_printf(&sb, ",\"params\":%" PRIu32 ",\"steps\":%" PRIu64 "}",
                        o->params, o->steps);
    }
    shardd__sb_printf(&sb, "]");
    json_more(&sb, "optimizers_more", j->has_optimizers_more, j->optimizers_more);
    json_more(&sb, "connected_ranks_more", j->has_connected_ranks_more,
              j->connected_ranks_more);
    json_more(&sb, "missing_ranks_more", j->has_missing_ranks_more,
              j->missing_ranks_more);
    if (j->n_connected_ranks + j->n_missing_ranks > 0) {
      json_u32s(&sb, "connected_ranks", j->connected_ranks, j->n_connected_ranks);
      json_u32s(&sb, "missing_ranks", j->missing_ranks, j->n_missing_ranks);
      shardd__sb_printf(&sb, ",\"missing_for_s\":[");
      for (size_t k = 0; k < j->n_missing_for_s; k++)
        shardd__sb_printf(&sb, "%s%.3f", k ? "," : "", j->missing_for_s[k]);
      shardd__sb_printf(&sb, "]");
    }
    shardd__sb_printf(&sb, ",\"collectives\":[");
    for (size_t k = 0; k < j->n_collectives; k++) {
      const Shardwire__CollectiveStatus *c = j->collectives[k];
      shardd__sb_printf(&sb, "%s{", k ? "," : "");
      json_key_str(&sb, "kind", c->kind, 0);
      shardd__sb_printf(&sb, ",\"target\":%" PRIu64, c->target);
      json_key_str(&sb, "name", c->name, 1);
      shardd__sb_printf(&sb, ",\"running\":%s,\"waited_s\":%.3f",
                        c->running ? "true" : "false", c->waited_s);
      json_u32s(&sb, "arrived", c->arrived, c->n_arrived);
      json_u32s(&sb, "waiting_for", c->waiting_for, c->n_waiting_for);
      json_more(&sb, "arrived_more", c->has_arrived_more, c->arrived_more);
      json_more(&sb, "waiting_for_more", c->has_waiting_for_more,
                c->waiting_for_more);
      shardd__sb_printf(&sb, "}");
    }
    shardd__sb_printf(&sb, "]");
    if (j->n_pending_checkpoints) {
      shardd__sb_printf(&sb, ",\"pending_checkpoints\":[");
      for (size_t k = 0; k < j->n_pending_checkpoints; k++) {
        const Shardwire__PendingCheckpoint *p = j->pending_checkpoints[k];
        shardd__sb_printf(&sb, "%s{", k ? "," : "");
        json_key_str(&sb, "dir", p->dir, 0);
        shardd__sb_printf(&sb, ",\"waited_s\":%.3f,\"wait_s\":%.3f}",
                          p->waited_s, p->wait_s);
      }
      shardd__sb_printf(&sb, "]");
    }
    if (j->has_nodes) {
      shardd__sb_printf(&sb, ",\"nodes\":%" PRIu32 ",\"node_rank\":%" PRIu32,
                        j->nodes, j->node_rank);
      json_key_str(&sb, "fabric", j->fabric ? j->fabric : "none", 1);
      if (j->fabric_error)
        json_key_str(&sb, "fabric_error", j->fabric_error, 1);
      shardd__sb_printf(&sb, ",\"node_states\":[");
      for (size_t k = 0; k < j->n_node_states; k++) {
        const Shardwire__NodeStatus *n = j->node_states[k];
        shardd__sb_printf(&sb, "%s{\"node\":%" PRIu32 ",\"first_rank\":%" PRIu32
                          ",\"ranks\":%" PRIu32,
                          k ? "," : "", n->node, n->first_rank, n->ranks);
        json_key_str(&sb, "state", n->state, 1);
        shardd__sb_printf(&sb, "}");
      }
      shardd__sb_printf(&sb, "]");
    }
    shardd__sb_printf(&sb, "}");
  }
  shardd__sb_printf(&sb, "]");
  if (st->has_first_job)
    shardd__sb_printf(&sb, ",\"first_job\":%" PRIu32, st->first_job);
  json_more(&sb, "jobs_more", st->has_jobs_more, st->jobs_more);
  shardd__sb_printf(&sb, "}\n");
  return shardd__sb_take(&sb);
}

static void shape_text(shardd__sb *sb, const int64_t *shape, size_t n) {
  shardd__sb_printf(sb, "[");
  for (size_t i = 0; i < n; i++)
    shardd__sb_printf(sb, "%s%" PRId64, i ? ", " : "", shape[i]);
  shardd__sb_printf(sb, "]");
}

char *shardd__fmt_inspect_text(const Shardwire__InspectReply *ir) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  char nm[VIS_NAME], jb[VIS_NAME], vn[VIS_NAME], kd[VIS_NAME];
  shardd__sb_printf(&sb, "id: %" PRIu64 "\nkind: %s\nname: %s\njob: %s\n",
                    ir->id, shardd__escape(ir->kind, kd, sizeof kd),
                    shardd__escape(ir->name, nm, sizeof nm),
                    shardd__escape(ir->job, jb, sizeof jb));
  if (ir->has_buffer)
    shardd__sb_printf(&sb, "buffer: %" PRIu64 "\n", ir->buffer);
  if (ir->has_dtype)
    shardd__sb_printf(&sb, "dtype: %s\n", dtype_word(ir->dtype));
  if (ir->has_offset)
    shardd__sb_printf(&sb, "offset: %" PRIu64 "\n", ir->offset);
  if (ir->has_numel)
    shardd__sb_printf(&sb, "numel: %" PRIu64 "\n", ir->numel);
  if (ir->has_padded_numel)
    shardd__sb_printf(&sb, "padded_numel: %" PRIu64 "\npadding: %" PRIu64 "\n",
                      ir->padded_numel, ir->padded_numel - ir->numel);
  if (ir->has_shard_numel)
    shardd__sb_printf(&sb, "shard_numel: %" PRIu64 "\n", ir->shard_numel);
  if (ir->has_world)
    shardd__sb_printf(&sb, "world: %" PRIu32 "\n", ir->world);
  if (ir->has_generation)
    shardd__sb_printf(&sb, "generation: %" PRIu64 "\n", ir->generation);
  if (ir->has_requires_grad)
    shardd__sb_printf(&sb, "requires_grad: %s\n",
                      ir->requires_grad ? "true" : "false");
  if (ir->has_steps)
    shardd__sb_printf(&sb, "steps: %" PRIu64 "\n", ir->steps);
  if (!strcmp(ir->kind, "buffer")) {
    uint64_t nf = 0;
    for (size_t i = 0; i < ir->n_frozen; i++)
      nf += ir->frozen[i]->numel;
    shardd__sb_printf(&sb, "frozen: %zu range%s, %" PRIu64 " elements",
                      ir->n_frozen, ir->n_frozen == 1 ? "" : "s", nf);
    if (ir->has_frozen_more && ir->frozen_more > 0)
      shardd__sb_printf(&sb, " (%" PRIu32 " more ranges not listed)", ir->frozen_more);
    shardd__sb_printf(&sb, "\n");
    for (size_t i = 0; i < ir->n_frozen; i++)
      shardd__sb_printf(&sb, "frozen range: [%" PRIu64 ", %" PRIu64 ")\n",
                        ir->frozen[i]->offset,
                        ir->frozen[i]->offset + ir->frozen[i]->numel);
  }
  if (ir->n_shape || !strcmp(ir->kind, "view")) {
    shardd__sb_printf(&sb, "shape: ");
    shape_text(&sb, ir->shape, ir->n_shape);
    shardd__sb_printf(&sb, "\n");
  }
  if (ir->has_optimizer)
    shardd__sb_printf(&sb, "optimizer: %" PRIu64 "\n", ir->optimizer);
  else
    shardd__sb_printf(&sb, "optimizer: none\n");
  if (ir->n_gather_leases || ir->n_grad_leases) {
    shardd__sb_printf(&sb, "leased gather areas: ranks");
    for (size_t i = 0; i < ir->n_gather_leases; i++)
      shardd__sb_printf(&sb, " %" PRIu32, ir->gather_leases[i]);
    more_note(&sb, ir->has_gather_leases_more, ir->gather_leases_more);
    shardd__sb_printf(&sb, "\nleased gradient areas: ranks");
    for (size_t i = 0; i < ir->n_grad_leases; i++)
      shardd__sb_printf(&sb, " %" PRIu32, ir->grad_leases[i]);
    more_note(&sb, ir->has_grad_leases_more, ir->grad_leases_more);
    shardd__sb_printf(&sb, "\n");
  }
  if (ir->has_resident_bytes) {
    char a[32];
    human(a, sizeof a, ir->resident_bytes);
    shardd__sb_printf(&sb, "resident: %s (%" PRIu64 " bytes)\n", a,
                      ir->resident_bytes);
  }
  for (size_t i = 0; i < ir->n_shards; i++) {
    const Shardwire__ShardInfo *s = ir->shards[i];
    shardd__sb_printf(&sb,
                      "shard rank %" PRIu32 ": device %" PRIu32
                      " elements [%" PRIu64 ", %" PRIu64 ")",
                      s->rank, s->device, s->offset, s->offset + s->numel);
    if (s->has_bytes) {
      char a[32];
      human(a, sizeof a, s->bytes);
      shardd__sb_printf(&sb, ", holds %s (%" PRIu64 " bytes)", a, s->bytes);
    }
    shardd__sb_printf(&sb, "\n");
  }
  if (ir->has_shards_more && ir->shards_more > 0)
    shardd__sb_printf(&sb, "and %" PRIu32 " more shards\n", ir->shards_more);
  if (!strcmp(ir->kind, "buffer"))
    shardd__sb_printf(&sb, "views: %zu\n", ir->n_views +
                      (ir->has_views_more ? ir->views_more : 0));
  for (size_t i = 0; i < ir->n_views; i++) {
    const Shardwire__ViewInfo *v = ir->views[i];
    shardd__sb_printf(&sb, "view %" PRIu64 " %s: [%" PRIu64 ", %" PRIu64 ") shape ",
                      v->id, shardd__escape(v->name, vn, sizeof vn), v->offset,
                      v->offset + v->numel);
    shape_text(&sb, v->shape, v->n_shape);
    if (v->has_generation)
      shardd__sb_printf(&sb, " generation %" PRIu64, v->generation);
    shardd__sb_printf(&sb, " requires_grad %s",
                      v->requires_grad ? "true" : "false");
    if (v->has_steps)
      shardd__sb_printf(&sb, " steps %" PRIu64, v->steps);
    shardd__sb_printf(&sb, "\n");
  }
  if (ir->has_views_more && ir->views_more > 0)
    shardd__sb_printf(&sb, "and %" PRIu32 " more views\n", ir->views_more);
  return shardd__sb_take(&sb);
}

static void shape_json(shardd__sb *sb, const int64_t *shape, size_t n) {
  shardd__sb_printf(sb, "[");
  for (size_t i = 0; i < n; i++)
    shardd__sb_printf(sb, "%s%" PRId64, i ? "," : "", shape[i]);
  shardd__sb_printf(sb, "]");
}

char *shardd__fmt_inspect_json(const Shardwire__InspectReply *ir) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "{\"id\":%" PRIu64, ir->id);
  json_key_str(&sb, "kind", ir->kind, 1);
  json_key_str(&sb, "name", ir->name, 1);
  json_key_str(&sb, "job", ir->job, 1);
  if (ir->has_buffer)
    shardd__sb_printf(&sb, ",\"buffer\":%" PRIu64, ir->buffer);
  if (ir->has_dtype)
    json_key_str(&sb, "dtype", dtype_word(ir->dtype), 1);
  if (ir->has_offset)
    shardd__sb_printf(&sb, ",\"offset\":%" PRIu64, ir->offset);
  if (ir->has_numel)
    shardd__sb_printf(&sb, ",\"numel\":%" PRIu64, ir->numel);
  if (ir->has_padded_numel)
    shardd__sb_printf(&sb, ",\"padded_numel\":%" PRIu64, ir->padded_numel);
  if (ir->has_shard_numel)
    shardd__sb_printf(&sb, ",\"shard_numel\":%" PRIu64, ir->shard_numel);
  if (ir->has_world)
    shardd__sb_printf(&sb, ",\"world\":%" PRIu32, ir->world);
  if (ir->has_generation)
    shardd__sb_printf(&sb, ",\"generation\":%" PRIu64, ir->generation);
  if (ir->has_requires_grad)
    shardd__sb_printf(&sb, ",\"requires_grad\":%s",
                      ir->requires_grad ? "true" : "false");
  if (ir->has_steps)
    shardd__sb_printf(&sb, ",\"steps\":%" PRIu64, ir->steps);
  if (!strcmp(ir->kind, "buffer")) {
    shardd__sb_printf(&sb, ",\"frozen\":[");
    for (size_t i = 0; i < ir->n_frozen; i++)
      shardd__sb_printf(&sb, "%s{\"offset\":%" PRIu64 ",\"numel\":%" PRIu64 "}",
                        i ? "," : "", ir->frozen[i]->offset,
                        ir->frozen[i]->numel);
    shardd__sb_printf(&sb, "]");
  }
  if (!strcmp(ir->kind, "view")) {
    shardd__sb_printf(&sb, ",\"shape\":");
    shape_json(&sb, ir->shape, ir->n_shape);
  }
  if (ir->has_optimizer)
    shardd__sb_printf(&sb, ",\"optimizer\":%" PRIu64, ir->optimizer);
  else
    shardd__sb_printf(&sb, ",\"optimizer\":null");
  if (ir->n_gather_leases || ir->n_grad_leases) {
    shardd__sb_printf(&sb, ",\"gather_leases\":[");
    for (size_t i = 0; i < ir->n_gather_leases; i++)
      shardd__sb_printf(&sb, "%s%" PRIu32, i ? "," : "", ir->gather_leases[i]);
    shardd__sb_printf(&sb, "],\"grad_leases\":[");
    for (size_t i = 0; i < ir->n_grad_leases; i++)
      shardd__sb_printf(&sb, "%s%" PRIu32, i ? "," : "", ir->grad_leases[i]);
    shardd__sb_printf(&sb, "]");
  }
  if (ir->has_resident_bytes)
    shardd__sb_printf(&sb, ",\"resident_bytes\":%" PRIu64, ir->resident_bytes);
  shardd__sb_printf(&sb, ",\"shards\":[");
  for (size_t i = 0; i < ir->n_shards; i++) {
    const Shardwire__ShardInfo *s = ir->shards[i];
    shardd__sb_printf(&sb,
                      "%s{\"rank\":%" PRIu32 ",\"device\":%" PRIu32
                      ",\"offset\":%" PRIu64 ",\"numel\":%" PRIu64,
                      i ? "," : "", s->rank, s->device, s->offset, s->numel);
    if (s->has_bytes)
      shardd__sb_printf(&sb, ",\"bytes\":%" PRIu64, s->bytes);
    shardd__sb_printf(&sb, "}");
  }
  shardd__sb_printf(&sb, "],\"views\":[");
  for (size_t i = 0; i < ir->n_views; i++) {
    const Shardwire__ViewInfo *v = ir->views[i];
    shardd__sb_printf(&sb, "%s{\"id\":%" PRIu64, i ? "," : "", v->id);
    json_key_str(&sb, "name", v->name, 1);
    shardd__sb_printf(&sb, ",\"offset\":%" PRIu64 ",\"numel\":%" PRIu64
                      ",\"shape\":", v->offset, v->numel);
    shape_json(&sb, v->shape, v->n_shape);
    if (v->has_generation)
      shardd__sb_printf(&sb, ",\"generation\":%" PRIu64, v->generation);
    shardd__sb_printf(&sb, ",\"requires_grad\":%s",
                      v->requires_grad ? "true" : "false");
    if (v->has_steps)
      shardd__sb_printf(&sb, ",\"steps\":%" PRIu64, v->steps);
    shardd__sb_printf(&sb, "}");
  }
  shardd__sb_printf(&sb, "]");
  json_more(&sb, "shards_more", ir->has_shards_more, ir->shards_more);
  json_more(&sb, "views_more", ir->has_views_more, ir->views_more);
  json_more(&sb, "frozen_more", ir->has_frozen_more, ir->frozen_more);
  json_more(&sb, "gather_leases_more", ir->has_gather_leases_more,
            ir->gather_leases_more);
  json_more(&sb, "grad_leases_more", ir->has_grad_leases_more,
            ir->grad_leases_more);
  shardd__sb_printf(&sb, "}\n");
  return shardd__sb_take(&sb);
}
