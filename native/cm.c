/*
 * async-rdma native RDMA CM: a thin Node-API layer over librdmacm
 * (build/Release/async_rdma_cm.node, built next to the verbs addon when the
 * librdmacm headers exist).
 *
 * One event channel per environment, created with the first cm_id, its fd
 * watched by uv_poll on the environment's loop. Every event is copied (type,
 * status, private data, connection parameters), acknowledged with
 * rdma_ack_cm_event at once, and only then handed to the JS handler given to
 * init(): so JS may destroy the id from inside its handler (rdma_destroy_id
 * waits for unacknowledged events of its id, which never exist here).
 *
 * "User-managed QP" model: this addon never creates a QP (no rdma_create_qp).
 * The caller creates its QP on its own verbs context of the device the id
 * resolved to (deviceName/deviceGuid in info()), passes its qp_num to
 * connect/accept, and drives INIT -> RTR -> RTS itself with the attributes
 * initQpAttr() returns (rdma_init_qp_attr: dgid, sgid index, path MTU, ...).
 * The active side then calls establish() (rdma_establish: sends the RTU).
 *
 * ids are napi externals: their rdma_cm_id is destroyed explicitly, by the
 * handle's finalizer, or at environment teardown (ids first, then the
 * channel); the wrapper's memory goes with the handle.
 *
 * Nothing here blocks the event loop: the channel's fd is O_NONBLOCK and is
 * read until EAGAIN, and rdma_destroy_id (which waits until every event it
 * reported for the id is acknowledged) never waits, since no event stays
 * unacknowledged past channel_ready. At teardown the watcher is stopped (it
 * leaves epoll) before the channel's fd is closed.
 */
#define _GNU_SOURCE
#include <node_api.h>
#include <uv.h>
#include <rdma/rdma_cma.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "napi_util.h"

typedef struct cm_state cm_state_t;
typedef struct cm_id cm_id_t;

#define CM_ID_MAGIC 0x636d6964u /* "cmid": tells our handles from other addons' externals */

struct cm_id {
  uint32_t magic;
  cm_state_t *st;
  struct rdma_cm_id *id;
  uint32_t token;
  int destroyed; /* the memory itself goes with the JS handle (finalizer) */
  cm_id_t *prev, *next;
};

struct cm_state {
  napi_env env;
  struct rdma_event_channel *ch;
  uv_poll_t *poll;
  napi_ref on_event;
  napi_async_context actx;
  cm_id_t *ids;
  uint32_t next_token;
  int keep_alive;
  int tearing_down;
  napi_async_cleanup_hook_handle hook;
};

/* ------------------------------------------------------------------ errors */
#define ARGS(n)                                                                                   \
  size_t argc = (n);                                                                              \
  napi_value argv[(n) > 0 ? (n) : 1];                                                             \
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok) return throw_arg(env, "bad call"); \
  for (size_t i_ = argc; i_ < (n); i_++) napi_get_undefined(env, &argv[i_])

static cm_state_t *state_of(napi_env env) {
  cm_state_t *st = NULL;
  napi_get_instance_data(env, (void **)&st);
  return st;
}

/* -------------------------------------------------------------------- ids */
/* rdma_destroy_id (never blocks here: every event is acknowledged before JS runs). */
static int id_destroy(cm_id_t *c) {
  if (c->destroyed) return 0;
  c->destroyed = 1;
  int e = 0;
  if (c->id) {
    c->id->context = NULL;
    if (rdma_destroy_id(c->id)) e = errno ? errno : EIO;
    c->id = NULL;
  }
  cm_state_t *st = c->st;
  if (c->prev) c->prev->next = c->next;
  else if (st->ids == c) st->ids = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = NULL;
  return e;
}

static void id_finalize(napi_env env, void *data, void *hint) {
  (void)env;
  (void)hint;
  cm_id_t *c = data;
  if (!c->st->tearing_down) id_destroy(c);
  c->magic = 0;
  free(c);
}

static cm_id_t *id_wrap(cm_state_t *st, struct rdma_cm_id *id) {
  cm_id_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->magic = CM_ID_MAGIC;
  c->st = st;
  c->id = id;
  c->token = ++st->next_token;
  if (c->token == 0) c->token = ++st->next_token;
  id->context = c;
  c->next = st->ids;
  if (st->ids) st->ids->prev = c;
  st->ids = c;
  return c;
}

