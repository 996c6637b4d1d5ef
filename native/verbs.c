/*
 * async-rdma native provider: a thin Node-API layer over libibverbs.
 *
 * Objects (each a napi external holding one reference):
 *   Context (ibv_context + async-event fd watched by uv_poll)
 *   PD, CQ (+ completion channel watched by uv_poll), QP (RC), MR, MW.
 *
 * Lifetimes: every object is reference counted: one reference for its JS
 * handle, one for every object that depends on it (MR/MW/QP -> PD, QP -> CQs,
 * PD/CQ -> Context), which is the order rdma-core needs them destroyed in.
 * The verbs resource is released either explicitly (destroy/dealloc/dereg,
 * which report verbs' errors such as EBUSY) or when the last reference goes,
 * so JS may release handles, or the GC collect them, in any order. A released
 * object drops its references at once (its memory stays until its handle is
 * collected, and never looks at its context again). Closing a context, and the
 * environment's cleanup hook, tear down everything on it in dependency order:
 * windows, QPs, MRs, CQs, PDs, context; the closer holds a reference on the
 * context for the whole walk, because the children it destroys drop theirs
 * (the context's handle may be collected already). Type-2 windows bound
 * through a QP are deallocated before that QP is destroyed (rxe otherwise
 * holds the QP and process exit stalls ~50 s). A CQ destroyed while armed
 * drops the arming's strong reference to its handler (which may close over
 * the CQ's own handle: a cycle the GC could never collect).
 * Provider-allocated MR memory is reference counted on its own (mem_t: the
 * registration, the MR's ArrayBuffer, every alias buffer, and every
 * registration over it by regMrUser): deregMr detaches the ArrayBuffer and
 * all aliases, and the memory is freed with the last reference, so neither a
 * JS view nor a registration (which the device may still DMA into) can
 * outlive it.
 *
 * Nothing here blocks the event loop: every event channel (CQ completion
 * channels, the device's async-event fd) is O_NONBLOCK and is read only until
 * EAGAIN; every event read is acknowledged before the callback returns, so
 * ibv_destroy_cq / ibv_destroy_qp (which wait until every event they
 * reported is acknowledged) return at once.
 *
 * Hot path: work requests are encoded by TypeScript into a shared
 * ArrayBuffer (layout in src/transport/verbs/codec.ts, mirrored below) and
 * posted with ONE ibv_post_send / ibv_post_recv of a chained list; completions
 * are polled straight into the caller's typed arrays.
 */
#define _GNU_SOURCE
#include <node_api.h>
#include <uv.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "napi_util.h"

/* ------------------------------------------------------------------ layout */
/* Must match src/transport/verbs/codec.ts. All fields little-endian (host). */
#define CTRL_BYTES 16          /* u32 badIndex(out), u32 capacity, u32 sgeOffset, u32 sgeCapacity */
#define SWR_BYTES 64
#define RWR_BYTES 16
#define SGE_BYTES 16
/* send record */
#define SWR_WRID 0             /* f64 */
#define SWR_OPCODE 8           /* u32 */
#define SWR_FLAGS 12           /* u32 */
#define SWR_SGE_START 16       /* u32 */
#define SWR_NUM_SGE 20         /* u32 */
#define SWR_IMM 24             /* u32 host order; LOCAL_INV: rkey to invalidate */
#define SWR_RKEY 28            /* u32 remote rkey; BIND_MW: new rkey */
#define SWR_RADDR 32           /* f64 remote address; BIND_MW: bind addr */
#define SWR_COMPARE_ADD 40     /* u64; BIND_MW: f64 bind length */
#define SWR_SWAP 48            /* u64; BIND_MW: u32 access */
#define SWR_MW 56              /* u32 index into the objs array (BIND_MW) */
#define SWR_MR 60              /* u32 index into the objs array (BIND_MW) */
/* recv record */
#define RWR_WRID 0
#define RWR_SGE_START 8
#define RWR_NUM_SGE 12
/* sge */
#define SGE_ADDR 0             /* f64 */
#define SGE_LENGTH 8           /* u32 */
#define SGE_LKEY 12            /* u32 */

/* Post results other than an errno (> 0). */
#define POST_DESTROYED (-1)
#define POST_BAD_BUFFER (-2)
#define POST_BAD_RECORD (-3)

/* ----------------------------------------------------------------- objects */
enum kind { K_CTX = 1, K_PD, K_CQ, K_QP, K_MR, K_MW, K_COUNT };
static const char *kind_name[K_COUNT] = {"?", "device", "protection domain", "completion queue", "queue pair", "memory region", "memory window"};

typedef struct state state_t;
typedef struct ctx ctx_t;
typedef struct obj obj_t;

struct obj {
  enum kind kind;
  int refs;
  int destroyed;
  ctx_t *ctx;   /* valid only while the object is not destroyed (a destroyed object no longer holds its context) */
  state_t *st;  /* the addon's per-environment state: lives as long as the process */
  obj_t *prev, *next; /* in ctx->lists[kind] while not destroyed */
};

typedef struct mem mem_t;

struct state {
  napi_env env;
  ctx_t *ctxs;
  mem_t *mems; /* live provider-allocated memory (regMrUser looks buffers up here) */
  int tearing_down;
  int pending_closes;
  napi_async_cleanup_hook_handle hook;
  /* for tests (debugLive): native objects not yet freed, by kind; live JS handles */
  long live[K_COUNT];
  long live_mems;
  long handles;
};

struct ctx {
  obj_t h;
  state_t *st;
  struct ibv_context *ibv;
  uv_poll_t *poll;
  napi_ref on_async; /* weak: the Device object holds the function */
  napi_async_context actx;
  obj_t *lists[K_COUNT];
  ctx_t *snext, *sprev;
};

typedef struct {
  obj_t h;
  ctx_t *owner;
  struct ibv_pd *pd;
} pd_t;

typedef struct {
  obj_t h;
  ctx_t *owner;
  struct ibv_cq *cq;
  struct ibv_comp_channel *ch;
  uv_poll_t *poll;
  napi_ref on_notify; /* strong only while armed */
  napi_async_context actx;
  int armed;
  int keep_alive; /* a JS handler is set: an armed CQ keeps the event loop alive */
  unsigned unacked;
} cq_t;

typedef struct mw mw_t;
typedef struct {
  obj_t h;
  pd_t *pd;
  cq_t *scq, *rcq;
  struct ibv_qp *qp;
  uint32_t swr_cap, ssge_cap, rwr_cap, rsge_cap;
  struct ibv_send_wr *swr;
  struct ibv_sge *ssge;
  struct ibv_recv_wr *rwr;
  struct ibv_sge *rsge;
  mw_t *mws; /* type-2 windows bound through this QP */
} qp_t;

typedef struct alias alias_t;

/* Provider-allocated MR memory. Freed when the last reference goes: the MR
 * registration, the MR's external ArrayBuffer, and one per alias buffer
 * (aliasMr). So memory outlives every JS view of it, whatever the order in
 * which the MR is deregistered, its handle collected, or its device closed. */
struct mem {
  void *ptr;
  size_t len;        /* registered length (aliases stay inside it) */
  int refs;
  alias_t *aliases;  /* alias buffers not yet finalized; deregMr detaches them */
  state_t *st;
  mem_t *prev, *next; /* in st->mems */
};

/* An external ArrayBuffer over part of an MR's memory (MemoryRegion.aliasBuffer). */
struct alias {
  mem_t *mem;
  state_t *st;
  napi_ref ref; /* weak: only to detach it at deregistration */
  alias_t *next, *prev;
};

typedef struct {
  obj_t h;
  pd_t *pd;
  struct ibv_mr *mr;
  mem_t *mem;       /* provider-allocated memory, or NULL */
  mem_t *covers;    /* regMrUser over provider memory (a grant over a slab): held until deregistration */
  napi_ref ab;      /* owned: weak ref to the external ArrayBuffer; user memory: strong ref */
} mr_t;

struct mw {
  obj_t h;
  pd_t *pd;
  struct ibv_mw *mw;
  qp_t *qp; /* QP it was last bound through */
  mw_t *qnext, *qprev;
};

static void obj_unref(obj_t *o);

static void list_add(obj_t *o) {
  obj_t **head = &o->ctx->lists[o->kind];
  o->st = o->ctx->st;
  o->st->live[o->kind]++;
  o->prev = NULL;
  o->next = *head;
  if (*head) (*head)->prev = o;
  *head = o;
}

static void list_del(obj_t *o) {
  if (o->prev) o->prev->next = o->next;
  else if (o->ctx->lists[o->kind] == o) o->ctx->lists[o->kind] = o->next;
  if (o->next) o->next->prev = o->prev;
  o->prev = o->next = NULL;
}

static void poll_closed(uv_handle_t *h) {
  state_t *st = h->data;
  free(h);
  if (st) {
    st->pending_closes--;
    if (st->tearing_down && st->pending_closes == 0 && st->hook) {
      napi_async_cleanup_hook_handle hk = st->hook;
      st->hook = NULL;
      napi_remove_async_cleanup_hook(hk);
    }
  }
}

static void poll_close(state_t *st, uv_poll_t **pp) {
  uv_poll_t *p = *pp;
  if (!p) return;
  *pp = NULL;
  uv_poll_stop(p);
  p->data = st;
  st->pending_closes++;
  uv_close((uv_handle_t *)p, poll_closed);
}

