/* kvplug's compiled HTTP/1.1 data path (see lane.h and docs/frontend.md "The native data path").
 *
 * State lives in two structs: a client connection (reading a head, reading a body, waiting for
 * an engine, relaying, flushing) and an engine connection (connecting, sending, reading the
 * answer head, relaying the body, idle in its upstream's pool). Deadlines are one field per
 * connection, checked on a 20 ms timerfd tick that only runs while connections are open.
 */
#define _GNU_SOURCE
#include "lane.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD 8190          /* as kvplug/frontend/lane.py: a longer head goes to Python */
#define MAX_ANSWER_HEAD 65536  /* an engine's answer head longer than this is a failure */
#define PAUSE_ENGINE_AT (256 * 1024) /* client output held before the engine is not read */
#define RESUME_ENGINE_AT (64 * 1024)
#define TAIL 4096
#define READ_CHUNK 65536
#define TICK_NS 20000000LL
/* A deadline judged this late means the loop running the lane stalled (the tick is 20 ms), not
 * that the peer was silent: the stalled time is given back, up to the deadline's own length and
 * STALL_GRACES times per request (kvplug.stalls.given_back, the same figures, in Python). */
#define STALL_NS 100000000LL
#define STALL_GRACES 3
#define ACCEPTS_PER_EVENT 64
#define PIPELINE_HOLD 65536 /* bytes of later requests read while one is served */
#define MAX_TRIES 16 /* retries of one request the lane follows */
#define MAX_DEPTH 8 /* pipelined requests served within one another's answer */

enum { K_LISTEN = 1, K_CLIENT, K_ENGINE, K_TIMER };

typedef struct {
    char *p;
    size_t off, len, cap; /* the data is p[off, len) */
} buf_t;

typedef struct client client_t;
typedef struct engine engine_t;

enum { E_CONNECTING, E_SENDING, E_HEAD, E_BODY, E_IDLE };
enum { F_NONE, F_LENGTH, F_CHUNKED, F_CLOSE };
enum { CH_SIZE, CH_EXT, CH_SIZE_LF, CH_DATA, CH_DATA_CR, CH_DATA_LF, CH_TRAILER, CH_TRAILER_LINE,
       CH_DONE };

struct engine {
    int kind, fd;
    uint32_t mask; /* the events epoll watches for it now */
    int up;    /* index into lane->ups */
    unsigned generation; /* its upstream's, when it connected */
    int state;
    int reused; /* came from the pool: a failure before any answer byte is retried once */
    int keep_alive;
    int paused;
    int send_queued; /* on the lane's to_send list */
    client_t *client;
    engine_t *next_idle;
    engine_t *next_send;
    engine_t *prev, *next; /* every engine connection */
    int64_t deadline;
    size_t sent;
    buf_t in;
    int status, framing, chunk_state, got_bytes;
    int size_digits; /* digits of the current chunk-size line copied to the client */
    uint64_t remaining;
};

enum { C_HEAD, C_BODY, C_WAIT, C_RELAY, C_FLUSH };

struct client {
    int kind, fd;
    uint32_t mask;
    int state;
    int first;       /* no request taken yet on this connection */
    int keep_alive;  /* the current request's */
    int answered;    /* a byte of an answer was queued on this connection */
    size_t answer_sent; /* bytes of it written to the socket */
    int streamed, first_byte_done;
    int wrap_chunks; /* the lane frames the client's chunks (until-close answers, streams) */
    int want_out;    /* EPOLLOUT is in the mask */
    client_t *prev, *next;
    client_t *next_ready; /* the lane's ready list: buffered requests to parse */
    int queued;
    client_t *next_flush; /* the lane's to_flush list: answers written at the end of the poll */
    int flush_queued;
    int tries; /* retries of the current request (finish's FORWARDs) */
    int64_t deadline;
    int64_t limit; /* the request's total deadline (request_timeout, then stream_timeout), or 0 */
    int64_t span, limit_span; /* their lengths, the most a stall gives back */
    int64_t given;            /* stalled time given back to the phase deadline since it was set */
    int graces;               /* stalls given back to this request (STALL_GRACES) */
    int can_end; /* a broken answer's client framing can take a last chunk (stream_end) */
    buf_t in, out;
    size_t head_len, body_len; /* of the current request: head includes its blank line */
    engine_t *eng;
    void *token;
    int up;
    int status;
    char *ereq;       /* head + body for the engine, one buffer */
    size_t ereq_head_len, ereq_len;
    int ereq_client_body; /* the body is the client's, still in `in` */
    char *extra;
    size_t extra_len;
    char tail[TAIL];
    size_t tail_pos, tail_fill;
    int tail_passed; /* stream_bytes was given some of this try's body (see tail_add) */
};

typedef struct {
    int id, live, busy;
    unsigned generation; /* bumped when the address changes: older connections are not pooled */
    struct sockaddr_storage addr;
    socklen_t addrlen;
    engine_t *idle;
} upstream_t;

struct lane {
    lane_config cfg;
    int64_t request_ns, stream_ns; /* cfg.request_timeout, cfg.stream_timeout; 0 = none */
    char *head_answer, *body_answer, *handoff_headers;
    int epfd, tfd;
    int closing, ticking;
    int64_t accept_paused_until; /* 0, or when the listeners are watched again */
    int n_listeners;
    int listen_tags[64][2]; /* {K_LISTEN, fd}: epoll data points here */
    int timer_tag[2];
    client_t *clients, *dead_clients, *ready;
    client_t *to_flush, *to_flush_last; /* answers written to their clients at the end of the poll */
    int depth;
    engine_t *engines, *dead_engines;
    engine_t *to_send, *to_send_last; /* written to their engines at the end of the poll */
    upstream_t *ups;
    int n_ups, cap_ups;
    lane_stats st;
    char date[48]; /* "Date: ...\r\n" of date_sec (date_line) */
    size_t date_len;
    time_t date_sec;
};

/* ---- small helpers ---------------------------------------------------------------------- */

/* the answer's "Date: <IMF-fixdate>\r\n" field, as the Python server writes one (RFC 9110
 * 6.6.1), formatted once a second; fixed names, not strftime's locale */
