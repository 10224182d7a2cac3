# cython: language_level=3
"""The scheduling core's hot loop: the "mlfabric" policy of
`mlfabric.scheduling.schedule` on arrays, without the GIL.

A port of the pure-Python reference in schedule.py (_Link,
earliest_completion, _Candidates, _plan_stf, _forced_choice): the same
reservation model and decisions, with the same floating-point operations in
the same order, so both give identical plans (tests/test_schedule.py runs
every property on both and compares them). Only the search structures
differ: a max-segment tree over each destination's free updates instead of
size groups, and an array of held updates instead of a heap. The Python
module validates, prepares the arrays and builds the decisions; this only
decides. docs/scheduling.md explains the model and the drop rule.

Its own extension, apart from the numeric kernels (mlfabric.kernels._core):
it shares no code with them, and a change to one rebuilds and re-tests only
that one.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport INFINITY
from libc.string cimport memmove

import numpy as np

# Link step functions and the search state; _ss_plan fills the order
# position by position and returns the number of sends.
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


cdef enum:
    _REASON_NONE = 0
    _REASON_DEADLINE_MISSED = 1
    _REASON_WOULD_IDLE_SERVER = 2


cdef Py_ssize_t _sl_split(_SLink* L, double t) noexcept nogil:
    # Index of the segment starting at t, inserting a breakpoint if needed
    # (room for it was allocated up front).
    cdef Py_ssize_t lo = 0, hi = L.n, mid, k, tail
    while lo < hi:
        mid = (lo + hi) // 2
        if t < L.t[mid]:
            hi = mid
        else:
            lo = mid + 1
    k = lo - 1
    if L.t[k] == t:
        return k
    tail = L.n - k - 1
    memmove(&L.t[k + 2], &L.t[k + 1], tail * sizeof(double))
    memmove(&L.r[k + 2], &L.r[k + 1], tail * sizeof(double))
    memmove(&L.f[k + 2], &L.f[k + 1], tail * sizeof(double))
    L.t[k + 1] = t
    L.r[k + 1] = L.r[k]
    L.f[k + 1] = L.f[k]
    L.n += 1
    return k + 1


cdef void _sl_reserve(_SLink* L, double start, double end, double rate) noexcept nogil:
    cdef Py_ssize_t i = _sl_split(L, start)
    cdef Py_ssize_t j = _sl_split(L, end)
    cdef Py_ssize_t k, lo, hi, mid
    cdef double nxt, rk, now
    for k in range(i, j):
        L.r[k] -= rate
    nxt = L.f[j] if j < L.n else INFINITY
    k = j - 1
    while k >= 0:
        rk = L.r[k]
        if k < i and rk <= nxt:
            break
        nxt = rk if rk < nxt else nxt
        L.f[k] = nxt
        k -= 1
    L.version += 1
    # Collapse the leading segments where F is 0: nothing can start there.
    if L.f[0] > 0.0 or L.n < 2 or L.f[1] > 0.0:
        return
    lo = 0
    hi = L.n
    while lo < hi:  # bisect_right(f, 0.0): F is non-decreasing
        mid = (lo + hi) // 2
        if 0.0 < L.f[mid]:
            hi = mid
        else:
            lo = mid + 1
    k = lo - 1
    now = L.t[0]
    memmove(L.t, &L.t[k], (L.n - k) * sizeof(double))
    memmove(L.r, &L.r[k], (L.n - k) * sizeof(double))
    memmove(L.f, &L.f[k], (L.n - k) * sizeof(double))
    L.n -= k
    L.t[0] = now
    L.r[0] = 0.0


cdef inline double _sl_capacity(_SLink* L) noexcept nogil:
    return L.f[L.n - 1]


cdef inline double _sl_first_free(_SLink* L) noexcept nogil:
    return L.t[0] if L.f[0] > 0.0 else L.t[1]


cdef inline bint _sl_flat(_SLink* L) noexcept nogil:
    return L.f[0] == L.f[L.n - 1]


cdef void _sl_earliest(_SLink** path, Py_ssize_t m, double size,
                       double* out_end, double* out_start, double* out_rate) noexcept nogil:
    # Earliest-completing constant-rate transfer of `size` on the m (2 or 3)
    # links of `path`: scan the breakpoints of the path's F.
    cdef Py_ssize_t ptr[3]
    cdef double nxt[3]
    cdef double best_end = INFINITY, best_start = 0.0, best_rate = 0.0
    cdef double t = path[0].t[0], rate, end, fastest = path[0].f[path[0].n - 1]
    cdef Py_ssize_t a
    for a in range(m):
        ptr[a] = 0
        if path[a].f[path[a].n - 1] < fastest:
            fastest = path[a].f[path[a].n - 1]
    # No rate exceeds the path's capacity: stop at the first start t with
    # t + size / capacity >= the best end found.
    fastest = size / fastest
    while True:
        rate = path[0].f[ptr[0]]
        for a in range(1, m):
            if path[a].f[ptr[a]] < rate:
                rate = path[a].f[ptr[a]]
        if rate > 0.0:
            end = t + size / rate
            if end < best_end:
                best_end = end
                best_start = t
                best_rate = rate
        t = INFINITY
        for a in range(m):
            nxt[a] = path[a].t[ptr[a] + 1] if ptr[a] + 1 < path[a].n else INFINITY
            if nxt[a] < t:
                t = nxt[a]
        if t + fastest >= best_end:
            break
        for a in range(m):
            if nxt[a] == t:
                ptr[a] += 1
    out_end[0] = best_end
    out_start[0] = best_start
    out_rate[0] = best_rate


cdef inline Py_ssize_t _ss_path(_SState* S, Py_ssize_t k, _SLink** path) noexcept nogil:
    path[0] = &S.links[S.up[k]]
    path[1] = &S.links[S.down[k]]
    if S.pair[k] >= 0:
        path[2] = &S.links[S.pair[k]]
        return 3
    return 2


cdef inline long _ss_stamp(_SState* S, Py_ssize_t k) noexcept nogil:
    cdef long s = S.links[S.up[k]].version + S.links[S.down[k]].version
    if S.pair[k] >= 0:
        s += S.links[S.pair[k]].version
    return s


cdef double _ss_completion(_SState* S, Py_ssize_t k) noexcept nogil:
    cdef _SLink* path[3]
    cdef Py_ssize_t m
    cdef long stamp = _ss_stamp(S, k)
    if stamp != S.stamp[k]:
        m = _ss_path(S, k, path)
        _sl_earliest(path, m, S.size[k], &S.end[k], &S.start[k], &S.rate[k])
        S.stamp[k] = stamp
    return S.end[k]


cdef inline bint _ss_less(_SState* S, double e1, Py_ssize_t k1, double e2,
                          Py_ssize_t k2) noexcept nogil:
    # (e1, size, -cap, k1) < (e2, size, -cap, k2); k2 < 0 is "none": anything wins.
    if k2 < 0:
        return True
    if e1 != e2:
        return e1 < e2
    if S.size[k1] != S.size[k2]:
        return S.size[k1] < S.size[k2]
    if S.cap[k1] != S.cap[k2]:
        return S.cap[k1] > S.cap[k2]
    return k1 < k2


cdef bint _ss_may_be_free(_SState* S, Py_ssize_t k) noexcept nogil:
    cdef double t0 = _sl_first_free(&S.links[S.down[k]])
    cdef _SLink* L = &S.links[S.up[k]]
    if not (L.t[L.n - 1] <= t0 or _sl_flat(L)):
        return False
    if S.pair[k] >= 0:
        L = &S.links[S.pair[k]]
        if not (L.t[L.n - 1] <= t0 or _sl_flat(L)):
            return False
    return True


cdef inline void _ss_hold(_SState* S, Py_ssize_t k) noexcept nogil:
    S.free[k] = 0
    _ss_set(S, k)
    if not S.in_held[k]:
        S.in_held[k] = 1
        S.held[S.n_held] = k
        S.n_held += 1


cdef Py_ssize_t _st_first_above(const double* tree, Py_ssize_t node, Py_ssize_t node_lo,
                                Py_ssize_t node_hi, Py_ssize_t lo, Py_ssize_t hi,
                                double x) noexcept nogil:
    # First position in [lo, hi) whose leaf is > x, or -1 (leaves hold a
    # capacity, or -1 for an update that is not a live free one).
    cdef Py_ssize_t mid, found
    if node_hi <= lo or node_lo >= hi or tree[node] <= x:
        return -1
    if node_hi - node_lo == 1:
        return node_lo
    mid = (node_lo + node_hi) // 2
    found = _st_first_above(tree, 2 * node, node_lo, mid, lo, hi, x)
    if found >= 0:
        return found
    return _st_first_above(tree, 2 * node + 1, mid, node_hi, lo, hi, x)


cdef inline void _st_fix(_SState* S, Py_ssize_t pos) noexcept nogil:
    cdef Py_ssize_t node = (S.tree_size + pos) // 2
    cdef double v
    while node >= 1:
        v = S.tree[2 * node] if S.tree[2 * node] > S.tree[2 * node + 1] else S.tree[2 * node + 1]
        if S.tree[node] == v:
            break  # nothing above changes either
        S.tree[node] = v
        node //= 2


cdef inline void _ss_set(_SState* S, Py_ssize_t k) noexcept nogil:
    # Refresh k's leaf after its alive/free flags changed.
    S.tree[S.tree_size + S.front_pos[k]] = S.cap[k] if S.alive[k] and S.free[k] else -1.0
    _st_fix(S, S.front_pos[k])


cdef Py_ssize_t _ss_best(_SState* S, Py_ssize_t exclude) noexcept nogil:
    # The alive update least by (end, size, -cap, index), other than exclude.
    cdef Py_ssize_t best = -1, d, i, k, w
    cdef double best_end = INFINITY, e, t0, cap_dest, c_walked
    cdef _SLink* D
    # Free updates: walk each destination's Pareto front (see _Candidates).
    # The segment tree jumps straight to the next live free update whose
    # capacity beats every one walked so far (positions are by size, so the
    # bound below holds for all later positions).
    if exclude >= 0:
        S.tree[S.tree_size + S.front_pos[exclude]] = -1.0
        _st_fix(S, S.front_pos[exclude])
    for d in range(S.n_dests):
        D = &S.links[S.dests[d]]
        t0 = _sl_first_free(D)
        cap_dest = _sl_capacity(D)
        c_walked = 0.0
        i = S.front_lo[S.dests[d]]
        while True:
            i = _st_first_above(S.tree, 1, 0, S.tree_size, i, S.front_hi[S.dests[d]], c_walked)
            if i < 0:
                break
            k = S.front[i]
            if t0 + S.size[k] / cap_dest > best_end:
                break
            c_walked = S.cap[k]
            # k is evaluated only if it can start early enough to win; if it
            # cannot, neither can anything it dominates.
            if t0 + S.size[k] / S.cap[k] <= best_end:
                e = _ss_completion(S, k)
                if _ss_less(S, e, k, best_end, best):
                    best = k
                    best_end = e
            if c_walked >= cap_dest:
                break
            i += 1
    if exclude >= 0:
        _ss_set(S, exclude)
    # Held updates: a stale cached end is a lower bound of the current one.
    w = 0
    for i in range(S.n_held):
        k = S.held[i]
        if not S.alive[k] or S.free[k]:
            S.in_held[k] = 0
            continue
        if _ss_stamp(S, k) != S.stamp[k] and _ss_may_be_free(S, k):
            S.free[k] = 1  # back to its front; still a candidate of this search
            S.in_held[k] = 0
            _ss_set(S, k)
        else:
            S.held[w] = k
            w += 1
        if k == exclude:
            continue
        if S.stamp[k] >= 0 and not _ss_less(S, S.end[k], k, best_end, best):
            continue
        e = _ss_completion(S, k)
        if _ss_less(S, e, k, best_end, best):
            best = k
            best_end = e
    S.n_held = w
    return best


cdef void _ss_reserved(_SState* S, Py_ssize_t k) noexcept nogil:
    # Reserve k's path; free updates sharing its private links are held now.
    cdef _SLink* path[3]
    cdef Py_ssize_t m = _ss_path(S, k, path), a, i, L, u
    for a in range(m):
        _sl_reserve(path[a], S.start[k], S.end[k], S.rate[k])
    for a in range(m):
        if a == 1:
            continue  # the destination is shared, not private
        L = S.up[k] if a == 0 else S.pair[k]
        for i in range(S.users_lo[L], S.users_lo[L + 1]):
            u = S.users[i]
            if u != k and S.alive[u] and S.free[u]:  # (k itself is placed next)
                _ss_hold(S, u)


cdef double _ss_blocked_until(_SState* S, double horizon) noexcept nogil:
    # The earliest time any update could start, if no destination has
    # capacity free from `horizon` on; else -1 (something may still start by
    # then). F only falls as reservations are added, so once every
    # destination is blocked past the horizon it stays so. (Destinations
    # whose updates are all placed count too: checking which still have
    # some would cost a pass over them per position.)
    cdef Py_ssize_t d, k
    cdef _SLink* L
    cdef double first = INFINITY
    for d in range(S.n_dests):
        L = &S.links[S.dests[d]]
        k = 0
        while k < L.n and L.f[k] <= 0.0:  # F is non-decreasing: zeros are a prefix
            k += 1
        if k == L.n:
            continue  # never free again (cannot happen: capacities are > 0)
        if L.t[k] <= horizon:
            return -1.0
        if L.t[k] < first:
            first = L.t[k]
    return first


cdef Py_ssize_t _ss_plan(_SState* S, double ready, bint has_deadlines,
                         const Py_ssize_t* dl, const Py_ssize_t* by_dl, double idle_factor,
                         Py_ssize_t* send_order, Py_ssize_t* position,
                         Py_ssize_t* drop_order, Py_ssize_t* n_drops_out,
                         signed char* reason, double* idle_out, double* displaced_out,
                         Py_ssize_t* forced, Py_ssize_t plan_ahead, double horizon,
                         double* unplanned_from) noexcept nogil:
    # Fill positions 0, 1, ...; returns the number of sends (see _plan_stf).
    # With plan_ahead > 0, stop once at least plan_ahead positions are filled
    # and nothing left can start by `horizon` (see schedule_stf).
    cdef Py_ssize_t n = S.n, unscheduled = n, n_sends = 0, n_drops = 0
    cdef Py_ssize_t q = 0, r, pos = 0, chosen, nf, a, b, f, h, tmp, k
    cdef double idle, displaced, blocked
    unplanned_from[0] = INFINITY
    if has_deadlines:
        while q < n and dl[by_dl[q]] < 0:
            k = by_dl[q]
            S.alive[k] = 0
            _ss_set(S, k)
            reason[k] = _REASON_DEADLINE_MISSED
            position[k] = 0
            drop_order[n_drops] = k
            n_drops += 1
            unscheduled -= 1
            q += 1
    while unscheduled > 0:
        chosen = -1
        if plan_ahead > 0 and pos >= plan_ahead:
            blocked = _ss_blocked_until(S, horizon)
            if blocked >= 0.0:
                unplanned_from[0] = blocked
                break
        if has_deadlines:
            while q < n and dl[by_dl[q]] < pos:
                k = by_dl[q]
                if S.alive[k]:
                    S.alive[k] = 0
                    _ss_set(S, k)
                    reason[k] = _REASON_DEADLINE_MISSED
                    position[k] = pos
                    drop_order[n_drops] = k
                    n_drops += 1
                    unscheduled -= 1
                q += 1
            # Forced: dl == pos, tried in the tie order.
            nf = 0
            r = q
            while r < n and dl[by_dl[r]] == pos:
                if S.alive[by_dl[r]]:
                    _ss_completion(S, by_dl[r])
                    forced[nf] = by_dl[r]
                    nf += 1
                r += 1
            for a in range(1, nf):  # insertion sort: a handful at most
                b = a
                while b > 0 and _ss_less(S, S.end[forced[b]], forced[b],
                                         S.end[forced[b - 1]], forced[b - 1]):
                    tmp = forced[b]
                    forced[b] = forced[b - 1]
                    forced[b - 1] = tmp
                    b -= 1
            for a in range(nf):
                f = forced[a]
                if idle_factor < 0.0:
                    chosen = f
                    break
                h = _ss_best(S, f)
                if h < 0 or _ss_less(S, S.end[f], f, S.end[h], h):
                    chosen = f  # the shortest-first choice anyway
                    break
                idle = ((ready if ready > S.end[f] else S.end[f])
                        - (ready if ready > S.end[h] else S.end[h]))
                displaced = S.end[h] - S.start[h]
                if idle > idle_factor * displaced:
                    S.alive[f] = 0
                    _ss_set(S, f)
                    reason[f] = _REASON_WOULD_IDLE_SERVER
                    position[f] = pos
                    idle_out[f] = idle
                    displaced_out[f] = displaced
                    drop_order[n_drops] = f
                    n_drops += 1
                    unscheduled -= 1
                    continue
                chosen = f
                break
        if chosen < 0:
            chosen = _ss_best(S, -1)
            if chosen < 0:
                break
        _ss_completion(S, chosen)
        _ss_reserved(S, chosen)
        S.alive[chosen] = 0
        _ss_set(S, chosen)
        unscheduled -= 1
        send_order[n_sends] = chosen
        position[chosen] = pos
        n_sends += 1
        if S.end[chosen] > ready:
            ready = S.end[chosen]
        pos += 1
    n_drops_out[0] = n_drops
    return n_sends


# Scratch memory kept from one call to the next, grown as needed. Allocated
# afresh on every call, the pages of a plan over 10,000 updates (about 2 MB)
# were faulted in and handed back each time: half of the call's 3.6 ms.
cdef void* _scratch[7]
cdef size_t _scratch_size[7]
cdef bint _scratch_busy = False


cdef void* _take(int slot, size_t size, bint shared) except NULL:
    # `size` bytes: slot `slot` of the shared scratch (grown to at least
    # twice its old size when short), or a fresh block the caller frees.
    cdef void* p
    if not shared:
        p = PyMem_Malloc(size)
        if p == NULL:
            raise MemoryError()
        return p
    if _scratch_size[slot] < size:
        if size < 2 * _scratch_size[slot]:
            size = 2 * _scratch_size[slot]
        PyMem_Free(_scratch[slot])
        _scratch[slot] = NULL
        _scratch_size[slot] = 0
        p = PyMem_Malloc(size)
        if p == NULL:
            raise MemoryError()
        _scratch[slot] = p
        _scratch_size[slot] = size
    return _scratch[slot]


@cython.boundscheck(False)  # every index is checked against its array first
@cython.wraparound(False)
def schedule_stf(double ready, const double[::1] size, const Py_ssize_t[::1] up,
                 const Py_ssize_t[::1] down, const Py_ssize_t[::1] pair,
                 const double[::1] cap, const Py_ssize_t[::1] dl, bint has_deadlines,
                 double idle_factor, const Py_ssize_t[::1] seg_lo,
                 const double[::1] seg_t, const double[::1] seg_r, const double[::1] seg_f,
                 double[::1] start, double[::1] rate, double[::1] end,
                 Py_ssize_t[::1] position, Py_ssize_t[::1] send_order,
                 Py_ssize_t[::1] drop_order, signed char[::1] reason,
                 double[::1] idle, double[::1] displaced, Py_ssize_t plan_ahead=0,
                 double horizon=-INFINITY):
    """Shortest-transfer-first with deadlines and drops (mlfabric.schedule's
    reference `_plan_stf`), on arrays. Returns (n_sends, n_drops,
    unplanned_from).

    Update k crosses links up[k], down[k] and pair[k] (-1: none); cap[k] is the
    least capacity on its path; dl[k] its deadline position (if
    has_deadlines); idle_factor < 0 turns the idle rule off. Link L starts
    with segments seg_lo[L]:seg_lo[L+1] of (seg_t, seg_r, seg_f). Outputs per
    update: start, rate, end, position (sends: their position; drops: the
    position being filled), reason (0 sent, 1 deadline_missed,
    2 would_idle_server), idle and displaced (would_idle_server); send_order and
    drop_order list the indices in decision order.

    plan_ahead > 0 stops the plan early: once at least plan_ahead positions
    are filled and no destination of the plan has capacity free from
    `horizon` on, no update left can start by then, so the
    positions filled are the full plan's and every send due by `horizon` is
    among them. The updates left are neither sent nor dropped (a deadline
    that would have passed later in the plan is not looked at), and
    unplanned_from is the earliest any of them could start (inf when the
    plan is complete)."""
    cdef Py_ssize_t n = size.shape[0], n_links = seg_lo.shape[0] - 1
    cdef Py_ssize_t L, k, i, total = 0, n_sends, n_drops = 0
    cdef double unplanned_from = INFINITY
    for arr in (up.shape[0], down.shape[0], pair.shape[0], cap.shape[0], dl.shape[0],
                start.shape[0], rate.shape[0], end.shape[0], position.shape[0],
                send_order.shape[0], drop_order.shape[0], reason.shape[0], idle.shape[0],
                displaced.shape[0]):
        if arr != n:
            raise ValueError(f"schedule_stf: every per-update array needs {n} elements")
    for k in range(n):
        if not (0 <= up[k] < n_links and 0 <= down[k] < n_links and -1 <= pair[k] < n_links):
            raise ValueError(f"schedule_stf: update {k} names a link outside 0..{n_links - 1}")
        if not size[k] > 0.0:
            raise ValueError(f"schedule_stf: update {k} has size {size[k]}; sizes must be > 0")
    if n_links < 0 or seg_lo[0] != 0 or not (
            seg_lo[n_links] == seg_t.shape[0] == seg_r.shape[0] == seg_f.shape[0]):
        raise ValueError("schedule_stf: seg_lo must run from 0 to the length of seg_t/r/f")
    for L in range(n_links):
        if seg_lo[L + 1] <= seg_lo[L]:
            raise ValueError(f"schedule_stf: link {L} has no segment (seg_lo must increase)")
    cdef _SState S
    cdef Py_ssize_t* ints = NULL
    cdef char* flags = NULL
    cdef double* segs = NULL
    cdef double* tree = NULL
    cdef double* busy = NULL
    cdef double t0
    cdef long* stamps = NULL
    cdef Py_ssize_t* users_count
    cdef Py_ssize_t* by_dl
    cdef Py_ssize_t* forced
    cdef Py_ssize_t* front
    cdef const Py_ssize_t[::1] order_view
    S.links = NULL
    global _scratch_busy
    # The memory of the last call is used again unless another thread is
    # planning with it (its search runs without the GIL).
    cdef bint shared = not _scratch_busy
    _scratch_busy = _scratch_busy or shared
    try:
        ints = <Py_ssize_t*> _take(0, (n_links * 5 + 5 + n * 7) * sizeof(Py_ssize_t), shared)
        flags = <char*> _take(1, (3 * n + 1) * sizeof(char), shared)
        stamps = <long*> _take(2, (n + 1) * sizeof(long), shared)
        S.links = <_SLink*> _take(3, (n_links + 1) * sizeof(_SLink), shared)
        users_count = ints                    # n_links + 1 (then users_lo)
        S.front_lo = ints + n_links + 1       # n_links + 1
        S.front_hi = ints + 2 * n_links + 2   # n_links + 1
        S.dests = ints + 3 * n_links + 3      # n_links + 1
        S.users = ints + 4 * n_links + 4      # up to 2n
        S.held = S.users + 2 * n              # n
        by_dl = S.held + n                    # n
        forced = by_dl + n                    # n
        front = forced + n                    # n
        S.front_pos = front + n               # n
        S.users_lo = users_count
        for L in range(n_links + 1):
            users_count[L] = 0
            S.front_lo[L] = 0
            S.front_hi[L] = 0
        for k in range(n):
            users_count[up[k]] += 1
            users_count[down[k]] += 1
            if pair[k] >= 0:
                users_count[pair[k]] += 1
        # Room per link: its initial segments, plus two breakpoints per
        # update that can reserve on it (start and end), plus one.
        for L in range(n_links):
            total += (seg_lo[L + 1] - seg_lo[L]) + 2 * users_count[L] + 1
        segs = <double*> _take(4, (3 * total + 1) * sizeof(double), shared)
        S.tree_size = 1
        while S.tree_size < n:
            S.tree_size *= 2
        tree = <double*> _take(5, 2 * S.tree_size * sizeof(double), shared)
        S.tree = tree
        for i in range(2 * S.tree_size):
            tree[i] = -1.0
        # Per link, when it is busy until (-inf: never, its F is flat), noted
        # as each link is copied in: what deciding whether an update may be
        # free reads of its private links, in one small array. Read through
        # each update's link tables instead, those were scattered reads over
        # megabytes whenever the ranked rows' hosts were in no order (workers
        # lagging by different amounts): 13% of a re-plan at 10,000 pending.
        busy = <double*> _take(6, (n_links + 1) * sizeof(double), shared)
        total = 0
        for L in range(n_links):
            i = (seg_lo[L + 1] - seg_lo[L]) + 2 * users_count[L] + 1
            S.links[L].t = segs + total
            S.links[L].r = segs + total + i
            S.links[L].f = segs + total + 2 * i
            S.links[L].n = seg_lo[L + 1] - seg_lo[L]
            S.links[L].version = 0
            for k in range(S.links[L].n):
                S.links[L].t[k] = seg_t[seg_lo[L] + k]
                S.links[L].r[k] = seg_r[seg_lo[L] + k]
                S.links[L].f[k] = seg_f[seg_lo[L] + k]
            busy[L] = -INFINITY if _sl_flat(&S.links[L]) else S.links[L].t[S.links[L].n - 1]
            total += 3 * i
        # Private users per link (CSR): uplinks and pair links.
        for L in range(n_links + 1):
            users_count[L] = 0
        for k in range(n):
            users_count[up[k] + 1] += 1
            if pair[k] >= 0:
                users_count[pair[k] + 1] += 1
        for L in range(n_links):
            users_count[L + 1] += users_count[L]
        for L in range(n_links + 1):
            S.front_hi[L] = users_count[L]  # scratch: fill pointers
        for k in range(n):
            S.users[S.front_hi[up[k]]] = k
            S.front_hi[up[k]] += 1
            if pair[k] >= 0:
                S.users[S.front_hi[pair[k]]] = k
                S.front_hi[pair[k]] += 1
        S.n = n
        S.size = &size[0] if n else NULL
        S.up = &up[0] if n else NULL
        S.down = &down[0] if n else NULL
        S.pair = &pair[0] if n else NULL
        S.cap = &cap[0] if n else NULL
        S.alive = flags
        S.free = flags + n
        S.in_held = flags + 2 * n
        S.end = &end[0] if n else NULL
        S.start = &start[0] if n else NULL
        S.rate = &rate[0] if n else NULL
        S.stamp = stamps
        S.n_held = 0
        S.front = front
        _build_fronts(&S, size, down, cap, n_links)
        # by_dl: indices by (dl, index)
        # (Typed: indexing the array object would cost a Python call per update.)
        order = stable_order((np.asarray(dl),))
        order_view = order
        for i in range(n):
            by_dl[i] = order_view[i]
        for k in range(n):
            S.alive[k] = 1
            S.stamp[k] = -1
            S.end[k] = INFINITY
            S.start[k] = 0.0
            S.rate[k] = 0.0
            reason[k] = _REASON_NONE
            position[k] = -1
            idle[k] = 0.0
            displaced[k] = 0.0
            S.in_held[k] = 0
            # Leaves only; the tree above them is built once below (fixing
            # the path to the root per update was most of the setup).
            # As _ss_may_be_free(&S, k), its private links from `busy` (its
            # destination is shared: most updates have the same one).
            t0 = _sl_first_free(&S.links[down[k]])
            if busy[up[k]] <= t0 and (pair[k] < 0 or busy[pair[k]] <= t0):
                S.free[k] = 1
                tree[S.tree_size + S.front_pos[k]] = S.cap[k]
            else:
                S.free[k] = 0
                S.in_held[k] = 1
                S.held[S.n_held] = k
                S.n_held += 1
        for i in range(S.tree_size - 1, 0, -1):
            tree[i] = tree[2 * i] if tree[2 * i] > tree[2 * i + 1] else tree[2 * i + 1]
        with nogil:
            n_sends = _ss_plan(&S, ready, has_deadlines, &dl[0] if n else NULL, by_dl,
                               idle_factor, &send_order[0] if n else NULL,
                               &position[0] if n else NULL, &drop_order[0] if n else NULL,
                               &n_drops, &reason[0] if n else NULL,
                               &idle[0] if n else NULL, &displaced[0] if n else NULL, forced,
                               plan_ahead, horizon, &unplanned_from)
        return n_sends, n_drops, unplanned_from
    finally:
        if shared:
            _scratch_busy = False
        else:
            PyMem_Free(tree)
            PyMem_Free(busy)
            PyMem_Free(segs)
            PyMem_Free(ints)
            PyMem_Free(flags)
            PyMem_Free(stamps)
            PyMem_Free(S.links)


def stable_order(keys):
    """The indices sorted by `keys` (the last the primary, as np.lexsort),
    ties by index. np.lexsort sorts once per key, stably; the index needs no
    pass of its own (the first sort keeps ties in index order), and a key
    equal for every row orders nothing (one server, updates of one size:
    the usual plan). Rows already in order need no sort: ranked earliest
    deadline first, the plan's rows are in deadline order. At 5,000 pending
    the front's four-key sort was 94 us, over a third of the kernel's call."""
    cdef Py_ssize_t n = len(keys[0])
    used = [k for k in keys if n and not (k[0] == k).all()]
    if not used:
        return np.arange(n, dtype=np.intp)
    if len(used) == 1 and (used[0][1:] >= used[0][:-1]).all():
        return np.arange(n, dtype=np.intp)
    return np.lexsort(used).astype(np.intp, copy=False)


cdef _build_fronts(_SState* S, const double[::1] size, const Py_ssize_t[::1] down,
                   const double[::1] cap, Py_ssize_t n_links):
    # front: updates sorted by (down link, size, -cap, index); per destination
    # link its range; dests: the links that have a range.
    cdef Py_ssize_t n = S.n, i, L, n_dests = 0
    cdef Py_ssize_t* dests = S.dests
    cdef const Py_ssize_t[::1] order_view
    order = stable_order((-np.asarray(cap), np.asarray(size), np.asarray(down)))
    order_view = order
    for i in range(n):
        (<Py_ssize_t*> S.front)[i] = order_view[i]
    for L in range(n_links + 1):
        S.front_lo[L] = 0
        S.front_hi[L] = 0
    for i in range(n):
        S.front_pos[S.front[i]] = i
    i = 0
    while i < n:
        L = down[S.front[i]]
        S.front_lo[L] = i
        while i < n and down[S.front[i]] == L:
            i += 1
        S.front_hi[L] = i
        dests[n_dests] = L
        n_dests += 1
    S.n_dests = n_dests


@cython.boundscheck(False)
@cython.wraparound(False)
def running_segments(double now, const double[::1] capacity, const long long[::1] ids,
                     const Py_ssize_t[::1] up, const Py_ssize_t[::1] down,
                     const double[::1] end, const double[::1] rate):
    """Every link's segments at the start of a plan, from the transfers
    running on them: transfer k (ids[k]) holds links up[k] and down[k] at
    rate[k] until end[k]; link L has capacity[L]. Returns (seg_lo, seg_t,
    seg_r, seg_f) as schedule_stf takes them: the same floats as
    mlfabric.scheduling.schedule's _Link.load_running gives for the links
    held (those ending after now at a rate > 0, each link's transfers in id
    order), and one flat segment from now for every other link.

    Everything starts at now, so a link's residual capacity only rises with
    time and its free-from capacity equals it."""
    cdef Py_ssize_t n = ids.shape[0], n_links = capacity.shape[0]
    cdef Py_ssize_t i, j, k, L, lo, hi, total, g, w
    cdef double c, load, x
    for arr in (up.shape[0], down.shape[0], end.shape[0], rate.shape[0]):
        if arr != n:
            raise ValueError(f"running_segments: every per-transfer array needs {n} elements")
    for k in range(n):
        if not (0 <= up[k] < n_links and 0 <= down[k] < n_links):
            raise ValueError(f"running_segments: transfer {k} names a link outside "
                             f"0..{n_links - 1}")
    # The live transfers by (end, id): per link, its ends ascending and, for
    # equal ends, its rates in id order (load_running's sums).
    ends = np.asarray(end)
    live = np.flatnonzero((ends > now) & (np.asarray(rate) > 0))
    order = live[np.lexsort((np.asarray(ids)[live], ends[live]))].astype(np.intp, copy=False)
    cdef const Py_ssize_t[::1] by = order
    cdef Py_ssize_t m = by.shape[0]
    # Per link, its holders in that order (CSR: first counts, then fill).
    seg_lo_a = np.zeros(n_links + 1, np.intp)
    held_lo_a = np.zeros(n_links + 1, np.intp)
    held_a = np.empty(2 * m, np.intp)
    cdef Py_ssize_t[::1] seg_lo = seg_lo_a
    cdef Py_ssize_t[::1] held_lo = held_lo_a
    cdef Py_ssize_t[::1] held = held_a
    for i in range(m):
        held_lo[up[by[i]] + 1] += 1
        held_lo[down[by[i]] + 1] += 1
    for L in range(n_links):
        held_lo[L + 1] += held_lo[L]
    fill_a = held_lo_a[:n_links].copy()
    cdef Py_ssize_t[::1] fill = fill_a
    for i in range(m):
        k = by[i]
        held[fill[up[k]]] = k
        fill[up[k]] += 1
        held[fill[down[k]]] = k
        fill[down[k]] += 1
    # Segments per link: now, then each distinct end.
    for L in range(n_links):
        g = 1
        for j in range(held_lo[L], held_lo[L + 1]):
            if j == held_lo[L] or end[held[j]] != end[held[j - 1]]:
                g += 1
        seg_lo[L + 1] = seg_lo[L] + g
    total = seg_lo[n_links]
    seg_t_a = np.empty(total, np.float64)
    seg_r_a = np.empty(total, np.float64)
    cdef double[::1] seg_t = seg_t_a
    cdef double[::1] seg_r = seg_r_a
    for L in range(n_links):
        lo, hi = seg_lo[L], seg_lo[L + 1]
        c = capacity[L]
        seg_t[lo] = now
        seg_r[hi - 1] = c
        # Each end's summed rate, in the slot of the segment that ends there.
        w = lo - 1
        for j in range(held_lo[L], held_lo[L + 1]):
            k = held[j]
            if j == held_lo[L] or end[k] != end[held[j - 1]]:
                w += 1
                seg_t[w + 1] = end[k]
                seg_r[w] = 0.0 + rate[k]
            else:
                seg_r[w] = seg_r[w] + rate[k]
        # What runs over segment w: everything ending at or after its end.
        load = 0.0
        for w in range(hi - 2, lo - 1, -1):
            load = load + seg_r[w]
            x = c - load
            seg_r[w] = x if x > 0.0 else 0.0
    return seg_lo_a, seg_t_a, seg_r_a, seg_r_a.copy()
