"""Test-session settings shared by the curvature suite.

The test models are tiny (a few hundred parameters): intra-op threading only adds
synchronisation overhead there, and on a loaded 2-core machine OpenMP spin-waits make
double-backward/vmap calls 10-100x slower. One thread keeps the suite fast and its timing stable.
"""
import torch

torch.set_num_threads(1)