static const char *date_line(lane_t *l, size_t *len) {
    static const char days[7][4] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char months[12][4] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                       "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    time_t now = time(NULL);
    if (now != l->date_sec || !l->date_len) {
        struct tm tm;
        gmtime_r(&now, &tm);
        int k = snprintf(l->date, sizeof l->date, "Date: %s, %02d %s %04d %02d:%02d:%02d GMT\r\n",
                         days[tm.tm_wday], tm.tm_mday, months[tm.tm_mon], tm.tm_year + 1900,
                         tm.tm_hour, tm.tm_min, tm.tm_sec);
        l->date_len = k > 0 && (size_t)k < sizeof l->date ? (size_t)k : 0;
        l->date_sec = now;
    }
    *len = l->date_len;
    return l->date;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t after(double seconds) {
    return seconds > 0 ? now_ns() + (int64_t)(seconds * 1e9) : 0;
}

/* c's phase deadline, seconds from now (0: none) */
static void due(client_t *c, double seconds) {
    c->deadline = after(seconds);
    c->span = c->deadline ? (int64_t)(seconds * 1e9) : 0;
    c->given = 0;
}

static int buf_reserve(buf_t *b, size_t extra) {
    if (b->off && b->off == b->len) b->off = b->len = 0;
    if (b->len + extra <= b->cap) return 0;
    if (b->off) { /* slide the data to the front before growing */
        memmove(b->p, b->p + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
        if (b->len + extra <= b->cap) return 0;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_append(buf_t *b, const void *data, size_t n) {
    if (n == 0) return 0;
    if (buf_reserve(b, n)) return -ENOMEM;
    memcpy(b->p + b->len, data, n);
    b->len += n;
    return 0;
}

static size_t buf_size(const buf_t *b) { return b->len - b->off; }
static char *buf_data(const buf_t *b) { return b->p + b->off; }
static void buf_consume(buf_t *b, size_t n) {
    b->off += n;
    if (b->off >= b->len) b->off = b->len = 0;
}
static void buf_free(buf_t *b) {
    free(b->p);
    b->p = NULL;
    b->off = b->len = b->cap = 0;
}

static int ep_set(lane_t *l, int op, int fd, uint32_t events, void *tag) {
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = events;
    ev.data.ptr = tag;
    return epoll_ctl(l->epfd, op, fd, &ev);
}

/* a connection's events (the kind/fd/mask prefix both structs share), when they change */
typedef struct {
    int kind, fd;
    uint32_t mask;
} conn_prefix;

static void watch(lane_t *l, void *conn, uint32_t events) {
    conn_prefix *p = conn;
    if (p->mask == events) return;
    p->mask = events;
    ep_set(l, EPOLL_CTL_MOD, p->fd, events, conn);
}

static const char *memfind(const char *h, size_t hn, const char *n, size_t nn) {
    return hn ? memmem(h, hn, n, nn) : NULL;
}

static void tick_arm(lane_t *l) {
    int want = l->clients != NULL || l->engines != NULL || l->accept_paused_until != 0;
    if (want == l->ticking) return;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    if (want) {
        its.it_value.tv_nsec = TICK_NS;
        its.it_interval.tv_nsec = TICK_NS;
    }
    timerfd_settime(l->tfd, 0, &its, NULL);
    l->ticking = want;
}

static void listeners_watch(lane_t *l, int op) {
    for (int i = 0; i < l->n_listeners; i++)
        ep_set(l, op, l->listen_tags[i][1], EPOLLIN, l->listen_tags[i]);
}

/* ---- the request head ------------------------------------------------------------------- */

static int is_tchar(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static int name_is(const char *name, size_t n, const char *lower) {
    return strlen(lower) == n && strncasecmp(name, lower, n) == 0;
}

/* whether `name` is one of the '\n'-terminated names in `list` (case-insensitive) */
static int name_listed(const char *name, size_t n, const char *list, size_t list_len) {
    for (const char *p = list, *end = list + list_len; p < end;) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) eol = end;
        if ((size_t)(eol - p) == n && strncasecmp(p, name, n) == 0) return 1;
        p = eol + 1;
    }
    return 0;
}

int lane_head_qualifies(const char *head, size_t len, size_t max_body, const char *handoff_headers,
                        size_t handoff_headers_len, lane_head *out) {
    static const char cpl[] = "POST /v1/completions HTTP/1.1\r\n";
    static const char chat[] = "POST /v1/chat/completions HTTP/1.1\r\n";
    memset(out, 0, sizeof *out);
    const char *p = head, *end = head + len;
    if (len >= sizeof cpl - 1 && memcmp(head, cpl, sizeof cpl - 1) == 0) {
        out->kind = LANE_KIND_COMPLETIONS;
        p += sizeof cpl - 1;
    } else if (len >= sizeof chat - 1 && memcmp(head, chat, sizeof chat - 1) == 0) {
        out->kind = LANE_KIND_CHAT;
        p += sizeof chat - 1;
    } else {
        return 0;
    }
    int have_length = 0, forwards = 0;
    const char *fields = p;
    out->keep_alive = 1;
    /* head ends without its blank line: every header line ends CRLF except the last */
    while (p < end) {
        const char *name = p;
        while (p < end && is_tchar((unsigned char)*p)) p++;
        if (p == name || p >= end || *p != ':') return 0;
        size_t name_len = (size_t)(p - name);
        p++;
        const char *value = p;
        while (p < end && ((unsigned char)*p == '\t' || ((unsigned char)*p >= 0x20 &&
                                                          (unsigned char)*p <= 0x7e)))
            p++;
        const char *value_end = p;
        if (p < end) {
            if (end - p < 2 || p[0] != '\r' || p[1] != '\n') return 0; /* bare CR/LF, non-ASCII */
            p += 2;
            if (p == end) return 0; /* an empty line inside the head */
        }
        while (value < value_end && (*value == ' ' || *value == '\t')) value++;
        while (value_end > value && (value_end[-1] == ' ' || value_end[-1] == '\t')) value_end--;
        size_t vlen = (size_t)(value_end - value);
        if (name_is(name, name_len, "transfer-encoding") || name_is(name, name_len, "expect") ||
            name_is(name, name_len, "upgrade") || name_is(name, name_len, "content-encoding") ||
            name_is(name, name_len, "http2-settings"))
            return 0;
        if (name_len >= 9 && strncasecmp(name, "x-kvplug-", 9) == 0) return 0; /* a hint */
        if (handoff_headers_len && name_listed(name, name_len, handoff_headers, handoff_headers_len))
            return 0; /* another routing hint (x-dynamo-dp-rank, ...) */
        if (name_is(name, name_len, "content-length")) {
            if (have_length || vlen == 0 || vlen > 15) return 0;
            uint64_t n = 0;
            for (size_t i = 0; i < vlen; i++) {
                if (value[i] < '0' || value[i] > '9') return 0;
                n = n * 10 + (uint64_t)(value[i] - '0');
            }
            if (n > max_body) return 0;
            out->content_length = (size_t)n;
            have_length = 1;
        } else if (name_is(name, name_len, "connection")) {
            if (vlen == 5 && strncasecmp(value, "close", 5) == 0)
                out->keep_alive = 0;
            else if (!(vlen == 10 && strncasecmp(value, "keep-alive", 10) == 0))
                return 0;
        } else if (name_is(name, name_len, "x-request-id") && !out->request_id) {
            out->request_id = value;
            out->request_id_len = vlen;
        } else if (name_is(name, name_len, "authorization")) {
            if (!out->authorization) {
                out->authorization = value;
                out->authorization_len = vlen;
            }
        } else if (!name_is(name, name_len, "host") && !name_is(name, name_len, "content-type") &&
                   !name_is(name, name_len, "x-request-id")) {
            forwards = 1; /* a field the engine gets as the client sent it (decide's `fields`) */
        }
    }
    if (forwards) {
        out->fields = fields;
        out->fields_len = (size_t)(end - fields);
    }
    return have_length;
}

/* ---- connections ------------------------------------------------------------------------ */

static void client_close(lane_t *l, client_t *c);
static void client_after_answer(lane_t *l, client_t *c);
static void client_process(lane_t *l, client_t *c);
static void engine_close(lane_t *l, engine_t *e);
static void attempt(lane_t *l, client_t *c);
static void apply_action(lane_t *l, client_t *c, lane_action *a, int outcome);
static void release(lane_t *l, lane_action *a);

static void client_unlink(lane_t *l, client_t *c) {
    if (c->prev) c->prev->next = c->next; else l->clients = c->next;
    if (c->next) c->next->prev = c->prev;
    l->st.open_clients--;
}

/* closed connections are freed at the end of lane_poll: an event later in the same batch may
 * still point at one (its kind is 0 by then) */
static void client_free(lane_t *l, client_t *c) {
    buf_free(&c->in);
    buf_free(&c->out);
    free(c->ereq);
    free(c->extra);
    c->ereq = c->extra = NULL;
    c->kind = 0;
    c->next = l->dead_clients;
    l->dead_clients = c;
}

static int client_serving(const client_t *c) { return c->state != C_HEAD && c->state != C_BODY; }

/* how many bytes may wait in `in`: the request at hand, then (while it is served) up to
 * PIPELINE_HOLD of the next ones; beyond that the client's bytes wait in the kernel */
static size_t client_hold(const client_t *c) {
    if (c->state == C_BODY) return c->head_len + c->body_len;
    if (c->state == C_HEAD) return MAX_HEAD;
    return c->head_len + c->body_len + PIPELINE_HOLD;
}

/* EPOLLIN stays on while a request is served (a hang-up reads as EOF; pipelined bytes are
 * kept), so serving one changes no epoll registration: two syscalls a request fewer */
static void client_mask(lane_t *l, client_t *c) {
    uint32_t ev = EPOLLRDHUP;
    if (!client_serving(c) || buf_size(&c->in) < client_hold(c)) ev |= EPOLLIN;
    c->want_out = buf_size(&c->out) > 0;
    if (c->want_out) ev |= EPOLLOUT;
    watch(l, c, ev);
}

/* the answer's body bytes (or finish's reason): the last TAIL of them kept for finish; with a
 * stream_bytes callback an event stream's are all handed over, TAIL at a time as the tail
 * fills, finish getting the rest, so the caller reads the whole stream as it passes */
static void tail_add(lane_t *l, client_t *c, const char *p, size_t n) {
    if (c->streamed && l->cfg.stream_bytes && c->token) {
        while (n) {
            size_t k = n < TAIL - c->tail_fill ? n : TAIL - c->tail_fill;
            memcpy(c->tail + c->tail_fill, p, k);
            c->tail_fill += k;
            p += k;
            n -= k;
            if (c->tail_fill == TAIL) {
                l->cfg.stream_bytes(l->cfg.ctx, c->token, c->tail, TAIL);
                c->tail_fill = 0;
                c->tail_passed = 1;
            }
        }
        c->tail_pos = c->tail_fill; /* the ring's view of it: unwrapped (finish reads from 0) */
        return;
    }
    if (n >= TAIL) {
        memcpy(c->tail, p + n - TAIL, TAIL);
        c->tail_pos = 0;
        c->tail_fill = TAIL;
        return;
    }
    for (size_t i = 0; i < n;) {
        size_t room = TAIL - c->tail_pos, k = n - i < room ? n - i : room;
        memcpy(c->tail + c->tail_pos, p + i, k);
        c->tail_pos = (c->tail_pos + k) % TAIL;
        i += k;
    }
    c->tail_fill = c->tail_fill + n > TAIL ? TAIL : c->tail_fill + n;
}

/* the finish callback, once per decided request; then what it asks for (a retry, an answer) */
static void finish(lane_t *l, client_t *c, int outcome) {
    char tail[TAIL];
    size_t n = c->tail_fill;
    size_t start = (c->tail_pos + TAIL - n) % TAIL;
    size_t first = n < TAIL - start ? n : TAIL - start; /* the ring's bytes up to its end */
    memcpy(tail, c->tail + start, first);
    memcpy(tail + first, c->tail, n - first); /* then those that wrapped to its start */
    void *token = c->token;
    c->token = NULL;
    lane_action a;
    memset(&a, 0, sizeof a);
    a.action = LANE_DEFAULT;
    switch (outcome) {
    case LANE_CLIENT_GONE: l->st.client_gone++; break;
    case LANE_ENGINE_UNAVAILABLE:
    case LANE_ENGINE_FAILED: l->st.engine_failed++; break;
    case LANE_TIMED_OUT:
    case LANE_DEADLINE: l->st.timeouts++; break;
    default: break;
    }
    if (outcome == LANE_OK || outcome == LANE_CLIENT_GONE) { /* nothing more to decide */
        l->cfg.finish(l->cfg.ctx, token, c->status, outcome, tail, n, NULL);
        return;
    }
    l->cfg.finish(l->cfg.ctx, token, c->status, outcome, tail, n, &a);
    apply_action(l, c, &a, outcome);
}

static const char *reason_of(int status) {
    switch (status) {
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 307: return "Temporary Redirect";
    case 405: return "Method Not Allowed";
    case 410: return "Gone";
    case 411: return "Length Required";
    case 412: return "Precondition Failed";
    case 416: return "Range Not Satisfiable";
    case 417: return "Expectation Failed";
    case 421: return "Misdirected Request";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 501: return "Not Implemented";
    case 505: return "HTTP Version Not Supported";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Request Entity Too Large";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
    }
}

static int client_flush(lane_t *l, client_t *c);

/* a whole answer of our own (decide's or finish's 3-tuple, or the default 502/504) */
static void answer(lane_t *l, client_t *c, int status, const char *headers, size_t headers_len,
                   const char *body, size_t body_len) {
    char line[160];
    if (l->closing) c->keep_alive = 0;
    int k = snprintf(line, sizeof line, "HTTP/1.1 %d %s\r\n", status, reason_of(status));
    buf_append(&c->out, line, (size_t)k);
    buf_append(&c->out, headers, headers_len);
    size_t date_len;
    const char *date = date_line(l, &date_len);
    buf_append(&c->out, date, date_len);
    k = snprintf(line, sizeof line, "Content-Length: %zu\r\n%s\r\n", body_len,
                 c->keep_alive ? "" : "Connection: close\r\n");
    buf_append(&c->out, line, (size_t)k);
    buf_append(&c->out, body, body_len);
    c->answered = 1;
    l->st.answered_directly++;
    client_after_answer(l, c);
}

static void default_answer(lane_t *l, client_t *c, int outcome) {
    static const char h[] = "Content-Type: application/json\r\n";
    static const char unavailable[] =
        "{\"error\":{\"message\":\"no engine could take the request\","
        "\"type\":\"service_unavailable\",\"code\":\"upstream_unavailable\"}}";
    static const char failed[] =
        "{\"error\":{\"message\":\"the engine failed before its answer\","
        "\"type\":\"upstream_error\",\"code\":\"upstream_failed\"}}";
    static const char timeout[] =
        "{\"error\":{\"message\":\"the engine did not answer in time\","
        "\"type\":\"upstream_error\",\"code\":\"upstream_timeout\"}}";
    if (outcome == LANE_TIMED_OUT || outcome == LANE_DEADLINE)
        answer(l, c, 504, h, sizeof h - 1, timeout, sizeof timeout - 1);
    else if (outcome == LANE_ENGINE_FAILED)
        answer(l, c, 502, h, sizeof h - 1, failed, sizeof failed - 1);
    else
        answer(l, c, 502, h, sizeof h - 1, unavailable, sizeof unavailable - 1);
}

static void handoff(lane_t *l, client_t *c) {
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    client_unlink(l, c);
    l->st.handed_off++;
    int fd = c->fd;
    /* the callback may run Python, which may poll nothing of ours: c is already unlinked */
    l->cfg.handoff(l->cfg.ctx, fd, buf_data(&c->in), buf_size(&c->in));
    client_free(l, c);
    tick_arm(l);
}

/* a FORWARD action: keep what the engine needs (the caller's buffers live until the next
 * callback), then try */
static int take_forward(client_t *c, const lane_action *a) {
    size_t body_len = a->body ? a->body_len : c->body_len;
    char *req = malloc(a->head_len + (a->body ? body_len : 0) + 1);
    char *extra = a->extra_len ? malloc(a->extra_len) : NULL;
    if (!req || (a->extra_len && !extra)) {
        free(req);
        free(extra);
        return -ENOMEM;
    }
    memcpy(req, a->head, a->head_len);
    if (a->body) memcpy(req + a->head_len, a->body, body_len);
    if (a->extra_len) memcpy(extra, a->extra, a->extra_len);
    free(c->ereq);
    free(c->extra);
    c->ereq = req;
    c->ereq_head_len = a->head_len;
    c->ereq_client_body = a->body == NULL;
    c->ereq_len = a->head_len + body_len;
    c->extra = extra;
    c->extra_len = a->extra_len;
    c->up = a->upstream;
    c->token = a->token;
    return 0;
}

/* a FORWARD the lane cannot follow: its token goes back (finished as never sent) */
static void release(lane_t *l, lane_action *a) {
    if (a->action != LANE_FORWARD) return;
    l->cfg.finish(l->cfg.ctx, a->token, 0, LANE_CLIENT_GONE, "", 0, NULL);
    a->action = LANE_DEFAULT;
}

/* a broken event stream's last event (finish's answer body: the Python path's SSE error event)
 * as a last chunk, then the chunked answer's end, as the Python path's relay ends such a
 * stream; 0, or -1 when the client's framing cannot take it (can_end: see note_stream_end) */
static int stream_end(lane_t *l, client_t *c, const char *event, size_t n) {
    if (!c->can_end || n == 0) return -1;
    char line[24];
    int k = snprintf(line, sizeof line, "%zx\r\n", n);
    buf_append(&c->out, line, (size_t)k);
    buf_append(&c->out, event, n);
    buf_append(&c->out, "\r\n0\r\n\r\n", 7);
    client_after_answer(l, c);
    return 0;
}

static void apply_action(lane_t *l, client_t *c, lane_action *a, int outcome) {
    if (a->action == LANE_FORWARD && ++c->tries > MAX_TRIES) {
        release(l, a); /* a decider retrying without end: the lane's own error instead */
        a->action = LANE_DEFAULT;
    }
    if (a->action == LANE_FORWARD && !c->answered) {
        if (take_forward(c, a) == 0) {
            l->st.retried += outcome != LANE_OK;
            attempt(l, c);
            return;
        }
        release(l, a); /* out of memory for its head */
    }
    release(l, a);
    if (c->answered && c->first_byte_done) { /* a stream under way: its last event, or cut */
        if (a->action != LANE_ANSWER || stream_end(l, c, a->body, a->body_len)) client_close(l, c);
        return;
    }
    if (c->answered && !c->answer_sent) { /* still all queued here: a clean error instead */
        c->answered = 0;
        c->out.off = c->out.len = 0;
    }
    if (c->answered) { /* the engine's answer was partly relayed: the client sees it end */
        client_close(l, c);
        return;
    }
    if (a->action == LANE_ANSWER)
        answer(l, c, a->status, a->head, a->head_len, a->body, a->body_len);
    else
        default_answer(l, c, outcome);
}

static void client_new(lane_t *l, int fd) {
    client_t *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return;
    }
    c->kind = K_CLIENT;
    c->fd = fd;
    c->first = 1;
    c->state = C_HEAD;
    due(c, l->cfg.head_timeout);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->mask = EPOLLIN | EPOLLRDHUP;
    if (ep_set(l, EPOLL_CTL_ADD, fd, c->mask, c)) {
        close(fd);
        free(c);
        return;
    }
    c->next = l->clients;
    if (l->clients) l->clients->prev = c;
    l->clients = c;
    l->st.open_clients++;
    tick_arm(l);
}

static void client_close(lane_t *l, client_t *c) {
    if (c->eng) {
        c->eng->client = NULL;
        engine_close(l, c->eng);
        c->eng = NULL;
    }
    if (c->token) finish(l, c, LANE_CLIENT_GONE);
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    client_unlink(l, c);
    client_free(l, c);
    tick_arm(l);
}

/* the request is served: its bytes leave the buffer; the next one starts after the flush, at
 * the end of the poll with the other answers of this poll (as engine_send_later: one wake of the
 * client's process for the batch, not one an answer) */
static void client_after_answer(lane_t *l, client_t *c) {
    buf_consume(&c->in, c->head_len + c->body_len);
    c->head_len = c->body_len = 0;
    c->state = C_FLUSH;
    c->deadline = c->limit = 0;
    if (c->flush_queued) return;
    c->flush_queued = 1;
    c->next_flush = NULL;
    if (l->to_flush) l->to_flush_last->next_flush = c; else l->to_flush = c;
    l->to_flush_last = c;
}

static void clients_flush(lane_t *l) {
    while (l->to_flush) {
        client_t *c = l->to_flush;
        l->to_flush = c->next_flush;
        c->flush_queued = 0;
        if (c->kind == K_CLIENT && client_flush(l, c) == 0) client_mask(l, c); /* else closed */
    }
}

/* what is queued for the client; -1 when the client is gone (and closed) */
static int client_flush(lane_t *l, client_t *c) {
    /* a whole answer (not an event stream) leaves once it is whole, as the Python path reads
     * it before it answers: an engine that breaks off or falls silent mid-body then gets the
     * client a clean 502/504, not a cut answer */
    if (c->state == C_RELAY && !c->streamed) return 0;
    while (buf_size(&c->out)) {
        ssize_t n = send(c->fd, buf_data(&c->out), buf_size(&c->out), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            client_close(l, c);
            return -1;
        }
        buf_consume(&c->out, (size_t)n);
        c->answer_sent += (size_t)n;
    }
    if (buf_size(&c->out) == 0 && c->state == C_FLUSH) {
        if (!c->keep_alive || l->closing) {
            client_close(l, c);
            return -1;
        }
        c->state = C_HEAD;
        c->first = 0;
        c->answered = 0;
        c->answer_sent = 0;
        c->streamed = c->first_byte_done = c->wrap_chunks = 0;
        c->tail_pos = c->tail_fill = 0;
        c->tail_passed = 0;
        c->status = 0;
        due(c, l->cfg.keepalive_timeout);
        client_mask(l, c);
        if (buf_size(&c->in)) {
            /* a pipelined request: at once, unless answers already nest here: then at the end
             * of this poll (answers wait for the poll's end, client_after_answer, so a request
             * the decider answers itself no longer recurses; the guard stays) */
            if (l->depth < MAX_DEPTH) {
                l->depth++;
                client_process(l, c);
                l->depth--;
            } else if (!c->queued) {
                c->queued = 1;
                c->next_ready = l->ready;
                l->ready = c;
            }
            return -1; /* c may be gone: the caller must not touch it */
        }
        return 0;
    }
    if (c->eng && c->eng->paused && buf_size(&c->out) < RESUME_ENGINE_AT) {
        c->eng->paused = 0;
        watch(l, c->eng, EPOLLIN | EPOLLRDHUP);
    }
    if ((buf_size(&c->out) > 0) != c->want_out) client_mask(l, c);
    return 0;
}

/* a request closed with its body unfinished, for the caller's counts (error paths only: the
 * head is parsed again for its kind; its age comes from the body's deadline, set when the head
 * was whole) */
static void count_unfinished(lane_t *l, client_t *c, int event, int64_t deadline, int64_t now) {
    if (!l->cfg.count) return;
    lane_head h;
    if (!lane_head_qualifies(buf_data(&c->in), c->head_len - 4, l->cfg.max_body, l->handoff_headers,
                             l->cfg.handoff_headers_len, &h))
        return; /* cannot be: the head qualified when it was whole */
    double seconds = 0.0;
    if (deadline && l->cfg.body_timeout > 0) {
        int64_t since = deadline - (int64_t)(l->cfg.body_timeout * 1e9) - c->given;
        if (now > since) seconds = (double)(now - since) / 1e9;
    }
    l->cfg.count(l->cfg.ctx, event, h.kind, seconds);
}

static void client_decide(lane_t *l, client_t *c, const lane_head *h) {
    lane_action a;
    memset(&a, 0, sizeof a);
    a.action = LANE_HANDOFF;
    const char *body = buf_data(&c->in) + c->head_len;
    l->cfg.decide(l->cfg.ctx, h->kind, body, c->body_len, h->request_id, h->request_id_len,
                  h->authorization, h->authorization_len, h->fields, h->fields_len, &a);
    c->keep_alive = h->keep_alive && !l->closing;
    c->first = 0;
    c->tries = 0;
    c->graces = 0;
    switch (a.action) {
    case LANE_FORWARD:
        if (take_forward(c, &a)) {
            release(l, &a); /* out of memory for its head */
            default_answer(l, c, LANE_ENGINE_UNAVAILABLE);
            return;
        }
        l->st.served++;
        c->limit = l->request_ns ? now_ns() + l->request_ns : 0; /* every try included */
        c->limit_span = l->request_ns;
        attempt(l, c);
        return;
    case LANE_ANSWER:
        answer(l, c, a.status, a.head, a.head_len, a.body, a.body_len);
        return;
    default:
        handoff(l, c);
        return;
    }
}

/* parse what is buffered: a whole head, then a whole body, then decide */
static void client_process(lane_t *l, client_t *c) {
    if (c->state == C_HEAD) {
        const char *data = buf_data(&c->in);
        size_t n = buf_size(&c->in);
        const char *end = memfind(data, n, "\r\n\r\n", 4);
        if (!end) {
            if (n > MAX_HEAD) handoff(l, c);
            return;
        }
        size_t head = (size_t)(end - data);
        lane_head h;
        if (head > MAX_HEAD || !lane_head_qualifies(data, head, l->cfg.max_body, l->handoff_headers,
                                                    l->cfg.handoff_headers_len, &h)) {
            handoff(l, c);
            return;
        }
        c->head_len = head + 4;
        c->body_len = h.content_length;
        c->state = C_BODY;
        due(c, l->cfg.body_timeout);
    }
    if (c->state == C_BODY && buf_size(&c->in) >= c->head_len + c->body_len) {
        lane_head h; /* parsed again (cheap) so its pointers are into the current buffer */
        lane_head_qualifies(buf_data(&c->in), c->head_len - 4, l->cfg.max_body, l->handoff_headers,
                            l->cfg.handoff_headers_len, &h);
        c->deadline = 0;
        client_decide(l, c, &h);
    }
}

/* what the client sent; 0, or -1 when it hung up or failed (and is closed) */
static int client_read(lane_t *l, client_t *c) {
    for (;;) {
        if (buf_reserve(&c->in, READ_CHUNK)) {
            client_close(l, c);
            return -1;
        }
        ssize_t n = recv(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (c->state == C_BODY)
                count_unfinished(l, c, LANE_COUNT_CLIENT_GONE, c->deadline, now_ns());
            client_close(l, c);
            return -1;
        }
        if (n == 0) { /* mid-request, this is the client hanging up (finish: outcome 1) */
            if (c->state == C_BODY)
                count_unfinished(l, c, LANE_COUNT_CLIENT_GONE, c->deadline, now_ns());
            client_close(l, c);
            return -1;
        }
        c->in.len += (size_t)n;
        if ((size_t)n < READ_CHUNK) break;
        /* enough for now: the rest waits in the kernel (level-triggered) */
        if (buf_size(&c->in) > client_hold(c)) break;
    }
    return 0;
}

static void client_readable(lane_t *l, client_t *c) {
    if (client_read(l, c) == 0) client_process(l, c);
}

static void client_event(lane_t *l, client_t *c, uint32_t ev) {
    if (ev & EPOLLOUT) {
        if (client_flush(l, c)) return;
    }
    if (!client_serving(c)) {
        if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) client_readable(l, c);
        return;
    }
    if (ev & (EPOLLHUP | EPOLLERR)) {
        client_close(l, c); /* hung up (reset) mid-request */
        return;
    }
    if (c->mask & EPOLLIN) {
        if (ev & (EPOLLIN | EPOLLRDHUP)) {
            /* pipelined bytes are kept for later; EOF is a hang-up */
            if (client_read(l, c) == 0 && buf_size(&c->in) >= client_hold(c)) client_mask(l, c);
        }
    } else if (ev & EPOLLRDHUP) {
        client_close(l, c); /* hung up while its pipelined bytes wait in the kernel */
    }
}

/* ---- engine connections ----------------------------------------------------------------- */

static void engine_unlink(lane_t *l, engine_t *e) {
    if (e->prev) e->prev->next = e->next; else l->engines = e->next;
    if (e->next) e->next->prev = e->prev;
    l->st.open_engines--;
}

static void pool_remove(lane_t *l, engine_t *e) {
    upstream_t *u = &l->ups[e->up];
    for (engine_t **p = &u->idle; *p; p = &(*p)->next_idle)
        if (*p == e) {
            *p = e->next_idle;
            l->st.idle_engines--;
            return;
        }
}

static void engine_close(lane_t *l, engine_t *e) {
    if (e->state == E_IDLE) pool_remove(l, e);
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, e->fd, NULL);
    close(e->fd);
    engine_unlink(l, e);
    buf_free(&e->in);
    e->kind = 0;
    e->next = l->dead_engines;
    l->dead_engines = e;
    tick_arm(l);
}

