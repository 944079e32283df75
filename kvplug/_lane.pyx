# cython: language_level=3
"""kvplug._lane: the compiled HTTP/1.1 data path of ``kvplug serve --data-path native``.

A thin wrapper over csrc/lane.c: the lane owns an epoll set; Python registers ``fileno()`` with
its event loop and calls ``poll()`` when it is readable. The Python callbacks (``decide``,
``first_byte``, ``finish``, ``handoff``) are called from inside ``poll()``; an exception in one
is logged (kvplug.frontend.native_lane) and the lane goes on (decide: the connection is
handed off; finish: the lane's own error answer). See kvplug/frontend/native_lane.py.
"""

import logging
import os

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport uint64_t
from libc.string cimport memset


cdef extern from "lane.h" nogil:
    ctypedef struct lane_t:
        pass

    ctypedef struct lane_action:
        int action
        int upstream
        int status
        const char *head
        size_t head_len
        const char *body
        size_t body_len
        const char *extra
        size_t extra_len
        void *token

    ctypedef void (*decide_fn)(void *, int, const char *, size_t, const char *, size_t,
                               const char *, size_t, const char *, size_t, lane_action *) noexcept
    ctypedef void (*first_byte_fn)(void *, void *) noexcept
    ctypedef void (*finish_fn)(void *, void *, int, int, const char *, size_t,
                               lane_action *) noexcept
    ctypedef void (*stream_bytes_fn)(void *, void *, const char *, size_t) noexcept
    ctypedef void (*handoff_fn)(void *, int, const char *, size_t) noexcept
    ctypedef void (*count_fn)(void *, int, int, double) noexcept

    ctypedef struct lane_config:
        void *ctx
        decide_fn decide
        first_byte_fn first_byte
        finish_fn finish
        stream_bytes_fn stream_bytes
        handoff_fn handoff
        count_fn count
        size_t max_body
        double head_timeout
        double keepalive_timeout
        double body_timeout
        double connect_timeout
        double try_timeout
        double engine_idle_timeout
        double pool_idle_timeout
        double request_timeout
        double stream_timeout
        const char *head_timeout_answer
        size_t head_timeout_answer_len
        const char *body_timeout_answer
        size_t body_timeout_answer_len
        const char *handoff_headers
        size_t handoff_headers_len

    ctypedef struct lane_stats:
        uint64_t served, handed_off, retried, client_gone, engine_failed, timeouts
        uint64_t answered_directly, open_clients, open_engines, idle_engines, accept_pauses
        uint64_t engine_pauses

    int LANE_HANDOFF, LANE_FORWARD, LANE_ANSWER, LANE_DEFAULT
    int LANE_COUNT_HEAD_TIMEOUT, LANE_COUNT_BODY_TIMEOUT, LANE_COUNT_CLIENT_GONE

    lane_t *lane_new(const lane_config *config)
    int lane_fd(const lane_t *lane)
    int lane_add_listener(lane_t *lane, int fd)
    int lane_poll(lane_t *lane)
    int lane_set_upstream(lane_t *lane, int id, const void *addr, unsigned addrlen)
    int lane_drop_upstream(lane_t *lane, int id)
    void lane_get_stats(const lane_t *lane, lane_stats *out)
    void lane_shutdown(lane_t *lane)
    void lane_free(lane_t *lane)

    ctypedef struct lane_head:
        int kind
        int keep_alive
        size_t content_length
        const char *request_id
        const char *authorization
        size_t request_id_len
        size_t authorization_len
        const char *fields
        size_t fields_len

    int lane_head_qualifies(const char *head, size_t len, size_t max_body,
                            const char *handoff_headers, size_t handoff_headers_len,
                            lane_head *out)


cdef extern from "<sys/socket.h>":
    cdef struct sockaddr_storage:
        pass

cdef extern from *:
    """
    #include <arpa/inet.h>
    #include <netinet/in.h>
    #include <string.h>
    /* a numeric IPv4 / IPv6 address and a port as a sockaddr; its length, or 0 */
    static unsigned kvl_sockaddr(const char *host, int port, struct sockaddr_storage *out) {
        memset(out, 0, sizeof *out);
        struct sockaddr_in *a4 = (struct sockaddr_in *)out;
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)out;
        if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
            a4->sin_family = AF_INET;
            a4->sin_port = htons((unsigned short)port);
            return sizeof *a4;
        }
        if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
            a6->sin6_family = AF_INET6;
            a6->sin6_port = htons((unsigned short)port);
            return sizeof *a6;
        }
        return 0;
    }
    """
    unsigned kvl_sockaddr(const char *host, int port, sockaddr_storage *out)


