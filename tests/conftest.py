import os

import torch

# One intra-op thread: tests fork ranks, and 2 cores are shared by every rank.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
