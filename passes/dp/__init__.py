"""Data parallelism: the pass (``shard_data_parallel``: DDP and ZeRO-1/2 buckets), FSDP units
(``fsdp``) and the graph helpers both use (``graph``)."""
