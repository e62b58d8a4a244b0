"""The runtime's roles wired in one process, for tests and tools: router and loader called
directly by compute's `LocalExpertSource`, over an anonymous staging pool."""
from __future__ import annotations

import mmap

import mlx.core as mx

from deltafin.runtime import tiers
from deltafin.runtime.config import Config, as_config
from deltafin.runtime.store import Store
from deltafin.workers.loader import Loader
from deltafin.workers.router_process import router_for
from deltafin.workers.sources import LocalExpertSource


def local_router(store: Store, config: Config | dict, n_slots: int = 0):
    """Router + Loader wired in-process over an anonymous staging pool: n_slots resident slots
    (0: cache.max_slots, else every expert), split among the record layouts in proportion to
    their experts. Returns (source, staging buffer, loader)."""
    config = as_config(config)
    cache = config.cache
    n_slots = n_slots or cache.max_slots or len(store.records)
    sizes = tiers.group_sizes(store)
    resident = tiers.whole_layers(store, tiers.split_resident(sizes, dict.fromkeys(sizes, 1), n_slots),
                                  cache.whole_layers, gpu=mx.default_device().type == mx.DeviceType.gpu)
    n_staging = tiers.staging_slots(store, config.loader.threads, cache.staging_slots)
    pool = mmap.mmap(-1, n_staging * store.max_record_bytes)
    loader = Loader(store, memoryview(pool), store.max_record_bytes)
    source = LocalExpertSource(router_for(store, cache, resident, n_staging), loader)
    return source, memoryview(pool), loader