static napi_value id_handle(napi_env env, cm_id_t *c) {
  napi_value v;
  if (napi_create_external(env, c, id_finalize, NULL, &v) != napi_ok) {
    id_destroy(c);
    free(c);
    return NULL;
  }
  return v;
}

static cm_id_t *get_id(napi_env env, napi_value v) {
  void *p = NULL;
  napi_valuetype t;
  if (napi_typeof(env, v, &t) != napi_ok || t != napi_external || napi_get_value_external(env, v, &p) != napi_ok || !p) {
    throw_arg(env, "expected an RDMA CM id handle");
    return NULL;
  }
  cm_id_t *c = p;
  if (c->magic != CM_ID_MAGIC || c->st != state_of(env)) {
    throw_arg(env, "expected an RDMA CM id handle");
    return NULL;
  }
  if (c->destroyed || !c->id) {
    throw_code(env, "DESTROYED", "the RDMA CM id is destroyed");
    return NULL;
  }
  return c;
}

#define GET_ID(var, val) \
  cm_id_t *var = get_id(env, (val)); \
  if (!var) return NULL

/* --------------------------------------------------------------- addresses */
/* host: an IPv4 or IPv6 literal ("" or null: the wildcard), port: 0..65535. */
static int parse_addr(napi_env env, napi_value vhost, napi_value vport, struct sockaddr_storage *ss) {
  char host[64] = "";
  size_t len = 0;
  napi_valuetype t;
  uint32_t port = 0;
  napi_typeof(env, vhost, &t);
  if (t == napi_string) {
    if (napi_get_value_string_utf8(env, vhost, host, sizeof host, &len) != napi_ok || len >= sizeof host - 1) return -1;
  } else if (t != napi_null && t != napi_undefined) {
    return -1;
  }
  if (get_u32(env, vport, &port) || port > 65535) return -1;
  memset(ss, 0, sizeof *ss);
  struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
  struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
  if (!host[0]) {
    a4->sin_family = AF_INET;
    a4->sin_addr.s_addr = htonl(INADDR_ANY);
    a4->sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)port);
    return 0;
  }
  return -1;
}

static void addr_str(const struct sockaddr *sa, char *out, size_t n, unsigned *port) {
  *port = 0;
  out[0] = 0;
  if (!sa) return;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &a->sin_addr, out, (socklen_t)n);
    *port = ntohs(a->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &a->sin6_addr, out, (socklen_t)n);
    *port = ntohs(a->sin6_port);
  }
}

/* ------------------------------------------------------------------ events */
typedef struct {
  int type;
  int status;
  uint32_t token;
  cm_id_t *child; /* CONNECT_REQUEST: the new id (wrapped here) */
  int has_conn;
  struct {
    uint32_t qp_num;
    uint8_t responder_resources, initiator_depth, retry_count, rnr_retry_count, srq;
  } conn;
  uint8_t pdata[256];
  int pdata_len;
} ev_copy_t;

