import sys, time, torch, collections
sys.path.insert(0, "scripts")
import gpu_bench as gb
from torch.profiler import ProfilerActivity, profile
model, tok = gb.build_quantized_llama("fp8")
engine = gb.make_engine(model, tok, max_num_seqs=512)
gb.decode_steps(engine, 64, 128, 20, "warm")
vocab = model.config.vocab_size
engine.runner.graphs.capture(list(range(1, 513)), max_pages=16)
prompts = gb.random_prompts(1024, 128, vocab, seed=12345)
gb.submit_all(engine, prompts, 128, "off")
rows = []
prof_done = False
t_all = time.perf_counter()
while True:
    t0 = time.perf_counter()
    if not engine.step():
        break
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    seqs, tokens = engine.last_step_shape()
    rows.append((seqs, tokens, (t1 - t0) * 1e3, (t2 - t0) * 1e3))
print("total s", time.perf_counter() - t_all)
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for s, t, host, tot in rows:
    k = "prompt" if t > s else "decode"
    agg[k][0] += 1; agg[k][1] += host; agg[k][2] += tot
print(dict(agg))
for r in rows[:40]: print("step seqs %d tokens %d launch %.1f ms synced %.1f ms" % r)
for r in rows[120:160:4]: print("step seqs %d tokens %d launch %.1f ms synced %.1f ms" % r)
# profile one mixed step like the offline ones: 256 decode + prompts
gb.submit_all(engine, prompts[:256], 64, "p1")
for _ in range(12): engine.step()
gb.submit_all(engine, prompts[256:300], 8, "p2")
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    engine.step(); torch.cuda.synchronize()
print(engine.last_step_shape())
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=60))
engine.run_until_idle()
