/* test_backend_host.c — the host backend's slabs: a batched registration's
 * blocks of one rank in one memfd, each at a page-aligned offset; the file
 * cut to its blocks and sealed at close; a block freed punched out of the
 * file while the others keep their bytes, counted used until the last
 * block goes and closes the file; a slab adopted at a restart with ranges
 * no block holds punched out. Expected offsets and sizes are computed here
 * from the page size, not with the backend's rounding. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"

static shardd__backend *be;
static size_t pg;
static char err[512];

static void setup(void) {
  cr_assert_eq(shardd__backend_host_create(1, 64ull << 20, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  pg = (size_t)sysconf(_SC_PAGESIZE);
}

static void teardown(void) { be->ops->destroy(be); }

TestSuite(backend_host, .init = setup, .fini = teardown);

static uint64_t used(void) {
  shardd__device_info di;
  be->ops->device_info(be, 0, &di);
  return di.used_bytes;
}

/* Bytes of fd's file at off, read through the file, not a mapping. */
static unsigned char byte_at(int fd, size_t off) {
  unsigned char c = 0xee;
  cr_assert_eq(pread(fd, &c, 1, (off_t)off), 1, "pread: %s", strerror(errno));
  return c;
}

static int fd_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }

/* What each of three()'s blocks counted for as it was taken. */
static uint64_t taken_bytes[3];
static int taken_fds[3];

/* Three blocks of 1, 2.5 and 1 page(s) taken from one slab, left open. */
static shardd__slab *three(shardd__region *r[3], size_t *sz) {
  shardd__slab *s;
  sz[0] = pg;
  sz[1] = 2 * pg + pg / 2;
  sz[2] = 1;
  cr_assert_eq(be->ops->slab_open(be, 0, sz[0] + sz[1] + sz[2], 3, "t", &s,
                                  err, sizeof err), SHARDD_OK, "%s", err);
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(be->ops->slab_take(be, s, sz[i], &r[i], err, sizeof err),
                 SHARDD_OK, "%s", err);
    shardd__backend_region_taken(r[i], &taken_bytes[i], &taken_fds[i]);
  }
  return s;
}

Test(backend_host, a_slab_s_blocks_lie_at_page_aligned_offsets_of_one_file) {
  shardd__region *r[3];
  size_t sz[3];
  shardd__slab *s = three(r, sz);
  /* pages: 1, 3 (2.5 rounded up), 1 */
  const size_t want_off[3] = {0, pg, 4 * pg}, want_bytes[3] = {pg, 3 * pg, pg};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(r[i]->slab, s);
    cr_assert_eq(r[i]->fd, r[0]->fd, "one descriptor for all");
    cr_assert_eq(r[i]->off, want_off[i]);
    cr_assert_eq(r[i]->bytes, want_bytes[i]);
    cr_assert_eq((char *)r[i]->ptr - (char *)r[0]->ptr, (ptrdiff_t)want_off[i]);
    memset(r[i]->ptr, 0x10 + i, r[i]->bytes); /* the daemon's mapping */
  }
  cr_assert_eq(used(), 5 * pg);
  cr_assert_eq(taken_fds[0], 1, "the first block counts the slab's descriptor");
  cr_assert_eq(taken_fds[1] + taken_fds[2], 0, "later blocks add none");
  cr_assert_eq(taken_bytes[0] + taken_bytes[1] + taken_bytes[2], 5 * pg);
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK, "%s", err);
  /* cut to its blocks (the room for rounding gone) and sealed: a client
   * holding the descriptor can neither grow it nor shrink it */
  struct stat st;
  cr_assert_eq(fstat(r[0]->fd, &st), 0);
  cr_assert_eq((size_t)st.st_size, 5 * pg);
  int seals = fcntl(r[0]->fd, F_GET_SEALS);
  cr_assert_eq(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
               F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  cr_assert_neq(ftruncate(r[0]->fd, (off_t)(6 * pg)), 0);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(byte_at(r[i]->fd, r[i]->off + r[i]->bytes - 1), 0x10 + i);
  for (int i = 0; i < 3; i++)
    be->ops->free(be, r[i]);
}

