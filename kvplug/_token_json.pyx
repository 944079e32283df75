# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A JSON array of token ids, read into a uint32 array without a Python int per token.

``kvplug serve`` receives completions whose ``prompt`` is a list of hundreds or thousands of
token ids. Decoding that list makes one Python int per token (about 11 us for 512 of them),
only for the router to read them back as u32 to hash them. ``msgspec`` hands the frontend the
array's raw bytes (a ``msgspec.Raw`` field, already checked to be valid JSON); this reads them
straight into the uint32 array the router hashes.

It reads only the plain case: ``[`` integers ``]`` with JSON whitespace, every integer in
[0, 2^32), at least one. Anything else (a negative number, a fraction or exponent, a nested
value, a string, an empty list) returns None, and the caller takes the general, validating path,
which says what is wrong.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint32_t, uint64_t

cnp.import_array()


cdef inline bint _space(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


cdef Py_ssize_t _count_items(const unsigned char *b, Py_ssize_t n) noexcept nogil:
    """Commas + 1 inside the brackets (an upper bound on the items; the parse checks)."""
    cdef Py_ssize_t i, commas = 0
    for i in range(n):
        if b[i] == 44:
            commas += 1
    return commas + 1


def parse_token_ids(const unsigned char[::1] raw):
    """The token ids of a JSON array as a numpy uint32 array, or None when ``raw`` is not a
    non-empty array of integers in [0, 2^32) (the caller's general path then reports why)."""
    cdef Py_ssize_t n = raw.shape[0]
    if n < 3:
        return None
    cdef const unsigned char *b = &raw[0]
    cdef Py_ssize_t i = 0, k = 0, start
    cdef uint64_t v
    cdef unsigned char c
    while i < n and _space(b[i]):
        i += 1
    if i >= n or b[i] != 91:  # '['
        return None
    i += 1
    cdef cnp.ndarray out = np.empty(_count_items(b, n), dtype=np.uint32)
    cdef uint32_t *dst = <uint32_t *>cnp.PyArray_DATA(out)
    while True:
        while i < n and _space(b[i]):
            i += 1
        if i >= n:
            return None
        start = i
        v = 0
        while i < n:
            c = b[i]
            if c < 48 or c > 57:
                break
            v = v * 10 + (c - 48)
            if v > <uint64_t>4294967295UL:
                return None
            i += 1
        if i == start:  # not a digit: ']' of an empty list, '-', a string, a nested value...
            return None
        if b[start] == 48 and i - start > 1:  # leading zero: not JSON, let the parser say
            return None
        dst[k] = <uint32_t>v
        k += 1
        while i < n and _space(b[i]):
            i += 1
        if i >= n:
            return None
        c = b[i]
        i += 1
        if c == 44:  # ','
            continue
        if c != 93:  # ']' (a '.', 'e' or anything else: not a plain integer)
            return None
        break
    while i < n and _space(b[i]):
        i += 1
    if i != n:
        return None
    return out if k == out.shape[0] else out[:k]
