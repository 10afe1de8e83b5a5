"""Microbenchmarks of gtpo_kernels against reference PyTorch (eager and compiled) and other libraries."""