static engine_t *engine_open(lane_t *l, int up) {
    upstream_t *u = &l->ups[up];
    if (u->addrlen == 0) return NULL; /* its name is not resolved (yet): unavailable */
    int fd = socket(u->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return NULL;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int r = connect(fd, (struct sockaddr *)&u->addr, u->addrlen);
    if (r < 0 && errno != EINPROGRESS) {
        close(fd);
        return NULL;
    }
    engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        close(fd);
        return NULL;
    }
    e->kind = K_ENGINE;
    e->fd = fd;
    e->up = up;
    e->generation = u->generation;
    e->state = r == 0 ? E_SENDING : E_CONNECTING;
    e->mask = EPOLLOUT | EPOLLRDHUP;
    if (ep_set(l, EPOLL_CTL_ADD, fd, e->mask, e)) {
        close(fd);
        free(e);
        return NULL;
    }
    e->next = l->engines;
    if (l->engines) l->engines->prev = e;
    l->engines = e;
    l->st.open_engines++;
    tick_arm(l);
    return e;
}

static int find_up(const lane_t *l, int id) {
    for (int i = 0; i < l->n_ups; i++)
        if (l->ups[i].id == id && l->ups[i].live) return i;
    return -1;
}

static void engine_send(lane_t *l, engine_t *e);

