/* fdstore_adopt.c — adopting the descriptions the fd store held at start
 * (see fdstore.h): each job's regions swapped in from their descriptors,
 * and the jobs a step tore or whose description could not be adopted,
 * kept until an operator forgets them. */
#include "fdstore.h"
#include "fdstore_int.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "log.h"
#include "manifest.h"
#include "sdnotify.h"
#include "strbuf.h"

/* ---- adopt ------------------------------------------------------------- */

typedef struct {
  shardd__fdstore_fd *fds;
  size_t n;
  /* [n]: 1 a region swapped in (through a descriptor of its own), 2 a
   * description's, owned by its entry */
  uint8_t *taken;
  uint8_t *kept;  /* [n]: kept open for a torn job */
} pool;

static ssize_t pool_find(const pool *p, const char *name) {
  for (size_t i = 0; i < p->n; i++)
    if (!p->taken[i] && !p->kept[i] && strcmp(p->fds[i].name, name) == 0)
      return (ssize_t)i;
  return -1;
}

/* Reads slot fd's text (malloc'd, NUL-ended) when its header is whole and
 * its CRC holds; NULL otherwise. *ver: its format (fdstore_int.h). */
static char *read_slot(int fd, uint64_t *gen, size_t *len, int *ver) {
  slot_hdr h;
  if (fd < 0 || pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h ||
      h.gen == 0 || h.len > SLOT_TEXT_MAX)
    return NULL;
  if (memcmp(h.magic, SLOT_MAGIC, 8) == 0)
    *ver = 2;
  else if (memcmp(h.magic, SLOT_MAGIC_V1, 8) == 0)
    *ver = 1;
  else
    return NULL;
  char *t = malloc(h.len + 1);
  if (t == NULL || pread(fd, t, h.len, SLOT_TEXT_OFF) != (ssize_t)h.len ||
      shardd__crc32c(0, t, h.len) != h.crc) {
    free(t);
    return NULL;
  }
  t[h.len] = '\0';
  *gen = h.gen;
  *len = h.len;
  return t;
}

/* The position of word n (0 the first) of line, or NULL. */
static const char *word_at(const char *line, const char *end, int n) {
  const char *p = line;
  for (; n > 0 && p; n--) {
    p = memchr(p, ' ', (size_t)(end - p));
    p = p ? p + 1 : NULL;
  }
  return p;
}

/* The step counts journal fd holds for the slot of generation gen, put in
 * manifest's place (its optimizer and ref lines' counts, the manifest
 * sealed anew): *out, malloc'd; NULL when the journal holds none of that
 * generation (the slot's are then the newest: it was written after the
 * counts the journal has). SHARDD_E_INVAL (err says why) when counts of
 * that generation do not fit the manifest, or of a later one are there:
 * a damaged journal. */