static void mem_unref(mem_t *m) {
  if (--m->refs == 0) {
    state_t *st = m->st;
    if (m->prev) m->prev->next = m->next;
    else if (st->mems == m) st->mems = m->next;
    if (m->next) m->next->prev = m->prev;
    st->live_mems--;
    free(m->ptr);
    free(m);
  }
}

/* The live provider memory that holds [p, p+len) entirely, or NULL. */
static mem_t *mem_find(state_t *st, const void *p, size_t len) {
  uintptr_t a = (uintptr_t)p;
  for (mem_t *m = st->mems; m; m = m->next) {
    uintptr_t b = (uintptr_t)m->ptr;
    if (a >= b && a - b <= m->len && len <= m->len - (a - b)) return m;
  }
  return NULL;
}

static void mw_unlink_qp(mw_t *w) {
  if (!w->qp) return;
  if (w->qprev) w->qprev->qnext = w->qnext;
  else w->qp->mws = w->qnext;
  if (w->qnext) w->qnext->qprev = w->qprev;
  w->qp = NULL;
  w->qnext = w->qprev = NULL;
}

static void mw_link_qp(mw_t *w, qp_t *q) {
  if (w->qp == q) return;
  mw_unlink_qp(w);
  w->qp = q;
  w->qprev = NULL;
  w->qnext = q->mws;
  if (q->mws) q->mws->qprev = w;
  q->mws = w;
}

/* Releases the verbs resource. force: teardown (errors ignored, resource considered gone). */
static int obj_destroy(obj_t *o, int force) {
  int err = 0;
  if (o->destroyed) return 0;
  switch (o->kind) {
    case K_MW: {
      mw_t *w = (mw_t *)o;
      err = ibv_dealloc_mw(w->mw);
      if (err && !force) return err;
      mw_unlink_qp(w);
      list_del(o);
      o->destroyed = 1;
      o->ctx = NULL;
      obj_unref(&w->pd->h);
      return err;
    }
    case K_QP: {
      qp_t *q = (qp_t *)o;
      while (q->mws) obj_destroy(&q->mws->h, 1);
      err = ibv_destroy_qp(q->qp);
      if (err && !force) return err;
      list_del(o);
      o->destroyed = 1;
      o->ctx = NULL;
      free(q->swr);
      free(q->ssge);
      free(q->rwr);
      free(q->rsge);
      q->swr = NULL;
      q->ssge = q->rsge = NULL;
      q->rwr = NULL;
      obj_unref(&q->scq->h);
      obj_unref(&q->rcq->h);
      obj_unref(&q->pd->h);
      return err;
    }
    case K_MR: {
      mr_t *m = (mr_t *)o;
      err = ibv_dereg_mr(m->mr);
      if (err && !force) return err;
      list_del(o);
      o->destroyed = 1;
      o->ctx = NULL;
      /* m->mem (the registration's reference) is kept until deregMr or obj_free,
       * so a deregMr after the device closed still detaches every view. The
       * memory a user registration covered is no longer the device's. */
      if (m->covers) {
        mem_t *c = m->covers;
        m->covers = NULL;
        mem_unref(c);
      }
      obj_unref(&m->pd->h);
      return err;
    }
    case K_CQ: {
      cq_t *c = (cq_t *)o;
      if (c->unacked) {
        ibv_ack_cq_events(c->cq, c->unacked);
        c->unacked = 0;
      }
      err = ibv_destroy_cq(c->cq);
      if (err && !force) return err;
      /* The watcher stops (and leaves epoll) before the channel's fd closes. */
      poll_close(o->st, &c->poll);
      if (c->ch) ibv_destroy_comp_channel(c->ch);
      c->ch = NULL;
      if (c->armed) {
        /* No notification can come any more: the handler goes weak again. */
        c->armed = 0;
        uint32_t rc;
        if (!o->st->tearing_down) napi_reference_unref(o->st->env, c->on_notify, &rc);
      }
      list_del(o);
      o->destroyed = 1;
      o->ctx = NULL;
      obj_unref(&c->owner->h);
      return err;
    }
    case K_PD: {
      pd_t *p = (pd_t *)o;
      err = ibv_dealloc_pd(p->pd);
      if (err && !force) return err;
      list_del(o);
      o->destroyed = 1;
      o->ctx = NULL;
      obj_unref(&p->owner->h);
      return err;
    }
    case K_CTX: {
      /* Callers that may not own a reference (ctx_close, teardown) go through
       * ctx_close_held; from obj_unref the lists are empty (children hold it). */
      ctx_t *c = (ctx_t *)o;
      static const enum kind order[] = {K_MW, K_QP, K_MR, K_CQ, K_PD};
      for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        while (c->lists[order[i]]) obj_destroy(c->lists[order[i]], 1);
      poll_close(c->st, &c->poll);
      ibv_close_device(c->ibv);
      c->ibv = NULL;
      o->destroyed = 1;
      if (c->sprev) c->sprev->snext = c->snext;
      else if (c->st->ctxs == c) c->st->ctxs = c->snext;
      if (c->snext) c->snext->sprev = c->sprev;
      c->snext = c->sprev = NULL;
      return 0;
    }
    default:
      return 0;
  }
}

static void obj_free(obj_t *o) {
  /* Not o->ctx->st: the context may be freed already (found by ASan: an MR
   * handle finalized after its device's handle, the device closed before). */
  state_t *st = o->st;
  napi_env env = st->env;
  int live = !st->tearing_down;
  st->live[o->kind]--;
  switch (o->kind) {
    case K_MR: {
      mr_t *m = (mr_t *)o;
      if (m->ab && live) napi_delete_reference(env, m->ab);
      if (m->mem) mem_unref(m->mem);
      if (m->covers) mem_unref(m->covers);
      break;
    }
    case K_CQ: {
      cq_t *c = (cq_t *)o;
      if (live) {
        if (c->on_notify) napi_delete_reference(env, c->on_notify);
        if (c->actx) napi_async_destroy(env, c->actx);
      }
      break;
    }
    case K_CTX: {
      ctx_t *c = (ctx_t *)o;
      if (live) {
        if (c->on_async) napi_delete_reference(env, c->on_async);
        if (c->actx) napi_async_destroy(env, c->actx);
      }
      break;
    }
    default:
      break;
  }
  free(o);
}

static void obj_unref(obj_t *o) {
  if (--o->refs > 0) return;
  obj_destroy(o, 1);
  obj_free(o);
}

/* Closes a context and everything on it, holding a reference across the
 * walk: each child destroyed drops its reference on the context, and when the
 * context's JS handle is already collected (GC order, or the environment's
 * teardown) one of them would otherwise free it while the walk still reads
 * its lists. */
static void ctx_close_held(ctx_t *c) {
  c->h.refs++;
  obj_destroy(&c->h, 1);
  obj_unref(&c->h);
}

static void handle_finalize(napi_env env, void *data, void *hint) {
  (void)env;
  (void)hint;
  obj_t *o = data;
  o->st->handles--;
  obj_unref(o);
}

/* ------------------------------------------------------------------ errors */
#define CHECK(call)                                              \
  do {                                                           \
    if ((call) != napi_ok) {                                     \
      bool pending_ = false;                                     \
      napi_is_exception_pending(env, &pending_);                 \
      if (!pending_) throw_arg(env, "invalid argument: " #call); \
      return NULL;                                               \
    }                                                            \
  } while (0)

#define ARGS(n)                                           \
  size_t argc = (n);                                      \
  napi_value argv[(n) > 0 ? (n) : 1];                     \
  CHECK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL))

static obj_t *get_obj(napi_env env, napi_value v, enum kind k, int must_be_live) {
  void *p = NULL;
  napi_valuetype t;
  if (napi_typeof(env, v, &t) != napi_ok || t != napi_external || napi_get_value_external(env, v, &p) != napi_ok || !p) {
    throw_arg(env, "expected a native handle");
    return NULL;
  }
  obj_t *o = p;
  if (o->kind != k) {
    char msg[128];
    snprintf(msg, sizeof msg, "expected a %s handle, got a %s", kind_name[k], o->kind > 0 && o->kind < K_COUNT ? kind_name[o->kind] : "?");
    throw_arg(env, msg);
    return NULL;
  }
  if (must_be_live && (o->destroyed || (o->ctx && o->ctx->h.destroyed))) {
    char msg[128];
    snprintf(msg, sizeof msg, "the %s is destroyed (or its device is closed)", kind_name[k]);
    throw_code(env, "DESTROYED", msg);
    return NULL;
  }
  return o;
}

#define GET(type, var, val, kind) \
  type *var = (type *)get_obj(env, (val), (kind), 1); \
  if (!var) return NULL

static napi_value make_handle(napi_env env, obj_t *o) {
  napi_value v;
  if (napi_create_external(env, o, handle_finalize, NULL, &v) != napi_ok) return NULL;
  o->st->handles++;
  return v;
}

static void gid_str(const union ibv_gid *g, char *out, size_t n) {
  if (!inet_ntop(AF_INET6, g->raw, out, (socklen_t)n)) snprintf(out, n, "::");
}

/* Runs a JS callback from a libuv callback: handle scope, async context
 * (so microtasks run afterwards) and uncaught exceptions routed to the process. */