_log = logging.getLogger("kvplug.frontend.native_lane")

# what ``count`` is told: a request the lane closed before it was whole
COUNT_HEAD_TIMEOUT = LANE_COUNT_HEAD_TIMEOUT
COUNT_BODY_TIMEOUT = LANE_COUNT_BODY_TIMEOUT
COUNT_CLIENT_GONE = LANE_COUNT_CLIENT_GONE


def _names(handoff_headers):
    """Header names as the lane takes them: lower case, each ending in a newline."""
    names = [n if isinstance(n, bytes) else n.encode("ascii") for n in handoff_headers]
    return b"".join(n.lower() + b"\n" for n in names)


def head_qualifies(bytes head, size_t max_body, handoff_headers=()):
    """The lane's rule for a request head (without its blank line): None when it hands the
    connection off, else (kind, content_length, keep_alive, request_id, authorization, fields):
    ``fields`` the header lines when one of them is forwarded to the engine as is, else None."""
    cdef lane_head h
    cdef bytes names = _names(handoff_headers)
    if not lane_head_qualifies(
        PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head), max_body,
        PyBytes_AS_STRING(names), PyBytes_GET_SIZE(names), &h
    ):
        return None
    return (
        h.kind,
        h.content_length,
        bool(h.keep_alive),
        _opt(h.request_id, h.request_id_len),
        _opt(h.authorization, h.authorization_len),
        _opt(h.fields, h.fields_len),
    )


def _lines(value, name):
    if value is None:
        return b""
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes")
    return value


