# cython: language_level=3
"""C-level declarations of the mlfabric kernels (see _core.pyx).

Other Cython modules can ``from mlfabric._core cimport momentum_apply_kernel``
and call the loops directly on raw pointers, without the Python-level
validation. The caller then guarantees what the Python wrappers check:
every pointer addresses ``n`` contiguous elements of the same dtype, outputs
are writable, and outputs either coincide exactly with an input or do not
overlap it at all. The functions take no locks and never raise, so they can be
called with or without the GIL.

Rounding: every elementwise kernel evaluates exactly the numpy expression in
its docstring, in the array dtype, in the same order (the extension is built
with -ffp-contract=off, so no FMA), and is bit-identical to numpy.
"""

ctypedef fused real_t:
    float
    double

# new = (w + u) + g*(w - prev); prev = old w; w = new. w and prev must not
# overlap; u may be exactly w or prev.
cdef void momentum_apply_kernel(real_t* w, real_t* prev, const real_t* u, real_t g,
                                Py_ssize_t n) noexcept nogil

# out = (w + u) + g*(w - prev), or w + u if prev is NULL; w, prev, u are only
# read. Returns True iff every element written is finite (NaN/Inf-free).
cdef bint momentum_into_kernel(real_t* out, const real_t* w, const real_t* prev,
                               const real_t* u, real_t g, Py_ssize_t n) noexcept nogil

# out = (((out if accumulate else a[0]) + a[0 or 1]) + ...) element by element,
# left to right; k == 0 and not accumulate writes +0.0. out may be exactly any
# of the k inputs.
cdef void sum_into_kernel(real_t* out, const real_t** arrays, Py_ssize_t k, Py_ssize_t n,
                          bint accumulate) noexcept nogil

# y = y + alpha*x.
cdef void scaled_add_kernel(real_t* y, const real_t* x, real_t alpha,
                            Py_ssize_t n) noexcept nogil

# sum of (double)x_i**2, accumulated in double (16 partial sums, s[i % 16]).
cdef double sum_squares_kernel(const real_t* x, Py_ssize_t n) noexcept nogil

# sum of ((double)a_i - (double)b_i)**2, accumulated in double (8 partial sums).
cdef double sum_squares_diff_kernel(const real_t* a, const real_t* b,
                                    Py_ssize_t n) noexcept nogil

# True iff no element is NaN, +Inf or -Inf.
cdef bint all_finite_kernel(const real_t* x, Py_ssize_t n) noexcept nogil
