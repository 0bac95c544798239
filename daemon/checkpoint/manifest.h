/* manifest.h — the text of a checkpoint's manifest, below write and
 * restore (inside the checkpoint module; checkpoint.h is its public
 * interface): the one place that knows the format, writing and parsing
 * every line (checkpoint.c and restore.c deal in what the lines say),
 * name encoding, bounded line reading and the seal check; the job
 * manifest of a multi-node job. Names are percent-encoded so any byte string survives the
 * space-separated format. */
#ifndef SHARDD_MANIFEST_H
#define SHARDD_MANIFEST_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "shardd.h"
#include "strbuf.h"

#define SHARDD__MANIFEST_FILE "manifest"
/* The first word of a manifest (of one node's job, or of a node's part). */
#define SHARDD__MANIFEST_MAGIC "shardd-checkpoint"
/* The manifest's own version. 2 recorded each buffer's and view's
 * generation and each view's requires_grad. Version 3 seals the manifest:
 * its "end" line carries the CRC32C of every byte before it, checked before
 * any line is acted upon; restore refuses versions 1 and 2, which carry no
 * seal (an edited step count in one was taken as written). Version 4 ends
 * each "ref" line with the steps that ref took (torch's per-parameter
 * state["step"]; a skipped parameter's stays); before it every ref was
 * stepped by every step, so a version 3 manifest restores each ref with its
 * optimizer's count. Version 5 is a node's part of a multi-node checkpoint
 * ("node" and "lineage" lines after the job line), so a daemon that reads
 * up to 4 refuses it at its header; single-node manifests are still
 * written as 4, which such a daemon restores. Data file headers keep
 * SHARDD_CHECKPOINT_VERSION. */
#define SHARDD_MANIFEST_VERSION 5
/* The oldest version restore accepts: the first that is sealed. */
#define SHARDD_MANIFEST_SEALED 3
#define SHARDD_MANIFEST_VERSION_SINGLE 4
/* The first word of a multi-node job's job-level manifest (checkpoint.h);
 * a node's part is an ordinary manifest in DIR/node-N. */
#define SHARDD__JOB_MANIFEST_MAGIC "shardd-job-checkpoint"
#define SHARDD__JOB_MANIFEST_VERSION 1

/* The longest manifest line restore reads (and write produces). The
 * longest one is an optimizer's: its RegisterOptimizer in hex, with its
 * name and step count. A client's registration fits one frame, but a
 * restored one is repacked with new ids and generations (longer varints),
 * so the cap allows a spec of two frames; write refuses past it rather than
 * leave a checkpoint restore would refuse. The manifest comes from a
 * directory the client names, and getline grew its buffer to whatever one
 * line held: a planted manifest without newlines cost its size in memory. */
#define SHARDD__MANIFEST_LINE_MAX ((size_t)4 * SHARDD_MAX_FRAME + 4096)

/* The largest manifest restore reads, checked on its size before a byte is
 * read (write refuses to leave a larger one). Restore holds the text whole
 * while it checks the seal and splits the lines off the loop thread, then
 * the loads and states its lines plan (about three times the text): the
 * cap keeps one restore near 1 GiB. A manifest takes about 40 bytes per
 * shard file and 80 per optimizer state file: 256 MiB is millions of data
 * files, each a file of its own in the directory. A planted 1.5 GB
 * manifest held the loop 4-6 s, and its plans would have held ~4.5 GB. */
#define SHARDD__MANIFEST_MAX ((size_t)256 << 20)

/* Appends s to sb percent-encoded (bytes <= 0x20, >= 0x7f and '%'). */
void shardd__manifest_enc_name(shardd__sb *sb, const char *s);
/* Decodes s in place; returns 0 on a malformed escape or an escaped NUL. */
int shardd__manifest_dec_name(char *s);
/* The value of a lowercase hex digit, -1 for anything else. */
int shardd__manifest_hexval(char c);

typedef enum {
  SHARDD__LINE_OK,
  SHARDD__LINE_EOF,
  SHARDD__LINE_LONG,
  SHARDD__LINE_NUL,
  SHARDD__LINE_NOMEM,
  SHARDD__LINE_IO
} shardd__line_rc;

/* Reads the next line of f, without its newline, into *buf (the caller's,
 * grown with realloc to at most max + 1 bytes; free() it). */
shardd__line_rc shardd__manifest_read_line(FILE *f, char **buf, size_t *cap,
                                           size_t max);

/* Checks the seal of a manifest (the CRC32C on its "end" line) before any
 * line is acted upon, then rewinds f: SHARDD_E_INVAL with err naming path
 * and line when it does not match. *seal is the checked CRC and *end_line
 * the number of the line it was checked on; 0 when the manifest has no
 * such line (an unsealed version, or truncated: the parser says which).
 * A reader takes the manifest as sealed only when its own "end" line is
 * line *end_line: another line it reads as "end" (" end 0", say) was not
 * checked. */
