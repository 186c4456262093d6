"""Data parallelism: the pass (``shard_data_parallel``), its gradient buckets for DDP and ZeRO-1/2
(``buckets``), FSDP units (``fsdp``), the graph helpers they share (``graph``), and the record the
pass leaves for the runtime (``info``: ``DataParallelInfo`` under ``gm.meta["fs_dp"]``); synchronized
batch norm (``batch_norm``) runs first, on the whole graph."""
