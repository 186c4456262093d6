"""Run-time collectives that rank graphs call: the leaf of ``passes``.

``comm`` holds the axis → group binding and the byte counter; ``dp_ops``, ``tp_ops`` and
``ep_ops`` are the autograd functions the data-parallel, tensor-parallel and expert-parallel
passes insert. Nothing here imports ``planner`` or the rewriting passes, so the runtime and the
classic modules can use these without pulling in the compiler.
"""