shardd_err shardd__manifest_verify_seal(FILE *f, const char *path,
                                        uint32_t *seal, int *end_line,
                                        char *err, size_t errlen);

/* A line's words: at most this many are looked at. */
#define SHARDD__MANIFEST_MAX_TOK 64
/* Splits line (NUL-ended) into its words, in place, at most
 * SHARDD__MANIFEST_MAX_TOK of them; the number of words. */
int shardd__manifest_split_words(char *line, char **tok);

/* text (n bytes and a NUL) is a manifest read whole: ends each line with a
 * NUL where its newline was and checks the seal (the CRC32C on its "end"
 * line, of every byte before it): SHARDD_E_INVAL with err naming path and
 * line on a mismatch, before any line is acted upon; *seal_line is the
 * "end" line checked (untouched when none). A line the line reader would
 * refuse (too long, a NUL byte) stops the split: *stop_line is its number
 * and *stop_rc why (untouched when none). */
shardd_err shardd__manifest_split_text(char *text, size_t n, const char *path,
                                       int *stop_line, shardd__line_rc *stop_rc,
                                       int *seal_line, char *err,
                                       size_t errlen);
/* Why line lineno of path was refused by the reader, in err; the code. */
shardd_err shardd__manifest_line_error(shardd__line_rc lr, const char *path,
                                       int lineno, char *err, size_t errlen);
/* Checks a manifest's header line's words (the magic, a version restore
 * reads and sealed): SHARDD_OK with *version, or SHARDD_E_INVAL with why
 * (*version set once the magic matched). */
shardd_err shardd__manifest_header(char **tok, int nt, int *version, char *why,
                                   size_t whylen);

/* ---- the lines, written ------------------------------------------------
 * The writer's side of the format (checkpoint.c gathers what they say).
 * A data file's line carries its CRC32C, known only once the file is
 * written: the line is written with 00000000 there, and the function
 * returns the offset in sb of those 8 digits for the writer to fill. */

/* "shardd-checkpoint VERSION" and "job NAME WORLD OWNER". */
void shardd__manifest_put_head(shardd__sb *sb, int version, const char *job,
                               uint32_t world, uint32_t owner);
/* "node N NODES" (a node's part of a multi-node checkpoint). */
void shardd__manifest_put_node(shardd__sb *sb, uint32_t node, uint32_t nodes);
/* "lineage LINEAGE ORIGIN" (the job's fabric, in hex). */
void shardd__manifest_put_lineage(shardd__sb *sb, uint64_t lineage,
                                  uint64_t origin);
/* "areas transient". */
void shardd__manifest_put_transient(shardd__sb *sb);
/* "buffer NAME DTYPE NUMEL GEN". */
void shardd__manifest_put_buffer(shardd__sb *sb, const char *name, int dtype,
                                 uint64_t numel, uint64_t generation);
/* "shard BUF RANK FILE CRC": the offset of CRC. */
size_t shardd__manifest_put_shard(shardd__sb *sb, size_t buf, uint32_t rank,
                                  const char *file);
/* "view BUF NAME OFFSET NUMEL NDIM DIM... GEN REQUIRES_GRAD". */
void shardd__manifest_put_view(shardd__sb *sb, size_t buf, const char *name,
                               uint64_t offset, uint64_t numel, int ndim,
                               const int64_t *shape, uint64_t generation,
                               int requires_grad);
/* "optimizer INDEX NAME STEPS SPEC_HEX". */
void shardd__manifest_put_optimizer(shardd__sb *sb, size_t index,
                                    const char *name, uint64_t steps,
                                    const uint8_t *spec, size_t spec_len);
/* "ref OPT OLD_ID view BUF NAME STEPS" (view NULL: "ref OPT OLD_ID buffer
 * BUF STEPS"). */
void shardd__manifest_put_ref(shardd__sb *sb, size_t opt, uint64_t old_id,
                              size_t buf, const char *view, uint64_t steps);
/* "state OPT BUF RANK MASTER_VALID FILE CRC BYTES NSTATE": the offset of
 * CRC. */
size_t shardd__manifest_put_state(shardd__sb *sb, size_t opt, size_t buf,
                                  uint32_t rank, int master_valid,
                                  const char *file, size_t bytes, int nstate);
/* "end SEAL": the CRC32C of every byte before it. */
void shardd__manifest_put_end(shardd__sb *sb, uint32_t seal);

/* ---- the lines, parsed -------------------------------------------------
 * The reader's side: a line's words (split by shardd__manifest_split_words)
 * as what they say. Only the words are read here; whether a line fits the
 * lines above it (a buffer index in range, a job line first) is restore's
 * to say, and so is every refusal: a parsed line keeps the words its
 * messages quote as written. */