/* A request is written to its engine at the end of the poll (send_queued), with the others
 * decided in the same poll: writing to a socket wakes the engine's process, and in the kernel
 * that wake-up costs the lane as much as the rest of the write (perf: writev 20 % of a native
 * serve's CPU, half of it the wake). Back to back, one wake serves the batch. */
static void engine_send_later(lane_t *l, engine_t *e) {
    if (e->send_queued) return;
    e->send_queued = 1;
    e->next_send = NULL;
    if (l->to_send) l->to_send_last->next_send = e; else l->to_send = e;
    l->to_send_last = e; /* in the order decided */
}

static void engines_send(lane_t *l) {
    while (l->to_send) {
        engine_t *e = l->to_send;
        l->to_send = e->next_send;
        e->send_queued = 0;
        /* closed since (kind 0, freed at the end of the poll), or already writing on EPOLLOUT */
        if (e->kind == K_ENGINE && e->state == E_SENDING && e->client) engine_send(l, e);
    }
}

/* one try of the current request: a pooled connection or a new one */
static void attempt(lane_t *l, client_t *c) {
    c->state = C_WAIT;
    c->status = 0;
    c->tail_pos = c->tail_fill = 0; /* a retry's tail (and finish's reason) is its own */
    c->tail_passed = 0;
    c->streamed = c->wrap_chunks = 0; /* as its answer's head says */
    int up = find_up(l, c->up);
    engine_t *e = NULL;
    if (up >= 0) {
        upstream_t *u = &l->ups[up];
        if (u->idle) {
            e = u->idle;
            u->idle = e->next_idle;
            l->st.idle_engines--;
            e->reused = 1;
            e->state = E_SENDING;
        } else {
            e = engine_open(l, up);
        }
    }
    client_mask(l, c);
    if (!e) {
        finish(l, c, LANE_ENGINE_UNAVAILABLE);
        return;
    }
    e->client = c;
    e->sent = 0;
    e->status = 0;
    e->got_bytes = 0;
    e->paused = 0;
    e->in.off = e->in.len = 0;
    c->eng = e;
    double first = l->cfg.try_timeout > 0 ? l->cfg.try_timeout : l->cfg.engine_idle_timeout;
    double connect = e->state == E_CONNECTING ? l->cfg.connect_timeout : 0;
    due(c, connect > 0 && (first <= 0 || connect < first) ? connect : first);
    if (e->state == E_SENDING) engine_send_later(l, e);
}

