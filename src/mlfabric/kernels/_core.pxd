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


# Scheduling: the hot loop of mlfabric.schedule (see the last section of
# _core.pyx). Link step functions and the search state; _ss_plan fills the
# order position by position and returns the number of sends.
cdef struct _SLink:
    # Segment k covers [t[k], t[k+1]); the last one runs to infinity.
    double* t   # breakpoints
    double* r   # residual capacity R per segment
    double* f   # free-from capacity F per segment (suffix minimum of R)
    Py_ssize_t n
    long version


cdef struct _SState:
    _SLink* links
    Py_ssize_t n
    const double* size
    const Py_ssize_t* up
    const Py_ssize_t* down
    const Py_ssize_t* pair   # -1: no pair link
    const double* cap        # least capacity on the path
    char* alive
    char* free
    char* in_held
    double* end
    double* start
    double* rate
    long* stamp
    Py_ssize_t* held         # indices that may be held (scanned, compacted)
    Py_ssize_t n_held
    const Py_ssize_t* front  # updates by (down link, size, -cap, index)
    Py_ssize_t* front_pos    # per update: its position in front
    double* tree             # max-segment tree over front: cap of live free updates, else -1
    Py_ssize_t tree_size     # leaves (a power of two >= n)
    Py_ssize_t* front_lo     # per link: [front_lo, front_hi) in front (empty if none)
    Py_ssize_t* front_hi
    Py_ssize_t* dests        # links that are somebody's destination
    Py_ssize_t n_dests
    Py_ssize_t* users        # per link: updates using it privately (CSR)
    Py_ssize_t* users_lo


cdef Py_ssize_t _ss_plan(_SState* S, double ready, bint has_deadlines,
                         const Py_ssize_t* dl, const Py_ssize_t* by_dl, double idle_factor,
                         Py_ssize_t* send_order, Py_ssize_t* position,
                         Py_ssize_t* drop_order, Py_ssize_t* n_drops_out,
                         signed char* reason, double* idle_out, double* displaced_out,
                         Py_ssize_t* forced) noexcept nogil
