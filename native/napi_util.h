/*
 * napi_util.h: the N-API helpers both addons use (verbs.c and cm.c): errors
 * thrown with a stable `errno` code string, and small value constructors.
 * Header-only (static inline), so each addon stays one translation unit.
 */
#ifndef ASYNC_RDMA_NAPI_UTIL_H
#define ASYNC_RDMA_NAPI_UTIL_H

#include <endian.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <node_api.h>

/* The errno's name ("ENOENT"), or "EUNKNOWN". */
static inline const char *errno_name(int e) {
  const char *n = strerrorname_np(e);
  return n ? n : "EUNKNOWN";
}

/* Throws an Error whose `errno` property is `code` (the JS side maps it to an RdmaError). Returns NULL. */
static inline void *throw_code(napi_env env, const char *code, const char *msg) {
  napi_value m, err, c;
  napi_create_string_utf8(env, msg, NAPI_AUTO_LENGTH, &m);
  napi_create_error(env, NULL, m, &err);
  napi_create_string_utf8(env, code, NAPI_AUTO_LENGTH, &c);
  napi_set_named_property(env, err, "errno", c);
  napi_throw(env, err);
  return NULL;
}

/* Throws "<call> failed: <strerror> (<ENAME>)" with `errno` = ENAME (EIO for e <= 0). Returns NULL. */
static inline void *throw_errno(napi_env env, const char *call, int e) {
  char msg[256];
  if (e <= 0) e = EIO;
  snprintf(msg, sizeof msg, "%s failed: %s (%s)", call, strerror(e), errno_name(e));
  return throw_code(env, errno_name(e), msg);
}

/* Throws a bad-argument error (`errno` EINVAL). Returns NULL. */
static inline void *throw_arg(napi_env env, const char *msg) { return throw_code(env, "EINVAL", msg); }

static inline napi_value num(napi_env env, double d) {
  napi_value v;
  napi_create_double(env, d, &v);
  return v;
}

static inline napi_value str(napi_env env, const char *s) {
  napi_value v;
  napi_create_string_utf8(env, s, NAPI_AUTO_LENGTH, &v);
  return v;
}

static inline napi_value null_v(napi_env env) {
  napi_value v;
  napi_get_null(env, &v);
  return v;
}

static inline void set(napi_env env, napi_value o, const char *k, napi_value v) { napi_set_named_property(env, o, k, v); }
static inline int get_u32(napi_env env, napi_value v, uint32_t *out) { return napi_get_value_uint32(env, v, out) == napi_ok ? 0 : -1; }
static inline int get_f64(napi_env env, napi_value v, double *out) { return napi_get_value_double(env, v, out) == napi_ok ? 0 : -1; }

/* A node GUID (big-endian 64 bits) as ibv_devinfo prints it: xxxx:xxxx:xxxx:xxxx. */
static inline void guid_str(uint64_t be, char *out, size_t n) {
  uint64_t g = be64toh(be);
  snprintf(out, n, "%04x:%04x:%04x:%04x", (unsigned)(g >> 48) & 0xffff, (unsigned)(g >> 32) & 0xffff, (unsigned)(g >> 16) & 0xffff, (unsigned)g & 0xffff);
}

#endif
