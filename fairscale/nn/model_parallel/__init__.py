"""FairScale 0.4.13's ``fairscale.nn.model_parallel``: Megatron-style tensor parallelism on ``passes.ops.comm``."""

from fairscale.nn.model_parallel import initialize
from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from fairscale.nn.model_parallel.initialize import (destroy_model_parallel, get_data_parallel_group,
                                                    get_data_parallel_rank, get_data_parallel_world_size,
                                                    get_model_parallel_group, get_model_parallel_rank,
                                                    get_model_parallel_world_size, get_pipeline_parallel_group,
                                                    get_pipeline_parallel_ranks, initialize_model_parallel,
                                                    model_parallel_is_initialized)
from fairscale.nn.model_parallel.layers import (ColumnParallelLinear, ParallelEmbedding, RowParallelLinear,
                                                VocabParallelEmbedding)

__all__ = ["initialize", "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_pipeline_parallel_group", "get_pipeline_parallel_ranks", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "ParallelEmbedding", "vocab_parallel_cross_entropy"]