cdef class Lane:
    """One serving process's compiled data path. Arguments: the listening sockets' fds (still
    owned by the caller), the four callbacks, the limits and timeouts in seconds (0 = none), and
    ``handoff_headers``: names whose presence hands a request off (besides every x-kvplug-*).
    ``count(event, kind, seconds)``, if given, hears of each request closed before it was whole
    (``COUNT_*``; ``kind`` -1 for a head timeout; ``seconds`` since its head, 0 when unknown).
    ``stream_bytes(token, data)``, if given, is handed an event stream's body 4 KiB at a time as
    it passes; ``finish``'s tail is then the rest (else a stream's last 4 KiB).
    ``request_timeout`` bounds a request from ``decide`` (every try) to its whole answer, an
    event stream to its first body bytes; ``max_stream_duration`` an event stream from there:
    past either, ``finish`` gets outcome 5. After a stream's first bytes, a 3-tuple ``finish``
    returns is the stream's last event (its body; status and headers unused)."""

    cdef lane_t *lane
    cdef object _decide, _first_byte, _finish, _handoff, _count, _stream_bytes
    cdef object _held  # the last callback's answer: C copies from it before the next callback
    cdef bytes _head_answer, _body_answer, _handoff_headers

    def __cinit__(
        self,
        listen_fds,
        decide,
        first_byte,
        finish,
        handoff,
        *,
        size_t max_body,
        double head_timeout=0.0,
        double keepalive_timeout=0.0,
        double body_timeout=0.0,
        double connect_timeout=0.0,
        double try_timeout=0.0,
        double engine_idle_timeout=0.0,
        double pool_idle_timeout=4.0,
        double request_timeout=0.0,
        double max_stream_duration=0.0,
        bytes head_timeout_answer=b"",
        bytes body_timeout_answer=b"",
        handoff_headers=(),
        count=None,
        stream_bytes=None,
    ):
        cdef lane_config cfg
        memset(&cfg, 0, sizeof(cfg))
        self._decide = decide
        self._first_byte = first_byte
        self._finish = finish
        self._handoff = handoff
        self._count = count
        self._stream_bytes = stream_bytes
        self._head_answer = head_timeout_answer
        self._body_answer = body_timeout_answer
        cfg.ctx = <void *>self
        cfg.decide = _decide_cb
        cfg.first_byte = _first_byte_cb
        cfg.finish = _finish_cb
        cfg.handoff = _handoff_cb
        if count is not None:  # else NULL (memset): nothing is told
            cfg.count = _count_cb
        if stream_bytes is not None:  # else a stream's last 4 KiB reach finish, not the rest
            cfg.stream_bytes = _stream_bytes_cb
        cfg.max_body = max_body
        cfg.head_timeout = head_timeout
        cfg.keepalive_timeout = keepalive_timeout
        cfg.body_timeout = body_timeout
        cfg.connect_timeout = connect_timeout
        cfg.try_timeout = try_timeout
        cfg.engine_idle_timeout = engine_idle_timeout
        cfg.pool_idle_timeout = pool_idle_timeout
        cfg.request_timeout = request_timeout
        cfg.stream_timeout = max_stream_duration
        cfg.head_timeout_answer = PyBytes_AS_STRING(head_timeout_answer)
        cfg.head_timeout_answer_len = PyBytes_GET_SIZE(head_timeout_answer)
        cfg.body_timeout_answer = PyBytes_AS_STRING(body_timeout_answer)
        cfg.body_timeout_answer_len = PyBytes_GET_SIZE(body_timeout_answer)
        self._handoff_headers = _names(handoff_headers)
        cfg.handoff_headers = PyBytes_AS_STRING(self._handoff_headers)
        cfg.handoff_headers_len = PyBytes_GET_SIZE(self._handoff_headers)
        self.lane = lane_new(&cfg)
        if self.lane == NULL:
            raise OSError("cannot create the lane's epoll set")
        cdef int r
        for fd in listen_fds:
            r = lane_add_listener(self.lane, fd)
            if r < 0:
                raise OSError(-r, f"cannot watch listening socket {fd}: {os.strerror(-r)}")

    def __dealloc__(self):
        if self.lane != NULL:
            lane_free(self.lane)
            self.lane = NULL

    cdef lane_t *_live(self) except NULL:
        if self.lane == NULL:
            raise ValueError("the lane is closed")
        return self.lane

    def fileno(self):
        return lane_fd(self._live())

    def poll(self):
        """Handle every ready event without blocking; the number handled."""
        cdef int n = lane_poll(self._live())
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        return n

    def set_upstream(self, int upstream_id, str host, int port):
        """Where ``upstream_id`` is: a numeric IPv4 / IPv6 address (names are resolved by the
        caller, off the event loop), or "" for an id whose address is not known yet (its
        tries are unavailable until it is)."""
        cdef sockaddr_storage addr
        cdef unsigned addrlen = 0
        if host:
            addrlen = kvl_sockaddr(host.encode(), port, &addr)
            if addrlen == 0:
                raise ValueError(f"{host!r} is not a numeric address (resolve it first)")
        cdef int r = lane_set_upstream(self._live(), upstream_id, &addr, addrlen)
        if r < 0:
            raise OSError(-r, os.strerror(-r))

    def drop_upstream(self, int upstream_id):
        """Stop sending to ``upstream_id``; answers in flight finish. False if unknown."""
        return lane_drop_upstream(self._live(), upstream_id) == 0

    def stats(self):
        cdef lane_stats s
        lane_get_stats(self._live(), &s)
        return {
            "served": s.served,
            "handed_off": s.handed_off,
            "retried": s.retried,
            "client_gone": s.client_gone,
            "engine_failed": s.engine_failed,
            "timeouts": s.timeouts,
            "answered_directly": s.answered_directly,
            "open_connections": s.open_clients,
            "engine_connections": s.open_engines,
            "idle_engine_connections": s.idle_engines,
            "accept_pauses": s.accept_pauses,
            "engine_pauses": s.engine_pauses,
        }

    def shutdown(self):
        """Stop accepting; idle connections close now, the others after their answer."""
        lane_shutdown(self._live())

    def close(self):
        """Close every connection (requests in flight finish as client-gone) and the lane."""
        if self.lane != NULL:
            lane_free(self.lane)
            self.lane = NULL

    @property
    def closed(self):
        return self.lane == NULL


