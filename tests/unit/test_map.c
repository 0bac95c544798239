/* test_map.c — the registry's hash maps: id and string keys, put / replace /
 * get / del, growth well past many doublings, and each(). Expected contents
 * are tracked in plain arrays next to the map. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "map.h"

static shardd__map m;

static void setup(void) { shardd__map_init(&m); }
static void teardown(void) { shardd__map_free(&m); }

TestSuite(map, .init = setup, .fini = teardown);

static int vals[16];

Test(map, empty) {
  cr_expect_eq(shardd__map_count(&m), 0);
  cr_expect_null(shardd__map_get_id(&m, 1));
  cr_expect_null(shardd__map_get_id(&m, 0));
  cr_expect_null(shardd__map_get_str(&m, ""));
  cr_expect_null(shardd__map_get_str(&m, "x"));
  cr_expect_null(shardd__map_del_id(&m, 1));
  cr_expect_null(shardd__map_del_str(&m, "x"));
  cr_expect_eq(shardd__map_count(&m), 0);
}

Test(map, id_put_get_replace_del) {
  cr_assert_eq(shardd__map_put_id(&m, 7, &vals[0]), SHARDD_OK);
  cr_assert_eq(shardd__map_put_id(&m, 0, &vals[1]), SHARDD_OK);
  cr_assert_eq(shardd__map_put_id(&m, UINT64_MAX, &vals[2]), SHARDD_OK);
  cr_expect_eq(shardd__map_count(&m), 3);
  cr_expect_eq(shardd__map_get_id(&m, 7), &vals[0]);
  cr_expect_eq(shardd__map_get_id(&m, 0), &vals[1]);
  cr_expect_eq(shardd__map_get_id(&m, UINT64_MAX), &vals[2]);
  cr_expect_null(shardd__map_get_id(&m, 8));

  cr_assert_eq(shardd__map_put_id(&m, 7, &vals[3]), SHARDD_OK);
  cr_expect_eq(shardd__map_count(&m), 3, "replace does not add");
  cr_expect_eq(shardd__map_get_id(&m, 7), &vals[3]);

  cr_expect_eq(shardd__map_del_id(&m, 7), &vals[3]);
  cr_expect_eq(shardd__map_count(&m), 2);
  cr_expect_null(shardd__map_get_id(&m, 7));
  cr_expect_null(shardd__map_del_id(&m, 7), "second del finds nothing");
  cr_expect_eq(shardd__map_get_id(&m, 0), &vals[1]);
}

Test(map, string_put_get_replace_del) {
  char key[32];
  strcpy(key, "layer.0.weight");
  cr_assert_eq(shardd__map_put_str(&m, key, &vals[0]), SHARDD_OK);
  strcpy(key, "clobbered");
  cr_expect_eq(shardd__map_get_str(&m, "layer.0.weight"), &vals[0],
               "the map copies its keys");
  cr_expect_null(shardd__map_get_str(&m, "clobbered"));

  cr_assert_eq(shardd__map_put_str(&m, "", &vals[1]), SHARDD_OK);
  cr_expect_eq(shardd__map_get_str(&m, ""), &vals[1]);
  cr_assert_eq(shardd__map_put_str(&m, "\xff\x01 bytes", &vals[2]), SHARDD_OK);
  cr_expect_eq(shardd__map_get_str(&m, "\xff\x01 bytes"), &vals[2]);
  cr_expect_null(shardd__map_get_str(&m, "layer.0.weigh"));
  cr_expect_null(shardd__map_get_str(&m, "layer.0.weightx"));
  cr_expect_eq(shardd__map_count(&m), 3);

  cr_assert_eq(shardd__map_put_str(&m, "layer.0.weight", &vals[3]), SHARDD_OK);
  cr_expect_eq(shardd__map_count(&m), 3);
  cr_expect_eq(shardd__map_get_str(&m, "layer.0.weight"), &vals[3]);
  cr_expect_eq(shardd__map_del_str(&m, "layer.0.weight"), &vals[3]);
  cr_expect_null(shardd__map_get_str(&m, "layer.0.weight"));
  cr_expect_eq(shardd__map_count(&m), 2);
}

Test(map, null_values_are_stored) {
  cr_assert_eq(shardd__map_put_id(&m, 3, NULL), SHARDD_OK);
  cr_expect_eq(shardd__map_count(&m), 1);
  cr_expect_null(shardd__map_get_id(&m, 3));
}

/* An id map and a string map are separate namespaces even in one map: the
 * string "5" and the id 5 are different keys. */
Test(map, id_and_string_keys_do_not_collide) {
  cr_assert_eq(shardd__map_put_id(&m, 5, &vals[0]), SHARDD_OK);
  cr_assert_eq(shardd__map_put_str(&m, "5", &vals[1]), SHARDD_OK);
  cr_assert_eq(shardd__map_put_str(&m, "", &vals[2]), SHARDD_OK);
  cr_assert_eq(shardd__map_put_id(&m, 0, &vals[3]), SHARDD_OK);
  cr_expect_eq(shardd__map_count(&m), 4);
  cr_expect_eq(shardd__map_get_id(&m, 5), &vals[0]);
  cr_expect_eq(shardd__map_get_str(&m, "5"), &vals[1]);
  cr_expect_eq(shardd__map_get_str(&m, ""), &vals[2]);
  cr_expect_eq(shardd__map_get_id(&m, 0), &vals[3]);
}