static void channel_ready(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  cm_state_t *st = p->data;
  if (!st || !st->ch || st->tearing_down) return;
  napi_env env = st->env;
  for (int budget = 0; budget < 64; budget++) {
    struct rdma_cm_event *ev = NULL;
    if (rdma_get_cm_event(st->ch, &ev)) break; /* EAGAIN: drained */
    ev_copy_t c;
    memset(&c, 0, sizeof c);
    c.type = ev->event;
    c.status = ev->status;
    cm_id_t *owner = NULL;
    if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
      owner = ev->listen_id ? ev->listen_id->context : NULL;
      if (owner && ev->id) c.child = id_wrap(st, ev->id);
      if (!c.child && ev->id) {
        /* nobody to give it to (listener gone, or out of memory): refuse it */
        rdma_ack_cm_event(ev);
        struct rdma_cm_id *nid = ev->id;
        rdma_reject(nid, NULL, 0);
        rdma_destroy_id(nid);
        continue;
      }
    } else {
      owner = ev->id ? ev->id->context : NULL;
    }
    if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST || ev->event == RDMA_CM_EVENT_CONNECT_RESPONSE || ev->event == RDMA_CM_EVENT_ESTABLISHED ||
        ev->event == RDMA_CM_EVENT_REJECTED) {
      const struct rdma_conn_param *cp = &ev->param.conn;
      c.has_conn = ev->event != RDMA_CM_EVENT_REJECTED;
      c.conn.qp_num = cp->qp_num;
      c.conn.responder_resources = cp->responder_resources;
      c.conn.initiator_depth = cp->initiator_depth;
      c.conn.retry_count = cp->retry_count;
      c.conn.rnr_retry_count = cp->rnr_retry_count;
      c.conn.srq = cp->srq;
      if (cp->private_data && cp->private_data_len) {
        c.pdata_len = cp->private_data_len;
        memcpy(c.pdata, cp->private_data, (size_t)c.pdata_len);
      }
    }
    c.token = owner && !owner->destroyed ? owner->token : 0;
    rdma_ack_cm_event(ev); /* always, before JS runs */
    if (c.token == 0) {
      if (c.child) {
        if (c.child->id) rdma_reject(c.child->id, NULL, 0);
        id_destroy(c.child);
        free(c.child);
      }
      continue;
    }
    if (!st->on_event) continue;
    napi_handle_scope scope;
    napi_open_handle_scope(env, &scope);
    napi_value argv[6];
    argv[0] = num(env, c.token);
    argv[1] = num(env, c.type);
    argv[2] = num(env, c.status);
    if (c.pdata_len > 0) {
      void *data;
      napi_value ab;
      if (napi_create_arraybuffer(env, (size_t)c.pdata_len, &data, &ab) == napi_ok) {
        memcpy(data, c.pdata, (size_t)c.pdata_len);
        argv[3] = ab;
      } else {
        argv[3] = null_v(env);
      }
    } else {
      argv[3] = null_v(env);
    }
    if (c.has_conn) {
      napi_value o;
      napi_create_object(env, &o);
      set(env, o, "qpNum", num(env, c.conn.qp_num));
      set(env, o, "responderResources", num(env, c.conn.responder_resources));
      set(env, o, "initiatorDepth", num(env, c.conn.initiator_depth));
      set(env, o, "retryCount", num(env, c.conn.retry_count));
      set(env, o, "rnrRetryCount", num(env, c.conn.rnr_retry_count));
      set(env, o, "srq", num(env, c.conn.srq));
      argv[4] = o;
    } else {
      argv[4] = null_v(env);
    }
    argv[5] = null_v(env);
    if (c.child) {
      napi_value h = id_handle(env, c.child);
      if (h) {
        napi_value arr;
        napi_create_array_with_length(env, 2, &arr);
        napi_set_element(env, arr, 0, h);
        napi_set_element(env, arr, 1, num(env, c.child->token));
        argv[5] = arr;
      }
    }
    napi_value fn, recv, res;
    if (napi_get_reference_value(env, st->on_event, &fn) == napi_ok && fn) {
      napi_get_global(env, &recv);
      if (napi_make_callback(env, st->actx, recv, fn, 6, argv, &res) != napi_ok) {
        bool pending = false;
        napi_is_exception_pending(env, &pending);
        if (pending) {
          napi_value exc;
          napi_get_and_clear_last_exception(env, &exc);
          napi_fatal_exception(env, exc);
        }
      }
    }
    napi_close_handle_scope(env, scope);
    if (!st->ch || st->tearing_down) break;
  }
}

static int ensure_channel(napi_env env, cm_state_t *st) {
  if (st->ch) return 0;
  struct rdma_event_channel *ch = rdma_create_event_channel();
  if (!ch) return errno ? errno : ENODEV;
  int fl = fcntl(ch->fd, F_GETFL);
  if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    int e = errno;
    rdma_destroy_event_channel(ch);
    return e;
  }
  uv_loop_t *loop = NULL;
  napi_get_uv_event_loop(env, &loop);
  uv_poll_t *p = malloc(sizeof *p);
  if (!p || !loop || uv_poll_init(loop, p, ch->fd) != 0) {
    free(p);
    rdma_destroy_event_channel(ch);
    return ENOMEM;
  }
  p->data = st;
  uv_poll_start(p, UV_READABLE, channel_ready);
  if (!st->keep_alive) uv_unref((uv_handle_t *)p);
  st->ch = ch;
  st->poll = p;
  return 0;
}

