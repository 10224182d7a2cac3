# cython: language_level=3
"""Sending a frame whose data block is pieces of many arrays, straight from
the arrays, in one scatter-gather system call.

A push of 1,000 small tensors could go out as one buffer per tensor (uvloop's
writelines makes a memoryview and a buffer export per piece) or gathered into
one block first (a copy of every byte, bound by memory bandwidth). Each costs
about as much as sending the bytes. Here the iovecs are built in C from each
array's data pointer (numpy's C API), and `sendv` hands the socket as much of
the frame as it takes without waiting; what it does not take is copied
(`rest`) and queued on the transport as usual (runtime.loop.write_parts).

A block plan says where each piece comes from: piece k is `lengths[k]` bytes
from byte `starts[k]` of `arrays[index[k]]`, at `offsets[k]` in the data
block of `total` bytes; the bytes between pieces and after the last are zero
(wire.protocol.BlockPlan). Every plan is checked against its arrays before a
byte is read.
"""

cimport numpy as cnp
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from posix.uio cimport iovec

import os

import numpy as np

cnp.import_array()


cdef extern from "<sys/socket.h>" nogil:
    cdef struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    enum: MSG_NOSIGNAL


cdef extern from "<unistd.h>" nogil:
    long sysconf(int name)
    enum: _SC_IOV_MAX


# Zero bytes for the padding between pieces (a gap longer than this takes
# several iovecs).
cdef enum:
    ZERO_BYTES = 4096
cdef char _zeros[ZERO_BYTES]
memset(_zeros, 0, ZERO_BYTES)

cdef long _iov_max = sysconf(_SC_IOV_MAX)
if _iov_max <= 0:
    _iov_max = 16  # POSIX's least IOV_MAX


cdef Py_ssize_t _count(list arrays, const Py_ssize_t[::1] index, const Py_ssize_t[::1] starts,
                       const Py_ssize_t[::1] lengths, const Py_ssize_t[::1] offsets,
                       Py_ssize_t total) except -1:
    """Check the plan against `arrays`; the number of iovecs its block takes."""
    cdef Py_ssize_t n = index.shape[0], k, i, nb, pos = 0, count = 0
    if starts.shape[0] != n or lengths.shape[0] != n or offsets.shape[0] != n:
        raise ValueError(f"a block plan of {n} pieces with {starts.shape[0]} starts, "
                         f"{lengths.shape[0]} lengths and {offsets.shape[0]} offsets")
    if total < 0:
        raise ValueError(f"a block plan of {total} bytes")
    for k in range(n):
        i = index[k]
        if i < 0 or i >= len(arrays):
            raise ValueError(f"piece {k} of a block plan names array {i} of {len(arrays)}")
        a = arrays[i]
        if not isinstance(a, np.ndarray) or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a):
            raise TypeError(f"piece {k} of a block plan: array {i} is not a C-contiguous "
                            f"numpy array")
        nb = cnp.PyArray_NBYTES(<cnp.ndarray>a)
        if lengths[k] < 0 or starts[k] < 0 or starts[k] > nb - lengths[k]:
            raise ValueError(f"piece {k} of a block plan: {lengths[k]} bytes from byte "
                             f"{starts[k]} of an array of {nb}")
        if offsets[k] < pos or offsets[k] > total - lengths[k]:
            raise ValueError(f"piece {k} of a block plan: {lengths[k]} bytes at offset "
                             f"{offsets[k]}, after {pos} bytes placed, in a block of {total}")
        count += (offsets[k] - pos + ZERO_BYTES - 1) // ZERO_BYTES + (lengths[k] > 0)
        pos = offsets[k] + lengths[k]
    count += (total - pos + ZERO_BYTES - 1) // ZERO_BYTES
    return count


cdef Py_ssize_t _gap(iovec* iov, Py_ssize_t m, Py_ssize_t size) noexcept:
    cdef Py_ssize_t take
    while size > 0:
        take = size if size < ZERO_BYTES else ZERO_BYTES
        iov[m].iov_base = _zeros
        iov[m].iov_len = take
        m += 1
        size -= take
    return m