/* whether the answer's body has begun (bytes in the tail, or handed to stream_bytes) */
static int body_seen(const client_t *c) { return c->tail_fill || c->tail_passed; }

/* whether the answer's head came but no body byte yet: nothing was sent (engine_readable) */
static int no_body_yet(const client_t *c) {
    return c->answered && !body_seen(c) && !c->answer_sent;
}

/* such an answer's try failed before its answer, as on the Python path, whose engine client
 * fails a try until the body's first bytes (retried): its head dropped, `why` its reason */
static void forget_head(lane_t *l, client_t *c, const char *why) {
    c->answered = 0;
    c->out.off = c->out.len = 0;
    c->status = 0;
    if (why) tail_add(l, c, why, strlen(why));
}

/* whether the client's answer can still take a last chunk (stream_end) once its engine is
 * gone: chunked to the client and at a chunk's end (always where the lane frames the chunks; a
 * whole answer's chunked framing is the engine's, copied as is) */
static void note_stream_end(client_t *c, const engine_t *e) {
    c->can_end = e->state == E_BODY &&
                 (c->wrap_chunks ||
                  (e->framing == F_CHUNKED && e->chunk_state == CH_SIZE && !e->size_digits));
}

/* the engine connection of a request that ends here (a timer): closed, so the engine aborts */
static void engine_abandon(lane_t *l, client_t *c) {
    engine_t *e = c->eng;
    if (!e) return;
    note_stream_end(c, e);
    e->client = NULL;
    engine_close(l, e);
    c->eng = NULL;
}

/* the try failed: a stale pooled connection (nothing read on it) is tried afresh once */
static void engine_failed(lane_t *l, engine_t *e, int outcome) {
    client_t *c = e->client;
    int stale = e->reused && !e->got_bytes && outcome == LANE_ENGINE_UNAVAILABLE;
    if (c && e->state == E_BODY && no_body_yet(c)) {
        forget_head(l, c, "the engine's answer ended (closed, reset or garbled) before its body");
        outcome = LANE_ENGINE_UNAVAILABLE;
    }
    if (c) note_stream_end(c, e);
    e->client = NULL;
    engine_close(l, e);
    if (!c) return;
    c->eng = NULL;
    if (stale) {
        int up = find_up(l, c->up);
        engine_t *fresh = up >= 0 ? engine_open(l, up) : NULL;
        if (fresh) {
            fresh->client = c;
            c->eng = fresh;
            if (fresh->state == E_SENDING) engine_send_later(l, fresh);
            return;
        }
    }
    finish(l, c, outcome);
}

static void engine_send(lane_t *l, engine_t *e) {
    client_t *c = e->client;
    for (;;) {
        struct iovec iov[2];
        int k = 0;
        size_t head = c->ereq_client_body ? c->ereq_head_len : c->ereq_len;
        if (e->sent < head) {
            iov[k].iov_base = c->ereq + e->sent;
            iov[k++].iov_len = head - e->sent;
        }
        if (c->ereq_client_body && c->body_len) {
            size_t done = e->sent > head ? e->sent - head : 0;
            if (done < c->body_len) {
                iov[k].iov_base = buf_data(&c->in) + c->head_len + done;
                iov[k++].iov_len = c->body_len - done;
            }
        }
        if (k == 0) break;
        ssize_t n = writev(e->fd, iov, k);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                watch(l, e, EPOLLOUT | EPOLLRDHUP);
                return;
            }
            engine_failed(l, e, LANE_ENGINE_UNAVAILABLE);
            return;
        }
        e->sent += (size_t)n;
    }
    e->state = E_HEAD;
    watch(l, e, EPOLLIN | EPOLLRDHUP);
}

/* one header line of an answer head: name, trimmed value; the next line's start */
typedef struct {
    const char *name, *value, *next;
    size_t name_len, value_len;
} header_line;

static int next_header(const char *p, const char *end, header_line *h) {
    const char *eol = memfind(p, (size_t)(end - p), "\r\n", 2);
    if (!eol) eol = end;
    const char *colon = memchr(p, ':', (size_t)(eol - p));
    if (!colon || colon == p) return -1;
    const char *v = colon + 1, *ve = eol;
    while (v < ve && (*v == ' ' || *v == '\t')) v++;
    while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
    h->name = p;
    h->name_len = (size_t)(colon - p);
    h->value = v;
    h->value_len = (size_t)(ve - v);
    h->next = eol + 2;
    return 0;
}