static void call_js(napi_env env, napi_ref fn_ref, napi_async_context actx, size_t argc, napi_value *argv) {
  napi_value fn, recv, res;
  if (napi_get_reference_value(env, fn_ref, &fn) != napi_ok || fn == NULL) return;
  napi_get_global(env, &recv); /* napi_make_callback needs an object receiver */
  if (napi_make_callback(env, actx, recv, fn, argc, argv, &res) != napi_ok) {
    bool pending = false;
    napi_is_exception_pending(env, &pending);
    if (pending) {
      napi_value exc;
      napi_get_and_clear_last_exception(env, &exc);
      napi_fatal_exception(env, exc);
    }
  }
}

static int set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) return errno;
  return fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ? errno : 0;
}

/* ---------------------------------------------------------------- devices */
static napi_value list_devices(napi_env env, napi_callback_info info) {
  (void)info;
  int n = 0;
  errno = 0;
  struct ibv_device **l = ibv_get_device_list(&n);
  napi_value arr;
  /* ENOSYS: the kernel has no RDMA subsystem (no uverbs): no devices, not an error */
  if (!l && errno == ENOSYS) {
    napi_create_array(env, &arr);
    return arr;
  }
  if (!l) return throw_errno(env, "ibv_get_device_list", errno ? errno : EIO);
  napi_create_array_with_length(env, (size_t)n, &arr);
  for (int i = 0; i < n; i++) {
    napi_value o;
    char g[32];
    napi_create_object(env, &o);
    set(env, o, "name", str(env, ibv_get_device_name(l[i])));
    guid_str(ibv_get_device_guid(l[i]), g, sizeof g);
    set(env, o, "guid", str(env, g));
    set(env, o, "nodeType", num(env, l[i]->node_type));
    set(env, o, "transportType", num(env, l[i]->transport_type));
    napi_set_element(env, arr, (uint32_t)i, o);
  }
  ibv_free_device_list(l);
  return arr;
}

static void async_ready(uv_poll_t *p, int status, int events) {
  (void)events;
  ctx_t *c = p->data;
  if (!c || c->h.destroyed) return;
  napi_env env = c->st->env;
  for (;;) {
    struct ibv_async_event ev;
    if (ibv_get_async_event(c->ibv, &ev)) break;
    int qpn = -1, port = 0;
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_COMM_EST:
      case IBV_EVENT_SQ_DRAINED:
      case IBV_EVENT_PATH_MIG:
      case IBV_EVENT_PATH_MIG_ERR:
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        qpn = (int)ev.element.qp->qp_num;
        break;
      case IBV_EVENT_PORT_ACTIVE:
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_LID_CHANGE:
      case IBV_EVENT_PKEY_CHANGE:
      case IBV_EVENT_SM_CHANGE:
      case IBV_EVENT_CLIENT_REREGISTER:
      case IBV_EVENT_GID_CHANGE:
        port = ev.element.port_num;
        break;
      default:
        break;
    }
    int type = ev.event_type;
    ibv_ack_async_event(&ev);
    if (!c->on_async) continue;
    napi_handle_scope scope;
    napi_open_handle_scope(env, &scope);
    napi_value argv[4] = {num(env, type), num(env, qpn), num(env, port), str(env, ibv_event_type_str((enum ibv_event_type)type))};
    c->h.refs++; /* the handler may close the device */
    call_js(env, c->on_async, c->actx, 4, argv);
    napi_close_handle_scope(env, scope);
    int gone = c->h.destroyed;
    obj_unref(&c->h);
    if (gone) break;
  }
  (void)status;
}

/* open(name | null, onAsync(type, qpNum, portNum, text)) -> handle */
static napi_value ctx_open(napi_env env, napi_callback_info info) {
  ARGS(2);
  state_t *st;
  CHECK(napi_get_instance_data(env, (void **)&st));
  char name[IBV_SYSFS_NAME_MAX + 1] = "";
  napi_valuetype t;
  napi_typeof(env, argv[0], &t);
  if (t == napi_string) {
    size_t len;
    CHECK(napi_get_value_string_utf8(env, argv[0], name, sizeof name, &len));
  }
  int n = 0;
  struct ibv_device **l = ibv_get_device_list(&n);
  if (!l && errno == ENOSYS) {
    throw_code(env, "ENODEV", "no RDMA devices: this kernel has no RDMA support (ibv_get_device_list: ENOSYS); load rdma_rxe / an HCA driver, or use the tcp provider");
    return NULL;
  }
  if (!l) return throw_errno(env, "ibv_get_device_list", errno ? errno : EIO);
  struct ibv_device *dev = NULL;
  for (int i = 0; i < n; i++)
    if (!name[0] || strcmp(name, ibv_get_device_name(l[i])) == 0) {
      dev = l[i];
      break;
    }
  if (!dev) {
    ibv_free_device_list(l);
    char msg[256];
    snprintf(msg, sizeof msg, n ? "no RDMA device named %s" : "no RDMA devices%s", name);
    throw_code(env, "ENODEV", msg);
    return NULL;
  }
  struct ibv_context *ibv = ibv_open_device(dev);
  int e = errno;
  ibv_free_device_list(l);
  if (!ibv) return throw_errno(env, "ibv_open_device", e);
  ctx_t *c = calloc(1, sizeof *c);
  if (!c) {
    ibv_close_device(ibv);
    return throw_errno(env, "calloc", ENOMEM);
  }
  c->h.kind = K_CTX;
  c->h.refs = 1;
  c->h.ctx = c;
  c->h.st = st;
  st->live[K_CTX]++;
  c->st = st;
  c->ibv = ibv;
  c->snext = st->ctxs;
  if (st->ctxs) st->ctxs->sprev = c;
  st->ctxs = c;
  napi_create_reference(env, argv[1], 0, &c->on_async);
  napi_async_init(env, NULL, str(env, "async-rdma:device"), &c->actx);
  if (set_nonblock(ibv->async_fd) == 0) {
    uv_loop_t *loop;
    napi_get_uv_event_loop(env, &loop);
    c->poll = malloc(sizeof *c->poll);
    if (c->poll && uv_poll_init(loop, c->poll, ibv->async_fd) == 0) {
      c->poll->data = c;
      uv_poll_start(c->poll, UV_READABLE, async_ready);
      uv_unref((uv_handle_t *)c->poll);
    } else {
      free(c->poll);
      c->poll = NULL;
    }
  }
  napi_value h = make_handle(env, &c->h);
  if (!h) {
    obj_unref(&c->h);
    return throw_errno(env, "napi_create_external", ENOMEM);
  }
  return h;
}

static napi_value ctx_close(napi_env env, napi_callback_info info) {
  ARGS(1);
  ctx_t *c = (ctx_t *)get_obj(env, argv[0], K_CTX, 0);
  if (!c) return NULL;
  ctx_close_held(c);
  return NULL;
}

/* Largest max_inline_data a QP can be created with (binary search). */
static uint32_t measure_inline(struct ibv_context *ibv) {
  struct ibv_pd *pd = ibv_alloc_pd(ibv);
  if (!pd) return 0;
  struct ibv_cq *cq = ibv_create_cq(ibv, 2, NULL, NULL, 0);
  if (!cq) {
    ibv_dealloc_pd(pd);
    return 0;
  }
  uint32_t lo = 0, hi = 1u << 16;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo + 1) / 2;
    struct ibv_qp_init_attr a = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .cap = {.max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = mid}};
    struct ibv_qp *qp = ibv_create_qp(pd, &a);
    if (qp) {
      lo = a.cap.max_inline_data > mid ? a.cap.max_inline_data : mid;
      if (lo > hi) lo = hi;
      ibv_destroy_qp(qp);
    } else {
      hi = mid - 1;
    }
  }
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  return lo;
}

static napi_value ctx_query(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET(ctx_t, c, argv[0], K_CTX);
  struct ibv_device_attr a;
  int e = ibv_query_device(c->ibv, &a);
  if (e) return throw_errno(env, "ibv_query_device", e);
  napi_value o;
  char g[32];
  napi_create_object(env, &o);
  set(env, o, "fwVer", str(env, a.fw_ver));
  guid_str(a.node_guid, g, sizeof g);
  set(env, o, "nodeGuid", str(env, g));
  set(env, o, "vendorId", num(env, a.vendor_id));
  set(env, o, "vendorPartId", num(env, a.vendor_part_id));
  set(env, o, "maxMrSize", num(env, (double)a.max_mr_size));
  set(env, o, "maxQp", num(env, a.max_qp));
  set(env, o, "maxQpWr", num(env, a.max_qp_wr));
  set(env, o, "maxSge", num(env, a.max_sge));
  set(env, o, "maxCq", num(env, a.max_cq));
  set(env, o, "maxCqe", num(env, a.max_cqe));
  set(env, o, "maxMr", num(env, a.max_mr));
  set(env, o, "maxPd", num(env, a.max_pd));
  set(env, o, "maxQpRdAtom", num(env, a.max_qp_rd_atom));
  set(env, o, "maxQpInitRdAtom", num(env, a.max_qp_init_rd_atom));
  set(env, o, "atomicCap", num(env, a.atomic_cap));
  set(env, o, "maxMw", num(env, a.max_mw));
  set(env, o, "deviceCapFlags", num(env, (double)a.device_cap_flags));
  set(env, o, "physPortCnt", num(env, a.phys_port_cnt));
  set(env, o, "maxInline", num(env, measure_inline(c->ibv)));
  return o;
}

static const char *gid_type_name(uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
    default: return "unknown";
  }
}