cdef int _fill(Lane self, object result, lane_action *out) except -1:
    """A decide-style answer into ``out``: None, a 5-tuple (forward) or a 3-tuple (answer)."""
    if result is None:
        out.action = LANE_HANDOFF
        return 0
    cdef Py_ssize_t n = len(result)
    if n == 5:
        upstream, head, body, extra, token = result
        head = _lines(head, "head")
        extra = _lines(extra, "answer_headers")
        if body is not None and not isinstance(body, bytes):
            raise TypeError("body must be bytes or None")
        self._held = (head, body, extra)
        out.action = LANE_FORWARD
        out.upstream = upstream
        out.head = PyBytes_AS_STRING(head)
        out.head_len = PyBytes_GET_SIZE(head)
        if body is not None:
            out.body = PyBytes_AS_STRING(body)
            out.body_len = PyBytes_GET_SIZE(body)
        out.extra = PyBytes_AS_STRING(extra)
        out.extra_len = PyBytes_GET_SIZE(extra)
        Py_INCREF(token)
        out.token = <void *>token
        return 0
    if n == 3:
        status, headers, body = result
        headers = _lines(headers, "headers")
        body = _lines(body, "body")
        self._held = (headers, body)
        out.status = status
        out.head = PyBytes_AS_STRING(headers)
        out.head_len = PyBytes_GET_SIZE(headers)
        out.body = PyBytes_AS_STRING(body)
        out.body_len = PyBytes_GET_SIZE(body)
        out.action = LANE_ANSWER
        return 0
    raise ValueError(f"a decision is None, a 5-tuple or a 3-tuple, not a {n}-tuple")


cdef inline object _opt(const char *p, size_t n):
    return None if p == NULL else PyBytes_FromStringAndSize(p, n)


cdef void _decide_cb(void *ctx, int kind, const char *body, size_t body_len,
                     const char *rid, size_t rid_len, const char *auth, size_t auth_len,
                     const char *fields, size_t fields_len, lane_action *out) noexcept with gil:
    cdef Lane self = <Lane>ctx
    try:
        result = self._decide(
            kind,
            PyBytes_FromStringAndSize(body, body_len),
            _opt(rid, rid_len),
            _opt(auth, auth_len),
            _opt(fields, fields_len),
        )
        _fill(self, result, out)
    except BaseException:
        _log.exception("the native lane's decide failed: the connection is handed off")
        out.action = LANE_HANDOFF  # the Python path serves it (and reports its own errors)


cdef void _first_byte_cb(void *ctx, void *token) noexcept with gil:
    cdef Lane self = <Lane>ctx
    try:
        self._first_byte(<object>token)
    except BaseException:
        _log.exception("the native lane's first_byte failed")


cdef void _finish_cb(void *ctx, void *token, int status, int outcome, const char *tail,
                     size_t tail_len, lane_action *out) noexcept with gil:
    cdef Lane self = <Lane>ctx
    cdef object tok = <object>token
    Py_DECREF(tok)  # the lane's reference, taken in _fill; `tok` holds one until we return
    if out != NULL:
        out.action = LANE_DEFAULT
    try:
        result = self._finish(tok, status, outcome, PyBytes_FromStringAndSize(tail, tail_len))
        if result is not None and out != NULL:  # else nothing is asked: the answer is dropped
            _fill(self, result, out)
    except BaseException:
        _log.exception("the native lane's finish failed: the lane answers its own error")
        if out != NULL:
            out.action = LANE_DEFAULT
    if out != NULL and out.action == LANE_HANDOFF:
        out.action = LANE_DEFAULT


cdef void _stream_bytes_cb(void *ctx, void *token, const char *data, size_t n) noexcept with gil:
    cdef Lane self = <Lane>ctx
    try:
        self._stream_bytes(<object>token, PyBytes_FromStringAndSize(data, n))
    except BaseException:
        _log.exception("the native lane's stream_bytes failed")


cdef void _handoff_cb(void *ctx, int fd, const char *data, size_t n) noexcept with gil:
    cdef Lane self = <Lane>ctx
    try:
        self._handoff(fd, PyBytes_FromStringAndSize(data, n))
    except BaseException:
        _log.exception("the native lane's handoff failed: the connection is closed")
        os.close(fd)  # nobody owns it now


cdef void _count_cb(void *ctx, int event, int kind, double seconds) noexcept with gil:
    cdef Lane self = <Lane>ctx
    try:
        self._count(event, kind, seconds)
    except BaseException:
        _log.exception("the native lane's count failed")