/* the engine's answer head: the client's head written, the framing known; 0, or -1 garbled */
static int engine_head(lane_t *l, engine_t *e, const char *h, size_t len) {
    client_t *c = e->client;
    if (len < 12 || memcmp(h, "HTTP/1.", 7) != 0 || h[8] != ' ') return -1;
    int minor = h[7] - '0';
    int status = 0;
    for (int i = 9; i < 12; i++) {
        if (h[i] < '0' || h[i] > '9') return -1;
        status = status * 10 + (h[i] - '0');
    }
    const char *line_end = memfind(h, len, "\r\n", 2);
    if (!line_end) line_end = h + len;
    const char *first = line_end + 2, *end = h + len;
    int chunked = 0, have_length = 0;
    uint64_t length = 0;
    const char *ctype = "application/json", *clen = NULL; /* the Python path's default type */
    size_t ctype_len = 16, clen_len = 0;
    e->keep_alive = minor >= 1;
    header_line hl;
    /* the framing first: with Transfer-Encoding, a Content-Length is not forwarded */
    for (const char *p = first; p < end; p = hl.next) {
        if (next_header(p, end, &hl)) return -1;
        if (name_is(hl.name, hl.name_len, "transfer-encoding")) {
            chunked = hl.value_len >= 7 &&
                      strncasecmp(hl.value + hl.value_len - 7, "chunked", 7) == 0;
            if (!chunked) return -1; /* a coding the lane cannot frame */
        } else if (name_is(hl.name, hl.name_len, "connection")) {
            if (hl.value_len == 5 && strncasecmp(hl.value, "close", 5) == 0) e->keep_alive = 0;
        } else if (name_is(hl.name, hl.name_len, "content-length")) {
            uint64_t n = 0;
            if (hl.value_len == 0 || hl.value_len > 18) return -1;
            for (size_t k = 0; k < hl.value_len; k++) {
                if (hl.value[k] < '0' || hl.value[k] > '9') return -1;
                n = n * 10 + (uint64_t)(hl.value[k] - '0');
            }
            if (have_length && n != length) return -1;
            length = n;
            have_length = 1;
            clen = hl.value;
            clen_len = hl.value_len;
        } else if (name_is(hl.name, hl.name_len, "content-type")) {
            c->streamed = hl.value_len >= 17 && strncasecmp(hl.value, "text/event-stream", 17) == 0;
            ctype = hl.value;
            ctype_len = hl.value_len;
        }
    }
    e->status = c->status = status;
    if (l->closing) c->keep_alive = 0;
    buf_t *out = &c->out;
    buf_append(out, "HTTP/1.1", 8);
    buf_append(out, h + 8, (size_t)(line_end - h) - 8);
    buf_append(out, "\r\n", 2);
    /* the Python path's header set: the engine's Content-Type, kvplug's answer headers and the
     * framing chosen here; the engine's other fields (Date, Server, an X-Request-Id it echoes,
     * ...) stay behind, as streaming.response_headers leaves them */
    buf_append(out, "Content-Type: ", 14);
    buf_append(out, ctype, ctype_len);
    buf_append(out, "\r\n", 2);
    size_t date_len;
    const char *date = date_line(l, &date_len);
    buf_append(out, date, date_len);
    buf_append(out, c->extra, c->extra_len);
    /* an event stream is not to be cached on the way, as the Python path's relay says */
    if (c->streamed) buf_append(out, "Cache-Control: no-cache\r\n", 25);
    if (status == 204 || status == 304 || (status >= 100 && status < 200)) {
        e->framing = F_NONE;
    } else if (chunked) {
        e->framing = F_CHUNKED;
        e->chunk_state = CH_SIZE;
        e->size_digits = 0;
        e->remaining = 0;
        c->wrap_chunks = c->streamed; /* a stream's data re-chunked: see engine_body */
        buf_append(out, "Transfer-Encoding: chunked\r\n", 28);
    } else if (have_length && c->streamed) { /* a stream is chunked to the client, as the
                                                * Python path's relay sends it: see engine_body */
        e->framing = F_LENGTH;
        e->remaining = length;
        c->wrap_chunks = 1;
        buf_append(out, "Transfer-Encoding: chunked\r\n", 28);
    } else if (have_length) {
        e->framing = F_LENGTH;
        e->remaining = length;
        buf_append(out, "Content-Length: ", 16);
        buf_append(out, clen, clen_len);
        buf_append(out, "\r\n", 2);
    } else {
        e->framing = F_CLOSE;
        e->keep_alive = 0;
        c->wrap_chunks = 1;
        buf_append(out, "Transfer-Encoding: chunked\r\n", 28);
    }
    if (!c->keep_alive) buf_append(out, "Connection: close\r\n", 19);
    buf_append(out, "\r\n", 2);
    c->answered = 1;
    return 0;
}

/* n body bytes as one chunk of the client's chunked answer (none for n = 0: that ends it) */
static void append_chunk(buf_t *out, const char *p, size_t n) {
    static const char hex[] = "0123456789abcdef";
    char line[24];
    size_t k = sizeof line;
    if (!n) return;
    line[--k] = '\n';
    line[--k] = '\r';
    for (size_t v = n; v; v >>= 4) line[--k] = hex[v & 15]; /* the size, in hex, right to left */
    buf_append(out, line + k, sizeof line - k);
    buf_append(out, p, n);
    buf_append(out, "\r\n", 2);
}

/* engine body bytes: to the client as they are, or chunk-wrapped (an until-close answer) or
 * re-chunked (a chunked event stream: each piece of data read is a whole chunk to the client,
 * as the Python path's relay writes it, so a stream the engine breaks off, even inside one of
 * its chunks, can still end with finish's last event); 1 when the answer ended, -1 when its
 * chunk framing is garbled */
static int engine_body(lane_t *l, engine_t *e, const char *p, size_t n, size_t *used) {
    client_t *c = e->client;
    size_t i = 0;
    int done = 0;
    if (e->framing == F_NONE) {
        done = 1;
    } else if (e->framing == F_LENGTH) {
        i = n < e->remaining ? n : (size_t)e->remaining;
        if (c->wrap_chunks)
            append_chunk(&c->out, p, i);
        else
            buf_append(&c->out, p, i);
        tail_add(l, c, p, i);
        e->remaining -= i;
        done = e->remaining == 0;
        if (done && c->wrap_chunks) buf_append(&c->out, "0\r\n\r\n", 5);
    } else if (e->framing == F_CLOSE) {
        append_chunk(&c->out, p, n);
        tail_add(l, c, p, n);
        i = n;
    } else { /* chunked: the state machine finds the end and the data; a whole answer's bytes
              * are copied as they are, a stream's data re-chunked */
        while (i < n && !done) {
            char ch = p[i];
            switch (e->chunk_state) {
            case CH_SIZE:
                if ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F')) {
                    if (e->remaining >> 56) return -1;
                    e->remaining = e->remaining * 16 +
                                   (uint64_t)(ch <= '9' ? ch - '0' : (ch | 0x20) - 'a' + 10);
                    e->size_digits = 1;
                } else if (ch == ';' || ch == ' ' || ch == '\t') {
                    e->chunk_state = CH_EXT;
                } else if (ch == '\r') {
                    e->chunk_state = CH_SIZE_LF;
                } else {
                    return -1;
                }
                i++;
                break;
            case CH_EXT:
                if (ch == '\r') e->chunk_state = CH_SIZE_LF;
                i++;
                break;
            case CH_SIZE_LF:
                if (ch != '\n') return -1;
                e->chunk_state = e->remaining ? CH_DATA : CH_TRAILER;
                i++;
                break;
            case CH_DATA: {
                size_t k = n - i < e->remaining ? n - i : (size_t)e->remaining;
                if (c->wrap_chunks) append_chunk(&c->out, p + i, k);
                tail_add(l, c, p + i, k);
                i += k;
                e->remaining -= k;
                if (!e->remaining) e->chunk_state = CH_DATA_CR;
                break;
            }
            case CH_DATA_CR:
                if (ch != '\r') return -1;
                e->chunk_state = CH_DATA_LF;
                i++;
                break;
            case CH_DATA_LF:
                if (ch != '\n') return -1;
                e->chunk_state = CH_SIZE;
                e->size_digits = 0;
                i++;
                break;
            case CH_TRAILER: /* after the last chunk: an empty line ends, else a trailer line */
                if (ch == '\r') {
                    e->chunk_state = CH_DONE;
                } else {
                    e->chunk_state = CH_TRAILER_LINE;
                }
                i++;
                break;
            case CH_TRAILER_LINE:
                if (ch == '\n') e->chunk_state = CH_TRAILER;
                i++;
                break;
            case CH_DONE:
                if (ch != '\n') return -1;
                i++;
                done = 1;
                break;
            }
        }
        if (!c->wrap_chunks)
            buf_append(&c->out, p, i);
        else if (done) /* the engine's trailers stay behind, as aiohttp's relay leaves them */
            buf_append(&c->out, "0\r\n\r\n", 5);
    }
    /* the body's first bytes, not framing: only they end the try's waiting (no_body_yet) */
    if (body_seen(c) && c->streamed && !c->first_byte_done && c->token) {
        c->first_byte_done = 1;
        /* a stream's request_timeout ends at its first bytes; stream_timeout runs from here */
        c->limit = l->stream_ns ? now_ns() + l->stream_ns : 0;
        c->limit_span = l->stream_ns;
        l->cfg.first_byte(l->cfg.ctx, c->token);
    }
    *used = i;
    return done;
}

