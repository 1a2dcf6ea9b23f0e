"""Model math, one module per op: a pure-torch reference (the CPU path and the test oracle) and the
dispatch to the compiled CUDA kernel when it is available (see cuda/)."""
