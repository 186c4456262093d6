"""Expert parallelism: the pass that splits MoE experts over ``mesh.ep`` (``shard_experts``)."""