static napi_value ctx_query_port(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET(ctx_t, c, argv[0], K_CTX);
  uint32_t port;
  if (get_u32(env, argv[1], &port)) return throw_arg(env, "port must be a number");
  struct ibv_port_attr pa;
  int e = ibv_query_port(c->ibv, (uint8_t)port, &pa);
  if (e) return throw_errno(env, "ibv_query_port", e);
  napi_value o, gids;
  napi_create_object(env, &o);
  set(env, o, "state", num(env, pa.state));
  set(env, o, "activeMtu", num(env, 128 << pa.active_mtu));
  set(env, o, "maxMtu", num(env, 128 << pa.max_mtu));
  set(env, o, "linkLayer", num(env, pa.link_layer));
  set(env, o, "lid", num(env, pa.lid));
  set(env, o, "gidTblLen", num(env, pa.gid_tbl_len));
  napi_create_array(env, &gids);
  uint32_t k = 0;
  int max = pa.gid_tbl_len > 0 ? pa.gid_tbl_len : 0;
  /* the table covers every port: room for 4 ports' worth, else fall back below */
  size_t cap = (size_t)max * 4;
  struct ibv_gid_entry *ents = cap ? calloc(cap, sizeof *ents) : NULL;
  ssize_t got = ents ? ibv_query_gid_table(c->ibv, ents, cap, 0) : -1;
  if (got >= 0) {
    for (ssize_t i = 0; i < got; i++) {
      if (ents[i].port_num != port) continue;
      static const uint8_t zero[16];
      if (!memcmp(ents[i].gid.raw, zero, 16)) continue;
      char s[64];
      napi_value g;
      gid_str(&ents[i].gid, s, sizeof s);
      napi_create_object(env, &g);
      set(env, g, "index", num(env, ents[i].gid_index));
      set(env, g, "gid", str(env, s));
      set(env, g, "type", str(env, gid_type_name(ents[i].gid_type)));
      napi_set_element(env, gids, k++, g);
    }
  } else {
    /* Older kernels: one query per index (bounded). */
    for (int i = 0; i < max && i < 256; i++) {
      union ibv_gid gid;
      static const uint8_t zero[16];
      if (ibv_query_gid(c->ibv, (uint8_t)port, i, &gid) || !memcmp(gid.raw, zero, 16)) continue;
      char s[64];
      napi_value g;
      gid_str(&gid, s, sizeof s);
      napi_create_object(env, &g);
      set(env, g, "index", num(env, i));
      set(env, g, "gid", str(env, s));
      struct ibv_gid_entry ent;
      if (ibv_query_gid_ex(c->ibv, port, (uint32_t)i, &ent, 0) == 0) set(env, g, "type", str(env, gid_type_name(ent.gid_type)));
      napi_set_element(env, gids, k++, g);
    }
  }
  free(ents);
  set(env, o, "gids", gids);
  return o;
}

static napi_value ctx_query_gid(napi_env env, napi_callback_info info) {
  ARGS(3);
  GET(ctx_t, c, argv[0], K_CTX);
  uint32_t port, idx;
  if (get_u32(env, argv[1], &port) || get_u32(env, argv[2], &idx)) return throw_arg(env, "port and index must be numbers");
  union ibv_gid gid;
  int e = ibv_query_gid(c->ibv, (uint8_t)port, (int)idx, &gid);
  if (e) return throw_errno(env, "ibv_query_gid", e < 0 ? -e : (errno ? errno : EINVAL));
  char s[64];
  gid_str(&gid, s, sizeof s);
  return str(env, s);
}

/* --------------------------------------------------------------------- PD */
static napi_value pd_alloc(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET(ctx_t, c, argv[0], K_CTX);
  struct ibv_pd *pd = ibv_alloc_pd(c->ibv);
  if (!pd) return throw_errno(env, "ibv_alloc_pd", errno);
  pd_t *p = calloc(1, sizeof *p);
  if (!p) {
    ibv_dealloc_pd(pd);
    return throw_errno(env, "calloc", ENOMEM);
  }
  p->h.kind = K_PD;
  p->h.refs = 1;
  p->h.ctx = c;
  p->owner = c;
  p->pd = pd;
  c->h.refs++;
  list_add(&p->h);
  napi_value h = make_handle(env, &p->h);
  if (!h) obj_unref(&p->h);
  return h;
}

static napi_value obj_release(napi_env env, napi_callback_info info, enum kind k, const char *call) {
  ARGS(1);
  obj_t *o = get_obj(env, argv[0], k, 0);
  if (!o) return NULL;
  if (o->destroyed) return NULL;
  if (o->ctx->h.destroyed) return NULL;
  int e = obj_destroy(o, 0);
  if (e) return throw_errno(env, call, e);
  return NULL;
}

static napi_value pd_dealloc(napi_env env, napi_callback_info info) { return obj_release(env, info, K_PD, "ibv_dealloc_pd"); }

/* --------------------------------------------------------------------- MR */
static void mem_ab_finalize(napi_env env, void *data, void *hint) {
  (void)env;
  (void)data;
  mem_unref((mem_t *)hint);
}

static mr_t *mr_new(ctx_t *c, pd_t *p, struct ibv_mr *mr) {
  mr_t *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->h.kind = K_MR;
  m->h.refs = 1;
  m->h.ctx = c;
  m->pd = p;
  m->mr = mr;
  p->h.refs++;
  list_add(&m->h);
  return m;
}

/* regMr(pd, length, access) -> [handle, arrayBuffer, addr, lkey, rkey] */
static napi_value mr_reg(napi_env env, napi_callback_info info) {
  ARGS(3);
  GET(pd_t, p, argv[0], K_PD);
  double dlen;
  uint32_t access;
  if (get_f64(env, argv[1], &dlen) || get_u32(env, argv[2], &access) || !(dlen >= 1) || dlen > 9007199254740991.0) return throw_arg(env, "bad length or access");
  size_t len = (size_t)dlen;
  long pg = sysconf(_SC_PAGESIZE);
  if (pg <= 0) pg = 4096;
  size_t alloc = (len + (size_t)pg - 1) / (size_t)pg * (size_t)pg;
  void *ptr = NULL;
  if (posix_memalign(&ptr, (size_t)pg, alloc)) return throw_errno(env, "posix_memalign", ENOMEM);
  memset(ptr, 0, alloc);
  struct ibv_mr *mr = ibv_reg_mr(p->pd, ptr, len, (int)access);
  if (!mr) {
    int e = errno;
    free(ptr);
    return throw_errno(env, "ibv_reg_mr", e);
  }
  mem_t *mem = calloc(1, sizeof *mem);
  mr_t *m = mem ? mr_new(p->h.ctx, p, mr) : NULL;
  if (!m) {
    ibv_dereg_mr(mr);
    free(ptr);
    free(mem);
    return throw_errno(env, "calloc", ENOMEM);
  }
  mem->ptr = ptr;
  mem->len = len;
  mem->refs = 1; /* the registration */
  mem->st = p->h.st;
  mem->next = mem->st->mems;
  if (mem->next) mem->next->prev = mem;
  mem->st->mems = mem;
  mem->st->live_mems++;
  m->mem = mem;
  napi_value ab, h, res;
  if (napi_create_external_arraybuffer(env, ptr, len, mem_ab_finalize, mem, &ab) != napi_ok) {
    obj_destroy(&m->h, 1);
    obj_unref(&m->h);
    return throw_errno(env, "napi_create_external_arraybuffer", ENOMEM);
  }
  mem->refs++; /* the ArrayBuffer */
  napi_create_reference(env, ab, 0, &m->ab);
  h = make_handle(env, &m->h);
  if (!h) {
    obj_unref(&m->h);
    return NULL;
  }
  napi_create_array_with_length(env, 5, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, ab);
  napi_set_element(env, res, 2, num(env, (double)(uintptr_t)ptr));
  napi_set_element(env, res, 3, num(env, mr->lkey));
  napi_set_element(env, res, 4, num(env, mr->rkey));
  return res;
}

/* regMrUser(pd, arrayBuffer | uint8Array, offset, length, access) -> [handle, addr, lkey, rkey]
 * A Uint8Array stands for the memory it views: the way a SharedArrayBuffer
 * reaches here (Node-API has no call for a SharedArrayBuffer's memory before
 * Node 24, but a typed array over one gives its data pointer). */
