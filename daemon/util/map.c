/* map.c — chained hash maps keyed by uint64 ids or strings (FNV-1a for
 * strings, a 64-bit mixer for ids), doubling at load factor 1. */
#include "map.h"

#include <stdlib.h>
#include <string.h>

#include "hash.h"

struct shardd__map_entry {
  shardd__map_entry *next;
  uint64_t hash;
  uint64_t id;
  char *key; /* NULL for id entries; else keybuf */
  void *value;
  /* a string key's bytes, in the entry's own allocation: one malloc and
   * one free per string entry, not two (a calloc and a strdup were a
   * tenth of a view's registration) */
  char keybuf[];
};

static uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

static uint64_t hash_str(const char *s) {
  return mix64(shardd__fnv1a_str(SHARDD__FNV1A_BASIS, s));
}

void shardd__map_init(shardd__map *m) { memset(m, 0, sizeof *m); }

void shardd__map_free(shardd__map *m) {
  for (size_t i = 0; i < m->nslots; i++) {
    shardd__map_entry *e = m->slots[i];
    while (e) {
      shardd__map_entry *next = e->next;
      free(e);
      e = next;
    }
  }
  while (m->spare) {
    shardd__map_entry *next = m->spare->next;
    free(m->spare);
    m->spare = next;
  }
  free(m->slots);
  memset(m, 0, sizeof *m);
}

size_t shardd__map_count(const shardd__map *m) { return m->count; }

static shardd_err map_grow(shardd__map *m) {
  size_t n = m->nslots ? m->nslots * 2 : 64;
  shardd__map_entry **slots = calloc(n, sizeof *slots);
  if (slots == NULL)
    return SHARDD_E_NO_MEMORY;
  for (size_t i = 0; i < m->nslots; i++) {
    shardd__map_entry *e = m->slots[i];
    while (e) {
      shardd__map_entry *next = e->next;
      size_t j = e->hash & (n - 1);
      e->next = slots[j];
      slots[j] = e;
      e = next;
    }
  }
  free(m->slots);
  m->slots = slots;
  m->nslots = n;
  return SHARDD_OK;
}

static shardd__map_entry **map_find(const shardd__map *m, uint64_t hash,
                                    uint64_t id, const char *key) {
  if (m->nslots == 0)
    return NULL;
  shardd__map_entry **pp = &m->slots[hash & (m->nslots - 1)];
  for (; *pp; pp = &(*pp)->next) {
    shardd__map_entry *e = *pp;
    if (e->hash != hash)
      continue;
    if (key ? (e->key && strcmp(e->key, key) == 0) : (!e->key && e->id == id))
      return pp;
  }
  return NULL;
}

/* The entry under (hash, id, key), added with value when absent; NULL
 * when out of memory. */
static shardd__map_entry *map_entry(shardd__map *m, uint64_t hash, uint64_t id,
                                    const char *key, void *value) {
  shardd__map_entry **pp = map_find(m, hash, id, key);
  if (pp)
    return *pp;
  if (m->count >= m->nslots && map_grow(m) != SHARDD_OK)
    return NULL;
  size_t klen = key ? strlen(key) + 1 : 0;
  shardd__map_entry *e;
  if (key == NULL && m->spare) {
    e = m->spare;
    m->spare = e->next;
    m->nspare--;
  } else if ((e = malloc(sizeof *e + klen)) == NULL) {
    return NULL;
  }
  e->key = NULL;
  if (key)
    e->key = memcpy(e->keybuf, key, klen);
  e->hash = hash;
  e->id = id;
  e->value = value;
  size_t j = hash & (m->nslots - 1);
  e->next = m->slots[j];
  m->slots[j] = e;
  m->count++;
  return e;
}

static shardd_err map_put(shardd__map *m, uint64_t hash, uint64_t id,
                          const char *key, void *value) {
  shardd__map_entry *e = map_entry(m, hash, id, key, value);
  if (e == NULL)
    return SHARDD_E_NO_MEMORY;
  e->value = value;
  return SHARDD_OK;
}

static void *map_del(shardd__map *m, uint64_t hash, uint64_t id,
                     const char *key) {
  shardd__map_entry **pp = map_find(m, hash, id, key);
  if (pp == NULL)
    return NULL;
  shardd__map_entry *e = *pp;
  void *v = e->value;
  *pp = e->next;
  if (e->key == NULL && m->nspare < SHARDD__MAP_SPARE_MAX) {
    e->next = m->spare;
    m->spare = e;
    m->nspare++;
  } else {
    free(e);
  }
  m->count--;
  return v;
}

shardd_err shardd__map_put_id(shardd__map *m, uint64_t id, void *value) {
  return map_put(m, mix64(id), id, NULL, value);
}

void *shardd__map_get_id(const shardd__map *m, uint64_t id) {
  shardd__map_entry **pp = map_find(m, mix64(id), id, NULL);
  return pp ? (*pp)->value : NULL;
}

void *shardd__map_del_id(shardd__map *m, uint64_t id) {
  return map_del(m, mix64(id), id, NULL);
}

shardd_err shardd__map_put_str(shardd__map *m, const char *key, void *value) {
  return map_put(m, hash_str(key), 0, key, value);
}

void *shardd__map_get_str(const shardd__map *m, const char *key) {
  shardd__map_entry **pp = map_find(m, hash_str(key), 0, key);
  return pp ? (*pp)->value : NULL;
}

void *shardd__map_del_str(shardd__map *m, const char *key) {
  return map_del(m, hash_str(key), 0, key);
}

void **shardd__map_slot_str(shardd__map *m, const char *key) {
  shardd__map_entry *e = map_entry(m, hash_str(key), 0, key, NULL);
  return e ? &e->value : NULL;
}

void shardd__map_each(const shardd__map *m, void (*fn)(void *value, void *arg),
                      void *arg) {
  for (size_t i = 0; i < m->nslots; i++)
    for (shardd__map_entry *e = m->slots[i]; e; e = e->next)
      fn(e->value, arg);
}