/* ------------------------------------------------------------- functions */
/* init(onEvent(token, type, status, privateData | null, conn | null, [childHandle, childToken] | null)) */
static napi_value cm_init(napi_env env, napi_callback_info info) {
  ARGS(1);
  cm_state_t *st = state_of(env);
  napi_valuetype t;
  napi_typeof(env, argv[0], &t);
  if (!st || t != napi_function) return throw_arg(env, "init takes the event handler");
  if (st->on_event) napi_delete_reference(env, st->on_event);
  napi_create_reference(env, argv[0], 1, &st->on_event);
  return NULL;
}

/* createId() -> [handle, token]  (RDMA_PS_TCP, on the environment's channel) */
static napi_value cm_create_id(napi_env env, napi_callback_info info) {
  (void)info;
  cm_state_t *st = state_of(env);
  if (!st) return throw_arg(env, "not initialised");
  int e = ensure_channel(env, st);
  if (e) return throw_errno(env, "rdma_create_event_channel", e);
  struct rdma_cm_id *id = NULL;
  if (rdma_create_id(st->ch, &id, NULL, RDMA_PS_TCP)) return throw_errno(env, "rdma_create_id", errno);
  cm_id_t *c = id_wrap(st, id);
  if (!c) {
    rdma_destroy_id(id);
    return throw_errno(env, "calloc", ENOMEM);
  }
  napi_value h = id_handle(env, c), res;
  if (!h) return throw_errno(env, "napi_create_external", ENOMEM);
  napi_create_array_with_length(env, 2, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, num(env, c->token));
  return res;
}

/* bindAddr(id, host | null, port) */
static napi_value cm_bind(napi_env env, napi_callback_info info) {
  ARGS(3);
  GET_ID(c, argv[0]);
  struct sockaddr_storage ss;
  if (parse_addr(env, argv[1], argv[2], &ss)) return throw_arg(env, "address must be an IPv4/IPv6 literal and a port 0..65535");
  if (rdma_bind_addr(c->id, (struct sockaddr *)&ss)) return throw_errno(env, "rdma_bind_addr", errno);
  return NULL;
}

/* listen(id, backlog) */
static napi_value cm_listen(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET_ID(c, argv[0]);
  uint32_t backlog;
  if (get_u32(env, argv[1], &backlog) || backlog > 65535) return throw_arg(env, "bad backlog");
  if (rdma_listen(c->id, (int)backlog)) return throw_errno(env, "rdma_listen", errno);
  return NULL;
}

/* resolveAddr(id, srcHost | null, dstHost, dstPort, timeoutMs) -> ADDR_RESOLVED / ADDR_ERROR event */
static napi_value cm_resolve_addr(napi_env env, napi_callback_info info) {
  ARGS(5);
  GET_ID(c, argv[0]);
  struct sockaddr_storage src, dst;
  napi_valuetype t;
  napi_typeof(env, argv[1], &t);
  int has_src = t == napi_string;
  napi_value zero = num(env, 0);
  if (has_src && parse_addr(env, argv[1], zero, &src)) return throw_arg(env, "source address must be an IPv4/IPv6 literal");
  napi_typeof(env, argv[2], &t);
  if (t != napi_string || parse_addr(env, argv[2], argv[3], &dst)) return throw_arg(env, "destination must be an IPv4/IPv6 literal and a port 0..65535");
  uint32_t ms;
  if (get_u32(env, argv[4], &ms) || ms < 1 || ms > 600000) return throw_arg(env, "bad timeout");
  if (rdma_resolve_addr(c->id, has_src ? (struct sockaddr *)&src : NULL, (struct sockaddr *)&dst, (int)ms)) return throw_errno(env, "rdma_resolve_addr", errno);
  return NULL;
}

/* resolveRoute(id, timeoutMs) -> ROUTE_RESOLVED / ROUTE_ERROR event */
static napi_value cm_resolve_route(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET_ID(c, argv[0]);
  uint32_t ms;
  if (get_u32(env, argv[1], &ms) || ms < 1 || ms > 600000) return throw_arg(env, "bad timeout");
  if (rdma_resolve_route(c->id, (int)ms)) return throw_errno(env, "rdma_resolve_route", errno);
  return NULL;
}

