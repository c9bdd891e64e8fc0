"""The rows of bench/gpu_check.py, one concern a module: kernels, parity, CUDA Graphs, speed, memory."""