static napi_value mr_reg_user(napi_env env, napi_callback_info info) {
  ARGS(5);
  GET(pd_t, p, argv[0], K_PD);
  bool is_ab = false, is_ta = false;
  void *data = NULL;
  size_t blen = 0;
  napi_is_arraybuffer(env, argv[1], &is_ab);
  if (is_ab) {
    CHECK(napi_get_arraybuffer_info(env, argv[1], &data, &blen));
  } else {
    napi_is_typedarray(env, argv[1], &is_ta);
    if (!is_ta) return throw_arg(env, "expected an ArrayBuffer or a Uint8Array");
    napi_typedarray_type t;
    napi_value ab;
    size_t off;
    CHECK(napi_get_typedarray_info(env, argv[1], &t, &blen, &data, &ab, &off));
    if (t != napi_uint8_array) return throw_arg(env, "expected an ArrayBuffer or a Uint8Array");
  }
  double doff, dlen;
  uint32_t access;
  if (get_f64(env, argv[2], &doff) || get_f64(env, argv[3], &dlen) || get_u32(env, argv[4], &access)) return throw_arg(env, "bad offset, length or access");
  if (!data || !(doff >= 0) || !(dlen >= 1) || doff + dlen > (double)blen) return throw_arg(env, "range outside the ArrayBuffer (or it is detached)");
  uint8_t *ptr = (uint8_t *)data + (size_t)doff;
  struct ibv_mr *mr = ibv_reg_mr(p->pd, ptr, (size_t)dlen, (int)access);
  if (!mr) return throw_errno(env, "ibv_reg_mr", errno);
  mr_t *m = mr_new(p->h.ctx, p, mr);
  if (!m) {
    ibv_dereg_mr(mr);
    return throw_errno(env, "calloc", ENOMEM);
  }
  /* Memory of this addon (an MR's ArrayBuffer or an alias of it: a grant over
   * a slab): the ArrayBuffer can be detached (deregMr of the slab, detachBuffer)
   * and then frees nothing it holds, so the registration holds the memory
   * itself until it is deregistered. Other memory is held by the strong
   * reference to its ArrayBuffer. */
  m->covers = mem_find(p->h.st, ptr, (size_t)dlen);
  if (m->covers) m->covers->refs++;
  napi_create_reference(env, argv[1], 1, &m->ab);
  napi_value h = make_handle(env, &m->h), res;
  if (!h) {
    obj_unref(&m->h);
    return NULL;
  }
  napi_create_array_with_length(env, 4, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, num(env, (double)(uintptr_t)ptr));
  napi_set_element(env, res, 2, num(env, mr->lkey));
  napi_set_element(env, res, 3, num(env, mr->rkey));
  return res;
}

/* deregMr(mr): ibv_dereg_mr; provider-allocated memory's ArrayBuffer and every
 * alias buffer of it are detached (the memory itself goes with the last reference). */
static napi_value mr_dereg(napi_env env, napi_callback_info info) {
  ARGS(1);
  mr_t *m = (mr_t *)get_obj(env, argv[0], K_MR, 0);
  if (!m) return NULL;
  int owned = m->mem != NULL;
  mem_t *mem = m->mem;
  if (!m->h.destroyed && !m->h.ctx->h.destroyed) {
    int e = obj_destroy(&m->h, 0);
    if (e) return throw_errno(env, "ibv_dereg_mr", e);
  }
  if (m->ab) {
    napi_value ab;
    if (owned && napi_get_reference_value(env, m->ab, &ab) == napi_ok && ab) napi_detach_arraybuffer(env, ab);
    napi_delete_reference(env, m->ab);
    m->ab = NULL;
  }
  if (mem) {
    for (alias_t *a = mem->aliases, *next; a; a = next) {
      napi_value v = NULL;
      next = a->next; /* detaching may finalize a (never another alias) */
      if (a->ref && napi_get_reference_value(env, a->ref, &v) == napi_ok && v) napi_detach_arraybuffer(env, v);
    }
    m->mem = NULL;
    mem_unref(mem); /* the registration's reference */
  }
  return NULL;
}

static void alias_finalize(napi_env env, void *data, void *hint) {
  (void)data;
  alias_t *a = hint;
  mem_t *m = a->mem;
  if (a->prev) a->prev->next = a->next;
  else if (m->aliases == a) m->aliases = a->next;
  if (a->next) a->next->prev = a->prev;
  if (a->ref && !a->st->tearing_down) napi_delete_reference(env, a->ref);
  free(a);
  mem_unref(m);
}

/* aliasMr(mr, offset, length) -> a new external ArrayBuffer over bytes
 * [offset, offset+length) of a provider-allocated MR's memory. It holds a
 * reference on the memory (which is freed only after the last alias is
 * collected), is detachable on its own, and is detached when the MR is
 * deregistered. */
static napi_value mr_alias(napi_env env, napi_callback_info info) {
  ARGS(3);
  GET(mr_t, m, argv[0], K_MR);
  mem_t *mem = m->mem;
  if (!mem) return throw_arg(env, "only memory the provider allocated (registerMr with a length) can be aliased");
  double off, len;
  if (get_f64(env, argv[1], &off) || get_f64(env, argv[2], &len)) return throw_arg(env, "offset and length must be numbers");
  if (!(off >= 0) || !(len >= 1) || off != (double)(size_t)off || len != (double)(size_t)len || off + len > (double)mem->len)
    return throw_arg(env, "alias range outside the memory region");
  alias_t *a = calloc(1, sizeof *a);
  if (!a) return throw_errno(env, "calloc", ENOMEM);
  a->mem = mem;
  a->st = m->h.ctx->st;
  napi_value ab;
  if (napi_create_external_arraybuffer(env, (uint8_t *)mem->ptr + (size_t)off, (size_t)len, alias_finalize, a, &ab) != napi_ok) {
    free(a);
    return throw_errno(env, "napi_create_external_arraybuffer", ENOMEM);
  }
  mem->refs++;
  napi_create_reference(env, ab, 0, &a->ref);
  a->next = mem->aliases;
  if (mem->aliases) mem->aliases->prev = a;
  mem->aliases = a;
  return ab;
}

/* detachBuffer(ab): napi_detach_arraybuffer of an external ArrayBuffer (an MR's
 * buffer or an alias). Node ignores external buffers in a structuredClone
 * transfer list, so this is the only way to detach them. */
static napi_value buffer_detach(napi_env env, napi_callback_info info) {
  ARGS(1);
  bool is_ab = false;
  napi_is_arraybuffer(env, argv[0], &is_ab);
  if (!is_ab) return throw_arg(env, "expected an ArrayBuffer");
  if (napi_detach_arraybuffer(env, argv[0]) != napi_ok) {
    bool pending = false;
    napi_is_exception_pending(env, &pending);
    if (!pending) throw_arg(env, "this ArrayBuffer cannot be detached (not external memory)");
    return NULL;
  }
  return NULL;
}

/* --------------------------------------------------------------------- MW */
static napi_value mw_alloc(napi_env env, napi_callback_info info) {
  ARGS(2);
  GET(pd_t, p, argv[0], K_PD);
  uint32_t type;
  if (get_u32(env, argv[1], &type) || (type != 1 && type != 2)) return throw_arg(env, "window type must be 1 or 2");
  struct ibv_mw *mw = ibv_alloc_mw(p->pd, type == 1 ? IBV_MW_TYPE_1 : IBV_MW_TYPE_2);
  if (!mw) return throw_errno(env, "ibv_alloc_mw", errno ? errno : EOPNOTSUPP);
  mw_t *w = calloc(1, sizeof *w);
  if (!w) {
    ibv_dealloc_mw(mw);
    return throw_errno(env, "calloc", ENOMEM);
  }
  w->h.kind = K_MW;
  w->h.refs = 1;
  w->h.ctx = p->h.ctx;
  w->pd = p;
  w->mw = mw;
  p->h.refs++;
  list_add(&w->h);
  napi_value h = make_handle(env, &w->h), res;
  if (!h) {
    obj_unref(&w->h);
    return NULL;
  }
  napi_create_array_with_length(env, 2, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, num(env, mw->rkey));
  return res;
}

static napi_value mw_dealloc(napi_env env, napi_callback_info info) { return obj_release(env, info, K_MW, "ibv_dealloc_mw"); }

/* --------------------------------------------------------------------- CQ */
static void cq_ready(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  cq_t *c = p->data;
  if (!c || c->h.destroyed) return;
  int got = 0;
  for (;;) {
    struct ibv_cq *ecq;
    void *ectx;
    if (ibv_get_cq_event(c->ch, &ecq, &ectx)) break;
    got++;
    c->unacked++;
  }
  if (c->unacked) {
    ibv_ack_cq_events(c->cq, c->unacked);
    c->unacked = 0;
  }
  if (!got || !c->armed) return;
  napi_env env = c->h.ctx->st->env;
  c->armed = 0;
  uv_unref((uv_handle_t *)c->poll);
  napi_handle_scope scope;
  napi_open_handle_scope(env, &scope);
  /* the reference goes weak after the call so the handler stays alive during it */
  c->h.refs++; /* the handler may destroy the CQ */
  call_js(env, c->on_notify, c->actx, 0, NULL);
  /* drop the arming's strong reference (a re-arm inside the handler took its own) */
  uint32_t rc;
  napi_reference_unref(env, c->on_notify, &rc);
  napi_close_handle_scope(env, scope);
  obj_unref(&c->h);
}

