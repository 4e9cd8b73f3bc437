/* A small JSON reader for the plugin's C tests: enough to parse the lines the plugin
 * writes (and tests/vectors/rules.json) and look fields up. Not for production use. */
#ifndef MINIJSON_H
#define MINIJSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum mj_type { MJ_NULL, MJ_BOOL, MJ_NUM, MJ_STR, MJ_ARR, MJ_OBJ };

struct mj {
  enum mj_type type;
  bool b;
  bool is_int; /* the number had no fraction or exponent */
  int64_t i;
  double num;
  char* str; /* decoded UTF-8, NUL-terminated (may contain NUL from \u0000) */
  size_t str_len;
  size_t n;    /* array/object length */
  struct mj* items;
  char** keys; /* objects only */
};

/* Parse exactly one JSON value spanning text[0..len) (surrounding whitespace allowed).
 * Returns NULL on error with a message in err. */
struct mj* mj_parse(const char* text, size_t len, char* err, size_t err_len);
void mj_free(struct mj* root); /* a value returned by mj_parse */
const struct mj* mj_get(const struct mj* obj, const char* key);
/* Convenience: field as string / int / double / bool; abort() with a message if missing
 * or of the wrong type. */
const char* mj_str(const struct mj* obj, const char* key);
int64_t mj_int(const struct mj* obj, const char* key);
double mj_num(const struct mj* obj, const char* key);
bool mj_bool(const struct mj* obj, const char* key);

#endif
