"""The CPU kernels of exlcli/csrc/cpu/: their loader (loader.py) and argument structs (args.py)."""