/* createCq(ctx, depth, onNotify) -> [handle, cqe] */
static napi_value cq_create(napi_env env, napi_callback_info info) {
  ARGS(3);
  GET(ctx_t, c, argv[0], K_CTX);
  uint32_t depth;
  if (get_u32(env, argv[1], &depth) || depth < 1) return throw_arg(env, "bad CQ depth");
  struct ibv_comp_channel *ch = ibv_create_comp_channel(c->ibv);
  if (!ch) return throw_errno(env, "ibv_create_comp_channel", errno);
  int e = set_nonblock(ch->fd);
  if (e) {
    ibv_destroy_comp_channel(ch);
    return throw_errno(env, "fcntl(O_NONBLOCK)", e);
  }
  struct ibv_cq *cq = ibv_create_cq(c->ibv, (int)depth, NULL, ch, 0);
  if (!cq) {
    e = errno;
    ibv_destroy_comp_channel(ch);
    return throw_errno(env, "ibv_create_cq", e);
  }
  cq_t *q = calloc(1, sizeof *q);
  uv_poll_t *poll = malloc(sizeof *poll);
  uv_loop_t *loop = NULL;
  napi_get_uv_event_loop(env, &loop);
  if (!q || !poll || !loop || uv_poll_init(loop, poll, ch->fd) != 0) {
    free(q);
    free(poll);
    ibv_destroy_cq(cq);
    ibv_destroy_comp_channel(ch);
    return throw_errno(env, "uv_poll_init", ENOMEM);
  }
  q->h.kind = K_CQ;
  q->h.refs = 1;
  q->h.ctx = c;
  q->owner = c;
  q->cq = cq;
  q->ch = ch;
  q->poll = poll;
  poll->data = q;
  uv_poll_start(poll, UV_READABLE, cq_ready);
  uv_unref((uv_handle_t *)poll);
  napi_create_reference(env, argv[2], 0, &q->on_notify);
  napi_async_init(env, NULL, str(env, "async-rdma:cq"), &q->actx);
  c->h.refs++;
  list_add(&q->h);
  napi_value h = make_handle(env, &q->h), res;
  if (!h) {
    obj_unref(&q->h);
    return NULL;
  }
  napi_create_array_with_length(env, 2, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, num(env, cq->cqe));
  return res;
}

static napi_value cq_destroy(napi_env env, napi_callback_info info) {
  ARGS(1);
  cq_t *q = (cq_t *)get_obj(env, argv[0], K_CQ, 0);
  if (!q || q->h.destroyed || q->h.ctx->h.destroyed) return NULL;
  int e = obj_destroy(&q->h, 0); /* also drops the arming's reference */
  if (e) return throw_errno(env, "ibv_destroy_cq", e);
  return NULL;
}

/* reqNotify(cq): the handler runs once when a completion arrives after this call. */
static napi_value cq_req_notify(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET(cq_t, q, argv[0], K_CQ);
  int e = ibv_req_notify_cq(q->cq, 0);
  if (e) return throw_errno(env, "ibv_req_notify_cq", e);
  if (!q->armed) {
    uint32_t rc;
    q->armed = 1;
    napi_reference_ref(env, q->on_notify, &rc);
    if (q->keep_alive) uv_ref((uv_handle_t *)q->poll);
  }
  return NULL;
}

/* keepAlive(cq, bool): whether an armed CQ keeps the event loop alive (true while a handler is set). */
static napi_value cq_keep_alive(napi_env env, napi_callback_info info) {
  ARGS(2);
  cq_t *q = (cq_t *)get_obj(env, argv[0], K_CQ, 0);
  if (!q) return NULL;
  bool on = false;
  napi_get_value_bool(env, argv[1], &on);
  q->keep_alive = on;
  if (q->poll && !q->h.destroyed) {
    if (on && q->armed) uv_ref((uv_handle_t *)q->poll);
    else uv_unref((uv_handle_t *)q->poll);
  }
  return NULL;
}

static int get_ta(napi_env env, napi_value v, napi_typedarray_type want, void **data, size_t *len) {
  napi_typedarray_type t;
  napi_value ab;
  size_t off;
  if (napi_get_typedarray_info(env, v, &t, len, data, &ab, &off) != napi_ok || t != want || !*data) return -1;
  return 0;
}

/* poll(cq, max, wrId f64[], status u8[], opcode u8[], flags u8[], byteLen u32[], imm u32[], qpNum u32[], vendorErr u32[]) -> n */
static napi_value cq_poll(napi_env env, napi_callback_info info) {
  ARGS(10);
  GET(cq_t, q, argv[0], K_CQ);
  uint32_t max;
  if (get_u32(env, argv[1], &max)) return throw_arg(env, "bad max");
  double *wrid;
  uint8_t *st, *op, *fl;
  uint32_t *bl, *imm, *qpn, *ve;
  size_t n0, n1, n2, n3, n4, n5, n6, n7;
  if (get_ta(env, argv[2], napi_float64_array, (void **)&wrid, &n0) || get_ta(env, argv[3], napi_uint8_array, (void **)&st, &n1) ||
      get_ta(env, argv[4], napi_uint8_array, (void **)&op, &n2) || get_ta(env, argv[5], napi_uint8_array, (void **)&fl, &n3) ||
      get_ta(env, argv[6], napi_uint32_array, (void **)&bl, &n4) || get_ta(env, argv[7], napi_uint32_array, (void **)&imm, &n5) ||
      get_ta(env, argv[8], napi_uint32_array, (void **)&qpn, &n6) || get_ta(env, argv[9], napi_uint32_array, (void **)&ve, &n7))
    return throw_arg(env, "completion buffer arrays have the wrong types (or are detached)");
  size_t cap = n0;
  size_t ns[] = {n1, n2, n3, n4, n5, n6, n7};
  for (size_t i = 0; i < 7; i++)
    if (ns[i] < cap) cap = ns[i];
  if (max > cap) max = (uint32_t)cap;
  struct ibv_wc wc[32];
  uint32_t done = 0;
  while (done < max) {
    int want = (int)(max - done < 32 ? max - done : 32);
    int k = ibv_poll_cq(q->cq, want, wc);
    if (k < 0) return throw_errno(env, "ibv_poll_cq", k == -1 ? EIO : -k);
    for (int i = 0; i < k; i++, done++) {
      memcpy(&wrid[done], &wc[i].wr_id, 8);
      st[done] = (uint8_t)wc[i].status;
      op[done] = (uint8_t)wc[i].opcode;
      fl[done] = (uint8_t)wc[i].wc_flags;
      bl[done] = wc[i].byte_len;
      imm[done] = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
      qpn[done] = wc[i].qp_num;
      ve[done] = wc[i].vendor_err;
    }
    if (k < want) break;
  }
  return num(env, done);
}

/* --------------------------------------------------------------------- QP */
/* createQp(pd, sendCq, recvCq, maxSendWr, maxRecvWr, maxSendSge, maxRecvSge, maxInline, sqSigAll, portNum, access)
 *   -> [handle, qpNum, maxSendWr, maxRecvWr, maxSendSge, maxRecvSge, maxInline] */
static napi_value qp_create(napi_env env, napi_callback_info info) {
  ARGS(11);
  GET(pd_t, p, argv[0], K_PD);
  GET(cq_t, scq, argv[1], K_CQ);
  GET(cq_t, rcq, argv[2], K_CQ);
  uint32_t v[8];
  for (int i = 0; i < 8; i++)
    if (get_u32(env, argv[3 + i], &v[i])) return throw_arg(env, "bad QP attribute");
  if (scq->h.ctx != p->h.ctx || rcq->h.ctx != p->h.ctx) return throw_arg(env, "CQs and PD belong to different devices");
  struct ibv_qp_init_attr a = {.send_cq = scq->cq,
                               .recv_cq = rcq->cq,
                               .qp_type = IBV_QPT_RC,
                               .sq_sig_all = v[5] ? 1 : 0,
                               .cap = {.max_send_wr = v[0], .max_recv_wr = v[1], .max_send_sge = v[2], .max_recv_sge = v[3], .max_inline_data = v[4]}};
  struct ibv_qp *qp = ibv_create_qp(p->pd, &a);
  if (!qp) return throw_errno(env, "ibv_create_qp", errno);
  struct ibv_qp_attr m = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = (uint8_t)v[6], .qp_access_flags = (int)v[7]};
  int e = ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (e) {
    ibv_destroy_qp(qp);
    return throw_errno(env, "ibv_modify_qp(INIT)", e);
  }
  /* The queue depths the device really gives (rxe rounds them up to 2^n - 1
   * and reports only the rounded values through ibv_query_qp). */
  {
    struct ibv_qp_attr qa;
    struct ibv_qp_init_attr qia;
    if (ibv_query_qp(qp, &qa, IBV_QP_CAP, &qia) == 0) {
      if (qa.cap.max_send_wr > a.cap.max_send_wr) a.cap.max_send_wr = qa.cap.max_send_wr;
      if (qa.cap.max_recv_wr > a.cap.max_recv_wr) a.cap.max_recv_wr = qa.cap.max_recv_wr;
      if (qa.cap.max_send_sge > a.cap.max_send_sge) a.cap.max_send_sge = qa.cap.max_send_sge;
      if (qa.cap.max_recv_sge > a.cap.max_recv_sge) a.cap.max_recv_sge = qa.cap.max_recv_sge;
      if (qa.cap.max_inline_data > a.cap.max_inline_data) a.cap.max_inline_data = qa.cap.max_inline_data;
    }
  }
  qp_t *q = calloc(1, sizeof *q);
  if (q) {
    /* One more than the queue holds: a list that overfills the queue still goes
     * down in one ibv_post_send, which refuses the first WR that does not fit. */
    q->swr_cap = a.cap.max_send_wr + 1;
    q->ssge_cap = q->swr_cap * (a.cap.max_send_sge ? a.cap.max_send_sge : 1);
    q->rwr_cap = a.cap.max_recv_wr + 1;
    q->rsge_cap = q->rwr_cap * (a.cap.max_recv_sge ? a.cap.max_recv_sge : 1);
    q->swr = calloc(q->swr_cap ? q->swr_cap : 1, sizeof *q->swr);
    q->ssge = calloc(q->ssge_cap ? q->ssge_cap : 1, sizeof *q->ssge);
    q->rwr = calloc(q->rwr_cap ? q->rwr_cap : 1, sizeof *q->rwr);
    q->rsge = calloc(q->rsge_cap ? q->rsge_cap : 1, sizeof *q->rsge);
  }
  if (!q || !q->swr || !q->ssge || !q->rwr || !q->rsge) {
    if (q) {
      free(q->swr);
      free(q->ssge);
      free(q->rwr);
      free(q->rsge);
      free(q);
    }
    ibv_destroy_qp(qp);
    return throw_errno(env, "calloc", ENOMEM);
  }
  q->h.kind = K_QP;
  q->h.refs = 1;
  q->h.ctx = p->h.ctx;
  q->pd = p;
  q->scq = scq;
  q->rcq = rcq;
  q->qp = qp;
  p->h.refs++;
  scq->h.refs++;
  rcq->h.refs++;
  list_add(&q->h);
  napi_value h = make_handle(env, &q->h), res;
  if (!h) {
    obj_unref(&q->h);
    return NULL;
  }
  napi_create_array_with_length(env, 7, &res);
  napi_set_element(env, res, 0, h);
  napi_set_element(env, res, 1, num(env, qp->qp_num));
  napi_set_element(env, res, 2, num(env, a.cap.max_send_wr));
  napi_set_element(env, res, 3, num(env, a.cap.max_recv_wr));
  napi_set_element(env, res, 4, num(env, a.cap.max_send_sge));
  napi_set_element(env, res, 5, num(env, a.cap.max_recv_sge));
  napi_set_element(env, res, 6, num(env, a.cap.max_inline_data));
  return res;
}

