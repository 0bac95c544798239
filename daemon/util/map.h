/* map.h — the two hash maps the registry indexes by: uint64 ids and string
 * keys. Maps store borrowed pointers; string keys are copied and owned by the
 * map. Not thread-safe: used from the loop thread only. */
#ifndef SHARDD_MAP_H
#define SHARDD_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

typedef struct shardd__map_entry shardd__map_entry;

typedef struct {
  /* private */
  shardd__map_entry **slots;
  size_t nslots;
  size_t count;
  /* id entries deleted, kept for the next puts (a view's registration and
   * unregistration put and delete two: the objects' and the freed ids'),
   * at most SHARDD__MAP_SPARE_MAX */
  shardd__map_entry *spare;
  size_t nspare;
} shardd__map;

#define SHARDD__MAP_SPARE_MAX 256

void shardd__map_init(shardd__map *m);
/* Frees the map's own memory, not the values. */
void shardd__map_free(shardd__map *m);
size_t shardd__map_count(const shardd__map *m);

/* Id keys. put replaces an existing value. */
shardd_err shardd__map_put_id(shardd__map *m, uint64_t id, void *value);
void *shardd__map_get_id(const shardd__map *m, uint64_t id);
void *shardd__map_del_id(shardd__map *m, uint64_t id);

/* String keys (any bytes up to NUL). */
shardd_err shardd__map_put_str(shardd__map *m, const char *key, void *value);
void *shardd__map_get_str(const shardd__map *m, const char *key);
void *shardd__map_del_str(shardd__map *m, const char *key);
/* Where key's value lives, added (its value NULL) when key is absent: a
 * read and a write under one hash and one search. NULL when out of
 * memory. Valid until the map next changes. */
void **shardd__map_slot_str(shardd__map *m, const char *key);

/* Calls fn on every value; fn must not change the map. */
void shardd__map_each(const shardd__map *m, void (*fn)(void *value, void *arg),
                      void *arg);

#endif /* SHARDD_MAP_H */