/* the answer is whole: finish, the engine connection back to its pool, the client flushed */
static void engine_done(lane_t *l, engine_t *e, int extra_bytes) {
    client_t *c = e->client;
    upstream_t *u = &l->ups[e->up];
    e->client = NULL;
    c->eng = NULL;
    if (e->keep_alive && !extra_bytes && u->live && e->generation == u->generation &&
        !l->closing) {
        e->state = E_IDLE;
        e->reused = 0;
        e->deadline = after(l->cfg.pool_idle_timeout);
        e->next_idle = u->idle;
        u->idle = e;
        l->st.idle_engines++;
        watch(l, e, EPOLLIN | EPOLLRDHUP); /* any event closes it */
    } else {
        engine_close(l, e);
    }
    if (c->status >= 500 && no_body_yet(c)) {
        /* an empty 5xx is a dead or restarting engine, not an answer: a failed try, as the
         * Python path's engine client fails it (upstream.py) */
        char why[32];
        snprintf(why, sizeof why, "empty HTTP %d answer", c->status);
        forget_head(l, c, why);
        finish(l, c, LANE_ENGINE_UNAVAILABLE);
        return;
    }
    finish(l, c, LANE_OK);
    client_after_answer(l, c);
}

/* what engine_body's answer `r` means for the engine: 1 when its answer ended (failed, or done
 * with `extra` bytes after it), 0 while more is to come */
static int engine_fed(lane_t *l, engine_t *e, int r, int extra) {
    if (r < 0) {
        engine_failed(l, e, LANE_ENGINE_FAILED);
        return 1;
    }
    if (r > 0) {
        engine_done(l, e, extra);
        return 1;
    }
    return 0;
}

/* feed engine bytes in answer order; returns 1 when the client connection is gone or done */
static int engine_feed(lane_t *l, engine_t *e, const char *p, size_t n) {
    client_t *c = e->client;
    if (e->state == E_HEAD) {
        if (buf_append(&e->in, p, n)) {
            engine_failed(l, e, LANE_ENGINE_FAILED);
            return 1;
        }
        const char *d = buf_data(&e->in);
        size_t len = buf_size(&e->in);
        const char *end = memfind(d, len, "\r\n\r\n", 4);
        if (!end) {
            if (len > MAX_ANSWER_HEAD) {
                engine_failed(l, e, LANE_ENGINE_FAILED);
                return 1;
            }
            return 0;
        }
        size_t hl = (size_t)(end - d);
        if (hl >= 12 && d[9] == '1' && memcmp(d + 9, "101", 3) != 0) {
            buf_consume(&e->in, hl + 4); /* an interim 1xx answer: the real one follows */
            size_t rest = buf_size(&e->in);
            char *copy = rest ? malloc(rest) : NULL;
            if (rest && !copy) {
                engine_failed(l, e, LANE_ENGINE_FAILED);
                return 1;
            }
            if (rest) memcpy(copy, buf_data(&e->in), rest);
            e->in.off = e->in.len = 0;
            int r = rest ? engine_feed(l, e, copy, rest) : 0;
            free(copy);
            return r;
        }
        if (engine_head(l, e, d, hl)) {
            c->answered = 0;
            c->out.off = c->out.len = 0;
            engine_failed(l, e, LANE_ENGINE_FAILED);
            return 1;
        }
        e->state = E_BODY;
        c->state = C_RELAY;
        due(c, l->cfg.engine_idle_timeout);
        size_t body_at = hl + 4;
        p = d + body_at;
        n = len - body_at;
        /* the body bytes are in e->in: fed below from there, then dropped */
        size_t used = 0;
        int r = engine_body(l, e, p, n, &used);
        e->in.off = e->in.len = 0;
        return engine_fed(l, e, r, used < n);
    }
    size_t used = 0;
    int r = engine_body(l, e, p, n, &used);
    due(c, l->cfg.engine_idle_timeout);
    return engine_fed(l, e, r, used < n);
}

static void engine_readable(lane_t *l, engine_t *e) {
    char chunk[READ_CHUNK];
    for (;;) {
        client_t *c = e->client;
        ssize_t n = recv(e->fd, chunk, sizeof chunk, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            engine_failed(l, e, e->state == E_HEAD ? LANE_ENGINE_UNAVAILABLE : LANE_ENGINE_FAILED);
            return;
        }
        if (n == 0) { /* the engine closed: the end of an until-close answer, else a failure */
            if (e->state == E_BODY && e->framing == F_CLOSE) {
                buf_append(&c->out, "0\r\n\r\n", 5);
                engine_done(l, e, 0);
            } else {
                engine_failed(l, e, e->state == E_HEAD && buf_size(&e->in) == 0
                                        ? LANE_ENGINE_UNAVAILABLE
                                        : LANE_ENGINE_FAILED);
            }
            return;
        }
        e->got_bytes = 1;
        if (engine_feed(l, e, chunk, (size_t)n)) return;
        /* the head waits for the body's first bytes (the Python path's engine client waits for
         * them before it answers): a try that ends before them is retried, not cut */
        if (body_seen(c) && client_flush(l, c)) return;
        if (c->streamed && buf_size(&c->out) > PAUSE_ENGINE_AT) { /* a whole answer is held */
            e->paused = 1; /* no events but errors until the client has taken most of it */
            l->st.engine_pauses++;
            watch(l, e, 0);
            return;
        }
        if ((size_t)n < sizeof chunk) break;
    }
}

static void engine_event(lane_t *l, engine_t *e, uint32_t ev) {
    if (e->state == E_IDLE) { /* the engine closed (or wrote to) an idle connection */
        engine_close(l, e);
        return;
    }
    if (e->state == E_CONNECTING || e->state == E_SENDING) {
        if (ev & (EPOLLERR | EPOLLHUP)) {
            engine_failed(l, e, LANE_ENGINE_UNAVAILABLE);
            return;
        }
        if (ev & EPOLLOUT) {
            if (e->state == E_CONNECTING) {
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(e->fd, SOL_SOCKET, SO_ERROR, &err, &len);
                if (err) {
                    engine_failed(l, e, LANE_ENGINE_UNAVAILABLE);
                    return;
                }
                e->state = E_SENDING;
            }
            engine_send(l, e);
        }
        return;
    }
    if (e->paused && !(ev & (EPOLLERR | EPOLLHUP))) return;
    engine_readable(l, e);
}

/* ---- deadlines -------------------------------------------------------------------------- */

static void client_expired(lane_t *l, client_t *c, int64_t now) {
    if (c->limit && now >= c->limit) { /* the request's total time: before any phase's timer */
        c->limit = c->deadline = 0;
        engine_abandon(l, c);
        finish(l, c, LANE_DEADLINE);
        return;
    }
    int64_t deadline = c->deadline; /* when the body was due: its head's age, for count */
    c->deadline = 0;
    switch (c->state) {
    case C_HEAD:
        if (c->first && l->head_answer) { /* a slow first head: 408, as kvplug's listener */
            l->st.timeouts++;
            if (l->cfg.count) l->cfg.count(l->cfg.ctx, LANE_COUNT_HEAD_TIMEOUT, -1, 0.0);
            send(c->fd, l->head_answer, l->cfg.head_timeout_answer_len, MSG_NOSIGNAL);
        }
        client_close(l, c);
        return;
    case C_BODY:
        l->st.timeouts++;
        count_unfinished(l, c, LANE_COUNT_BODY_TIMEOUT, deadline, now);
        if (l->body_answer)
            send(c->fd, l->body_answer, l->cfg.body_timeout_answer_len, MSG_NOSIGNAL);
        client_close(l, c);
        return;
    case C_WAIT: { /* no answer head within the try's time */
        engine_t *e = c->eng;
        int outcome = l->cfg.try_timeout > 0 || (e && e->state == E_CONNECTING)
                          ? LANE_ENGINE_UNAVAILABLE
                          : LANE_TIMED_OUT;
        engine_abandon(l, c);
        if (outcome == LANE_ENGINE_UNAVAILABLE) l->st.timeouts++;
        finish(l, c, outcome);
        return;
    }
    case C_RELAY: /* the engine fell silent mid-answer (or before its body: a failed try) */
        if (no_body_yet(c)) forget_head(l, c, NULL); /* finish's reason: the idle timeout */
        engine_abandon(l, c);
        finish(l, c, LANE_TIMED_OUT);
        return;
    default:
        return;
    }
}

/* A due deadline judged more than STALL_NS late: the loop stalled, and what the peer sent
 * meanwhile was read in this poll's batch (deadlines are judged after it). The stalled time is
 * given back instead of expiring: a request the stall kept from being sent, or an answer on
 * its way, gets its time. 1 if given back. */
