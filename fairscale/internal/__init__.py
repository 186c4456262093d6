"""``fairscale.internal``: FairScale 0.4.13's helper modules that its clients and test suite import.

    from fairscale.internal import torch_version
    from fairscale.internal.parallel import chunk_and_pad, get_process_group_cached
    from fairscale.internal.containers import apply_to_tensors, pack_kwargs, unpack_kwargs
    from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer

Modules: ``version``, ``parallel``, ``params``, ``containers``, ``state_dict``, ``object``,
``reduce_scatter_bucketer``. They are helpers, not a stable API of ours; they keep the 0.4.13 names.
"""

from fairscale.internal.version import torch_version

__all__ = ["torch_version"]