static shardd_err journal_steps(int fd, uint64_t gen, const char *manifest,
                                char **out, char *err, size_t errlen) {
  *out = NULL;
  struct stat st;
  steps_hdr h;
  if (fstat(fd, &st) != 0) {
    snprintf(err, errlen, "its step journal: %s", strerror(errno));
    return SHARDD_E_IO;
  }
  /* none written (a journal of a daemon before them, or its growth
   * failed: no step was committed through them then) */
  if ((size_t)st.st_size < JRNL_BYTES + sizeof h)
    return SHARDD_OK;
  if (pread(fd, &h, sizeof h, JRNL_BYTES) != (ssize_t)sizeof h) {
    snprintf(err, errlen, "its step journal: %s", strerror(errno));
    return SHARDD_E_IO;
  }
  uint64_t hgen = atomic_load(&h.gen);
  if (hgen == 0 || hgen < gen) /* being written, or of an older slot */
    return SHARDD_OK;
  if (memcmp(h.magic, STEPS_MAGIC, 8) != 0 || hgen > gen ||
      h.bytes < sizeof h || h.bytes > (uint64_t)st.st_size - JRNL_BYTES ||
      (h.bytes - sizeof h) % sizeof(uint64_t) != 0) {
    snprintf(err, errlen, "its step journal is damaged (step counts of "
             "generation %" PRIu64 ", %" PRIu64 " bytes, for a description "
             "of generation %" PRIu64 ")", hgen, h.bytes, gen);
    return SHARDD_E_INVAL;
  }
  size_t nw = (size_t)(h.bytes - sizeof h) / sizeof(uint64_t);
  uint64_t *w = malloc((nw ? nw : 1) * sizeof *w);
  if (w == NULL) {
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  if (pread(fd, w, nw * sizeof *w, JRNL_BYTES + sizeof h) !=
      (ssize_t)(nw * sizeof *w)) {
    free(w);
    snprintf(err, errlen, "its step journal: %s", strerror(errno));
    return SHARDD_E_IO;
  }
  shardd__sb sb;
  shardd__sb_init(&sb);
  size_t at = 0;       /* the next entry's word */
  const uint64_t *ent = NULL; /* the current optimizer's */
  uint64_t nopt = 0, refk = 0;
  const char *bad = NULL;
  for (const char *line = manifest; *line && !bad;) {
    const char *end = strchr(line, '\n');
    end = end ? end : line + strlen(line);
    size_t len = (size_t)(end - line);
    if (len > 10 && !strncmp(line, "optimizer ", 10)) {
      const char *sw = word_at(line, end, 3), *rest = word_at(line, end, 4);
      if (ent && refk != ent[1])
        bad = "an optimizer's refs are not those counted";
      else if (strtoull(line + 10, NULL, 10) != nopt || nopt >= h.nopt ||
               at + 2 > nw || w[at + 1] > nw - at - 2 || sw == NULL)
        bad = "its optimizers are not those counted";
      if (bad)
        break;
      ent = w + at;
      at += 2 + ent[1];
      nopt++;
      refk = 0;
      shardd__sb_printf(&sb, "%.*s%" PRIu64 "%s%.*s\n", (int)(sw - line), line,
                        ent[0], rest ? " " : "",
                        rest ? (int)(end - rest) : 0, rest ? rest : "");
    } else if (len > 4 && !strncmp(line, "ref ", 4)) {
      const char *last = end;
      while (last > line && last[-1] != ' ')
        last--;
      if (ent == NULL || strtoull(line + 4, NULL, 10) != nopt - 1 ||
          refk >= ent[1] || word_at(line, end, 5) == NULL) {
        bad = "its refs are not those counted";
        break;
      }
      shardd__sb_printf(&sb, "%.*s%" PRIu64 "\n", (int)(last - line), line,
                        ent[2 + refk++]);
    } else if (len >= 3 && !strncmp(line, "end", 3) &&
               (len == 3 || line[3] == ' ')) {
      shardd__manifest_put_end(&sb, shardd__crc32c(0, sb.s, sb.len));
    } else {
      shardd__sb_printf(&sb, "%.*s\n", (int)len, line);
    }
    line = *end ? end + 1 : end;
  }
  if (!bad && ((ent && refk != ent[1]) || nopt != h.nopt || at != nw))
    bad = "its counts are not those of the description's optimizers";
  free(w);
  if (bad) {
    shardd__sb_free(&sb);
    snprintf(err, errlen, "its step journal does not fit its description "
             "(%s)", bad);
    return SHARDD_E_INVAL;
  }
  if (sb.failed) {
    shardd__sb_free(&sb);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  *out = shardd__sb_take(&sb);
  return SHARDD_OK;
}

/* The job line of the manifest in text: name (decoded) and uid. */
static int job_of(const char *manifest, char *name, size_t len,
                  uint32_t *uid) {
  const char *p = strstr(manifest, "\njob ");
  char tok[1024];
  unsigned world, u;
  if (p == NULL || sscanf(p + 5, "%1023s %u %u", tok, &world, &u) != 3 ||
      !shardd__manifest_dec_name(tok) || strlen(tok) >= len)
    return 0;
  memcpy(name, tok, strlen(tok) + 1);
  *uid = u;
  return 1;
}

/* Puts the adopted memfd named store_name in place of *slot (a region
 * apply made, of the same size), which is freed. */
static shardd_err swap_in(shardd__fdstore *fs, pool *p, shardd__region **slot,
                          const char *store_name, char *err, size_t errlen) {
  shardd__backend *be = fs->reg->backend;
  ssize_t i = pool_find(p, store_name);
  if (i < 0) {
    snprintf(err, errlen, "region %s was not handed back", store_name);
    return SHARDD_E_NOT_FOUND;
  }
  struct stat st;
  if (fstat(p->fds[i].fd, &st) != 0 || (size_t)st.st_size != (*slot)->bytes) {
    snprintf(err, errlen, "region %s holds %jd bytes, not %zu", store_name,
             (intmax_t)st.st_size, (*slot)->bytes);
    return SHARDD_E_MISMATCH;
  }
  int dup_fd = fcntl(p->fds[i].fd, F_DUPFD_CLOEXEC, 0);
  shardd__region *nr;
  shardd_err rc = dup_fd < 0 ? SHARDD_E_IO
                             : be->ops->wrap_fd(be, (*slot)->device, dup_fd,
                                                store_name, &nr, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  be->ops->free(be, *slot);
  *slot = nr;
  p->taken[i] = 1;
  return SHARDD_OK;
}

/* A block of a slab a region line names: swapped in with the others of
 * its file (swap_slabs). */
typedef struct {
  shardd__region **slot;
  const char *name; /* its file's FDNAME, in the slot's text */
  size_t off;
  int done;
} slab_line;

typedef struct {
  slab_line *v;
  size_t n, cap;
} slab_lines;

/* Each slab the lines name mapped once for all its blocks, which take the
 * place of the regions apply made (one memfd each, freed). */
static shardd_err swap_slabs(shardd__fdstore *fs, pool *p, shardd__job *job,
                             slab_lines *sl, char *err, size_t errlen) {
  shardd__backend *be = fs->reg->backend;
  size_t *offs = malloc((sl->n ? sl->n : 1) * sizeof *offs);
  size_t *bytes = malloc((sl->n ? sl->n : 1) * sizeof *bytes);
  size_t *who = malloc((sl->n ? sl->n : 1) * sizeof *who);
  shardd__region **out = malloc((sl->n ? sl->n : 1) * sizeof *out);
  shardd_err rc = SHARDD_OK;
  if (!offs || !bytes || !who || !out) {
    snprintf(err, errlen, "out of memory");
    rc = SHARDD_E_NO_MEMORY;
  }
  for (size_t i = 0; i < sl->n && rc == SHARDD_OK; i++) {
    if (sl->v[i].done)
      continue;
    size_t k = 0;
    for (size_t j = i; j < sl->n; j++)
      if (!sl->v[j].done && strcmp(sl->v[j].name, sl->v[i].name) == 0) {
        sl->v[j].done = 1;
        offs[k] = sl->v[j].off;
        bytes[k] = (*sl->v[j].slot)->bytes;
        who[k++] = j;
      }
    ssize_t f = pool_find(p, sl->v[i].name);
    if (f < 0) {
      snprintf(err, errlen, "region %s was not handed back", sl->v[i].name);
      rc = SHARDD_E_NOT_FOUND;
      break;
    }
    int dup_fd = fcntl(p->fds[f].fd, F_DUPFD_CLOEXEC, 0);
    rc = dup_fd < 0 ? SHARDD_E_IO
                    : be->ops->wrap_slab
                          ? be->ops->wrap_slab(be, (*sl->v[i].slot)->device,
                                               dup_fd, sl->v[i].name, k, offs,
                                               bytes, out, err, errlen)
                          : SHARDD_E_INVAL;
    if (rc != SHARDD_OK) {
      if (dup_fd >= 0 && be->ops->wrap_slab == NULL)
        close(dup_fd);
      break;
    }
    for (size_t m = 0; m < k; m++) {
      be->ops->free(be, *sl->v[who[m]].slot);
      *sl->v[who[m]].slot = out[m];
    }
    p->taken[f] = 1;
    /* apply counted each block a region; the slab is one */
    shardd__registry_regions_merged(fs->reg, job, k - 1);
  }
  free(offs);
  free(bytes);
  free(who);
  free(out);
  return rc;
}

/* The region lines of text (up to "manifest"), each swapped in. */
static shardd_err swap_regions(shardd__fdstore *fs, pool *p, shardd__job *job,
                               char *text, char *err, size_t errlen) {
  char *save = NULL;
  slab_lines sl = {NULL, 0, 0};
  shardd_err rc = SHARDD_OK;
  for (char *line = strtok_r(text, "\n", &save); line;
       line = strtok_r(NULL, "\n", &save)) {
    if (strcmp(line, "manifest") == 0) {
      rc = swap_slabs(fs, p, job, &sl, err, errlen);
      free(sl.v);
      return rc;
    }
    char *tok[SHARDD__MANIFEST_MAX_TOK];
    int nt = shardd__manifest_split_words(line, tok);
    if ((nt == 5 || nt == 6) && !strcmp(tok[0], "region") &&
        !strcmp(tok[1], "buffer") && shardd__manifest_dec_name(tok[2])) {
      shardd__buffer *b = shardd__map_get_str(&job->buffers, tok[2]);
      uint32_t r = (uint32_t)strtoul(tok[3], NULL, 10);
      if (b == NULL || !shardd__job_rank_local(job, r) || r >= job->world ||
          b->blocks[r] == NULL) {
        snprintf(err, errlen, "a region of buffer \"%s\" rank %s the "
                 "manifest does not have", tok[2], tok[3]);
        rc = SHARDD_E_INVAL;
      } else if (nt == 6 && sl.n == sl.cap) {
        size_t cap = sl.cap ? 2 * sl.cap : 64;
        slab_line *v = realloc(sl.v, cap * sizeof *v);
        if (v == NULL) {
          snprintf(err, errlen, "out of memory");
          rc = SHARDD_E_NO_MEMORY;
        } else {
          sl.v = v;
          sl.cap = cap;
        }
      }
      if (rc == SHARDD_OK && nt == 6)
        sl.v[sl.n++] = (slab_line){&b->blocks[r], tok[4],
                                   (size_t)strtoull(tok[5], NULL, 10), 0};
      else if (rc == SHARDD_OK)
        rc = swap_in(fs, p, &b->blocks[r], tok[4], err, errlen);
    } else if (nt == 6 && !strcmp(tok[0], "region") &&
               !strcmp(tok[1], "state") && shardd__manifest_dec_name(tok[2]) &&
               shardd__manifest_dec_name(tok[3])) {
      shardd__optim *o = shardd__optim_find(job, tok[2]);
      shardd__buffer *b = shardd__map_get_str(&job->buffers, tok[3]);
      uint32_t r = (uint32_t)strtoul(tok[4], NULL, 10);
      shardd__optim_shard *sh = NULL;
      for (size_t k = 0; o && k < o->nshards && !sh; k++)
        if (o->shards[k].buf == b && o->shards[k].rank == r)
          sh = &o->shards[k];
      if (sh == NULL || sh->state == NULL) {
        snprintf(err, errlen, "a state region of optimizer \"%s\" the "
                 "manifest does not have", tok[2]);
        return SHARDD_E_INVAL;
      }
      rc = swap_in(fs, p, &sh->state, tok[5], err, errlen);
    } else {
      snprintf(err, errlen, "a malformed region line");
      rc = SHARDD_E_INVAL;
    }
    if (rc != SHARDD_OK) {
      free(sl.v);
      return rc;
    }
  }
  free(sl.v);
  snprintf(err, errlen, "no manifest");
  return SHARDD_E_INVAL;
}

/* How far job got: the most steps one of its optimizers took. */
static uint64_t job_step(shardd__job *job) {
  shardd__optim **opts;
  size_t no;
  uint64_t s = 0;
  if (shardd__job_optims(job, &opts, &no) != SHARDD_OK)
    return 0;
  for (size_t i = 0; i < no; i++)
    if (opts[i]->steps > s)
      s = opts[i]->steps;
  free(opts);
  return s;
}

/* Keeps the fds of a torn job open, in the store, until it is forgotten:
 * the description's three and every region its text names. */
static void keep_torn(shardd__fdstore *fs, pool *p, const char *base,
                      const char *text, torn *t) {
  for (size_t i = 0; i < p->n; i++) {
    const char *n = p->fds[i].name;
    int mine = strncmp(n, base, strlen(base)) == 0 &&
               strlen(n) == strlen(base) + 2;
    if (!mine && !p->taken[i] && !p->kept[i]) {
      /* a region its text names: " NAME\n", or " NAME OFFSET\n" (a
       * slab's); a hit inside a longer name is passed over */
      size_t l = strlen(n);
      for (const char *hit = strstr(text, n); hit && !mine;
           hit = strstr(hit + 1, n))
        mine = hit > text && hit[-1] == ' ' &&
               (hit[l] == '\n' || hit[l] == ' ');
    }
    if (!mine || p->taken[i] || p->kept[i])
      continue;
    shardd__fdstore_fd *nf = realloc(t->fds, (t->nfds + 1) * sizeof *nf);
    char **nn = nf ? realloc(t->names, (t->nfds + 1) * sizeof *nn) : NULL;
    if (nf)
      t->fds = nf;
    if (nn)
      t->names = nn;
    char *dup = nn ? strdup(n) : NULL;
    if (dup == NULL)
      continue; /* closed and removed with the unused: the memory goes */
    t->fds[t->nfds] = (shardd__fdstore_fd){p->fds[i].fd, dup};
    t->names[t->nfds++] = dup;
    p->kept[i] = 1;
  }
  (void)fs;
}

/* Marks uid's job jname torn (why NULL: killed in step in_step of
 * optimizer in_opt, 0 an unnamed one; else its description could not be
 * adopted, for that reason), keeping its fds in the store. */
static void add_torn(shardd__fdstore *fs, pool *p, const char *base,
                     const char *text, uint32_t uid, const char *jname,
                     uint64_t in_step, const char *in_opt, const char *why) {
  torn *tn = calloc(1, sizeof *tn);
  if (tn && (tn->key = shardd__fdstore_key_of(uid, jname)) && (tn->name = strdup(jname)) &&
      (why == NULL || (tn->why = strdup(why)))) {
    tn->step = in_step;
    tn->anonymous = in_step == 0;
    snprintf(tn->opt, sizeof tn->opt, "%s", in_opt ? in_opt : "");
    keep_torn(fs, p, base, text, tn);
    tn->next = fs->torn;
    fs->torn = tn;
  } else if (tn) {
    free(tn->key);
    free(tn->name);
    free(tn);
  }
}

/* The step journal of base's description (t, job jname of uid): 1 when
 * a step was in progress or the journal is damaged (the job is then torn:
 * refused, logged), 0 when the memory is whole. */
static int journal_torn(shardd__fdstore *fs, pool *p, const char *base,
                        const char *t, int jfd, uint32_t uid,
                        const char *jname) {
  struct stat jst;
  const jrnl *j = MAP_FAILED;
  if (fstat(jfd, &jst) == 0 && jst.st_size >= JRNL_BYTES)
    j = mmap(NULL, JRNL_BYTES, PROT_READ, MAP_SHARED, jfd, 0);
  if (j == MAP_FAILED || memcmp(j->magic, JRNL_MAGIC, 8) != 0) {
    /* whether a step was running cannot be told: refused, not fresh */
    if (j != MAP_FAILED)
      munmap((void *)j, JRNL_BYTES);
    shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") not resumed: its "
                "step journal is damaged; every attach is refused until it "
                "is released (shardctl release) or restored from a "
                "checkpoint", jname, uid);
    add_torn(fs, p, base, t, uid, jname, 0, NULL,
             "its step journal is damaged");
    return 1;
  }
  uint64_t in_step = 0, overflow = 0;
  char in_opt[112] = "";
  {
    overflow = atomic_load(&j->overflow);
    for (int i = 0; i < JRNL_RECS && in_step == 0; i++) {
      uint64_t s1 = atomic_load_explicit(&j->rec[i].step1, memory_order_acquire);
      if (s1) {
        in_step = s1 - 1;
        memcpy(in_opt, j->rec[i].name, sizeof in_opt);
        in_opt[sizeof in_opt - 1] = '\0';
      }
    }
    munmap((void *)j, JRNL_BYTES);
  }
  if (in_step || overflow) {
    add_torn(fs, p, base, t, uid, jname, in_step, in_opt, NULL);
    if (in_step)
      shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") is torn: the "
                  "daemon died during step %" PRIu64 " of optimizer \"%s\", "
                  "and its memory may hold half of it; not resumed, and "
                  "every attach is refused until it is released (shardctl "
                  "release) or restored from a checkpoint", jname, uid,
                  in_step, in_opt);
    else
      shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") is torn: the "
                  "daemon died during one of its steps; not resumed", jname,
                  uid);
    return 1;
  }

  return 0;
}

