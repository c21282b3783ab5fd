"""One cache for the small constant tensors validation hands the kernels (the default frequencies of ``base=``,
the pair-to-axis map of multi-axis positions): built once per key and device, the most recently used kept, so
repeated eager calls allocate nothing. Traced calls build afresh and keep nothing (a graph must not hold a tensor
made outside it). Under ``torch.inference_mode()`` the tensors are built as normal tensors, which later calls with
autograd may save."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor


def device_cache(maxsize: int = 64) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorate ``make(*key) -> Tensor`` (hashable arguments, the device among them) with an LRU cache of
    ``maxsize`` entries that is bypassed while torch.compile traces. ``fn.cache_clear()`` empties it,
    ``fn.cache_len()`` counts its entries, ``fn.maxsize`` is the bound."""

    def decorate(make: Callable[..., Tensor]) -> Callable[..., Tensor]:
        cache: OrderedDict = OrderedDict()

        @functools.wraps(make)
        def cached(*key) -> Tensor:
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
                return hit
            if torch.compiler.is_compiling():  # built in the graph, kept nowhere (and torch.compile cannot
                return make(*key)  # trace is_inference_mode_enabled() below)
            if torch.is_inference_mode_enabled():
                # a normal tensor, which every later call may use: one made in inference mode could not be saved
                # for the backward of a training call after it (generation, then training, as RL loops do)
                with torch.inference_mode(False):
                    value = make(*key)
            else:
                value = make(*key)
            cache[key] = value
            if len(cache) > maxsize:
                cache.popitem(last=False)
            return value

        cached.cache_clear = cache.clear
        cached.cache_len = cache.__len__
        cached.maxsize = maxsize
        return cached

    return decorate
