/* kvplug's compiled HTTP/1.1 data path for `kvplug serve --data-path native` (issue 12).
 *
 * One lane per serving process, no threads: the lane owns an epoll set (and a timerfd for its
 * deadlines); the caller polls it when its fd is readable. It accepts on the listening sockets it
 * is given, takes the plain routed request (POST /v1/completions or /v1/chat/completions, see
 * lane_head_qualifies), asks the caller's `decide` where to send it, relays the engine's answer
 * to the client and reports the outcome through `finish`. Every other connection is given back
 * through `handoff` with the bytes read so far. Every entry point returns a status (0 = done,
 * < 0 = -errno) where it can fail.
 */
#ifndef KVPLUG_LANE_H
#define KVPLUG_LANE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lane lane_t;

/* request kinds passed to decide */
enum { LANE_KIND_COMPLETIONS = 0, LANE_KIND_CHAT = 1 };

/* outcomes passed to finish */
enum {
    LANE_OK = 0,
    LANE_CLIENT_GONE = 1,
    LANE_ENGINE_UNAVAILABLE = 2, /* refused, reset, per-try timeout, an empty 5xx: before the
                                  * answer's body (its head is not sent before it) */
    LANE_ENGINE_FAILED = 3,      /* the engine broke off (or garbled) its answer */
    LANE_TIMED_OUT = 4,          /* no byte from the engine within the engine idle timeout */
    LANE_DEADLINE = 5            /* the request's total time passed: request_timeout (the whole
                                  * answer; a stream until its first body bytes), then
                                  * stream_timeout (an event stream's body) */
};

/* events passed to count: a request the lane closes before it is whole (the Python path counts
 * these; the lane only reports them, and only on these error paths) */
enum {
    LANE_COUNT_HEAD_TIMEOUT = 0, /* a first head past head_timeout: answered head_timeout_answer */
    LANE_COUNT_BODY_TIMEOUT = 1, /* a body past body_timeout: answered body_timeout_answer */
    LANE_COUNT_CLIENT_GONE = 2   /* the client hung up (or reset) with its body unfinished */
};

/* what decide (and finish, after a failure) tells the lane to do */
enum { LANE_HANDOFF = 0, LANE_FORWARD = 1, LANE_ANSWER = 2, LANE_DEFAULT = 3 };

typedef struct {
    int action;        /* LANE_HANDOFF / LANE_FORWARD / LANE_ANSWER / LANE_DEFAULT */
    int upstream;      /* FORWARD: an id given to lane_set_upstream */
    int status;        /* ANSWER: the HTTP status */
    const char *head;  /* FORWARD: the request head for the engine; ANSWER: header lines */
    size_t head_len;
    const char *body;  /* FORWARD: NULL = the client's body unchanged; ANSWER: the body */
    size_t body_len;
    const char *extra; /* FORWARD: header lines for the client's answer head */
    size_t extra_len;
    void *token;       /* FORWARD: the caller's, handed back to first_byte and finish */
} lane_action;

