# cython: language_level=3
"""The compression kernels (issue 35): error feedback fused with a cast to
16 bits, and low rank's product P Q^T in a fixed order.

The casts: for each element, acc = x + r (float32), h = the 16-bit code of
acc, r = acc - float(h). numpy takes five passes and three temporaries for
the same (`np.add`, `astype`, `astype`, `np.subtract`, a clamp); the worker
runs this on the whole model before every push.

Rounding is numpy's: float32 -> float16 and -> bfloat16 round to nearest,
ties to even, exactly as `astype(np.float16)` does and as the reference in
tests/test_compression.py does for bfloat16. A value too large for the
16-bit format is clamped to its largest finite value first (65504 for
float16): what the clamp cuts off stays in the residual, so error feedback
sends it later instead of sending inf. The input must be finite (the caller
checks with `kernels.all_finite`); NaN is not a number to round.

Low rank. `lowrank_product` computes P Q^T summing over the rank in
order, in double, rounded once to float32: the same bits on every machine,
so a server and its replica decode a low-rank update identically (a BLAS
product may differ between builds in the last place), and the worker's
residual is taken from the very tensor they apply.
"""

from libc.stdint cimport uint16_t, uint32_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #define MLF_HALF_MAX 65504.0f
    #define MLF_BF16_MAX 3.3895313892515355e38f

    /* x86-64 with F16C (every x86 CPU since 2012): eight elements at a time
       with the hardware's conversions, which round to nearest even as IEEE
       (and numpy) do. Chosen at run time; elsewhere, and for the tail, the
       portable loops below. Each returns how many elements it did. */
    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    __attribute__((target("avx,f16c")))
    static Py_ssize_t mlf_ef_half_f16c(const float* x, float* r, uint16_t* out,
                                       Py_ssize_t n) {
        const __m256 hi = _mm256_set1_ps(MLF_HALF_MAX), lo = _mm256_set1_ps(-MLF_HALF_MAX);
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 acc = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(r + i));
            __m256 c = _mm256_max_ps(_mm256_min_ps(acc, hi), lo);
            __m128i h = _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT);
            _mm_storeu_si128((__m128i*)(out + i), h);
            _mm256_storeu_ps(r + i, _mm256_sub_ps(acc, _mm256_cvtph_ps(h)));
        }
        return i;
    }
    __attribute__((target("avx,f16c")))
    static Py_ssize_t mlf_half_to_float_f16c(const uint16_t* h, float* out, Py_ssize_t n) {
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
        return i;
    }
    static int mlf_has_f16c(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    }
    #else
    static Py_ssize_t mlf_ef_half_f16c(const float* x, float* r, uint16_t* out,
                                       Py_ssize_t n) { return 0; }
    static Py_ssize_t mlf_half_to_float_f16c(const uint16_t* h, float* out, Py_ssize_t n) {
        return 0;
    }
    static int mlf_has_f16c(void) { return 0; }
    #endif
    """
    float MLF_HALF_MAX
    float MLF_BF16_MAX
    Py_ssize_t mlf_ef_half_f16c(const float* x, float* r, uint16_t* out, Py_ssize_t n) nogil
    Py_ssize_t mlf_half_to_float_f16c(const uint16_t* h, float* out, Py_ssize_t n) nogil
    int mlf_has_f16c()

cdef bint _F16C = mlf_has_f16c()


cdef inline uint32_t _bits(float f) noexcept nogil:
    cdef uint32_t u
    memcpy(&u, &f, 4)
    return u


cdef inline float _float(uint32_t u) noexcept nogil:
    cdef float f
    memcpy(&f, &u, 4)
    return f


cdef inline uint16_t _to_half(float f) noexcept nogil:
    """float32 -> IEEE half, round to nearest even; |f| <= 65504."""
    cdef uint32_t u = _bits(f)
    cdef uint16_t sign = <uint16_t>((u >> 16) & 0x8000)
    cdef uint32_t a = u & 0x7FFFFFFF
    cdef uint32_t mant, shift, half_bit, rest, out
    cdef int exp
    if a < 0x33000000:  # below half the smallest subnormal (2^-25): rounds to 0
        return sign
    exp = <int>(a >> 23) - 127
    if exp < -14:  # a subnormal half: units of 2^-24
        mant = (a & 0x7FFFFF) | 0x800000  # the 24-bit significand
        shift = <uint32_t>(-exp - 1)  # value = mant * 2^(exp-23); unit 2^-24: >> (-1-exp)
        out = mant >> shift
        half_bit = <uint32_t>1 << (shift - 1)
        rest = mant & ((<uint32_t>1 << shift) - 1)
        # may carry into the smallest normal: still the right code
        out += <uint32_t>(rest > half_bit) | (<uint32_t>(rest == half_bit) & out & 1)
        return sign | <uint16_t>out
    # normal: 10 of the 23 mantissa bits stay. Rounded without a branch: on
    # real updates the rounding goes either way half the time, and a
    # mispredicted branch per element cost more than the rest of the loop.
    out = (<uint32_t>(exp + 15) << 10) | ((a >> 13) & 0x3FF)
    rest = a & 0x1FFF
    # a carry into the exponent is the right rounding too
    out += <uint32_t>(rest > 0x1000) | (<uint32_t>(rest == 0x1000) & out & 1)
    return sign | <uint16_t>out


cdef inline float _from_half(uint16_t h) noexcept nogil:
    cdef uint32_t sign = (<uint32_t>h & 0x8000) << 16
    cdef uint32_t exp = (h >> 10) & 0x1F
    cdef uint32_t mant = h & 0x3FF
    cdef float f
    if exp == 0:  # subnormal (or 0): mant * 2^-24, exact in float32
        f = <float>mant * <float>5.9604644775390625e-08
        return -f if sign else f
    if exp == 31:  # inf or NaN (never made here; decoded data is checked first)
        return _float(sign | 0x7F800000 | (mant << 13))
    return _float(sign | ((exp + 112) << 23) | (mant << 13))


cdef inline uint16_t _to_bf16(float f) noexcept nogil:
    """float32 -> bfloat16, round to nearest even; |f| <= MLF_BF16_MAX."""
    cdef uint32_t u = _bits(f)
    u += 0x7FFF + ((u >> 16) & 1)
    return <uint16_t>(u >> 16)


cdef void _ef_loop(const float* x, float* residual, uint16_t* out, Py_ssize_t start,
                   Py_ssize_t n, bint half) noexcept nogil:
    """The portable loop of both casts (`half`: fp16, else bf16): the branch
    on `half` goes the same way every element, so it costs nothing."""
    cdef Py_ssize_t i
    cdef float acc, c, top = MLF_HALF_MAX if half else MLF_BF16_MAX
    cdef uint16_t h
    for i in range(start, n):
        acc = x[i] + residual[i]
        c = acc
        if c > top:
            c = top
        elif c < -top:
            c = -top
        if half:
            h = _to_half(c)
            residual[i] = acc - _from_half(h)
        else:
            h = _to_bf16(c)
            residual[i] = acc - _float(<uint32_t>h << 16)
        out[i] = h


def _check_lengths(str what, Py_ssize_t n, Py_ssize_t r, Py_ssize_t o):
    if r != n or o != n:
        raise ValueError(f"{what}: x, residual and out differ in length: {n}, {r}, {o}")


def ef_half(const float[::1] x, float[::1] residual, uint16_t[::1] out):
    """acc = x + residual; out = float16 bits of acc (clamped to +-65504);
    residual = acc - float32(out). Returns nothing; `residual` and `out`
    are written in place."""
    cdef Py_ssize_t n = x.shape[0]
    _check_lengths("ef_half", n, residual.shape[0], out.shape[0])
    if n == 0:
        return
    cdef Py_ssize_t start = 0
    with nogil:
        if _F16C:
            start = mlf_ef_half_f16c(&x[0], &residual[0], &out[0], n)
        _ef_loop(&x[0], &residual[0], &out[0], start, n, True)


def ef_bf16(const float[::1] x, float[::1] residual, uint16_t[::1] out):
    """As `ef_half`, to bfloat16 (clamped to its largest finite value)."""
    cdef Py_ssize_t n = x.shape[0]
    _check_lengths("ef_bf16", n, residual.shape[0], out.shape[0])
    if n == 0:
        return
    with nogil:
        _ef_loop(&x[0], &residual[0], &out[0], 0, n, False)


def half_to_float(const uint16_t[::1] h, float[::1] out):
    """out = float32 of the float16 bits `h` (as `h.view(np.float16)`)."""
    cdef Py_ssize_t n = h.shape[0], i
    if out.shape[0] != n:
        raise ValueError(f"half_to_float: {n} codes, {out.shape[0]} outputs")
    cdef Py_ssize_t start = 0
    if n and _F16C:
        with nogil:
            start = mlf_half_to_float_f16c(&h[0], &out[0], n)
    with nogil:
        for i in range(start, n):
            out[i] = _from_half(h[i])


def bf16_to_float(const uint16_t[::1] h, float[::1] out):
    """out = float32 of the bfloat16 bits `h`."""
    cdef Py_ssize_t n = h.shape[0], i
    if out.shape[0] != n:
        raise ValueError(f"bf16_to_float: {n} codes, {out.shape[0]} outputs")
    with nogil:
        for i in range(n):
            out[i] = _float(<uint32_t>h[i] << 16)


def lowrank_product(const float[:, ::1] p, const float[:, ::1] q, float[:, ::1] out):
    """out = P Q^T (m x n from m x R and n x R), each element summed over the
    rank in order in double and rounded once."""
    cdef Py_ssize_t m = p.shape[0], n = q.shape[0], rank = p.shape[1], i, j, k
    if q.shape[1] != rank or out.shape[0] != m or out.shape[1] != n:
        raise ValueError(f"lowrank_product: P {p.shape[0]}x{p.shape[1]}, Q "
                         f"{q.shape[0]}x{q.shape[1]}, out {out.shape[0]}x{out.shape[1]}: "
                         f"need P m x R, Q n x R, out m x n")
    cdef double acc
    with nogil:
        for i in range(m):
            for j in range(n):
                acc = 0.0
                for k in range(rank):
                    acc = acc + <double>p[i, k] * <double>q[j, k]
                out[i, j] = <float>acc


def uses_f16c():
    """Whether the fp16 kernels run on the CPU's F16C conversions here (else
    the portable loops; both round alike: tests/test_compression.py)."""
    return bool(_F16C)


def set_f16c(bint on):
    """Use the F16C path or not (tests compare the two); returns the old setting."""
    global _F16C
    old = _F16C
    _F16C = on and mlf_has_f16c()
    return bool(old)