typedef enum {
  SHARDD__ML_UNKNOWN, /* no line of the format, or not its word count */
  SHARDD__ML_END,     /* any word count: restore says when it is wrong */
  SHARDD__ML_JOB,
  SHARDD__ML_NODE,
  SHARDD__ML_LINEAGE,
  SHARDD__ML_TRANSIENT,
  SHARDD__ML_BUFFER,
  SHARDD__ML_SHARD,
  SHARDD__ML_VIEW,
  SHARDD__ML_OPTIMIZER,
  SHARDD__ML_REF,
  SHARDD__ML_STATE
} shardd__mline_kind;

/* The most dimensions a view line may have. */
#define SHARDD__MANIFEST_VIEW_DIMS 16

/* One line. Names are decoded in place in the words (name_ok 0: a
 * malformed escape); numbers are read as restore always read them
 * (strtoul and friends: what does not parse is 0). */
typedef struct {
  shardd__mline_kind kind;
  union {
    struct {
      char *name; /* decoded when name_ok */
      int name_ok;
      const char *world_word; /* as written, for messages */
      unsigned long world;
      uint32_t owner;
    } job;
    struct {
      uint32_t node, nodes;
    } node;
    struct {
      uint64_t lineage, origin;
    } lineage;
    struct {
      char *name;
      int name_ok;
      int dtype;
      uint64_t numel, generation;
    } buffer;
    struct {
      size_t buf;
      uint32_t rank;
      const char *file;
      int file_ok; /* a plain name, no '/' */
      uint32_t crc;
    } shard;
    struct {
      size_t buf;
      int ok; /* its dimensions and word count agree, its name decoded */
      char *name;
      uint64_t offset, numel;
      int ndim;
      int64_t shape[SHARDD__MANIFEST_VIEW_DIMS];
      uint64_t generation;
      int requires_grad;
    } view;
    struct {
      size_t index;
      char *name;
      int name_ok;
      uint64_t steps;
      const char *spec_hex; /* the registration, in hex (manifest_unhex) */
    } optimizer;
    struct {
      size_t opt, buf;
      uint64_t old_id;
      int is_view; /* else "buffer" (ok says whether it is that) */
      int ok;      /* its word count is the kind's, a view's name decoded */
      char *view;
      int has_steps; /* version 4 on */
      uint64_t steps;
    } ref;
    struct {
      size_t opt, buf;
      const char *rank_word; /* as written, for messages */
      unsigned long rank;
      int master_valid;
      const char *file;
      int file_ok;
      uint32_t crc;
      const char *bytes_word;
      unsigned long long bytes;
      int bytes_ok; /* it parsed without overflow */
      int nstate;
    } state;
  } u;
} shardd__mline;

/* The kind of a line of words (nt of them, nt > 0) in a manifest of
 * version (the header's; "ref" lines end with steps from version 4). */
shardd__mline_kind shardd__manifest_kind(char **tok, int nt);
/* Parses the words of a line of that kind into *ml (in place: names are
 * decoded in tok). */
void shardd__manifest_parse(char **tok, int nt, int version,
                            shardd__mline *ml);
/* Decodes hex (lowercase, an even count of digits) into out (room for
 * strlen(hex) / 2 bytes); 0 on a bad digit or an odd count. */
int shardd__manifest_unhex(const char *hex, uint8_t *out);

/* ---- the job manifest --------------------------------------------------
 * A multi-node job's manifest in DIR, over its nodes' parts in DIR/node-N:
 * "shardd-job-checkpoint VERSION", "job NAME WORLD OWNER", "nodes NODES",
 * "part N node-N SEAL" for every node, "end SEAL". */

/* A job-level manifest lists at most this many nodes (the seals cross the
 * nodes in one all_reduce of SHARDD_ALL_REDUCE_MAX values). */
#define SHARDD__CKJOB_MAX_NODES 64

/* What a job-level manifest says (shardd__checkpoint_write_job writes it);
 * nodes 0 when the manifest in dir is an ordinary single-node one. */
typedef struct shardd__ckjob {
  char name[256];
  uint32_t world, uid, nodes;
  uint32_t seals[SHARDD__CKJOB_MAX_NODES];
  uint32_t seal; /* the job manifest's own */
} shardd__ckjob;

/* Writes the whole job manifest into sb (seals[n]: node n's part's);
 * returns its seal, the CRC32C on its "end" line. */
uint32_t shardd__manifest_put_job(shardd__sb *sb, const char *name,
                                  uint32_t world, uint32_t owner,
                                  uint32_t nodes, const uint32_t *seals);
/* Reads the manifest in f, its seal checked on line end_line (0: none),
 * as a job manifest into *out (zeroed by the caller): 1 when it is one,
 * complete; 0 when it is an ordinary manifest (out->nodes 0); -1 when it
 * is malformed or incomplete, *lineno the line where that showed. */
int shardd__manifest_read_job(FILE *f, int end_line, shardd__ckjob *out,
                              int *lineno);

#endif /* SHARDD_MANIFEST_H */
