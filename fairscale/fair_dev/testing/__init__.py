"""``fairscale.fair_dev.testing``: helpers for tests written against FairScale 0.4.13.

``testing`` (process launch, skips, comparisons, test models), ``testing_memory`` (find a tensor
on the heap) and ``golden_testing_data`` (AdaScale cases with closed-form expected values).
"""