cdef Py_ssize_t _fill(iovec* iov, Py_ssize_t m, list arrays, const Py_ssize_t[::1] index,
                      const Py_ssize_t[::1] starts, const Py_ssize_t[::1] lengths,
                      const Py_ssize_t[::1] offsets, Py_ssize_t total):
    """The block's iovecs from iov[m] on (the plan checked by _count)."""
    cdef Py_ssize_t k, pos = 0
    cdef char* data
    for k in range(index.shape[0]):
        m = _gap(iov, m, offsets[k] - pos)
        if lengths[k] > 0:
            data = <char*>cnp.PyArray_DATA(<cnp.ndarray>arrays[index[k]])
            iov[m].iov_base = data + starts[k]
            iov[m].iov_len = lengths[k]
            m += 1
        pos = offsets[k] + lengths[k]
    return _gap(iov, m, total - pos)


def sendv(int fd, const unsigned char[::1] head, list arrays, index, starts, lengths, offsets,
          Py_ssize_t total):
    """Write `head`, then the data block the plan makes of `arrays`, to the
    non-blocking socket `fd`, as far as it takes them without waiting.
    Returns the bytes written (0 to len(head) + total); raises OSError on a
    socket error. The arrays must stay alive and unchanged during the call
    (the GIL is released around the system calls)."""
    cdef const Py_ssize_t[::1] ix = index
    cdef const Py_ssize_t[::1] st = starts
    cdef const Py_ssize_t[::1] ln = lengths
    cdef const Py_ssize_t[::1] of = offsets
    cdef Py_ssize_t count = 1 + _count(arrays, ix, st, ln, of, total)
    cdef iovec* iov = <iovec*>malloc(count * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    cdef Py_ssize_t first = 0, batch, k, written = 0, want, r
    cdef int err = 0
    cdef msghdr msg
    memset(&msg, 0, sizeof(msg))
    try:
        iov[0].iov_base = <void*>&head[0] if head.shape[0] else <void*>_zeros
        iov[0].iov_len = head.shape[0]
        count = _fill(iov, 1, arrays, ix, st, ln, of, total)
        with nogil:
            while first < count:
                batch = count - first if count - first < _iov_max else _iov_max
                want = 0
                for k in range(first, first + batch):
                    want += iov[k].iov_len
                msg.msg_iov = iov + first
                msg.msg_iovlen = batch
                r = sendmsg(fd, &msg, MSG_NOSIGNAL)
                if r < 0:
                    if errno == EINTR:
                        continue
                    if errno != EAGAIN:  # EWOULDBLOCK is EAGAIN on Linux and macOS
                        err = errno
                    break
                written += r
                if r < want:
                    break  # the socket is full: the rest goes on the transport
                first += batch
    finally:
        free(iov)
    if err:
        raise OSError(err, os.strerror(err))
    return written


def rest(list arrays, index, starts, lengths, offsets, Py_ssize_t total, Py_ssize_t skip):
    """Bytes `skip` to `total` of the data block the plan makes of `arrays`,
    copied into a new buffer (a memoryview of bytes): what a partial `sendv`
    left to send."""
    cdef const Py_ssize_t[::1] ix = index
    cdef const Py_ssize_t[::1] st = starts
    cdef const Py_ssize_t[::1] ln = lengths
    cdef const Py_ssize_t[::1] of = offsets
    cdef Py_ssize_t count = _count(arrays, ix, st, ln, of, total)
    if skip < 0 or skip > total:
        raise ValueError(f"rest: byte {skip} of a block of {total}")
    out = np.empty(total - skip, np.uint8)
    cdef char* dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef iovec* iov = <iovec*>malloc((count if count > 0 else 1) * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    cdef Py_ssize_t k, n, pos = 0
    try:
        count = _fill(iov, 0, arrays, ix, st, ln, of, total)
        for k in range(count):
            n = iov[k].iov_len
            if pos + n > skip:
                if pos < skip:
                    memcpy(dst, <char*>iov[k].iov_base + (skip - pos), n - (skip - pos))
                    dst += n - (skip - pos)
                else:
                    memcpy(dst, iov[k].iov_base, n)
                    dst += n
            pos += n
    finally:
        free(iov)
    return memoryview(out)