/* The adopted job's description goes on in the same three memfds (idx:
 * their places in p, k the newest slot, of generation gen and format
 * ver); on failure the job runs undescribed until its next change. */
static void keep_describing(shardd__fdstore *fs, pool *p, shardd__job *job,
                            const char *base, const ssize_t idx[3], int k,
                            uint64_t gen, int ver, uint32_t uid,
                            const char *jname) {
  char name[80];
  fs_job *e = calloc(1, sizeof *e);
  char *ekey = shardd__fdstore_key_of(uid, jname);
  if (e && ekey && shardd__map_put_str(&fs->jobs, ekey, e) == SHARDD_OK) {
    e->key = ekey;
    e->job = job;
    snprintf(e->base, sizeof e->base, "%s", base);
    for (int q = 0; q < 3; q++) {
      e->fd[q] = idx[q] >= 0 ? p->fds[idx[q]].fd : -1;
      if (idx[q] >= 0)
        p->taken[idx[q]] = 2; /* the entry's own from here */
    }
    if (e->fd[1 - k] < 0) { /* a slot lost: a new one, stored */
      shardd__fdstore_fd_name(e, 1 - k, name, sizeof name);
      e->fd[1 - k] = memfd_create(name, MFD_CLOEXEC);
      if (e->fd[1 - k] >= 0)
        shardd__fdstore_store_fd(e->fd[1 - k], name);
    }
    e->gen = gen;
    e->active = k;
    e->dirty = 1;
    if (e->fd[1 - k] < 0 || shardd__fdstore_map_journal(e) != SHARDD_OK) {
      shardd__map_del_str(&fs->jobs, e->key);
      shardd__fdstore_entry_free(e, 0);
    } else if (shardd__fdstore_sync_entry(fs, e) == SHARDD_OK && ver == 1) {
      /* (written anew: the new generations of its handles) */
      /* the slot of the format before goes, now that a whole one of this
       * format is there: a daemon that reads only that format (a
       * downgrade) would take its step counts, stale from the next step
       * on, for the job's */
      slot_hdr zero;
      memset(&zero, 0, sizeof zero);
      if (pwrite(e->fd[k], &zero, sizeof zero, 0) != (ssize_t)sizeof zero)
        shardd__log(1, "fd store: job \"%s\": its description of the format "
                    "before could not be cleared: %s", jname,
                    strerror(errno));
    }
  } else {
    free(e);
    free(ekey);
  }
}

