"""The compiled CUDA kernels (exlcli/csrc/), one job per module:

  build.py       the sources, the build key, the JIT build and loading the library
  loader.py      loads it once per process, runs the self-check, says whether ops may use it
  self_check.py  the decode kernels against a float64 reference at load: which ones to use
  state.py       what the loader found (loaded, why not, the self-check) and the launch options
  limits.py      what the kernels are built for (head sizes, decode rows, attention versions)
  checks.py      the input checks: KernelInputError naming the problem, before any launch
  kernels.py     the checked wrappers, the only way exlcli calls torch.ops.exlcli
"""