static int give_back(client_t *c, int64_t now) {
    int64_t due_at = c->deadline && now >= c->deadline ? c->deadline : INT64_MAX;
    if (c->limit && now >= c->limit && c->limit < due_at) due_at = c->limit;
    int64_t late = now - due_at;
    if (late <= STALL_NS || c->graces >= STALL_GRACES) return 0;
    c->graces++;
    if (c->deadline && now >= c->deadline) {
        int64_t back = now - c->deadline, was = c->deadline;
        c->deadline = now + (back < c->span ? back : c->span);
        c->given += c->deadline - was;
    }
    if (c->limit && now >= c->limit) {
        int64_t back = now - c->limit;
        c->limit = now + (back < c->limit_span ? back : c->limit_span);
    }
    return 1;
}

static void expire(lane_t *l) {
    int64_t now = now_ns();
    for (client_t *c = l->clients, *next; c; c = next) {
        next = c->next;
        if ((c->deadline && now >= c->deadline) || (c->limit && now >= c->limit)) {
            if (give_back(c, now)) continue;
            client_expired(l, c, now);
            next = l->clients; /* callbacks may have closed anything: start over */
            now = now_ns();
        }
    }
    for (engine_t *e = l->engines, *next; e; e = next) {
        next = e->next;
        if (e->state == E_IDLE && e->deadline && now >= e->deadline) engine_close(l, e);
    }
    if (l->accept_paused_until && now >= l->accept_paused_until) {
        l->accept_paused_until = 0;
        if (!l->closing) listeners_watch(l, EPOLL_CTL_ADD);
        tick_arm(l);
    }
}

/* ---- the lane --------------------------------------------------------------------------- */

static void accept_all(lane_t *l, int fd) {
    for (int i = 0; i < ACCEPTS_PER_EVENT && !l->closing; i++) {
        int cfd = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd >= 0) {
            client_new(l, cfd);
            continue;
        }
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* out of descriptors or memory: stop accepting for a second (as asyncio does),
             * else the level-triggered listener would spin */
            listeners_watch(l, EPOLL_CTL_DEL);
            l->accept_paused_until = now_ns() + 1000000000LL;
            l->st.accept_pauses++;
            tick_arm(l);
        }
        return; /* EAGAIN, or a client gone before accept: nothing to do */
    }
}

lane_t *lane_new(const lane_config *config) {
    lane_t *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->cfg = *config;
    l->request_ns = config->request_timeout > 0 ? (int64_t)(config->request_timeout * 1e9) : 0;
    l->stream_ns = config->stream_timeout > 0 ? (int64_t)(config->stream_timeout * 1e9) : 0;
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    l->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (config->head_timeout_answer_len) {
        l->head_answer = malloc(config->head_timeout_answer_len);
        if (l->head_answer)
            memcpy(l->head_answer, config->head_timeout_answer, config->head_timeout_answer_len);
    }
    if (config->body_timeout_answer_len) {
        l->body_answer = malloc(config->body_timeout_answer_len);
        if (l->body_answer)
            memcpy(l->body_answer, config->body_timeout_answer, config->body_timeout_answer_len);
    }
    if (config->handoff_headers_len) {
        l->handoff_headers = malloc(config->handoff_headers_len);
        if (l->handoff_headers)
            memcpy(l->handoff_headers, config->handoff_headers, config->handoff_headers_len);
        else
            l->cfg.handoff_headers_len = 0;
    }
    l->timer_tag[0] = K_TIMER;
    l->timer_tag[1] = l->tfd;
    if (l->epfd < 0 || l->tfd < 0 || ep_set(l, EPOLL_CTL_ADD, l->tfd, EPOLLIN, l->timer_tag)) {
        int err = errno;
        if (l->epfd >= 0) close(l->epfd);
        if (l->tfd >= 0) close(l->tfd);
        free(l->head_answer);
        free(l->body_answer);
        free(l->handoff_headers);
        free(l);
        errno = err;
        return NULL;
    }
    return l;
}

int lane_fd(const lane_t *l) { return l->epfd; }

int lane_add_listener(lane_t *l, int fd) {
    if (l->n_listeners >= 64) return -ENOSPC;
    int *tag = l->listen_tags[l->n_listeners];
    tag[0] = K_LISTEN;
    tag[1] = fd;
    if (ep_set(l, EPOLL_CTL_ADD, fd, EPOLLIN, tag)) return -errno;
    l->n_listeners++;
    return 0;
}

static void bury(lane_t *l) {
    while (l->dead_clients) {
        client_t *c = l->dead_clients;
        l->dead_clients = c->next;
        free(c);
    }
    while (l->dead_engines) {
        engine_t *e = l->dead_engines;
        l->dead_engines = e->next;
        free(e);
    }
}

int lane_poll(lane_t *l) {
    struct epoll_event evs[64];
    int n = epoll_wait(l->epfd, evs, 64, 0);
    if (n < 0) return errno == EINTR ? 0 : -errno;
    int tick = 0;
    for (int i = 0; i < n; i++) {
        void *ptr = evs[i].data.ptr;
        int kind = *(int *)ptr;
        if (kind == K_LISTEN) {
            accept_all(l, ((int *)ptr)[1]);
        } else if (kind == K_TIMER) {
            tick = 1;
        } else if (kind == K_CLIENT) {
            client_event(l, (client_t *)ptr, evs[i].events);
        } else if (kind == K_ENGINE) {
            engine_event(l, (engine_t *)ptr, evs[i].events);
        } /* else closed by an earlier event of this batch */
    }
    /* Deadlines are judged after the batch's sockets are read: after a stall of the loop the
     * tick, ready since the stall began, leads the batch, and expiring first would cancel
     * answers that arrived in the meantime and wait in this same batch. */
    if (tick) {
        uint64_t ticks;
        while (read(l->tfd, &ticks, sizeof ticks) > 0) {}
        expire(l);
    }
    for (;;) { /* a flush may start a pipelined request, whose write waits here too, ... */
        while (l->ready) { /* the pipelined requests left for later (client_flush) */
            client_t *c = l->ready;
            l->ready = c->next_ready;
            c->queued = 0;
            if (c->kind == K_CLIENT && c->state == C_HEAD) client_process(l, c);
        }
        if (!l->to_send && !l->to_flush) break;
        engines_send(l);
        clients_flush(l);
    }
    bury(l);
    return n;
}

int lane_set_upstream(lane_t *l, int id, const void *addr, unsigned addrlen) {
    if (addrlen > sizeof(struct sockaddr_storage)) return -EINVAL;
    int at = find_up(l, id);
    if (at < 0) {
        if (l->n_ups == l->cap_ups) {
            int cap = l->cap_ups ? l->cap_ups * 2 : 8;
            upstream_t *ups = realloc(l->ups, (size_t)cap * sizeof *ups);
            if (!ups) return -ENOMEM;
            l->ups = ups;
            l->cap_ups = cap;
        }
        at = l->n_ups++;
        memset(&l->ups[at], 0, sizeof l->ups[at]);
    } else {
        while (l->ups[at].idle) engine_close(l, l->ups[at].idle); /* a new address */
        l->ups[at].generation++;
    }
    upstream_t *u = &l->ups[at];
    if (!u->live) u->generation++; /* a dropped id set again: its old connections close */
    u->id = id;
    u->live = 1;
    memcpy(&u->addr, addr, addrlen);
    u->addrlen = addrlen;
    return 0;
}

int lane_drop_upstream(lane_t *l, int id) {
    int at = find_up(l, id);
    if (at < 0) return -ENOENT;
    l->ups[at].live = 0; /* connections in use finish their answers, then close */
    while (l->ups[at].idle) engine_close(l, l->ups[at].idle);
    return 0;
}

void lane_get_stats(const lane_t *l, lane_stats *out) { *out = l->st; }

void lane_shutdown(lane_t *l) {
    if (l->closing) return;
    l->closing = 1;
    if (!l->accept_paused_until) listeners_watch(l, EPOLL_CTL_DEL);
    for (client_t *c = l->clients, *next; c; c = next) {
        next = c->next;
        if (c->state == C_HEAD) client_close(l, c); /* idle: no request of its own yet */
    }
    for (int i = 0; i < l->n_ups; i++)
        while (l->ups[i].idle) engine_close(l, l->ups[i].idle);
    bury(l);
}

void lane_free(lane_t *l) {
    if (!l) return;
    l->closing = 1;
    while (l->clients) client_close(l, l->clients);
    while (l->engines) {
        engine_t *e = l->engines;
        if (e->state == E_IDLE) pool_remove(l, e);
        e->state = E_CONNECTING; /* not in a pool any more */
        engine_close(l, e);
    }
    bury(l);
    close(l->epfd);
    close(l->tfd);
    free(l->ups);
    free(l->head_answer);
    free(l->body_answer);
    free(l->handoff_headers);
    free(l);
}
