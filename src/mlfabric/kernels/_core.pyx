# cython: language_level=3
"""Numeric kernels of mlfabric: one pass over memory, GIL released, numpy-exact.

Every kernel works on numpy arrays of dtype float32 or float64 (one fused-type
implementation for both), of any ndim but C-contiguous, as on their flat view.
Each has a numpy reference it is tested against (tests/test_core.py):

==============================================  ==========================================
kernel                                          numpy reference
==============================================  ==========================================
momentum_apply(w, prev, u, gamma)               new = w + u + g*(w - prev); prev[...] = w;
                                                w[...] = new                  (bit-exact)
momentum_into(out, w, prev, u, gamma)           out[...] = w + u + g*(w - prev) (bit-exact);
                                                returns bool(np.isfinite(out).all())
momentum_into(out, w, None, u, gamma)           out[...] = w + u              (bit-exact);
                                                returns bool(np.isfinite(out).all())
sum_into(out, arrays, accumulate=False)         out[...] = reduce(np.add, arrays), or
                                                reduce(np.add, arrays, out)  (bit-exact)
scaled_add(y, x, alpha)                         y[...] = y + a*x              (bit-exact)
l2_norm(x)                                      np.linalg.norm(x.astype(np.float64))
l2_norm_diff(a, b)                              np.linalg.norm(a.astype(np.float64)
                                                               - b.astype(np.float64))
all_finite(x)                                   bool(np.isfinite(x).all())
==============================================  ==========================================

where g = x.dtype.type(gamma) and a = x.dtype.type(alpha): scalars are cast to
the array dtype first, so float32 arrays are computed in float32, as numpy does
with a Python float. The extension is built with -ffp-contract=off (no FMA) and
without -ffast-math, and every expression keeps numpy's evaluation order, so
the elementwise kernels round exactly like numpy. NaN and Inf propagate like
numpy's (NaN in the same places; when two different NaN payloads meet, which
payload survives is not specified, as in numpy's own SIMD loops).

The norms square and accumulate in double, in interleaved partial sums (16
for l2_norm, 8 for l2_norm_diff; so the loop vectorizes), and so agree with the float64 reference to rounding
(about 1e-15 relative), not bit for bit. l2_norm_diff converts both operands to
double before subtracting. No scaling is done: a float64 array whose squares
overflow double gives inf, like np.linalg.norm.

Validation happens before any data is touched and raises
  TypeError   for a non-ndarray, a dtype other than native float32/float64,
              or arrays of different dtypes;
  ValueError  for a shape mismatch, a non-C-contiguous array, a read-only
              output, or an output that partially overlaps another argument.
An output may be exactly the same array as an input (for example
momentum_into(prev, w, prev, u, g) computes the new weights into the prev
buffer, and the caller swaps the names): every element is read before it is
written, so the result is still numpy's. In momentum_apply, w and prev must not
share memory at all (prev has to receive the old w). A 0-d array is treated as
one element; empty arrays are a no-op (norm 0.0, all_finite True).

The GIL is released around every loop over at least NOGIL_MIN_ELEMENTS
elements. Tiny arrays keep it, as numpy does (its threshold is 500 elements):
releasing costs little, but taking the GIL back can wait a whole switch
interval (5 ms) when another thread is running Python code.
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport isfinite, pow, sqrt
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset

cimport numpy as cnp

import numbers

import numpy as np

# The numpy C API serves the one place where a Python-level buffer export per
# array costs more than the work: checking 1,000 small tensors (check_gather).
cnp.import_array()

# Loops over at least this many elements release the GIL.
NOGIL_MIN_ELEMENTS = 8192
cdef Py_ssize_t _NOGIL_MIN = NOGIL_MIN_ELEMENTS

cdef enum:
    # Elements per block in sum_into (4 or 8 KiB: a block of partial sums
    # stays in L1 between groups of inputs).
    _BLOCK = 1024
    # Elements per block in momentum_apply (new weights staged on the stack).
    _APPLY_BLOCK = 256
    # Elements per block in all_finite (early-exit granularity).
    _FINITE_BLOCK = 4096

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# ---------------------------------------------------------------------------
# Kernels (declared in _core.pxd). Plain C loops: -O3 vectorizes them.
# ---------------------------------------------------------------------------

cdef void momentum_apply_kernel(real_t* w, real_t* prev, const real_t* u, real_t g,
                                Py_ssize_t n) noexcept nogil:
    # Per block: compute the new weights into a stack buffer (reading w, prev
    # and u), then copy w to prev and the buffer to w. Same bytes moved as one
    # fused loop, but the two store streams come in bursts instead of
    # interleaved with the loads, which measured up to 1.5x faster here (the
    # fused loop was sensitive to where the three arrays sit in memory). u is
    # read before anything is written, so it may be the same buffer as w or
    # prev; w and prev must not overlap.
    cdef real_t new[_APPLY_BLOCK]
    cdef Py_ssize_t start = 0, m, i
    cdef real_t* wb
    cdef real_t* pb
    cdef const real_t* ub
    while start < n:
        m = n - start
        if m > _APPLY_BLOCK:
            m = _APPLY_BLOCK
        wb = w + start
        pb = prev + start
        ub = u + start
        for i in range(m):
            new[i] = (wb[i] + ub[i]) + g * (wb[i] - pb[i])
        memcpy(pb, wb, m * sizeof(real_t))
        memcpy(wb, new, m * sizeof(real_t))
        start += m


cdef bint momentum_into_kernel(real_t* out, const real_t* w, const real_t* prev,
                               const real_t* u, real_t g, Py_ssize_t n) noexcept nogil:
    # Returns whether every element written is finite, tracked in a register
    # as all_finite_kernel does (the exponent-field carry into the sign bit),
    # so the parameter server can refuse a step that overflows the model
    # without a second pass over out: three integer ops per element, hidden
    # under the memory traffic of a large array (benchmarks/bench_store.py).
    # prev == NULL drops the momentum term: out = w + u (not the same as
    # g = 0, which would turn -0.0 into +0.0 and w - prev = inf into NaN).
    cdef Py_ssize_t i
    cdef real_t v
    cdef uint32_t b32, acc32 = 0
    cdef uint64_t b64, acc64 = 0
    if real_t is float:
        if prev == NULL:
            for i in range(n):
                v = w[i] + u[i]
                out[i] = v
                memcpy(&b32, &v, 4)
                acc32 = acc32 | ((b32 & 0x7f800000u) + 0x00800000u)
        else:
            for i in range(n):
                v = (w[i] + u[i]) + g * (w[i] - prev[i])
                out[i] = v
                memcpy(&b32, &v, 4)
                acc32 = acc32 | ((b32 & 0x7f800000u) + 0x00800000u)
        return (acc32 & 0x80000000u) == 0
    else:
        if prev == NULL:
            for i in range(n):
                v = w[i] + u[i]
                out[i] = v
                memcpy(&b64, &v, 8)
                acc64 = acc64 | ((b64 & 0x7ff0000000000000u) + 0x0010000000000000u)
        else:
            for i in range(n):
                v = (w[i] + u[i]) + g * (w[i] - prev[i])
                out[i] = v
                memcpy(&b64, &v, 8)
                acc64 = acc64 | ((b64 & 0x7ff0000000000000u) + 0x0010000000000000u)
        return (acc64 & 0x8000000000000000u) == 0


cdef inline void _sum_group(real_t* acc, const real_t* base, const real_t** rest,
                            Py_ssize_t g, Py_ssize_t start, Py_ssize_t m) noexcept nogil:
    # acc[i] = ((base[i] + r0[i]) + r1[i]) + r2[i] with g (0 to 3) terms r, all
    # at offset start. base may be acc itself: each element is read first.
    cdef Py_ssize_t i
    cdef const real_t* r0
    cdef const real_t* r1
    cdef const real_t* r2
    if g == 0:
        for i in range(m):
            acc[i] = base[i]
    elif g == 1:
        r0 = rest[0] + start
        for i in range(m):
            acc[i] = base[i] + r0[i]
    elif g == 2:
        r0 = rest[0] + start
        r1 = rest[1] + start
        for i in range(m):
            acc[i] = (base[i] + r0[i]) + r1[i]
    else:
        r0 = rest[0] + start
        r1 = rest[1] + start
        r2 = rest[2] + start
        for i in range(m):
            acc[i] = ((base[i] + r0[i]) + r1[i]) + r2[i]


cdef void sum_into_kernel(real_t* out, const real_t** arrays, Py_ssize_t k, Py_ssize_t n,
                          bint accumulate) noexcept nogil:
    # Block by block; within a block the inputs are added three at a time in
    # one loop, so up to four input streams advance together (hardware
    # prefetchers keep up; adding one whole input at a time measured up to 2x
    # slower). Per element the order is out (if accumulate), a0, a1, ...,
    # exactly reduce(np.add, ...). Each input is read once and out written
    # once (a block of out is re-read from L1 by later groups). With more than
    # one group and out being one of the inputs, the partial sums go to a
    # stack buffer instead, so every input block is read before the out block
    # is written: out may be the very same buffer as any input.
    cdef real_t buf[_BLOCK]
    cdef real_t* acc
    cdef Py_ssize_t start, m, i, j, g, n_rest
    cdef bint staged = False
    cdef const real_t* base
    cdef const real_t** rest
    if k == 0:
        if not accumulate:
            for i in range(n):
                out[i] = 0
        return
    if k == 1 and not accumulate:
        if out != arrays[0]:
            memcpy(out, arrays[0], n * sizeof(real_t))
        return
    if accumulate:
        rest = arrays
        n_rest = k
    else:
        rest = arrays + 1
        n_rest = k - 1
    if n_rest > 3:
        for j in range(k):
            if arrays[j] == out:
                staged = True
    start = 0
    while start < n:
        m = n - start
        if m > _BLOCK:
            m = _BLOCK
        if accumulate:
            base = out + start
        else:
            base = arrays[0] + start
        if staged:
            acc = buf
        else:
            acc = out + start
        g = n_rest if n_rest < 3 else 3
        _sum_group(acc, base, rest, g, start, m)
        j = g
        while j < n_rest:
            g = n_rest - j if n_rest - j < 3 else 3
            _sum_group(acc, acc, rest + j, g, start, m)
            j += g
        if staged:
            memcpy(out + start, buf, m * sizeof(real_t))
        start += m


cdef void scaled_add_kernel(real_t* y, const real_t* x, real_t alpha,
                            Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = y[i] + alpha * x[i]


cdef extern from *:
    # The sums of squares in C, to compile them twice: for the baseline
    # (SSE2) and for AVX2, picked at load time (GCC's target_clones, an ELF
    # ifunc). The float32 loop is bound by the float -> double conversions,
    # which AVX2 does four at a time: on the benchmark machine l2_norm of
    # 64 MiB went from 2.5 to 2.2 ms, about all_finite's 2.0 ms, so the
    # parameter server's norm of every update costs what its finiteness
    # check did. Sixteen interleaved partial sums (not 8) keep four vector
    # adds in flight, so the loop is not bound by the add latency either.
    # The partial sums are explicit and -ffp-contract=off forbids FMA, so
    # both clones compute the same bits in the same order.
    """
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    #define MLF_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define MLF_CLONES
    #endif
    #define MLF_SUM_SQUARES(NAME, T)                                              \
    MLF_CLONES static double NAME(const T* x, Py_ssize_t n) {                    \
        double s[16] = {0};                                                       \
        double v;                                                                 \
        Py_ssize_t i = 0, j;                                                      \
        for (; i + 16 <= n; i += 16)                                              \
            for (j = 0; j < 16; j++) { v = (double)x[i + j]; s[j] += v * v; }    \
        for (; i < n; i++) { v = (double)x[i]; s[i & 15] += v * v; }              \
        for (j = 0; j < 8; j++) s[j] += s[j + 8];                                 \
        return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); \
    }
    MLF_SUM_SQUARES(mlf_sum_squares_f32, float)
    MLF_SUM_SQUARES(mlf_sum_squares_f64, double)
    """
    double mlf_sum_squares_f32(const float* x, Py_ssize_t n) noexcept nogil
    double mlf_sum_squares_f64(const double* x, Py_ssize_t n) noexcept nogil


cdef double sum_squares_kernel(const real_t* x, Py_ssize_t n) noexcept nogil:
    # Sixteen independent partial sums (s[i % 16]): the compiler may not
    # reorder a single floating-point sum, but it vectorizes interleaved ones.
    if real_t is float:
        return mlf_sum_squares_f32(x, n)
    else:
        return mlf_sum_squares_f64(x, n)


cdef double sum_squares_diff_kernel(const real_t* a, const real_t* b,
                                    Py_ssize_t n) noexcept nogil:
    cdef double s[8]
    cdef double v
    cdef Py_ssize_t i = 0, j
    for j in range(8):
        s[j] = 0.0
    while i + 8 <= n:
        for j in range(8):
            v = <double>a[i + j] - <double>b[i + j]
            s[j] += v * v
        i += 8
    while i < n:
        v = <double>a[i] - <double>b[i]
        s[0] += v * v
        i += 1
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


cdef bint all_finite_kernel(const real_t* x, Py_ssize_t n) noexcept nogil:
    # On the IEEE-754 bits: x is NaN or +-Inf iff its exponent field is all
    # ones, i.e. iff (bits & EXP) + EXP_LSB carries into the sign bit. So a
    # block is finite iff the OR of those sums has the sign bit clear: integer
    # and/add/or only, which the compiler vectorizes (a float compare per
    # element does not vectorize for double). memcpy reads the bits without
    # breaking strict aliasing and compiles to a plain load. One check per
    # block, so a bad update stops early.
    cdef Py_ssize_t start = 0, stop, i
    cdef uint32_t b32, acc32
    cdef uint64_t b64, acc64
    while start < n:
        stop = start + _FINITE_BLOCK
        if stop > n:
            stop = n
        if real_t is float:
            acc32 = 0
            for i in range(start, stop):
                memcpy(&b32, &x[i], 4)
                acc32 = acc32 | ((b32 & 0x7f800000u) + 0x00800000u)
            if acc32 & 0x80000000u:
                return False
        else:
            acc64 = 0
            for i in range(start, stop):
                memcpy(&b64, &x[i], 8)
                acc64 = acc64 | ((b64 & 0x7ff0000000000000u) + 0x0010000000000000u)
            if acc64 & 0x8000000000000000u:
                return False
        start = stop
    return True


# ---------------------------------------------------------------------------
# Run a kernel, releasing the GIL unless the loop is tiny (see module docstring).
# ---------------------------------------------------------------------------

cdef void _run_momentum_apply(real_t* w, real_t* prev, const real_t* u, real_t g,
                              Py_ssize_t n) noexcept:
    if n < _NOGIL_MIN:
        momentum_apply_kernel(w, prev, u, g, n)
    else:
        with nogil:
            momentum_apply_kernel(w, prev, u, g, n)


cdef bint _run_momentum_into(real_t* out, const real_t* w, const real_t* prev,
                             const real_t* u, real_t g, Py_ssize_t n) noexcept:
    cdef bint ok
    if n < _NOGIL_MIN:
        return momentum_into_kernel(out, w, prev, u, g, n)
    with nogil:
        ok = momentum_into_kernel(out, w, prev, u, g, n)
    return ok


cdef void _run_sum_into(real_t* out, const real_t** arrays, Py_ssize_t k, Py_ssize_t n,
                        bint accumulate) noexcept:
    if n < _NOGIL_MIN:
        sum_into_kernel(out, arrays, k, n, accumulate)
    else:
        with nogil:
            sum_into_kernel(out, arrays, k, n, accumulate)


cdef void _run_scaled_add(real_t* y, const real_t* x, real_t alpha, Py_ssize_t n) noexcept:
    if n < _NOGIL_MIN:
        scaled_add_kernel(y, x, alpha, n)
    else:
        with nogil:
            scaled_add_kernel(y, x, alpha, n)


cdef double _run_sum_squares(const real_t* x, Py_ssize_t n) noexcept:
    cdef double s
    if n < _NOGIL_MIN:
        return sum_squares_kernel(x, n)
    with nogil:
        s = sum_squares_kernel(x, n)
    return s


cdef double _run_sum_squares_diff(const real_t* a, const real_t* b, Py_ssize_t n) noexcept:
    cdef double s
    if n < _NOGIL_MIN:
        return sum_squares_diff_kernel(a, b, n)
    with nogil:
        s = sum_squares_diff_kernel(a, b, n)
    return s


cdef bint _run_all_finite(const real_t* x, Py_ssize_t n) noexcept:
    cdef bint ok
    if n < _NOGIL_MIN:
        return all_finite_kernel(x, n)
    with nogil:
        ok = all_finite_kernel(x, n)
    return ok


# ---------------------------------------------------------------------------
# Validation and buffer access (Python level; nothing here touches the data).
# ---------------------------------------------------------------------------

cdef class _Buffers:
    """Holds the buffer exports of one call's arrays.

    Holding the export pins each array's memory (numpy refuses to resize an
    array with exported buffers) while the kernel runs without the GIL.
    """

    cdef Py_buffer* views
    cdef Py_ssize_t count
    cdef Py_ssize_t filled

    def __cinit__(self, Py_ssize_t count):
        self.views = <Py_buffer*>PyMem_Malloc((count if count > 0 else 1) * sizeof(Py_buffer))
        if self.views == NULL:
            raise MemoryError()
        self.count = count
        self.filled = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.views != NULL:
            for i in range(self.filled):
                PyBuffer_Release(&self.views[i])
            PyMem_Free(self.views)

    cdef int add(self, object arr, bint writable) except -1:
        cdef int flags = PyBUF_C_CONTIGUOUS
        if writable:
            flags |= PyBUF_WRITABLE
        PyObject_GetBuffer(arr, &self.views[self.filled], flags)
        self.filled += 1
        return 0

    cdef inline void* ptr(self, Py_ssize_t i) noexcept:
        return self.views[i].buf

    cdef bint partial_overlap(self, Py_ssize_t i, Py_ssize_t j) noexcept:
        """True if views i and j share bytes but do not start at the same address."""
        cdef char* a = <char*>self.views[i].buf
        cdef char* b = <char*>self.views[j].buf
        cdef Py_ssize_t la = self.views[i].len
        cdef Py_ssize_t lb = self.views[j].len
        if la == 0 or lb == 0 or a == b:
            return False
        return a < b + lb and b < a + la

    cdef bint any_overlap(self, Py_ssize_t i, Py_ssize_t j) noexcept:
        cdef char* a = <char*>self.views[i].buf
        cdef char* b = <char*>self.views[j].buf
        cdef Py_ssize_t la = self.views[i].len
        cdef Py_ssize_t lb = self.views[j].len
        if la == 0 or lb == 0:
            return False
        return a < b + lb and b < a + la


def _check_arrays(str func, list names, list arrays, list writable):
    """Validate the arrays of one call; return True for float32, False for float64.

    Raises before anything is read or written.
    """
    cdef Py_ssize_t i, k = len(arrays)
    for i in range(k):
        arr = arrays[i]
        if not isinstance(arr, np.ndarray):
            raise TypeError(
                f"{func}: {names[i]} must be a numpy.ndarray of dtype float32 or float64, "
                f"got {type(arr).__name__}; convert with np.asarray({names[i]}, dtype=np.float32)"
            )
    for i in range(k):
        arr = arrays[i]
        if arr.dtype != _F32 and arr.dtype != _F64 or not arr.dtype.isnative:
            raise TypeError(
                f"{func}: {names[i]} has dtype {arr.dtype.str if not arr.dtype.isnative else arr.dtype}"
                f" but the kernels take float32 or float64 only; "
                f"convert with {names[i]}.astype(np.float32)"
            )
    if k == 0:
        return True
    dtype0 = arrays[0].dtype
    for i in range(1, k):
        if arrays[i].dtype != dtype0:
            seen = ", ".join(f"{names[j]} {arrays[j].dtype}" for j in range(k))
            raise TypeError(
                f"{func}: mixed dtypes ({seen}); all arrays must have the same dtype; "
                f"convert with {names[i]}.astype(np.{dtype0})"
            )
    shape0 = arrays[0].shape
    for i in range(1, k):
        if arrays[i].shape != shape0:
            raise ValueError(
                f"{func}: shape mismatch: {names[0]} has shape {shape0} but {names[i]} has "
                f"shape {arrays[i].shape}; all arrays must have the same shape"
            )
    for i in range(k):
        arr = arrays[i]
        if not arr.flags.c_contiguous:
            raise ValueError(
                f"{func}: {names[i]} is not C-contiguous (shape {arr.shape}, strides "
                f"{arr.strides}); pass np.ascontiguousarray({names[i]})"
            )
    for i in range(k):
        if writable[i] and not arrays[i].flags.writeable:
            raise ValueError(
                f"{func}: {names[i]} is read-only (flags.writeable is False) but this kernel "
                f"writes to it; pass a writable array, e.g. {names[i]}.copy()"
            )
    return dtype0 == _F32


cdef _Buffers _acquire(list arrays, list writable):
    cdef _Buffers bufs = _Buffers(len(arrays))
    cdef Py_ssize_t i
    for i in range(len(arrays)):
        bufs.add(arrays[i], writable[i])
    return bufs


cdef _check_outputs(str func, _Buffers bufs, list names, Py_ssize_t n_out):
    """Outputs are the first n_out views; reject partial overlaps with any view."""
    cdef Py_ssize_t i, j
    for i in range(n_out):
        for j in range(bufs.filled):
            if j != i and bufs.partial_overlap(i, j):
                raise ValueError(
                    f"{func}: {names[i]} and {names[j]} overlap in memory without being the "
                    f"same array, so the result would not match numpy; pass separate "
                    f"buffers (an output may be exactly the same array as an input)"
                )


cdef double _scalar(str func, str name, object value) except? -1.0:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{func}: {name} must be a real number, got {type(value).__name__}")
    # The caller casts this double to the array dtype in C (<float>g): one
    # round-to-nearest, as numpy's cast; out of float32 range gives +-inf.
    return float(value)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

def momentum_apply(w, prev, u, gamma):
    """In place: new = (w + u) + g*(w - prev); prev[...] = old w; w[...] = new.

    g is gamma cast to the array dtype. Bit-identical to the numpy expression.
    w and prev must not share memory; u may be exactly w or prev.
    """
    names = ["w", "prev", "u"]
    arrays = [w, prev, u]
    writable = [True, True, False]
    cdef bint f32 = _check_arrays("momentum_apply", names, arrays, writable)
    cdef double g = _scalar("momentum_apply", "gamma", gamma)
    cdef _Buffers b = _acquire(arrays, writable)
    if b.any_overlap(0, 1):
        raise ValueError(
            "momentum_apply: w and prev share memory, but prev must receive the old w; "
            "pass two separate buffers"
        )
    _check_outputs("momentum_apply", b, names, 2)
    cdef Py_ssize_t n = w.size
    if f32:
        _run_momentum_apply(<float*>b.ptr(0), <float*>b.ptr(1), <const float*>b.ptr(2),
                                  <float>g, n)
    else:
        _run_momentum_apply(<double*>b.ptr(0), <double*>b.ptr(1),
                                  <const double*>b.ptr(2), g, n)


def momentum_into(out, w, prev, u, gamma):
    """out[...] = (w + u) + g*(w - prev), or w + u if prev is None; w, prev
    and u are only read. Returns True iff every element written is finite.

    g is gamma cast to the array dtype. Bit-identical to the numpy expression.
    out may be exactly one of the inputs (e.g. prev, to rotate two buffers).
    The finiteness of the result is tracked while it is written (no second
    pass), so a caller can refuse a step that overflows to Inf or NaN.
    """
    if prev is None:
        names = ["out", "w", "u"]
        arrays = [out, w, u]
        writable = [True, False, False]
    else:
        names = ["out", "w", "prev", "u"]
        arrays = [out, w, prev, u]
        writable = [True, False, False, False]
    cdef bint f32 = _check_arrays("momentum_into", names, arrays, writable)
    cdef double g = _scalar("momentum_into", "gamma", gamma)
    cdef _Buffers b = _acquire(arrays, writable)
    _check_outputs("momentum_into", b, names, 1)
    cdef Py_ssize_t n = out.size
    cdef Py_ssize_t iu = 2 if prev is None else 3
    cdef void* p = NULL if prev is None else b.ptr(2)
    cdef bint ok
    if f32:
        ok = _run_momentum_into(<float*>b.ptr(0), <const float*>b.ptr(1),
                                <const float*>p, <const float*>b.ptr(iu), <float>g, n)
    else:
        ok = _run_momentum_into(<double*>b.ptr(0), <const double*>b.ptr(1),
                                <const double*>p, <const double*>b.ptr(iu), g, n)
    return ok


def sum_into(out, arrays, accumulate=False):
    """out[...] = a0 + a1 + ... (left to right), or out + a0 + a1 + ... if accumulate.

    Bit-identical to functools.reduce(np.add, arrays) (with out as the initial
    value if accumulate). No arrays and accumulate=False sets out to 0.0.
    One pass: each input is read once and out written once. out may be exactly
    one of the inputs.
    """
    inputs = list(arrays)
    cdef Py_ssize_t k = len(inputs), i
    names = ["out"] + [f"arrays[{i}]" for i in range(k)]
    all_arrays = [out] + inputs
    writable = [True] + [False] * k
    cdef bint f32 = _check_arrays("sum_into", names, all_arrays, writable)
    cdef bint acc = bool(accumulate)
    cdef _Buffers b = _acquire(all_arrays, writable)
    _check_outputs("sum_into", b, names, 1)
    cdef Py_ssize_t n = out.size
    cdef void** ptrs = <void**>PyMem_Malloc((k if k > 0 else 1) * sizeof(void*))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(k):
            ptrs[i] = b.ptr(i + 1)
        if f32:
            _run_sum_into(<float*>b.ptr(0), <const float**>ptrs, k, n, acc)
        else:
            _run_sum_into(<double*>b.ptr(0), <const double**>ptrs, k, n, acc)
    finally:
        PyMem_Free(ptrs)


def scaled_add(y, x, alpha):
    """y[...] = y + a*x with a = alpha cast to the array dtype. Bit-identical.

    x may be exactly y (y becomes y + a*y).
    """
    names = ["y", "x"]
    arrays = [y, x]
    writable = [True, False]
    cdef bint f32 = _check_arrays("scaled_add", names, arrays, writable)
    cdef double a = _scalar("scaled_add", "alpha", alpha)
    cdef _Buffers b = _acquire(arrays, writable)
    _check_outputs("scaled_add", b, names, 1)
    cdef Py_ssize_t n = y.size
    if f32:
        _run_scaled_add(<float*>b.ptr(0), <const float*>b.ptr(1), <float>a, n)
    else:
        _run_scaled_add(<double*>b.ptr(0), <const double*>b.ptr(1), a, n)


def l2_norm(x):
    """sqrt(sum(x_i**2)), squared and summed in double; 0.0 for an empty array.

    Matches np.linalg.norm(x.astype(np.float64)) to rounding (16 partial sums).
    """
    cdef bint f32 = _check_arrays("l2_norm", ["x"], [x], [False])
    cdef _Buffers b = _acquire([x], [False])
    cdef Py_ssize_t n = x.size
    cdef double s
    if f32:
        s = _run_sum_squares(<const float*>b.ptr(0), n)
    else:
        s = _run_sum_squares(<const double*>b.ptr(0), n)
    return sqrt(s)


def l2_norm_diff(a, b):
    """||a - b||_2: both operands converted to double, then subtracted, squared, summed.

    Matches np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) to
    rounding. For float32 input the difference is thus not rounded to float32.
    """
    cdef bint f32 = _check_arrays("l2_norm_diff", ["a", "b"], [a, b], [False, False])
    cdef _Buffers bufs = _acquire([a, b], [False, False])
    cdef Py_ssize_t n = a.size
    cdef double s
    if f32:
        s = _run_sum_squares_diff(<const float*>bufs.ptr(0), <const float*>bufs.ptr(1), n)
    else:
        s = _run_sum_squares_diff(<const double*>bufs.ptr(0),
                                        <const double*>bufs.ptr(1), n)
    return sqrt(s)


def all_finite(x):
    """True iff x holds no NaN, +Inf or -Inf (True for an empty array).

    One pass, no temporaries; checks once per 4096 elements and stops at the
    first block holding a non-finite value.
    """
    cdef bint f32 = _check_arrays("all_finite", ["x"], [x], [False])
    cdef _Buffers b = _acquire([x], [False])
    cdef Py_ssize_t n = x.size
    cdef bint ok
    if f32:
        ok = _run_all_finite(<const float*>b.ptr(0), n)
    else:
        ok = _run_all_finite(<const double*>b.ptr(0), n)
    return ok


# ---------------------------------------------------------------------------
# Segments: a model kept in one flat buffer, one segment per tensor (the
# store's layout, which is a frame's), computed in one call instead of one
# call per tensor. A model of 1,000 small tensors otherwise spends its time
# in the calls, not in the arithmetic.
# ---------------------------------------------------------------------------

cdef _check_segments(str func, Py_ssize_t n, const Py_ssize_t[::1] starts,
                     const Py_ssize_t[::1] counts):
    if starts.shape[0] != counts.shape[0]:
        raise ValueError(f"{func}: {starts.shape[0]} segment starts but {counts.shape[0]} "
                         f"counts")
    cdef Py_ssize_t k
    for k in range(starts.shape[0]):
        if starts[k] < 0 or counts[k] < 0 or starts[k] > n - counts[k]:
            raise ValueError(f"{func}: segment {k} [{starts[k]}, {starts[k] + counts[k]}) "
                             f"is outside the arrays of {n} elements")


cdef Py_ssize_t _segments_total(const Py_ssize_t[::1] counts) noexcept:
    cdef Py_ssize_t k, total = 0
    for k in range(counts.shape[0]):
        total += counts[k]
    return total


cdef Py_ssize_t _segments_norm(const float* x, const Py_ssize_t* starts,
                               const Py_ssize_t* counts, Py_ssize_t m,
                               double* squares) noexcept nogil:
    # As ParameterStore._update_norm and the workers sum their tensors: each
    # tensor's norm (l2_norm) times itself, added in order. A product, not
    # pow(): glibc's pow(x, 2) and x * x differ in the last bit for about 1
    # x in 1,200, and the compiler makes pow(x, 2.0) a product anyway.
    cdef Py_ssize_t k
    cdef double norm, total = 0.0
    for k in range(m):
        norm = sqrt(mlf_sum_squares_f32(x + starts[k], counts[k]))
        if not isfinite(norm):
            squares[0] = total
            return k
        total += norm * norm
    squares[0] = total
    return -1


def segments_l2_norm(x, starts, counts):
    """The norm of a flat float32 update whose tensors are the segments
    [starts[k], starts[k] + counts[k]): sqrt(sum over k of n_k * n_k),
    n_k = l2_norm(segment k), bit for bit as that Python expression computes
    it (and as the workers and ParameterStore._update_norm do). Returns
    (norm, k): k is the first segment whose norm is not finite (the update
    holds NaN or Inf there; the norm is then of the segments before it), or -1.
    """
    _check_arrays("segments_l2_norm", ["x"], [x], [False])
    if x.dtype != _F32:
        raise TypeError("segments_l2_norm: x must be float32")
    cdef const Py_ssize_t[::1] s = starts
    cdef const Py_ssize_t[::1] c = counts
    _check_segments("segments_l2_norm", x.size, s, c)
    cdef _Buffers b = _acquire([x], [False])
    cdef Py_ssize_t m = s.shape[0], bad
    cdef double squares = 0.0
    cdef const Py_ssize_t* sp = &s[0] if m else NULL
    cdef const Py_ssize_t* cp = &c[0] if m else NULL
    cdef const float* xp = <const float*>b.ptr(0)
    if _segments_total(c) < _NOGIL_MIN:
        bad = _segments_norm(xp, sp, cp, m, &squares)
    else:
        with nogil:
            bad = _segments_norm(xp, sp, cp, m, &squares)
    return sqrt(squares), bad


cdef Py_ssize_t _segments_momentum(float* out, const float* w, const float* prev,
                                   const float* u, float g, const Py_ssize_t* starts,
                                   const Py_ssize_t* counts, Py_ssize_t m) noexcept nogil:
    cdef Py_ssize_t k, a
    cdef const float* pa = NULL
    for k in range(m):
        a = starts[k]
        if prev != NULL:
            pa = prev + a
        if not momentum_into_kernel(out + a, w + a, pa, u + a, g, counts[k]):
            return k
    return -1


def _momentum_arguments(out, w, prev, u):
    """The arrays of a momentum kernel, their names and which are written
    (prev None: no momentum term)."""
    if prev is None:
        return ["out", "w", "u"], [out, w, u], [True, False, False]
    return ["out", "w", "prev", "u"], [out, w, prev, u], [True, False, False, False]


def segments_momentum_into(out, w, prev, u, gamma, starts, counts):
    """momentum_into(out[seg], w[seg], prev[seg], u[seg], gamma) for every
    segment seg = [starts[k], starts[k] + counts[k]) of flat float32 arrays
    (prev may be None: w + u), in order; elements outside the segments are
    not touched. Bit-identical to the calls one by one. Returns -1 when every
    element written is finite, else the first segment k that is not (the
    segments after it are not computed)."""
    names, arrays, writable = _momentum_arguments(out, w, prev, u)
    cdef bint f32 = _check_arrays("segments_momentum_into", names, arrays, writable)
    if not f32:
        raise TypeError("segments_momentum_into: the arrays must be float32")
    cdef double g = _scalar("segments_momentum_into", "gamma", gamma)
    cdef const Py_ssize_t[::1] s = starts
    cdef const Py_ssize_t[::1] c = counts
    _check_segments("segments_momentum_into", out.size, s, c)
    cdef _Buffers b = _acquire(arrays, writable)
    _check_outputs("segments_momentum_into", b, names, 1)
    cdef Py_ssize_t m = s.shape[0], bad
    cdef Py_ssize_t iu = 2 if prev is None else 3
    cdef const float* p = NULL if prev is None else <const float*>b.ptr(2)
    cdef const Py_ssize_t* sp = &s[0] if m else NULL
    cdef const Py_ssize_t* cp = &c[0] if m else NULL
    cdef float* op = <float*>b.ptr(0)
    cdef const float* wp = <const float*>b.ptr(1)
    cdef const float* up = <const float*>b.ptr(iu)
    cdef float gf = <float>g
    if _segments_total(c) < _NOGIL_MIN:
        bad = _segments_momentum(op, wp, p, up, gf, sp, cp, m)
    else:
        with nogil:
            bad = _segments_momentum(op, wp, p, up, gf, sp, cp, m)
    return bad


cdef Py_ssize_t _segments_stage(float* out, const float* w, const float* prev,
                                const float* u, float g, const Py_ssize_t* starts,
                                const Py_ssize_t* counts, Py_ssize_t m, Py_ssize_t* done,
                                double* squares, Py_ssize_t received, bint check
                                ) noexcept nogil:
    cdef Py_ssize_t k, a, avail, have
    cdef double norm
    cdef const float* pa = NULL
    for k in range(m):
        avail = received - starts[k]
        if avail < 0:
            avail = 0
        if avail > counts[k]:
            avail = counts[k]
        have = done[k]
        if avail <= have:
            if avail < counts[k]:
                return -1  # later segments have not started arriving
            continue
        a = starts[k] + have
        norm = sqrt(mlf_sum_squares_f32(u + a, avail - have))
        if check and not isfinite(norm):
            return k
        if prev != NULL:
            pa = prev + a
        if not momentum_into_kernel(out + a, w + a, pa, u + a, g, avail - have) and check:
            return k
        squares[k] += norm * norm
        done[k] = avail
    return -1


def segments_stage(out, w, prev, u, gamma, starts, counts, done, squares,
                   Py_ssize_t received, bint check):
    """The staged apply's step over the first `received` elements of an update
    arriving in the store's flat layout (what StagedApply.feed does tensor by
    tensor): for each segment k, momentum_into on its elements from done[k]
    up to those received, adding the squared norm of that stretch to
    squares[k] and moving done[k] on; segments not yet reached stop it. With
    `check`, returns the first segment whose stretch holds NaN/Inf or would
    overflow (the staging is then void), else -1."""
    names, arrays, writable = _momentum_arguments(out, w, prev, u)
    if not _check_arrays("segments_stage", names, arrays, writable):
        raise TypeError("segments_stage: the arrays must be float32")
    cdef double g = _scalar("segments_stage", "gamma", gamma)
    cdef const Py_ssize_t[::1] s = starts
    cdef const Py_ssize_t[::1] c = counts
    cdef Py_ssize_t[::1] d = done
    cdef double[::1] q = squares
    _check_segments("segments_stage", out.size, s, c)
    cdef Py_ssize_t m = s.shape[0], k
    if d.shape[0] != m or q.shape[0] != m:
        raise ValueError(f"segments_stage: done and squares need {m} entries, got "
                         f"{d.shape[0]} and {q.shape[0]}")
    for k in range(m):
        if d[k] < 0 or d[k] > c[k]:
            raise ValueError(f"segments_stage: done[{k}] = {d[k]} is outside 0..{c[k]}")
    cdef _Buffers b = _acquire(arrays, writable)
    _check_outputs("segments_stage", b, names, 1)
    cdef Py_ssize_t iu = 2 if prev is None else 3
    cdef float* op = <float*>b.ptr(0)
    cdef const float* wp = <const float*>b.ptr(1)
    cdef const float* pp = NULL if prev is None else <const float*>b.ptr(2)
    cdef const float* up = <const float*>b.ptr(iu)
    cdef float gf = <float>g
    cdef const Py_ssize_t* sp = &s[0] if m else NULL
    cdef const Py_ssize_t* cp = &c[0] if m else NULL
    cdef Py_ssize_t* dp = &d[0] if m else NULL
    cdef double* qp = &q[0] if m else NULL
    cdef Py_ssize_t bad
    with nogil:
        bad = _segments_stage(op, wp, pp, up, gf, sp, cp, m, dp, qp, received, check)
    return bad


def gather(out, arrays, offsets):
    """Copy each array's bytes (C-contiguous, any dtype) into the uint8 array
    `out` at its offset: many small tensors into one frame's data block, so
    they go out as one buffer instead of one per tensor. The bytes between
    them are left as they are (zero them first, as np.zeros does)."""
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise TypeError("gather: out must be a writable C-contiguous uint8 numpy array")
    cdef list items = list(arrays)
    cdef list where = list(offsets)
    if len(items) != len(where):
        raise ValueError(f"gather: {len(items)} arrays but {len(where)} offsets")
    cdef _Buffers dst = _acquire([out], [True])
    cdef char* base = <char*>dst.ptr(0)
    cdef Py_ssize_t size = out.size, k, off
    cdef Py_buffer view
    for k in range(len(items)):
        off = where[k]
        PyObject_GetBuffer(items[k], &view, PyBUF_C_CONTIGUOUS)
        try:
            if off < 0 or off > size - view.len:
                raise ValueError(f"gather: array {k} of {view.len} bytes at offset {off} does "
                                 f"not fit in {size} bytes")
            memcpy(base + off, view.buf, view.len)
        finally:
            PyBuffer_Release(&view)


cdef inline Py_ssize_t _checked_nbytes(object value, tuple shape):
    """The bytes of `value` if it is a C-contiguous native float32 numpy array
    of `shape` (read through numpy's C API), else -1."""
    if type(value) is not np.ndarray:
        return -1
    cdef cnp.ndarray arr = <cnp.ndarray>value
    if (cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or not cnp.PyArray_ISNOTSWAPPED(arr)
            or not cnp.PyArray_IS_C_CONTIGUOUS(arr)):
        return -1
    cdef int i, ndim = cnp.PyArray_NDIM(arr)
    if ndim != len(shape):
        return -1
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(arr)
    for i in range(ndim):
        if dims[i] != <Py_ssize_t>shape[i]:
            return -1
    return cnp.PyArray_NBYTES(arr)


def check_gather(update, list names, list shapes, list offsets, out):
    """If `update` is a dict naming exactly `names`, in that order, each a
    C-contiguous float32 numpy array of the shape in `shapes`, at increasing
    `offsets`: copy each into `out` (uint8) at its offset, zero the bytes
    between and after them, and return True (so `out` may be np.empty: a
    zeroed buffer would be written twice). Otherwise False, with nothing
    promised about `out`: the caller checks the update the slow way, which
    says what is wrong. (The whole check of an update of 1,000 small tensors,
    in C, reading each array's fields through numpy's C API: a buffer export
    per array would cost more than copying its 4 KB.)"""
    if type(update) is not dict or not isinstance(out, np.ndarray) or out.dtype != np.uint8 \
            or not out.flags.c_contiguous or not out.flags.writeable:
        return False
    cdef dict d = <dict>update
    cdef Py_ssize_t n = len(names), k = 0, off, nbytes, pos = 0, size = out.size
    if len(d) != n or len(shapes) != n or len(offsets) != n:
        return False
    cdef char* base = <char*>cnp.PyArray_DATA(<cnp.ndarray>out)
    for key, value in d.items():
        name = names[k]
        if key is not name and key != name:
            return False
        nbytes = _checked_nbytes(value, <tuple>shapes[k])
        off = offsets[k]
        if nbytes < 0 or off < pos or off > size - nbytes:
            return False
        memset(base + pos, 0, off - pos)
        memcpy(base + off, cnp.PyArray_DATA(<cnp.ndarray>value), nbytes)
        pos = off + nbytes
        k += 1
    memset(base + pos, 0, size - pos)
    return True


def check_laid_out(update, list names, list shapes):
    """check_gather's check without the copy: the arrays of `update` in
    order if it is a dict naming exactly `names`, in that order, each a
    C-contiguous float32 numpy array of the shape in `shapes`; else None.
    (An update of many small tensors then goes out straight from its arrays,
    in one writev: see runtime._sendv.)"""
    if type(update) is not dict:
        return None
    cdef dict d = <dict>update
    cdef Py_ssize_t n = len(names), k = 0
    if len(d) != n or len(shapes) != n:
        return None
    for key, value in d.items():
        name = names[k]
        if key is not name and key != name:
            return None
        if _checked_nbytes(value, <tuple>shapes[k]) < 0:
            return None
        k += 1
    return list(d.values())


def copy_ranges(dst, dst_offsets, src, src_offsets, lengths):
    """dst[dst_offsets[k]:+lengths[k]] = src[src_offsets[k]:+lengths[k]] for
    every k, on uint8 arrays: a sharded client's update, gathered into the
    whole model's block once, cut into each shard's block without a Python
    object per piece."""
    for name, arr, w in (("dst", dst, True), ("src", src, False)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 \
                or not arr.flags.c_contiguous or (w and not arr.flags.writeable):
            raise TypeError(f"copy_ranges: {name} must be a C-contiguous uint8 numpy array"
                            f"{' (writable)' if w else ''}")
    cdef const Py_ssize_t[::1] do = dst_offsets
    cdef const Py_ssize_t[::1] so = src_offsets
    cdef const Py_ssize_t[::1] ln = lengths
    cdef Py_ssize_t m = ln.shape[0], k, nd = dst.size, ns = src.size
    if do.shape[0] != m or so.shape[0] != m:
        raise ValueError(f"copy_ranges: {do.shape[0]} and {so.shape[0]} offsets for {m} lengths")
    for k in range(m):
        if (ln[k] < 0 or do[k] < 0 or so[k] < 0 or do[k] > nd - ln[k]
                or so[k] > ns - ln[k]):
            raise ValueError(f"copy_ranges: range {k} ({ln[k]} bytes from {so[k]} to "
                             f"{do[k]}) is outside the arrays ({ns} and {nd} bytes)")
    cdef _Buffers b = _acquire([dst, src], [True, False])
    cdef char* dp = <char*>b.ptr(0)
    cdef const char* sp = <const char*>b.ptr(1)
    with nogil:
        for k in range(m):
            memcpy(dp + do[k], sp + so[k], ln[k])
