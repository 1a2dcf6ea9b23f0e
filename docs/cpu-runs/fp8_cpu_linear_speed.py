"""FP8 weights on the CPU: the reference linear (dequantizes on every call, exact fp32 products) against the
int8 kernel over fp8.int8_blocks (the CPU path with bf16 activations), one 4096 x 4096 e4m3 weight with a
scale per row, 1 and 16 token rows, best of 5 calls:

    python3 docs/cpu-runs/fp8_cpu_linear_speed.py"""

import time

import torch

from exlcli.ops.formats import cpu_qmatmul, fp8

torch.manual_seed(0)
n, k = 4096, 4096
w = torch.randn(n, k) * 0.02
scale = w.abs().amax(1, keepdim=True) / 448
weight = fp8.from_fp8((w / scale).to(torch.float8_e4m3fn), scale)
linears = {"reference": fp8.Fp8ReferenceLinear(weight),
           "int8 kernel": fp8.cpu_linear(weight, None, torch.device("cpu"), torch.bfloat16)}
assert isinstance(linears["int8 kernel"], cpu_qmatmul.QuantCpuLinear), "the CPU kernel is not built here"


def best_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


for rows in (1, 16):
    x = torch.randn(rows, k).bfloat16()
    for name, lin in linears.items():
        ms = best_ms(lambda: lin(x))  # noqa: B023
        print(f"{rows} rows, {name}: {ms:.2f} ms a call ({weight.nbytes() / ms / 1e6:.1f} GB/s of fp8 weights)")
