"""Cache-format math: each op as a PyTorch reference (and, for CUDA, Triton)."""