static enum ibv_mtu mtu_enum(uint32_t b) {
  switch (b) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    default: return IBV_MTU_4096;
  }
}

/* connect(qp, portNum, gidIndex, mtuBytes, destQpn, rqPsn, sqPsn, dlid, dgid, timeout, retryCnt, rnrRetry, minRnrTimer, maxRdAtomic, maxDestRdAtomic) */
static napi_value qp_connect(napi_env env, napi_callback_info info) {
  ARGS(15);
  GET(qp_t, q, argv[0], K_QP);
  uint32_t v[15] = {0};
  for (int i = 1; i < 15; i++) {
    if (i == 8) continue;
    if (get_u32(env, argv[i], &v[i])) return throw_arg(env, "bad connect attribute");
  }
  char gs[64];
  size_t gl;
  if (napi_get_value_string_utf8(env, argv[8], gs, sizeof gs, &gl) != napi_ok) return throw_arg(env, "gid must be a string");
  union ibv_gid dgid;
  if (inet_pton(AF_INET6, gs, dgid.raw) != 1) return throw_arg(env, "gid is not an IPv6-form GID");
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = mtu_enum(v[3]);
  a.dest_qp_num = v[4];
  a.rq_psn = v[5] & 0xffffff;
  a.max_dest_rd_atomic = (uint8_t)v[14];
  a.min_rnr_timer = (uint8_t)v[12];
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = dgid;
  a.ah_attr.grh.sgid_index = (uint8_t)v[2];
  a.ah_attr.grh.hop_limit = 64;
  a.ah_attr.dlid = (uint16_t)v[7];
  a.ah_attr.sl = 0;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.port_num = (uint8_t)v[1];
  int e = ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (e) return throw_errno(env, "ibv_modify_qp(RTR)", e);
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = (uint8_t)v[9];
  a.retry_cnt = (uint8_t)v[10];
  a.rnr_retry = (uint8_t)v[11];
  a.sq_psn = v[6] & 0xffffff;
  a.max_rd_atomic = (uint8_t)v[13];
  e = ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (e) return throw_errno(env, "ibv_modify_qp(RTS)", e);
  return NULL;
}

static napi_value qp_set_error(napi_env env, napi_callback_info info) {
  ARGS(1);
  GET(qp_t, q, argv[0], K_QP);
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
  int e = ibv_modify_qp(q->qp, &a, IBV_QP_STATE);
  if (e) return throw_errno(env, "ibv_modify_qp(ERR)", e);
  return NULL;
}

/* state(qp) -> ibv_qp_state, or -1 when destroyed */
static napi_value qp_state(napi_env env, napi_callback_info info) {
  ARGS(1);
  qp_t *q = (qp_t *)get_obj(env, argv[0], K_QP, 0);
  if (!q) return NULL;
  if (q->h.destroyed) return num(env, -1);
  struct ibv_qp_attr a;
  struct ibv_qp_init_attr ia;
  int e = ibv_query_qp(q->qp, &a, IBV_QP_STATE, &ia);
  if (e) return throw_errno(env, "ibv_query_qp", e);
  return num(env, a.qp_state);
}

static napi_value qp_destroy(napi_env env, napi_callback_info info) { return obj_release(env, info, K_QP, "ibv_destroy_qp"); }

static inline uint32_t rd32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static inline uint64_t rd64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
static inline double rdf(const uint8_t *p) {
  double v;
  memcpy(&v, p, 8);
  return v;
}
static inline int addr_ok(double d) { return d >= 0 && d <= 18446744073709549568.0; }

/* Reads `count` SGEs starting at `start` of the buffer's SGE region into out[]; 0 or -1. */
static int read_sges(const uint8_t *buf, size_t blen, uint32_t start, uint32_t count, struct ibv_sge *out, uint32_t out_cap, uint32_t *used) {
  uint32_t sge_off = rd32(buf + 8), sge_cap = rd32(buf + 12);
  if (count == 0) return 0;
  if ((uint64_t)start + count > sge_cap || (uint64_t)sge_off + (uint64_t)sge_cap * SGE_BYTES > blen) return -1;
  if ((uint64_t)*used + count > out_cap) return -1;
  for (uint32_t i = 0; i < count; i++) {
    const uint8_t *s = buf + sge_off + (size_t)(start + i) * SGE_BYTES;
    double a = rdf(s + SGE_ADDR);
    if (!addr_ok(a)) return -1;
    struct ibv_sge *o = &out[*used + i];
    o->addr = (uint64_t)a;
    o->length = rd32(s + SGE_LENGTH);
    o->lkey = rd32(s + SGE_LKEY);
  }
  *used += count;
  return 0;
}

/* postSend(qp, buf, count, objs?) -> 0 | errno | POST_*; buf[0..4) = index of the first WR not posted */
static napi_value qp_post_send(napi_env env, napi_callback_info info) {
  ARGS(4);
  qp_t *q = (qp_t *)get_obj(env, argv[0], K_QP, 0);
  if (!q) return NULL;
  if (q->h.destroyed || q->h.ctx->h.destroyed) return num(env, POST_DESTROYED);
  uint8_t *buf;
  size_t blen;
  uint32_t count;
  if (napi_get_arraybuffer_info(env, argv[1], (void **)&buf, &blen) != napi_ok || !buf || blen < CTRL_BYTES || get_u32(env, argv[2], &count)) return num(env, POST_BAD_BUFFER);
  uint32_t cap = rd32(buf + 4);
  uint32_t bad_at = 0;
  memcpy(buf, &bad_at, 4);
  if (count == 0) return num(env, 0);
  if (count > cap || count > q->swr_cap || CTRL_BYTES + (uint64_t)cap * SWR_BYTES > blen) return num(env, POST_BAD_BUFFER);
  napi_value objs = argv[3];
  napi_valuetype ot;
  napi_typeof(env, objs, &ot);
  uint32_t used = 0;
  for (uint32_t i = 0; i < count; i++) {
    const uint8_t *r = buf + CTRL_BYTES + (size_t)i * SWR_BYTES;
    struct ibv_send_wr *w = &q->swr[i];
    memset(w, 0, sizeof *w);
    double wrid = rdf(r + SWR_WRID);
    memcpy(&w->wr_id, &wrid, 8);
    w->opcode = (enum ibv_wr_opcode)rd32(r + SWR_OPCODE);
    w->send_flags = rd32(r + SWR_FLAGS);
    w->next = i + 1 < count ? &q->swr[i + 1] : NULL;
    uint32_t nsge = rd32(r + SWR_NUM_SGE);
    w->sg_list = &q->ssge[used];
    w->num_sge = (int)nsge;
    if (read_sges(buf, blen, rd32(r + SWR_SGE_START), nsge, q->ssge, q->ssge_cap, &used)) goto bad;
    if (nsge == 0) w->sg_list = NULL;
    switch (w->opcode) {
      case IBV_WR_SEND_WITH_IMM:
        w->imm_data = htonl(rd32(r + SWR_IMM));
        break;
      case IBV_WR_RDMA_WRITE_WITH_IMM:
        w->imm_data = htonl(rd32(r + SWR_IMM));
        /* fall through */
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_READ: {
        double ra = rdf(r + SWR_RADDR);
        if (!addr_ok(ra)) goto bad;
        w->wr.rdma.remote_addr = (uint64_t)ra;
        w->wr.rdma.rkey = rd32(r + SWR_RKEY);
        break;
      }
      case IBV_WR_ATOMIC_CMP_AND_SWP:
      case IBV_WR_ATOMIC_FETCH_AND_ADD: {
        double ra = rdf(r + SWR_RADDR);
        if (!addr_ok(ra)) goto bad;
        w->wr.atomic.remote_addr = (uint64_t)ra;
        w->wr.atomic.rkey = rd32(r + SWR_RKEY);
        w->wr.atomic.compare_add = rd64(r + SWR_COMPARE_ADD);
        w->wr.atomic.swap = rd64(r + SWR_SWAP);
        break;
      }
      case IBV_WR_LOCAL_INV:
        w->invalidate_rkey = rd32(r + SWR_IMM);
        break;
      case IBV_WR_BIND_MW: {
        napi_value vmw, vmr;
        if (ot != napi_object || napi_get_element(env, objs, rd32(r + SWR_MW), &vmw) != napi_ok || napi_get_element(env, objs, rd32(r + SWR_MR), &vmr) != napi_ok) goto bad;
        mw_t *mw = (mw_t *)get_obj(env, vmw, K_MW, 1);
        mr_t *mr = mw ? (mr_t *)get_obj(env, vmr, K_MR, 1) : NULL;
        if (!mr) {
          napi_value exc;
          napi_get_and_clear_last_exception(env, &exc);
          goto bad;
        }
        double ba = rdf(r + SWR_RADDR), bl = rdf(r + SWR_COMPARE_ADD);
        if (!addr_ok(ba) || !addr_ok(bl)) goto bad;
        w->bind_mw.mw = mw->mw;
        w->bind_mw.rkey = rd32(r + SWR_RKEY);
        w->bind_mw.bind_info.mr = mr->mr;
        w->bind_mw.bind_info.addr = (uint64_t)ba;
        w->bind_mw.bind_info.length = (uint64_t)bl;
        w->bind_mw.bind_info.mw_access_flags = rd32(r + SWR_SWAP);
        break;
      }
      default:
        break;
    }
    continue;
  bad:
    bad_at = i;
    memcpy(buf, &bad_at, 4);
    if (i == 0) return num(env, POST_BAD_RECORD);
    q->swr[i - 1].next = NULL;
    count = i;
    break;
  }
  uint32_t decoded = count;
  struct ibv_send_wr *bad = NULL;
  int e = ibv_post_send(q->qp, q->swr, &bad);
  uint32_t posted = e ? (bad ? (uint32_t)(bad - q->swr) : 0) : decoded;
  /* Windows bound through this QP are deallocated before it is destroyed. */
  for (uint32_t i = 0; i < posted; i++)
    if (q->swr[i].opcode == IBV_WR_BIND_MW) {
      napi_value vmw;
      void *p;
      if (napi_get_element(env, objs, rd32(buf + CTRL_BYTES + (size_t)i * SWR_BYTES + SWR_MW), &vmw) == napi_ok && napi_get_value_external(env, vmw, &p) == napi_ok)
        mw_link_qp((mw_t *)p, q);
    }
  if (e) {
    memcpy(buf, &posted, 4);
    return num(env, e < 0 ? -e : e);
  }
  if (bad_at) return num(env, POST_BAD_RECORD); /* buf[0] names it; the ones before were posted */
  return num(env, 0);
}

