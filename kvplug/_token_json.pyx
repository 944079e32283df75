# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A JSON array of token ids, read into a uint32 array without a Python int per token; and the
common completion body read in one pass.

``kvplug serve`` receives completions whose ``prompt`` is a list of hundreds or thousands of
token ids. Decoding that list makes one Python int per token (about 11 us for 512 of them),
only for the router to read them back as u32 to hash them. These read the ids straight into the
uint32 array the router hashes.

``parse_token_ids`` reads an array's bytes (``msgspec`` hands the frontend the prompt as a
``msgspec.Raw``, already checked to be valid JSON). ``read_common_completion`` reads a whole
body of the usual shape - a flat object of ASCII strings without escapes, plain numbers,
``true``/``false``/``null`` and the ``prompt`` ids - in one pass over its bytes, where the
``msgspec`` head decode and then ``parse_token_ids`` walk the prompt twice (~5.4 us for ~512
ids, ~1.6 us here). It accepts a strict subset of JSON whose every value is in range, so what it
accepts the ``msgspec`` path accepts with the same result (tests/test_parsing_fastpath.py checks
it on generated bodies); for anything else it returns None and the caller takes that path.

The ids themselves: ``[`` integers ``]`` with JSON whitespace, every integer in [0, 2^32), at
least one. Anything else (a negative number, a fraction or exponent, a nested value, a string,
an empty list) returns None, and the caller takes the general, validating path, which says what
is wrong.
"""

import numpy as np

cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy

cnp.import_array()

# ids are read into this buffer, then copied into an array of their exact length (one pass over
# the bytes instead of counting the commas first); grown on demand, let go when a huge prompt
# made it big. Only called with the GIL held, so one buffer serves every call.
cdef uint32_t *_scratch = NULL
cdef Py_ssize_t _scratch_cap = 0
cdef Py_ssize_t _SCRATCH_KEEP = 1 << 18  # ids (1 MiB) kept between calls at most

# the fields the common completion reads (bit positions in a "seen" mask)
cdef enum:
    F_OTHER = 0
    F_MODEL = 1
    F_PROMPT = 2
    F_STREAM = 3
    F_NVEXT = 4
    F_SALT = 5
# digits a plain number may have here: any such number is a finite double / an int64, so every
# JSON decoder accepts it as is (no range question for the other paths to answer differently)
cdef enum:
    MAX_NUMBER_DIGITS = 15
    MAX_EXPONENT_DIGITS = 2


cdef inline bint _space(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


cdef inline Py_ssize_t _skip_space(const unsigned char *b, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and _space(b[i]):
        i += 1
    return i


cdef int _reserve(Py_ssize_t ids) noexcept:
    """Room for ``ids`` in the scratch buffer; -1 when memory ran out."""
    global _scratch, _scratch_cap
    if ids <= _scratch_cap:
        return 0
    cdef Py_ssize_t cap = ids if ids > 4096 else 4096
    cdef uint32_t *grown = <uint32_t *>realloc(_scratch, cap * sizeof(uint32_t))
    if grown == NULL:
        return -1
    _scratch = grown
    _scratch_cap = cap
    return 0


cdef Py_ssize_t _read_ids(const unsigned char *b, Py_ssize_t i, Py_ssize_t n,
                          Py_ssize_t *count) noexcept:
    """The id array starting at ``b[i]`` (its ``[``) into the scratch buffer: the index after
    its ``]`` and ``count`` ids, or -1 when it is not a non-empty array of integers in
    [0, 2^32) (or memory ran out: the caller's other path then fails the same way)."""
    cdef Py_ssize_t k = 0, start
    cdef uint64_t v
    cdef unsigned int d
    cdef unsigned char c
    if i >= n or b[i] != 91:  # '['
        return -1
    i += 1
    # every id takes a digit and a separator: an upper bound for the buffer
    if _reserve((n - i) // 2 + 1) < 0:
        return -1
    cdef uint32_t *dst = _scratch
    while True:
        i = _skip_space(b, i, n)
        start = i
        v = 0
        while i < n:
            d = <unsigned int>b[i] - 48u
            if d > 9u:
                break
            v = v * 10u + d
            i += 1
        # none: ']' of an empty list, '-', a string, a nested value...; over 10 digits or
        # 2^32 - 1: past u32 (at most 10 digits, so v cannot have wrapped)
        if i == start or i - start > 10 or v > <uint64_t>4294967295UL:
            return -1
        if b[start] == 48 and i - start > 1:  # leading zero: not JSON, let the parser say
            return -1
        dst[k] = <uint32_t>v
        k += 1
        i = _skip_space(b, i, n)
        if i >= n:
            return -1
        c = b[i]
        i += 1
        if c == 44:  # ','
            continue
        if c != 93:  # ']' (a '.', 'e' or anything else: not a plain integer)
            return -1
        count[0] = k
        return i


cdef object _take_ids(Py_ssize_t k):
    """The first ``k`` ids of the scratch buffer as a uint32 array of their own."""
    global _scratch, _scratch_cap
    cdef cnp.npy_intp dims = k
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_UINT32, 0)
    memcpy(cnp.PyArray_DATA(out), _scratch, k * sizeof(uint32_t))
    if _scratch_cap > _SCRATCH_KEEP:
        free(_scratch)
        _scratch = NULL
        _scratch_cap = 0
    return out


def parse_token_ids(const unsigned char[::1] raw):
    """The token ids of a JSON array as a numpy uint32 array, or None when ``raw`` is not a
    non-empty array of integers in [0, 2^32) (the caller's general path then reports why)."""
    cdef Py_ssize_t n = raw.shape[0], k = 0
    if n < 3:
        return None
    cdef const unsigned char *b = &raw[0]
    cdef Py_ssize_t i = _read_ids(b, _skip_space(b, 0, n), n, &k)
    if i < 0 or _skip_space(b, i, n) != n:
        return None
    return _take_ids(k)


cdef Py_ssize_t _string_end(const unsigned char *b, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """After the string at ``b[i]`` (its opening quote) when it is printable ASCII without
    escapes; -1 otherwise."""
    cdef unsigned char c
    i += 1
    while i < n:
        c = b[i]
        if c == 34:  # '"'
            return i + 1
        if c < 32 or c > 126 or c == 92:  # control, non-ASCII, '\\'
            return -1
        i += 1
    return -1


cdef inline Py_ssize_t _digits(const unsigned char *b, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and 48 <= b[i] <= 57:
        i += 1
    return i


cdef Py_ssize_t _number_end(const unsigned char *b, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """After the JSON number at ``b[i]`` when it has at most MAX_NUMBER_DIGITS digits and
    MAX_EXPONENT_DIGITS exponent digits; -1 otherwise."""
    cdef Py_ssize_t j, digits
    if i < n and b[i] == 45:  # '-'
        i += 1
    if i >= n or not 48 <= b[i] <= 57:
        return -1
    j = _digits(b, i, n)
    if b[i] == 48 and j - i > 1:  # leading zero
        return -1
    digits = j - i
    i = j
    if i < n and b[i] == 46:  # '.'
        j = _digits(b, i + 1, n)
        if j == i + 1:
            return -1
        digits += j - i - 1
        i = j
    if digits > MAX_NUMBER_DIGITS:
        return -1
    if i < n and (b[i] == 101 or b[i] == 69):  # 'e', 'E'
        i += 1
        if i < n and (b[i] == 43 or b[i] == 45):  # '+', '-'
            i += 1
        j = _digits(b, i, n)
        if j == i or j - i > MAX_EXPONENT_DIGITS:
            return -1
        i = j
    return i


cdef inline int _field(const unsigned char *key, Py_ssize_t size) noexcept nogil:
    if size == 5 and memcmp(key, b"model", 5) == 0:
        return F_MODEL
    if size == 6 and memcmp(key, b"prompt", 6) == 0:
        return F_PROMPT
    if size == 6 and memcmp(key, b"stream", 6) == 0:
        return F_STREAM
    if size == 5 and memcmp(key, b"nvext", 5) == 0:
        return F_NVEXT
    if size == 10 and memcmp(key, b"cache_salt", 10) == 0:
        return F_SALT
    return F_OTHER


def read_common_completion(object raw):
    """``(model, ids, stream, cache_salt)`` of a completion body of the common shape: a JSON
    object (bytes) whose values are printable-ASCII strings without escapes, numbers of at most
    15 digits, ``true``, ``false`` or ``null``; a non-empty string ``model``; ``prompt`` a
    non-empty array of integers in [0, 2^32); ``stream`` a boolean or null; ``nvext`` absent
    or null; each of these five keys at most once. ``cache_salt`` is None unless a string.
    None for any other body (the ``msgspec`` path decides it)."""
    if type(raw) is not bytes:
        return None
    cdef const unsigned char *b = <const unsigned char *>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(raw)
    cdef Py_ssize_t i = _skip_space(b, 0, n), end, k = 0
    cdef int field, seen = 0
    cdef unsigned char c
    cdef object model = None, salt = None, stream = False
    if i >= n or b[i] != 123:  # '{'
        return None
    i = _skip_space(b, i + 1, n)
    while True:
        if i >= n or b[i] != 34:  # a key (an empty object has no model: not this shape)
            return None
        end = _string_end(b, i, n)
        if end < 0:
            return None
        field = _field(b + i + 1, end - i - 2)
        if field != F_OTHER:
            if seen & (1 << field):  # a repeated key: the other path says which one counts
                return None
            seen |= 1 << field
        i = _skip_space(b, end, n)
        if i >= n or b[i] != 58:  # ':'
            return None
        i = _skip_space(b, i + 1, n)
        if i >= n:
            return None
        c = b[i]
        if field == F_PROMPT:
            i = _read_ids(b, i, n, &k)
            if i < 0:
                return None
        elif c == 34:  # a string
            end = _string_end(b, i, n)
            if end < 0 or field == F_STREAM or field == F_NVEXT:
                return None
            if field == F_MODEL or field == F_SALT:
                text = PyUnicode_DecodeASCII(<const char *>b + i + 1, end - i - 2, NULL)
                if field == F_MODEL:
                    model = text
                else:
                    salt = text
            i = end
        elif c == 116 and n - i >= 4 and memcmp(b + i, b"true", 4) == 0:
            if field == F_MODEL or field == F_NVEXT:
                return None
            stream = True if field == F_STREAM else stream
            salt = None if field == F_SALT else salt
            i += 4
        elif c == 102 and n - i >= 5 and memcmp(b + i, b"false", 5) == 0:
            if field == F_MODEL or field == F_NVEXT:
                return None
            stream = False if field == F_STREAM else stream
            salt = None if field == F_SALT else salt
            i += 5
        elif c == 110 and n - i >= 4 and memcmp(b + i, b"null", 4) == 0:
            if field == F_MODEL:
                return None
            stream = False if field == F_STREAM else stream
            salt = None if field == F_SALT else salt
            i += 4
        else:  # a number, or what this reader leaves to the other path (objects, arrays...)
            if field == F_MODEL or field == F_STREAM or field == F_NVEXT:
                return None
            i = _number_end(b, i, n)
            if i < 0:
                return None
            salt = None if field == F_SALT else salt
        i = _skip_space(b, i, n)
        if i >= n:
            return None
        c = b[i]
        i = _skip_space(b, i + 1, n)
        if c == 125:  # '}'
            break
        if c != 44:  # ','
            return None
    if i != n or not (seen & (1 << F_MODEL)) or not (seen & (1 << F_PROMPT)) or not model:
        return None
    return model, _take_ids(k), stream, salt