/* Fills conn params from (qpNum, privateData, responderResources, initiatorDepth, retryCount, rnrRetryCount). */
static int conn_param(napi_env env, napi_value *a, struct rdma_conn_param *p, size_t max_pdata) {
  uint32_t qpn, rr, id, rc, rnr;
  if (get_u32(env, a[0], &qpn) || qpn > 0xffffff || get_u32(env, a[2], &rr) || rr > 255 || get_u32(env, a[3], &id) || id > 255 || get_u32(env, a[4], &rc) || rc > 7 ||
      get_u32(env, a[5], &rnr) || rnr > 7)
    return -1;
  memset(p, 0, sizeof *p);
  p->qp_num = qpn;
  p->responder_resources = (uint8_t)rr;
  p->initiator_depth = (uint8_t)id;
  p->retry_count = (uint8_t)rc;
  p->rnr_retry_count = (uint8_t)rnr;
  p->flow_control = 1;
  napi_valuetype t;
  napi_typeof(env, a[1], &t);
  if (t == napi_null || t == napi_undefined) return 0;
  void *data = NULL;
  size_t len = 0;
  bool is_ab = false, is_ta = false;
  napi_is_arraybuffer(env, a[1], &is_ab);
  napi_is_typedarray(env, a[1], &is_ta);
  if (is_ab) {
    if (napi_get_arraybuffer_info(env, a[1], &data, &len) != napi_ok) return -1;
  } else if (is_ta) {
    napi_typedarray_type tt;
    napi_value ab;
    size_t off;
    if (napi_get_typedarray_info(env, a[1], &tt, &len, &data, &ab, &off) != napi_ok || tt != napi_uint8_array) return -1;
  } else {
    return -1;
  }
  if (len > max_pdata) return -2;
  if (len && !data) return -1;
  p->private_data = data;
  p->private_data_len = (uint8_t)len;
  return 0;
}

/* connect(id, qpNum, privateData, responderResources, initiatorDepth, retryCount, rnrRetryCount) -> CONNECT_RESPONSE / REJECTED / UNREACHABLE */
static napi_value cm_connect(napi_env env, napi_callback_info info) {
  ARGS(7);
  GET_ID(c, argv[0]);
  struct rdma_conn_param p;
  int r = conn_param(env, argv + 1, &p, 56);
  if (r == -2) return throw_arg(env, "private data for rdma_connect is at most 56 bytes");
  if (r) return throw_arg(env, "bad connection parameters");
  if (rdma_connect(c->id, &p)) return throw_errno(env, "rdma_connect", errno);
  return NULL;
}

/* accept(id, qpNum, privateData, responderResources, initiatorDepth, retryCount, rnrRetryCount) -> ESTABLISHED */
static napi_value cm_accept(napi_env env, napi_callback_info info) {
  ARGS(7);
  GET_ID(c, argv[0]);
  struct rdma_conn_param p;
  int r = conn_param(env, argv + 1, &p, 196);
  if (r == -2) return throw_arg(env, "private data for rdma_accept is at most 196 bytes");
  if (r) return throw_arg(env, "bad connection parameters");
  if (rdma_accept(c->id, &p)) return throw_errno(env, "rdma_accept", errno);
  return NULL;
}

/* establish(id): the active side, after its QP reached RTS on CONNECT_RESPONSE (sends the RTU). */
static napi_value cm_establish(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET_ID(c, argv[0]);
  if (rdma_establish(c->id)) return throw_errno(env, "rdma_establish", errno);
  return NULL;
}

/* reject(id, privateData | null)  (at most 148 bytes) */
static napi_value cm_reject(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET_ID(c, argv[0]);
  void *data = NULL;
  size_t len = 0;
  napi_valuetype t;
  napi_typeof(env, argv[1], &t);
  if (t != napi_null && t != napi_undefined) {
    bool is_ta = false;
    napi_typedarray_type tt;
    napi_value ab;
    size_t off;
    napi_is_typedarray(env, argv[1], &is_ta);
    if (!is_ta || napi_get_typedarray_info(env, argv[1], &tt, &len, &data, &ab, &off) != napi_ok || tt != napi_uint8_array) return throw_arg(env, "private data must be a Uint8Array");
    if (len > 148) return throw_arg(env, "private data for rdma_reject is at most 148 bytes");
  }
  if (rdma_reject(c->id, len ? data : NULL, (uint8_t)len)) return throw_errno(env, "rdma_reject", errno);
  return NULL;
}