/* One job's description (its three fds, any of them missing): adopted,
 * torn or refused. 0 adopted, 1 refused (logged). */
static int adopt_one(shardd__fdstore *fs, pool *p, const char *base,
                     void (*adopted)(void *, shardd__job *, uint64_t),
                     void *arg) {
  char name[80], err[1024];
  ssize_t idx[3];
  for (int k = 0; k < 3; k++) {
    snprintf(name, sizeof name, "%s-%c", base, "abj"[k]);
    idx[k] = pool_find(p, name);
  }
  uint64_t gen[2] = {0, 0};
  size_t len[2] = {0, 0};
  int ver[2] = {0, 0};
  char *text[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++)
    if (idx[k] >= 0)
      text[k] = read_slot(p->fds[idx[k]].fd, &gen[k], &len[k], &ver[k]);
  int k = text[0] && (!text[1] || gen[0] > gen[1]) ? 0 : 1;
  char *t = text[k];
  free(text[1 - k]);
  if (t == NULL || idx[2] < 0) {
    shardd__log(0, "fd store: description %s: %s; its job is not resumed",
                base, idx[2] < 0 ? "no step journal" : "no whole slot");
    free(t);
    return 1;
  }
  const char *manifest = strstr(t, "\nmanifest\n");
  manifest = manifest ? manifest + 10
                      : (strncmp(t, "manifest\n", 9) == 0 ? t + 9 : NULL);
  char jname[256];
  uint32_t uid = 0;
  if (manifest == NULL || !job_of(manifest, jname, sizeof jname, &uid)) {
    shardd__log(0, "fd store: description %s: no job line; not resumed", base);
    free(t);
    return 1;
  }
  char *key = shardd__fdstore_key_of(uid, jname);
  if (key) /* the map copies its keys; any non-NULL value marks one */
    shardd__map_put_str(&fs->held, key, fs);
  free(key);

  /* the journal: a step in progress makes the job torn */
  if (journal_torn(fs, p, base, t, p->fds[idx[2]].fd, uid, jname)) {
    free(t);
    return 1;
  }

  /* the step counts committed through the journal since this slot was
   * written (a slot of format 1 has every step's own) */
  char *stepped = NULL;
  shardd_err rc = ver[k] >= 2 ? journal_steps(p->fds[idx[2]].fd, gen[k],
                                              manifest, &stepped, err,
                                              sizeof err)
                              : SHARDD_OK;
  /* rebuilt through the restore's apply, then the memory swapped in */
  shardd__ckrestore *r = NULL;
  char label[300];
  snprintf(label, sizeof label, "fd store %s", base);
  const char *mtext = stepped ? stepped : manifest;
  if (rc == SHARDD_OK)
    rc = shardd__checkpoint_restore_read_text(fs->reg, label, mtext,
                                              strlen(mtext), &r, err,
                                              sizeof err);
  free(stepped);
  if (rc == SHARDD_OK)
    rc = shardd__checkpoint_restore_apply(r, err, sizeof err);
  shardd__job *job = NULL;
  if (rc == SHARDD_OK) {
    job = shardd__checkpoint_restore_finish(r);
    rc = swap_regions(fs, p, job, t, err, sizeof err);
    if (rc != SHARDD_OK) {
      shardd__job_release(fs->reg, job);
      job = NULL;
    }
  }
  shardd__checkpoint_restore_free(r);
  if (rc != SHARDD_OK) {
    /* refused as a torn job is: a relaunch must not start it afresh in
     * silence (a kill between a buffer's free and its description's
     * rewrite leaves a description naming memory no longer stored) */
    shardd__log(0, "fd store: job \"%s\" (uid %" PRIu32 ") not resumed: %s; "
                "every attach is refused until it is released (shardctl "
                "release) or restored from a checkpoint", jname, uid, err);
    add_torn(fs, p, base, t, uid, jname, 0, NULL, err);
    free(t);
    return 1;
  }
  free(t);
  keep_describing(fs, p, job, base, idx, k, gen[k], ver[k], uid, jname);
  adopted(arg, job, job_step(job));
  return 0;
}