typedef struct {
    void *ctx;
    /* fills *out; pointers in it must stay valid until the next callback */
    /* fields: the head's header lines (CRLF-separated, without the request line) when one of
     * them is not Host, Content-Length, Content-Type, Connection, X-Request-Id or Authorization,
     * so the engine gets the client's other fields as the Python path forwards them; else NULL */
    void (*decide)(void *ctx, int kind, const char *body, size_t body_len, const char *request_id,
                   size_t request_id_len, const char *authorization, size_t authorization_len,
                   const char *fields, size_t fields_len, lane_action *out);
    void (*first_byte)(void *ctx, void *token);
    /* consumes the token; after a failure with nothing sent to the client, *out may say
     * FORWARD (another try) or ANSWER; LANE_DEFAULT means the lane's own 502/504. After an
     * event stream's first body bytes (first_byte was called), ANSWER's body is the stream's
     * last event (its status and headers unused): the lane ends the stream with it when it can
     * (chunked to the client, at a chunk's end), else closes the connection. `out` is NULL
     * when there is nothing to decide (ok, client gone, a token the lane gives back) */
    void (*finish)(void *ctx, void *token, int status, int outcome, const char *tail,
                   size_t tail_len, lane_action *out);
    /* NULL, or handed an event stream's body bytes (de-chunked) as they pass, TAIL (4096) at a
     * time: finish's tail is then the rest, so the caller reads the whole stream (its output
     * tokens as they grow); without it finish gets a stream's last 4096 bytes only */
    void (*stream_bytes)(void *ctx, void *token, const char *data, size_t len);
    /* the fd is the caller's from here on (with the bytes read on it so far) */
    void (*handoff)(void *ctx, int fd, const char *data, size_t len);
    /* NULL, or told of each LANE_COUNT_* event: kind is the request's (-1 for a head timeout),
     * seconds since its head was whole (0 when unknown: no body_timeout) */
    void (*count)(void *ctx, int event, int kind, double seconds);

    size_t max_body;           /* a longer Content-Length is handed off */
    double head_timeout;       /* first request head (0 = none): then head_timeout_answer */
    double keepalive_timeout;  /* a kept-alive connection's next head (0 = none): closed */
    double body_timeout;       /* the whole body after its head (0 = none): body_timeout_answer */
    double connect_timeout;    /* TCP connect to an engine (0 = none) */
    double try_timeout;        /* connect + answer head, one try (0 = none) */
    double engine_idle_timeout;/* silence from the engine while it answers (0 = none) */
    double pool_idle_timeout;  /* an idle kept-alive engine connection is closed after */
    double request_timeout;    /* from decide, every try included, to the whole answer; for an
                                * event stream to its first body bytes (0 = none): LANE_DEADLINE */
    double stream_timeout;     /* an event stream, from its first body bytes (0 = none) */
    const char *head_timeout_answer; /* the whole HTTP answer (408), sent then closed */
    size_t head_timeout_answer_len;
    const char *body_timeout_answer;
    size_t body_timeout_answer_len;
    /* header names (lower case, each ending in '\n') whose presence hands the connection off,
     * besides every x-kvplug-* one: the routing hints the Python path reads */
    const char *handoff_headers;
    size_t handoff_headers_len;
} lane_config;

typedef struct {
    uint64_t served, handed_off, retried, client_gone, engine_failed, timeouts, answered_directly;
    uint64_t open_clients, open_engines, idle_engines;
    uint64_t accept_pauses; /* accept stopped for a second: out of descriptors or memory */
    uint64_t engine_pauses; /* an engine not read while its client was backed up */
} lane_stats;

/* a new lane (NULL and errno on failure); the config is copied */
lane_t *lane_new(const lane_config *config);
int lane_fd(const lane_t *lane);
int lane_add_listener(lane_t *lane, int fd); /* the caller keeps owning the socket */
/* handle every ready event without blocking; returns the number handled or -errno */
int lane_poll(lane_t *lane);
/* addrlen 0: the id is known but has no address yet (its tries are unavailable) */
int lane_set_upstream(lane_t *lane, int id, const void *sockaddr, unsigned addrlen);
int lane_drop_upstream(lane_t *lane, int id);
void lane_get_stats(const lane_t *lane, lane_stats *out);
/* stop accepting, close idle connections; the others close after their current answer */
void lane_shutdown(lane_t *lane);
/* close everything (finish with LANE_CLIENT_GONE for requests still in flight) and free */
void lane_free(lane_t *lane);

/* whether a request head (without its blank line) is one the lane takes; fills what it read */
typedef struct {
    int kind;
    int keep_alive;
    size_t content_length;
    const char *request_id, *authorization;
    size_t request_id_len, authorization_len;
    const char *fields; /* the header lines, when one is forwarded as is (see decide) */
    size_t fields_len;
} lane_head;
int lane_head_qualifies(const char *head, size_t len, size_t max_body, const char *handoff_headers,
                        size_t handoff_headers_len, lane_head *out);

#ifdef __cplusplus
}
#endif
#endif