/* disconnect(id) -> DISCONNECTED on both sides (errors such as EINVAL when never connected are returned, not thrown) */
static napi_value cm_disconnect(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET_ID(c, argv[0]);
  if (rdma_disconnect(c->id)) return num(env, errno ? errno : EIO);
  return num(env, 0);
}

/* destroyId(id): idempotent */
static napi_value cm_destroy_id(napi_env env, napi_callback_info info) {
  ARGS(1);
  void *p = NULL;
  napi_valuetype t;
  if (napi_typeof(env, argv[0], &t) != napi_ok || t != napi_external || napi_get_value_external(env, argv[0], &p) != napi_ok || !p) return throw_arg(env, "expected an RDMA CM id handle");
  cm_id_t *c = p;
  if (c->magic != CM_ID_MAGIC || c->st != state_of(env)) return throw_arg(env, "expected an RDMA CM id handle");
  int e = id_destroy(c);
  if (e) return throw_errno(env, "rdma_destroy_id", e);
  return NULL;
}

/* info(id) -> { deviceName, deviceGuid, portNum, localAddr, localPort, peerAddr, peerPort } (device null before resolution/bind) */
static napi_value cm_info(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET_ID(c, argv[0]);
  napi_value o;
  napi_create_object(env, &o);
  struct rdma_cm_id *id = c->id;
  if (id->verbs && id->verbs->device) {
    char g[32];
    set(env, o, "deviceName", str(env, ibv_get_device_name(id->verbs->device)));
    guid_str(ibv_get_device_guid(id->verbs->device), g, sizeof g);
    set(env, o, "deviceGuid", str(env, g));
  } else {
    set(env, o, "deviceName", null_v(env));
    set(env, o, "deviceGuid", null_v(env));
  }
  set(env, o, "portNum", num(env, id->port_num));
  char a[INET6_ADDRSTRLEN + 1];
  unsigned port;
  addr_str(rdma_get_local_addr(id), a, sizeof a, &port);
  set(env, o, "localAddr", str(env, a));
  set(env, o, "localPort", num(env, port));
  addr_str(rdma_get_peer_addr(id), a, sizeof a, &port);
  set(env, o, "peerAddr", str(env, a));
  set(env, o, "peerPort", num(env, port));
  return o;
}

/* initQpAttr(id, state) -> the attributes rdma_init_qp_attr gives for INIT (1), RTR (2) or RTS (3) */
static napi_value cm_init_qp_attr(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET_ID(c, argv[0]);
  uint32_t state;
  if (get_u32(env, argv[1], &state) || state < IBV_QPS_INIT || state > IBV_QPS_RTS) return throw_arg(env, "state must be INIT (1), RTR (2) or RTS (3)");
  struct ibv_qp_attr a;
  int mask = 0;
  memset(&a, 0, sizeof a);
  a.qp_state = (enum ibv_qp_state)state;
  if (rdma_init_qp_attr(c->id, &a, &mask)) return throw_errno(env, "rdma_init_qp_attr", errno);
  napi_value o;
  napi_create_object(env, &o);
  set(env, o, "mask", num(env, mask));
  set(env, o, "portNum", num(env, a.port_num ? a.port_num : c->id->port_num));
  set(env, o, "qpAccessFlags", num(env, a.qp_access_flags));
  set(env, o, "pkeyIndex", num(env, a.pkey_index));
  set(env, o, "pathMtu", num(env, a.path_mtu ? 128 << a.path_mtu : 0));
  set(env, o, "destQpNum", num(env, a.dest_qp_num));
  set(env, o, "rqPsn", num(env, a.rq_psn));
  set(env, o, "sqPsn", num(env, a.sq_psn));
  set(env, o, "maxDestRdAtomic", num(env, a.max_dest_rd_atomic));
  set(env, o, "maxRdAtomic", num(env, a.max_rd_atomic));
  set(env, o, "minRnrTimer", num(env, a.min_rnr_timer));
  set(env, o, "timeout", num(env, a.timeout));
  set(env, o, "retryCnt", num(env, a.retry_cnt));
  set(env, o, "rnrRetry", num(env, a.rnr_retry));
  set(env, o, "isGlobal", num(env, a.ah_attr.is_global));
  set(env, o, "dlid", num(env, a.ah_attr.dlid));
  set(env, o, "sl", num(env, a.ah_attr.sl));
  char g[INET6_ADDRSTRLEN + 1];
  if (!inet_ntop(AF_INET6, a.ah_attr.grh.dgid.raw, g, sizeof g)) snprintf(g, sizeof g, "::");
  set(env, o, "dgid", str(env, g));
  set(env, o, "sgidIndex", num(env, a.ah_attr.grh.sgid_index));
  set(env, o, "hopLimit", num(env, a.ah_attr.grh.hop_limit));
  set(env, o, "trafficClass", num(env, a.ah_attr.grh.traffic_class));
  return o;
}