int shardd__fdstore_adopt(shardd__fdstore *fs, shardd__fdstore_fd *fds,
                          size_t n,
                          void (*adopted)(void *arg, shardd__job *job,
                                          uint64_t step),
                          void *arg) {
  pool p = {fds, n, calloc(n ? n : 1, 1), calloc(n ? n : 1, 1)};
  int refused = 0;
  if (p.taken == NULL || p.kept == NULL) {
    shardd__log(0, "fd store: out of memory adopting %zu descriptors", n);
    refused = 1;
    n = 0;
  }
  for (size_t i = 0; i < n; i++) {
    const char *nm = fds[i].name;
    size_t l = strlen(nm);
    /* each description once, by its journal */
    if (p.taken[i] || p.kept[i] || strncmp(nm, META_PREFIX, 8) != 0 || l < 3 ||
        strcmp(nm + l - 2, "-j") != 0)
      continue;
    char base[80];
    if (l - 2 >= sizeof base)
      continue;
    memcpy(base, nm, l - 2);
    base[l - 2] = '\0';
    refused += adopt_one(fs, &p, base, adopted, arg);
  }
  /* what no job took: out of the store; a region taken is mapped through
   * a descriptor of its own, so the one handed back is closed too */
  size_t dropped = 0;
  for (size_t i = 0; i < p.n; i++) {
    if (p.taken && p.kept && (p.taken[i] == 2 || p.kept[i]))
      continue;
    if (p.taken && !p.taken[i]) {
      shardd__fdstore_unstore_fd(fds[i].name);
      dropped++;
    }
    close(fds[i].fd);
  }
  if (dropped)
    shardd__log(2, "fd store: %zu descriptor%s no job holds removed", dropped,
                dropped == 1 ? "" : "s");
  free(p.taken);
  free(p.kept);
  return refused;
}

