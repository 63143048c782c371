"""Memory tiers beyond GPU memory, chapter *Beyond HBM* (book/12_beyond_hbm): one module per question it asks.

- `tiers`: what each tier delivers. The links KV bytes travel over, at their datasheet rates (`LINKS`; the fabrics between
  GPUs and nodes in `CLUSTER_LINKS`), and every
  tier of this machine measured (`measure_tiers`: GPU memory and the host link through `kvlab.specs.hardware`'s probes,
  RAM, `O_DIRECT` disk, the page cache). The lab's first table and the links table.
- `direct_io`: files read and written past the page cache (`O_DIRECT`, aligned buffers, the polled Linux-AIO
  reader `PolledReader`, scratch directories), for the disk tier and saved caches.
- `cache`: a transformers `Cache` that keeps chosen layers on the host or on disk and streams them in every step
  (`OffloadedCache`, `HostLayer`, `DiskLayer`).
- `loop`: the decode loop over it, timed in lockstep with an in-memory reference, the tier re-timed between
  steps (`decode_lockstep`, `time_offload`).
- `cost`: the step's cost model, compute plus transfer with no overlap, and the claim on it (`offload_cost`,
  `fit_offload`, `measure_offload`, `check_offload`): the lab's offloaded-decode section.
- `saved_kv`: a prompt's KV saved to disk and read back (`save_kv`, `load_kv`).
- `reload`: recompute or reload, estimated over cited links and timed here (`recompute_vs_reload`,
  `time_reload`, `check_reload`): the lab's last sections.

Import from the module that owns a name (`from kvlab.offload.cost import measure_offload`); the package itself
exposes nothing else.
"""
