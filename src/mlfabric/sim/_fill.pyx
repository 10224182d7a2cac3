# cython: language_level=3
"""Progressive filling (max-min fair rates) for the simulator's flow network.

A port of `mlfabric.sim.flownet.max_min_rates_reference`: the same rounds,
the same floating-point operations in the same order, so both give
bit-identical rates (tests/test_sim.py compares them on random networks).
What differs is the cost of a round. The reference recounts every live flow
on every link in each round, with numpy; a network whose links saturate at
many different levels (64 shard servers, each its own bottleneck) takes
tens of rounds over tens of thousands of flows, and the simulator re-fills
on every event. Here each link keeps its count of flows still rising and a
list of the flows crossing it, so a flow is visited once when it freezes
and a round costs only a scan of the links still in use.

Its own extension (setup.py): it shares no code with the other kernels.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport INFINITY
from libc.stdlib cimport qsort
from libc.string cimport memset

import numpy as np

from mlfabric.errors import ConfigError

# Links whose fair share is within this relative distance of the smallest
# saturate in the same round (flownet._TIE).
cdef double _TIE = 1e-12

# Per link index of the network: its position among the links in use, or
# -1. Kept between calls (and reset to -1 after each) so that a call costs
# what its flows cost, not what the network's thousands of idle links would.
cdef Py_ssize_t* _slot = NULL
cdef Py_ssize_t _slot_len = 0


cdef int _ensure_slots(Py_ssize_t n) except -1:
    global _slot, _slot_len
    cdef Py_ssize_t k, size
    cdef Py_ssize_t* grown
    if n <= _slot_len:
        return 0
    size = max(n, 2 * _slot_len)
    grown = <Py_ssize_t*> PyMem_Malloc(size * sizeof(Py_ssize_t))
    if grown == NULL:
        raise MemoryError()
    for k in range(size):
        grown[k] = -1
    PyMem_Free(_slot)
    _slot = grown
    _slot_len = size
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
def max_min_rates(const Py_ssize_t[:, ::1] links, const double[::1] capacity,
                  const double[::1] cap=None):
    """The max-min fair rate of each flow: see flownet.max_min_rates_reference."""
    cdef Py_ssize_t n = links.shape[0], hops = links.shape[1], nlinks_all = capacity.shape[0]
    cdef Py_ssize_t f, k, l, s, i, j, nused = 0, nalive, n_active = n, p = 0, nlim, ntouch
    cdef double level, sh, thr
    cdef bint has_cap = cap is not None
    if has_cap and cap.shape[0] != n:
        raise ValueError(f"cap has {cap.shape[0]} entries for {n} flows")
    rate_arr = np.zeros(n, np.float64)
    cdef double[::1] rate = rate_arr
    if n == 0:
        return rate_arr
    _ensure_slots(nlinks_all)
    # Flows by their own limit, finite limits only (a flow without one meets
    # the level only when it is infinite, the error case below).
    if has_cap:
        cap_arr = np.asarray(cap)
        finite = np.flatnonzero(cap_arr < INFINITY)
        order_arr = finite[np.argsort(cap_arr[finite], kind="stable")]
    else:
        order_arr = np.zeros(0, np.intp)
    cdef const Py_ssize_t[::1] order = order_arr
    cdef Py_ssize_t n_order = order.shape[0]
    # Per flow: its links as slots; per slot: the link, capacity left, count
    # of rising flows crossing it, its share, and its flows (CSR, ascending).
    cdef Py_ssize_t* fl = <Py_ssize_t*> PyMem_Malloc(n * hops * sizeof(Py_ssize_t))
    cdef Py_ssize_t* used = <Py_ssize_t*> PyMem_Malloc(n * hops * sizeof(Py_ssize_t))
    cdef char* active = <char*> PyMem_Malloc(n)
    cdef Py_ssize_t* lim = <Py_ssize_t*> PyMem_Malloc(n * sizeof(Py_ssize_t))
    cdef Py_ssize_t* cnt = NULL
    cdef Py_ssize_t* off = NULL
    cdef Py_ssize_t* member = NULL
    cdef Py_ssize_t* alive = NULL
    cdef Py_ssize_t* kacc = NULL
    cdef Py_ssize_t* touched = NULL
    cdef double* left = NULL
    cdef double* share = NULL
    cdef double* acc = NULL
    try:
        if fl == NULL or used == NULL or active == NULL or lim == NULL:
            raise MemoryError()
        for f in range(n):
            for k in range(hops):
                l = links[f, k]
                if l < 0 or l >= nlinks_all:
                    raise ValueError(f"flow {f} crosses link {l}; links are 0..{nlinks_all - 1}")
                s = _slot[l]
                if s < 0:
                    s = nused
                    _slot[l] = s
                    used[nused] = l
                    nused += 1
                fl[f * hops + k] = s
        cnt = <Py_ssize_t*> PyMem_Malloc(nused * sizeof(Py_ssize_t))
        off = <Py_ssize_t*> PyMem_Malloc((nused + 1) * sizeof(Py_ssize_t))
        member = <Py_ssize_t*> PyMem_Malloc(n * hops * sizeof(Py_ssize_t))
        alive = <Py_ssize_t*> PyMem_Malloc(nused * sizeof(Py_ssize_t))
        kacc = <Py_ssize_t*> PyMem_Malloc(nused * sizeof(Py_ssize_t))
        touched = <Py_ssize_t*> PyMem_Malloc(nused * sizeof(Py_ssize_t))
        left = <double*> PyMem_Malloc(nused * sizeof(double))
        share = <double*> PyMem_Malloc(nused * sizeof(double))
        acc = <double*> PyMem_Malloc(nused * sizeof(double))
        if (cnt == NULL or off == NULL or member == NULL or alive == NULL or kacc == NULL
                or touched == NULL or left == NULL or share == NULL or acc == NULL):
            raise MemoryError()
        memset(cnt, 0, nused * sizeof(Py_ssize_t))
        memset(kacc, 0, nused * sizeof(Py_ssize_t))
        for s in range(nused):
            left[s] = capacity[used[s]]
            acc[s] = 0.0
            alive[s] = s
        for i in range(n * hops):
            cnt[fl[i]] += 1
        off[0] = 0
        for s in range(nused):
            off[s + 1] = off[s] + cnt[s]
        for s in range(nused):  # off[s] becomes the fill position, then back
            kacc[s] = off[s]
        for f in range(n):
            active[f] = 1
            for k in range(hops):
                s = fl[f * hops + k]
                member[kacc[s]] = f
                kacc[s] += 1
        memset(kacc, 0, nused * sizeof(Py_ssize_t))
        nalive = nused
        while n_active > 0:
            # Each link's fair share; links no rising flow crosses leave the scan.
            level = INFINITY
            i = 0
            while i < nalive:
                s = alive[i]
                if cnt[s] == 0:
                    nalive -= 1
                    alive[i] = alive[nalive]
                    continue
                sh = (left[s] if left[s] > 0.0 else 0.0) / cnt[s]
                share[s] = sh
                if sh < level:
                    level = sh
                i += 1
            if has_cap:
                # Flows whose own limit is at most the level freeze at it; their
                # rates come off their links summed in flow order (numpy's bincount).
                nlim = 0
                while p < n_order and cap[order[p]] <= level:
                    if active[order[p]]:
                        lim[nlim] = order[p]
                        nlim += 1
                    p += 1
                if level == INFINITY:  # cap <= inf: every flow still rising (the reference's)
                    nlim = 0
                    for f in range(n):
                        if active[f]:
                            lim[nlim] = f
                            nlim += 1
                if nlim:
                    _sort(lim, nlim)
                    ntouch = 0
                    for j in range(nlim):
                        f = lim[j]
                        rate[f] = cap[f]
                        active[f] = 0
                        n_active -= 1
                        ntouch = _freeze(f, hops, fl, kacc, touched, ntouch, acc, cap[f])
                    for j in range(ntouch):
                        s = touched[j]
                        left[s] -= acc[s]
                        cnt[s] -= kacc[s]
                        acc[s] = 0.0
                        kacc[s] = 0
                    continue
            if level == INFINITY:
                raise ConfigError("a flow crosses no link of finite capacity")
            # Every rising flow crossing a link at the level freezes at it.
            thr = level * (1 + _TIE) if level > 0 else 0.0
            ntouch = 0
            for i in range(nalive):
                s = alive[i]
                if share[s] > thr:
                    continue
                for j in range(off[s], off[s + 1]):
                    f = member[j]
                    if not active[f]:
                        continue
                    active[f] = 0
                    n_active -= 1
                    rate[f] = level
                    ntouch = _freeze(f, hops, fl, kacc, touched, ntouch, NULL, 0.0)
            for j in range(ntouch):
                s = touched[j]
                left[s] -= level * <double> kacc[s]
                cnt[s] -= kacc[s]
                kacc[s] = 0
        return rate_arr
    finally:
        for s in range(nused):
            _slot[used[s]] = -1
        PyMem_Free(fl)
        PyMem_Free(used)
        PyMem_Free(active)
        PyMem_Free(lim)
        PyMem_Free(cnt)
        PyMem_Free(off)
        PyMem_Free(member)
        PyMem_Free(alive)
        PyMem_Free(kacc)
        PyMem_Free(touched)
        PyMem_Free(left)
        PyMem_Free(share)
        PyMem_Free(acc)


cdef inline Py_ssize_t _freeze(Py_ssize_t f, Py_ssize_t hops, const Py_ssize_t* fl,
                               Py_ssize_t* kacc, Py_ssize_t* touched, Py_ssize_t ntouch,
                               double* acc, double weight) noexcept nogil:
    # Flow f leaves the filling: each link it crosses counts it (once per
    # crossing) and, with `acc`, adds its rate to what comes off the link.
    # Returns the count of links touched so far in this round.
    cdef Py_ssize_t k, s
    for k in range(hops):
        s = fl[f * hops + k]
        if kacc[s] == 0:
            touched[ntouch] = s
            ntouch += 1
        kacc[s] += 1
        if acc != NULL:
            acc[s] += weight
    return ntouch


cdef int _cmp(const void* a, const void* b) noexcept nogil:
    cdef Py_ssize_t x = (<const Py_ssize_t*> a)[0], y = (<const Py_ssize_t*> b)[0]
    return (x > y) - (x < y)


cdef inline void _sort(Py_ssize_t* a, Py_ssize_t n) noexcept:
    qsort(a, n, sizeof(Py_ssize_t), _cmp)