int shardd__fdstore_held(const shardd__fdstore *fs, uint32_t uid,
                         const char *name) {
  char *key = shardd__fdstore_key_of(uid, name);
  int held = key && shardd__map_get_str(&fs->held, key) != NULL;
  free(key);
  return held;
}

static torn *find_torn(const shardd__fdstore *fs, uint32_t uid,
                       const char *name) {
  for (torn *t = fs->torn; t; t = t->next)
    if (!strcmp(t->name, name) &&
        strtoul(t->key, NULL, 10) == (unsigned long)uid)
      return t;
  return NULL;
}

void shardd__fdstore_set_hint(shardd__fdstore *fs, uint32_t uid,
                              const char *name, const char *checkpoint) {
  torn *t = find_torn(fs, uid, name);
  if (t) {
    free(t->hint);
    t->hint = checkpoint ? strdup(checkpoint) : NULL;
  }
}

int shardd__fdstore_torn(const shardd__fdstore *fs, uint32_t uid,
                         const char *name, char *msg, size_t len) {
  const torn *t = fs ? find_torn(fs, uid, name) : NULL;
  if (t == NULL)
    return 0;
  char where[4200];
  if (t->hint)
    snprintf(where, sizeof where, "its newest checkpoint is %s: `shardctl "
             "release %s` then `shardctl restore %s`", t->hint, name, t->hint);
  else
    snprintf(where, sizeof where, "no checkpoint of it is known to this "
             "daemon: restore one you wrote after `shardctl release %s`, or "
             "release it to start afresh", name);
  if (t->why)
    snprintf(msg, len, "job \"%s\" could not be resumed from the fd store "
             "(%s); not resumed. %s", name, t->why, where);
  else if (t->anonymous)
    snprintf(msg, len, "job \"%s\" is torn: the daemon died during one of "
             "its steps, and its memory may hold half of it; not resumed. %s",
             name, where);
  else
    snprintf(msg, len, "job \"%s\" is torn: the daemon died during step %"
             PRIu64 " of optimizer \"%s\", and its memory may hold half of "
             "that step; not resumed. %s", name, t->step, t->opt, where);
  return 1;
}

int shardd__fdstore_forget_torn(shardd__fdstore *fs, uint32_t uid,
                                const char *name) {
  if (fs == NULL)
    return 0;
  for (torn **pp = &fs->torn; *pp; pp = &(*pp)->next) {
    torn *t = *pp;
    if (strcmp(t->name, name) || strtoul(t->key, NULL, 10) != (unsigned long)uid)
      continue;
    *pp = t->next;
    for (size_t i = 0; i < t->nfds; i++)
      shardd__fdstore_unstore_fd(t->names[i]);
    shardd__log(2, "fd store: torn job \"%s\" released; its memory is out of "
                "the store", name);
    shardd__fdstore_free_torn(t);
    return 1;
  }
  return 0;
}