/* keepAlive(on): whether the channel keeps the event loop alive (set while a connect/accept waits) */
static napi_value cm_keep_alive(napi_env env, napi_callback_info info) {
  ARGS(1);
  cm_state_t *st = state_of(env);
  bool on = false;
  napi_get_value_bool(env, argv[0], &on);
  if (!st) return NULL;
  st->keep_alive = on;
  if (st->poll) {
    if (on) uv_ref((uv_handle_t *)st->poll);
    else uv_unref((uv_handle_t *)st->poll);
  }
  return NULL;
}

static napi_value cm_event_str(napi_env env, napi_callback_info info) {
  ARGS(1);
  uint32_t t;
  if (get_u32(env, argv[0], &t)) return throw_arg(env, "event type must be a number");
  return str(env, rdma_event_str((enum rdma_cm_event_type)t));
}

static napi_value cm_errno_name(napi_env env, napi_callback_info info) {
  ARGS(1);
  uint32_t e;
  if (get_u32(env, argv[0], &e)) return throw_arg(env, "errno must be a number");
  return str(env, errno_name((int)e));
}

/* ----------------------------------------------------------------- module */
static void poll_closed(uv_handle_t *h) {
  cm_state_t *st = h->data;
  free(h);
  if (st && st->hook) {
    napi_async_cleanup_hook_handle hk = st->hook;
    st->hook = NULL;
    napi_remove_async_cleanup_hook(hk);
  }
}

static void teardown(napi_async_cleanup_hook_handle hook, void *arg) {
  cm_state_t *st = arg;
  st->tearing_down = 1;
  /* ids first (rdma_destroy_id discards their unread events), then the
   * watcher: stopped and closing, so its fd leaves epoll while it is still
   * open (closed first, the number could be reused by then and the wrong
   * file dropped from epoll, or watched), then the channel and its fd. The
   * hook is done when the handle's close callback has run. */
  while (st->ids) {
    cm_id_t *c = st->ids;
    id_destroy(c);
  }
  uv_poll_t *p = st->poll;
  st->poll = NULL;
  if (p) {
    uv_poll_stop(p);
    p->data = st;
    st->hook = hook;
    uv_close((uv_handle_t *)p, poll_closed);
  }
  if (st->ch) {
    rdma_destroy_event_channel(st->ch);
    st->ch = NULL;
  }
  if (!p) napi_remove_async_cleanup_hook(hook);
}

NAPI_MODULE_INIT() {
  cm_state_t *st = calloc(1, sizeof *st); /* lives as long as the process: finalizers may run after teardown */
  if (!st) return NULL;
  st->env = env;
  napi_set_instance_data(env, st, NULL, NULL);
  napi_async_init(env, NULL, str(env, "async-rdma:cm"), &st->actx);
  napi_add_async_cleanup_hook(env, teardown, st, NULL);
  static const struct {
    const char *name;
    napi_callback fn;
  } fns[] = {
      {"init", cm_init},           {"createId", cm_create_id},   {"bindAddr", cm_bind},       {"listen", cm_listen},       {"resolveAddr", cm_resolve_addr},
      {"resolveRoute", cm_resolve_route}, {"connect", cm_connect}, {"accept", cm_accept},      {"establish", cm_establish}, {"reject", cm_reject},
      {"disconnect", cm_disconnect}, {"destroyId", cm_destroy_id}, {"info", cm_info},         {"initQpAttr", cm_init_qp_attr}, {"keepAlive", cm_keep_alive},
      {"eventName", cm_event_str}, {"errnoName", cm_errno_name},
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    napi_value f;
    napi_create_function(env, fns[i].name, NAPI_AUTO_LENGTH, fns[i].fn, NULL, &f);
    napi_set_named_property(env, exports, fns[i].name, f);
  }
  return exports;
}
