"""Tensor and sequence parallelism: the pass (``shard_tensor_parallel``), its placement algebra
(``placement``), the per-op rules (``rules``, ``model_rules``), the rewriter they share
(``rewrite``), collective fusion (``fuse``) and the pattern detector that proposes a plan's rules
(``patterns``)."""
