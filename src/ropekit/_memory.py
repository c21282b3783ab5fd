"""Memory overlap of strided tensors, for in-place writes: a tensor written in place must not reach one element
twice, and two tensors written in one launch must not share an element (their stores would race)."""

from __future__ import annotations

from torch import Tensor

_SEARCH_BUDGET = 4096  # search nodes before giving up and calling two tensors overlapping


def has_internal_overlap(x: Tensor) -> bool:
    """Whether two indices of ``x`` may reach one element (``expand()``, overlapping ``as_strided``).

    Exact for the layouts views produce (each stride at least the span of the smaller ones); a layout that
    interleaves its dimensions otherwise counts as overlapping."""
    reach = 1  # elements spanned by the dimensions with smaller strides
    dims = [(st, n) for st, n in zip(x.stride(), x.shape) if n > 1]
    while dims:
        # smallest stride first, by comparisons rather than sorted(): under torch.compile(dynamic=True) strides are
        # symbolic, and each comparison becomes a guard where a sort cannot be traced
        j = 0
        for i in range(1, len(dims)):
            if dims[i][0] < dims[j][0]:
                j = i
        stride, size = dims.pop(j)
        if stride < reach:
            return True
        reach = stride * (size - 1) + reach
    return False


def span_bytes(x: Tensor) -> int:
    """Bytes from ``x``'s first element to the end of its last (non-negative strides, as torch makes them)."""
    return x.element_size() * (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1)


def overlap(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share at least one byte of memory (True where it cannot be decided cheaply).

    Disjoint address ranges answer at once; interleaved views of one buffer (q and k of a packed QKV
    projection) are decided exactly by a bounded search over the index differences."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    ea, eb = a.element_size(), b.element_size()
    a0, b0 = a.data_ptr(), b.data_ptr()
    if a0 + span_bytes(a) <= b0 or b0 + span_bytes(b) <= a0:
        return False
    if ea != eb:
        return True
    # Is there an element index i of a and j of b with |addr_a(i) - addr_b(j)| < element size?
    # sum_d i_d*sa_d - sum_d j_d*sb_d must fall in (b0 - a0 - ea, b0 - a0 + ea), in bytes.
    terms: dict[int, list[int]] = {}
    for x, sign in ((a, 1), (b, -1)):
        for n, st in zip(x.shape, x.stride()):
            if n > 1 and st:
                lo, hi = (0, n - 1) if sign > 0 else (1 - n, 0)
                span = terms.setdefault(st * ea, [0, 0])
                span[0] += lo
                span[1] += hi
    delta = b0 - a0
    try:
        return _reachable(sorted(((c, lo, hi) for c, (lo, hi) in terms.items()), reverse=True),
                          delta - ea + 1, delta + ea - 1)
    except _Undecided:
        return True


class _Undecided(Exception):
    pass


def _reachable(terms: list, lo: int, hi: int) -> bool:
    """Whether integers x_k in [min_k, max_k] exist with lo <= sum_k c_k*x_k <= hi; ``terms`` = (c_k, min_k,
    max_k) with c_k > 0, largest first. Views whose strides nest leave one or two candidates per term."""
    rest_min = [0] * (len(terms) + 1)
    rest_max = [0] * (len(terms) + 1)
    for i in range(len(terms) - 1, -1, -1):
        c, xmin, xmax = terms[i]
        rest_min[i], rest_max[i] = rest_min[i + 1] + c * xmin, rest_max[i + 1] + c * xmax
    budget = [_SEARCH_BUDGET]

    def search(i: int, lo: int, hi: int) -> bool:
        if i == len(terms):
            return lo <= 0 <= hi
        budget[0] -= 1
        if budget[0] < 0:
            raise _Undecided
        c, xmin, xmax = terms[i]
        first = max(xmin, -((rest_max[i + 1] - lo) // c))  # ceil((lo - rest_max) / c)
        last = min(xmax, (hi - rest_min[i + 1]) // c)
        return any(search(i + 1, lo - c * x, hi - c * x) for x in range(first, last + 1))

    return search(0, lo, hi)