#define BIG 100000

Test(map, ids_grow_to_100k) {
  static int v[BIG];
  for (uint64_t i = 0; i < BIG; i++) {
    /* spread keys over the whole range, not just 0..N */
    uint64_t id = i * 0x9e3779b97f4a7c15ULL;
    cr_assert_eq(shardd__map_put_id(&m, id, &v[i]), SHARDD_OK);
    if (i % 9973 == 0)
      cr_assert_eq(shardd__map_count(&m), i + 1);
  }
  cr_assert_eq(shardd__map_count(&m), BIG);
  for (uint64_t i = 0; i < BIG; i++)
    cr_assert_eq(shardd__map_get_id(&m, i * 0x9e3779b97f4a7c15ULL), &v[i],
                 "id #%llu", (unsigned long long)i);
  for (uint64_t i = 0; i < BIG; i += 2)
    cr_assert_eq(shardd__map_del_id(&m, i * 0x9e3779b97f4a7c15ULL), &v[i]);
  cr_assert_eq(shardd__map_count(&m), BIG / 2);
  for (uint64_t i = 0; i < BIG; i++) {
    void *got = shardd__map_get_id(&m, i * 0x9e3779b97f4a7c15ULL);
    if (i % 2)
      cr_assert_eq(got, &v[i]);
    else
      cr_assert_null(got);
  }
}

Test(map, strings_grow_to_100k) {
  static int v[BIG];
  char key[32];
  for (int i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "model.layers.%d.w", i);
    cr_assert_eq(shardd__map_put_str(&m, key, &v[i]), SHARDD_OK);
  }
  cr_assert_eq(shardd__map_count(&m), BIG);
  for (int i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "model.layers.%d.w", i);
    cr_assert_eq(shardd__map_get_str(&m, key), &v[i], "%s", key);
  }
  for (int i = 0; i < BIG; i++) {
    snprintf(key, sizeof key, "model.layers.%d.w", i);
    cr_assert_eq(shardd__map_del_str(&m, key), &v[i]);
  }
  cr_assert_eq(shardd__map_count(&m), 0);
  snprintf(key, sizeof key, "model.layers.%d.w", 5);
  cr_expect_null(shardd__map_get_str(&m, key));
}

static void count_cb(void *value, void *arg) {
  int *seen = arg;
  int *p = value;
  seen[p - vals]++;
}

Test(map, each_visits_every_value_once) {
  for (int i = 0; i < 16; i++)
    cr_assert_eq(shardd__map_put_id(&m, (uint64_t)i * 1000, &vals[i]),
                 SHARDD_OK);
  shardd__map_del_id(&m, 5000);
  int seen[16] = {0};
  shardd__map_each(&m, count_cb, seen);
  for (int i = 0; i < 16; i++)
    cr_expect_eq(seen[i], i == 5 ? 0 : 1, "value %d seen %d times", i, seen[i]);
}

static void never_cb(void *value, void *arg) { (*(int *)arg)++; }

Test(map, each_on_empty_and_after_free) {
  int calls = 0;
  shardd__map_each(&m, never_cb, &calls);
  cr_expect_eq(calls, 0);
  shardd__map_put_str(&m, "a", &vals[0]);
  shardd__map_free(&m);
  cr_expect_eq(shardd__map_count(&m), 0);
  shardd__map_each(&m, never_cb, &calls);
  cr_expect_eq(calls, 0);
  cr_expect_null(shardd__map_get_str(&m, "a"));
  /* usable again after free */
  cr_assert_eq(shardd__map_put_str(&m, "a", &vals[1]), SHARDD_OK);
  cr_expect_eq(shardd__map_get_str(&m, "a"), &vals[1]);
}

Test(map, a_strings_slot_is_read_and_written_in_place) {
  void **s = shardd__map_slot_str(&m, "gen");
  cr_assert_not_null(s);
  cr_assert_null(*s, "an absent key's slot is added empty");
  cr_assert_eq(shardd__map_count(&m), 1);
  *s = (void *)(uintptr_t)7;
  cr_assert_eq((uintptr_t)shardd__map_get_str(&m, "gen"), 7);
  void **again = shardd__map_slot_str(&m, "gen");
  cr_assert_eq(again, s, "an existing key's slot is its own");
  cr_assert_eq(shardd__map_count(&m), 1);
  cr_assert_eq((uintptr_t)shardd__map_del_str(&m, "gen"), 7);
  cr_assert_eq(shardd__map_count(&m), 0);
}

Test(map, a_string_key_is_the_maps_own_copy) {
  /* the key lives in the entry: the caller's bytes may change or go */
  char *k = strdup("layer0.param1.weight");
  cr_assert_not_null(k);
  cr_assert_eq(shardd__map_put_str(&m, k, &vals[3]), SHARDD_OK);
  void **slot = shardd__map_slot_str(&m, "an.other");
  cr_assert_not_null(slot);
  *slot = &vals[4];
  memset(k, 'x', strlen(k));
  free(k);
  cr_expect_eq(shardd__map_get_str(&m, "layer0.param1.weight"), &vals[3]);
  cr_expect_eq(shardd__map_get_str(&m, "an.other"), &vals[4]);
  cr_expect_eq(shardd__map_del_str(&m, "layer0.param1.weight"), &vals[3]);
  cr_expect_eq(shardd__map_count(&m), 1);
}