Test(backend_host, a_block_freed_is_punched_out_and_the_others_keep_their_bytes) {
  shardd__region *r[3];
  size_t sz[3];
  shardd__slab *s = three(r, sz);
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK);
  for (int i = 0; i < 3; i++)
    memset(r[i]->ptr, 0x20 + i, r[i]->bytes);
  int fd = r[0]->fd;
  size_t off1 = r[1]->off;
  unsigned char *p0 = r[0]->ptr, *p2 = r[2]->ptr;
  uint64_t b;
  int n;
  shardd__backend_region_gives(r[1], &b, &n);
  cr_assert_eq(b, 0, "not the last: its bytes stay counted");
  cr_assert_eq(n, 0);
  be->ops->free(be, r[1]);
  cr_assert_eq(byte_at(fd, off1), 0, "punched: the file reads zeros there");
  cr_assert_eq(byte_at(fd, off1 + 3 * pg - 1), 0);
  cr_assert_eq(p0[0], 0x20);
  cr_assert_eq(p2[pg - 1], 0x22);
  p2[7] = 0x7f; /* still the daemon's, writable */
  cr_assert_eq(byte_at(fd, r[2]->off + 7), 0x7f);
  /* counted until the slab goes: a client holding its descriptor could
   * fault pages back into the range */
  cr_assert_eq(used(), 5 * pg);
  cr_assert(fd_open(fd));
  be->ops->free(be, r[0]);
  cr_assert(fd_open(fd));
  shardd__backend_region_gives(r[2], &b, &n);
  cr_assert_eq(b, 5 * pg, "the last gives back the whole slab");
  cr_assert_eq(n, 1, "and its descriptor");
  be->ops->free(be, r[2]);
  cr_assert_not(fd_open(fd), "the last block closed the file");
  cr_assert_eq(used(), 0);
}

Test(backend_host, a_block_freed_before_close_is_given_back_at_once) {
  shardd__region *r[3];
  size_t sz[3];
  shardd__slab *s = three(r, sz);
  uint64_t b;
  int n;
  shardd__backend_region_gives(r[1], &b, &n);
  cr_assert_eq(b, 3 * pg, "nobody else holds the descriptor yet");
  cr_assert_eq(n, 0);
  be->ops->free(be, r[1]);
  cr_assert_eq(used(), 2 * pg);
  be->ops->free(be, r[0]);
  shardd__backend_region_gives(r[2], &b, &n);
  cr_assert_eq(n, 1, "the last live block carries the descriptor");
  int fd = r[2]->fd;
  be->ops->free(be, r[2]);
  cr_assert(fd_open(fd), "open: its batch may still take blocks");
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK);
  cr_assert_not(fd_open(fd), "closed with no block: gone");
  cr_assert_eq(used(), 0);
}

Test(backend_host, a_slab_no_block_took_goes_at_close) {
  shardd__slab *s;
  cr_assert_eq(be->ops->slab_open(be, 0, 10 * pg, 10, "t", &s, err, sizeof err),
               SHARDD_OK);
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK);
  cr_assert_eq(used(), 0);
}

Test(backend_host, a_block_past_the_slab_s_room_or_capacity_is_refused) {
  shardd__slab *s;
  shardd__region *r;
  cr_assert_eq(be->ops->slab_open(be, 0, pg, 1, "t", &s, err, sizeof err),
               SHARDD_OK);
  cr_assert_eq(be->ops->slab_take(be, s, 64ull << 20, &r, err, sizeof err),
               SHARDD_E_INTERNAL, "past its room: %s", err);
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK);
  /* the device's capacity holds for slabs as for regions */
  cr_assert_eq(be->ops->slab_open(be, 0, 65ull << 20, 1, "t", &s, err,
                                  sizeof err), SHARDD_OK);
  cr_assert_eq(be->ops->slab_take(be, s, 65ull << 20, &r, err, sizeof err),
               SHARDD_E_NO_MEMORY, "%s", err);
  cr_assert_eq(used(), 0);
  cr_assert_eq(be->ops->slab_close(be, s, err, sizeof err), SHARDD_OK);
}