/* postRecv(qp, buf, count) -> 0 | errno | POST_* */
static napi_value qp_post_recv(napi_env env, napi_callback_info info) {
  ARGS(3);
  qp_t *q = (qp_t *)get_obj(env, argv[0], K_QP, 0);
  if (!q) return NULL;
  if (q->h.destroyed || q->h.ctx->h.destroyed) return num(env, POST_DESTROYED);
  uint8_t *buf;
  size_t blen;
  uint32_t count;
  if (napi_get_arraybuffer_info(env, argv[1], (void **)&buf, &blen) != napi_ok || !buf || blen < CTRL_BYTES || get_u32(env, argv[2], &count)) return num(env, POST_BAD_BUFFER);
  uint32_t cap = rd32(buf + 4);
  uint32_t bad_at = 0;
  memcpy(buf, &bad_at, 4);
  if (count == 0) return num(env, 0);
  if (count > cap || count > q->rwr_cap || CTRL_BYTES + (uint64_t)cap * RWR_BYTES > blen) return num(env, POST_BAD_BUFFER);
  uint32_t used = 0;
  int badrec = 0;
  for (uint32_t i = 0; i < count; i++) {
    const uint8_t *r = buf + CTRL_BYTES + (size_t)i * RWR_BYTES;
    struct ibv_recv_wr *w = &q->rwr[i];
    double wrid = rdf(r + RWR_WRID);
    memcpy(&w->wr_id, &wrid, 8);
    w->next = i + 1 < count ? &q->rwr[i + 1] : NULL;
    uint32_t nsge = rd32(r + RWR_NUM_SGE);
    w->sg_list = nsge ? &q->rsge[used] : NULL;
    w->num_sge = (int)nsge;
    if (read_sges(buf, blen, rd32(r + RWR_SGE_START), nsge, q->rsge, q->rsge_cap, &used)) {
      bad_at = i;
      memcpy(buf, &bad_at, 4);
      if (i == 0) return num(env, POST_BAD_RECORD);
      q->rwr[i - 1].next = NULL;
      badrec = 1;
      break;
    }
  }
  struct ibv_recv_wr *bad = NULL;
  int e = ibv_post_recv(q->qp, q->rwr, &bad);
  if (e) {
    uint32_t posted = bad ? (uint32_t)(bad - q->rwr) : 0;
    memcpy(buf, &posted, 4);
    return num(env, e < 0 ? -e : e);
  }
  return num(env, badrec ? POST_BAD_RECORD : 0);
}

/* ----------------------------------------------------------------- module */
static void teardown(napi_async_cleanup_hook_handle hook, void *arg) {
  state_t *st = arg;
  st->tearing_down = 1;
  st->hook = hook;
  while (st->ctxs) ctx_close_held(st->ctxs);
  if (st->pending_closes == 0) {
    st->hook = NULL;
    napi_remove_async_cleanup_hook(hook);
  }
}

/* debugLive() -> { device, pd, cq, qp, mr, mw, memory, handles }: native
 * objects not yet freed, provider memory blocks not yet freed, JS handles not
 * yet collected (for tests of lifetimes). */
static napi_value debug_live(napi_env env, napi_callback_info info) {
  (void)info;
  state_t *st;
  CHECK(napi_get_instance_data(env, (void **)&st));
  static const char *names[K_COUNT] = {NULL, "device", "pd", "cq", "qp", "mr", "mw"};
  napi_value o;
  napi_create_object(env, &o);
  for (int k = K_CTX; k < K_COUNT; k++) set(env, o, names[k], num(env, (double)st->live[k]));
  set(env, o, "memory", num(env, (double)st->live_mems));
  set(env, o, "handles", num(env, (double)st->handles));
  return o;
}

/* debugMemRefs(addr, length) -> references on the provider memory block holding
 * [addr, addr+length) (0: none, or freed). */
static napi_value debug_mem_refs(napi_env env, napi_callback_info info) {
  ARGS(2);
  state_t *st;
  CHECK(napi_get_instance_data(env, (void **)&st));
  double a, l;
  if (get_f64(env, argv[0], &a) || get_f64(env, argv[1], &l) || !addr_ok(a) || !(l >= 0)) return throw_arg(env, "bad address or length");
  mem_t *m = mem_find(st, (const void *)(uintptr_t)a, (size_t)l);
  return num(env, m ? m->refs : 0);
}

static napi_value errno_name_js(napi_env env, napi_callback_info info) {
  ARGS(1);
  uint32_t e;
  if (get_u32(env, argv[0], &e)) return throw_arg(env, "errno must be a number");
  return str(env, errno_name((int)e));
}

NAPI_MODULE_INIT() {
  state_t *st = calloc(1, sizeof *st); /* lives as long as the process: finalizers may run after teardown */
  if (!st) return NULL;
  st->env = env;
  napi_set_instance_data(env, st, NULL, NULL);
  napi_add_async_cleanup_hook(env, teardown, st, NULL);
  static const struct {
    const char *name;
    napi_callback fn;
  } fns[] = {
      {"listDevices", list_devices}, {"open", ctx_open}, {"close", ctx_close}, {"queryDevice", ctx_query}, {"queryPort", ctx_query_port},
      {"queryGid", ctx_query_gid}, {"allocPd", pd_alloc}, {"deallocPd", pd_dealloc}, {"regMr", mr_reg}, {"regMrUser", mr_reg_user},
      {"deregMr", mr_dereg}, {"aliasMr", mr_alias}, {"detachBuffer", buffer_detach}, {"allocMw", mw_alloc}, {"deallocMw", mw_dealloc}, {"createCq", cq_create}, {"destroyCq", cq_destroy},
      {"reqNotifyCq", cq_req_notify}, {"keepAliveCq", cq_keep_alive}, {"pollCq", cq_poll}, {"createQp", qp_create}, {"connectQp", qp_connect}, {"setQpError", qp_set_error},
      {"queryQpState", qp_state}, {"destroyQp", qp_destroy}, {"postSend", qp_post_send}, {"postRecv", qp_post_recv}, {"errnoName", errno_name_js},
      {"debugLive", debug_live}, {"debugMemRefs", debug_mem_refs},
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    napi_value f;
    napi_create_function(env, fns[i].name, NAPI_AUTO_LENGTH, fns[i].fn, NULL, &f);
    napi_set_named_property(env, exports, fns[i].name, f);
  }
  napi_value layout;
  napi_create_object(env, &layout);
  set(env, layout, "ctrlBytes", num(env, CTRL_BYTES));
  set(env, layout, "sendWrBytes", num(env, SWR_BYTES));
  set(env, layout, "recvWrBytes", num(env, RWR_BYTES));
  set(env, layout, "sgeBytes", num(env, SGE_BYTES));
  set(env, exports, "layout", layout);
  return exports;
}
