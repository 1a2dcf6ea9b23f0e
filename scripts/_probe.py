import sys; sys.path.insert(0, "tests/engine")
from conftest import LetterTokenizer, greedy, tokens_of
import torch, time, cProfile, pstats
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import random_config, random_tensors
cfg = random_config("tiny")
m = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
prompt = [5, 9, 13, 2, 7] * 4
for spec in (None, "ngram", None):
    e = Engine(m, LetterTokenizer(), EngineConfig(speculative=spec))
    t=time.time()
    out = tokens_of(e.submit(greedy("a", prompt, 40)))
    print(spec, time.time()-t)
e = Engine(m, LetterTokenizer(), EngineConfig(speculative="ngram"))
cProfile.run('tokens_of(e.submit(greedy("a", prompt, 40)))', '/tmp/prof')
pstats.Stats('/tmp/prof').sort_stats('cumtime').print_stats(18)