Test(backend_host, an_adopted_slab_punches_the_ranges_no_block_holds) {
  /* a previous daemon's slab of 4 pages, its block at page 1 freed (and
   * filled again through a client's descriptor before the restart) */
  int fd = memfd_create("old", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  cr_assert_geq(fd, 0);
  cr_assert_eq(ftruncate(fd, (off_t)(4 * pg)), 0);
  unsigned char *p = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  cr_assert_neq(p, MAP_FAILED);
  for (size_t k = 0; k < 4; k++)
    memset(p + k * pg, 0x30 + (int)k, pg);
  munmap(p, 4 * pg);
  const size_t offs[2] = {2 * pg, 0}, bytes[2] = {2 * pg, pg};
  shardd__region *r[2];
  int keep = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  cr_assert_eq(be->ops->wrap_slab(be, 0, fd, "shardd-rX-1", 2, offs, bytes, r,
                                  err, sizeof err), SHARDD_OK, "%s", err);
  cr_assert_eq(((unsigned char *)r[0]->ptr)[0], 0x32);
  cr_assert_eq(((unsigned char *)r[0]->ptr)[2 * pg - 1], 0x33);
  cr_assert_eq(((unsigned char *)r[1]->ptr)[pg - 1], 0x30);
  cr_assert_eq(byte_at(keep, pg), 0, "the freed block's page punched again");
  cr_assert_eq(used(), 3 * pg);
  cr_assert_str_eq(shardd__backend_region_store_name(r[0]), "shardd-rX-1");
  be->ops->free(be, r[0]);
  cr_assert_eq(used(), 3 * pg);
  be->ops->free(be, r[1]);
  cr_assert_eq(used(), 0);
  close(keep);
}

Test(backend_host, an_adopted_slab_whose_blocks_do_not_fit_is_refused) {
  int fd = memfd_create("old", MFD_CLOEXEC);
  cr_assert_eq(ftruncate(fd, (off_t)(2 * pg)), 0);
  shardd__region *r[2];
  /* overlapping, then past the end, then off a page */
  const size_t o1[2] = {0, pg}, b1[2] = {2 * pg, pg};
  cr_assert_eq(be->ops->wrap_slab(be, 0, fcntl(fd, F_DUPFD_CLOEXEC, 0), "x", 2,
                                  o1, b1, r, err, sizeof err), SHARDD_E_INVAL);
  const size_t o2[1] = {pg}, b2[1] = {2 * pg};
  cr_assert_eq(be->ops->wrap_slab(be, 0, fcntl(fd, F_DUPFD_CLOEXEC, 0), "x", 1,
                                  o2, b2, r, err, sizeof err), SHARDD_E_INVAL);
  const size_t o3[1] = {1}, b3[1] = {pg};
  cr_assert_eq(be->ops->wrap_slab(be, 0, fcntl(fd, F_DUPFD_CLOEXEC, 0), "x", 1,
                                  o3, b3, r, err, sizeof err), SHARDD_E_INVAL);
  /* a gap before a block that does not fit: the refused file's bytes stay
   * (a torn job's memory is the operator's to look at), none punched */
  cr_assert_eq(pwrite(fd, "x", 1, 0), 1);
  const size_t o5[2] = {pg, 2 * pg}, b5[2] = {pg, pg};
  cr_assert_eq(be->ops->wrap_slab(be, 0, fcntl(fd, F_DUPFD_CLOEXEC, 0), "x", 2,
                                  o5, b5, r, err, sizeof err), SHARDD_E_INVAL);
  cr_assert_eq(byte_at(fd, 0), 'x', "a refused slab's gap was punched");
  /* wholly past the file's end: its pointer would lie past the mapping */
  const size_t o4[1] = {4 * pg}, b4[1] = {pg};
  cr_assert_eq(be->ops->wrap_slab(be, 0, fcntl(fd, F_DUPFD_CLOEXEC, 0), "x", 1,
                                  o4, b4, r, err, sizeof err), SHARDD_E_INVAL);
  cr_assert_eq(used(), 0);
  close(fd);
}
