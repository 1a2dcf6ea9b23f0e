"""A second chat turn's time to first token on a sliding-window (Gemma 3) model, exlcli serve beside
llama-server on the same GGUF file and the same conversation.

Turn 1 sends a long conversation (--tokens, 16k by default) through /v1/chat/completions; turn 2 sends the
same messages, turn 1's answer and a short new user message. Both stream at temperature 0, and each turn's
time to first token is measured from the request's send to the first streamed token. An engine that keeps the
window layers' pages for a cached prefix computes only turn 2's new tokens; one that drops its prompt cache
on a sliding-window model computes the whole conversation again.

    python3 scripts/second_turn_ttft.py --llama-bin DIR --model OUT.gguf [--tokens 16384] [--threads 2]

DIR holds llama.cpp's llama-server (build it as scripts/cpu_vs_llamacpp.sh says, target llama-server).
If OUT.gguf does not exist it is made first: a random-weight Gemma3ForCausalLM (text only; Gemma 3 270M's
widths: hidden 640, MLP 2048, 4 heads of 256, 1 KV head, window 512; every sixth layer global, 32k context;
--layers, default 6) saved by transformers and converted by
llama.cpp's own convert_hf_to_gguf.py (--convert, with its gguf-py on PYTHONPATH) at f16. Its tokenizer and
chat template are those of the default model's GGUF (SmolLM2's byte-level BPE and ChatML), rebuilt as a
tokenizer.json, since the converter needs one and neither engine downloads anything here.

llama-server runs with -np 1 and its defaults (prompt cache on, its context checkpoints), then again with
--swa-full (a full-size cache for the window layers, which lets it reuse a prefix at the cost of memory).
With --edit-back N, turn 2 also halves an earlier user message about N characters before the end, as an agent
that trims an old tool output does: the two prompts then part there, further back than a window.
The rows print as a Markdown table; --json writes every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WINDOW = 512
WORDS = ("the of and to in is was for that with as on by at from this be are which or an it not have has "
         "river station library morning garden letter window market bridge engine harbor village forest "
         "winter summer teacher doctor painter farmer sailor captain student writer number answer "
         "question reason history science music travel weather kitchen journey signal pattern record "
         "carried opened measured wrote found built moved turned asked showed kept began spoke heard "
         "quickly slowly quietly early later often always never almost nearly together alone").split()


# ---------------------------------------------------------------------------------------------- the model

def tokenizer_folder_files(folder: Path) -> tuple[int, int, int]:
    """tokenizer.json and tokenizer_config.json from the default model's GGUF vocabulary; (vocabulary size,
    BOS id, EOS id)."""
    from exlcli.hub.default_model import resolve_model_path
    from exlcli.model.gguf_meta import metadata_from_reader, open_gguf
    from exlcli.text.gguf_vocab import build_byte_level_bpe

    meta = metadata_from_reader(open_gguf(str(resolve_model_path(None))))
    tok = build_byte_level_bpe(meta)
    tok.save(str(folder / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": meta["tokenizer.chat_template"],
              "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
              "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
              "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
              "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
              "add_bos_token": False, "model_max_length": 32768}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return len(tokens), meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]


def make_model(out: Path, convert: Path, layers: int, hidden: int, intermediate: int) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        vocab, bos, eos = tokenizer_folder_files(folder)
        config = Gemma3TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            max_position_embeddings=32768, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config).to(torch.float16)
        model.save_pretrained(folder)
        env = dict(os.environ, PYTHONPATH=str(convert.parent / "gguf-py"))
        subprocess.run([sys.executable, str(convert), str(folder), "--outtype", "f16", "--outfile", str(out),
                        "--model-name", "gemma3-shape"],
                       check=True, env=env)


# ---------------------------------------------------------------------------------------- the conversation

def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
    return " ".join(words).capitalize() + "."


def conversation(tokens: int, count) -> list[dict]:
    """System, then user/assistant pairs of plain sentences until the rendered prompt holds about
    `tokens` tokens (count(messages) gives the rendered prompt's length), ending on a user message."""
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are a careful assistant. " + sentence(rng)}]
    while True:
        messages.append({"role": "user", "content": " ".join(sentence(rng) for _ in range(rng.randint(4, 10)))})
        if count(messages) >= tokens:
            return messages
        messages.append({"role": "assistant", "content": " ".join(sentence(rng) for _ in range(rng.randint(6, 14)))})


def conversation_for(model: Path, tokens: int) -> list[dict]:
    """The conversation of about `tokens` tokens as the model's own chat template and tokenizer count them."""
    from exlcli.model.loader import load_model

    loaded = load_model(str(model), device="cpu")

    def count(messages: list[dict]) -> int:
        return len(loaded.chat_template.encode(loaded.tokenizer, messages))

    messages = conversation(tokens, count)
    print(f"# conversation: {len(messages)} messages, {count(messages)} tokens as exlcli renders it",
          file=sys.stderr, flush=True)
    return messages


# ------------------------------------------------------------------------------------------------ serving

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit: float = 600.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"server exited ({proc.returncode}); its log: {log}\n" + log.read_text()[-2000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"server not ready after {limit:.0f} s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: time to first token, the answer, the usage and llama-server's timings."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    text, usage, timings, finish = [], None, None, None
    try:
        r = urllib.request.urlopen(req, timeout=1800)
    except urllib.error.HTTPError as e:
        sys.exit(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}")
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                sys.exit(f"error from {url}: {chunk['error']}")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
                finish = choice.get("finish_reason") or finish
    total = time.perf_counter() - start
    return {"ttft_s": first if first is not None else total, "total_s": total, "answer": "".join(text),
            "finish_reason": finish, "usage": usage, "timings": timings, "first_token_streamed": first is not None}


def two_turns(url: str, messages: list[dict], max_tokens: int, follow_up: str, edit_back: int) -> list[dict]:
    one = chat(url, messages, max_tokens)
    history = [dict(m) for m in messages]
    if edit_back:  # shorten the user message that starts about edit_back characters before the end
        chars = 0
        for m in reversed(history):
            chars += len(m["content"])
            if m["role"] == "user" and chars >= edit_back:
                m["content"] = m["content"][:len(m["content"]) // 2] + " [trimmed]"
                break
    second = history + [{"role": "assistant", "content": one["answer"]}, {"role": "user", "content": follow_up}]
    two = chat(url, second, max_tokens)
    return [one, two]


def run_server(name: str, cmd: list[str], port: int, messages, a, logdir: Path) -> dict:
    log = logdir / f"{name.replace(' ', '_')}.log"
    print(f"# {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        turns = two_turns(url, messages, a.max_tokens, a.follow_up, a.edit_back)
    finally:
        stop(proc)
    for i, t in enumerate(turns, 1):
        print(f"#   turn {i}: ttft {t['ttft_s']:.2f} s, usage {t['usage']}, timings {t['timings']}",
              file=sys.stderr, flush=True)
    return {"engine": name, "command": cmd, "turns": turns}


def turn_two_counts(result: dict) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, cached, computed) of turn 2 as the server reports them."""
    t = result["turns"][1]
    usage, timings = t["usage"] or {}, t["timings"]
    if timings:  # llama-server: prompt_n computed, cache_n taken from the cache
        return timings.get("prompt_n", 0) + timings.get("cache_n", 0), timings.get("cache_n"), timings.get("prompt_n")
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return prompt, cached, None if prompt is None or cached is None else prompt - cached


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["engine"] == "exlcli"), results[0])["turns"][1]["ttft_s"]
    rows = ["| engine | turn 1 TTFT s | turn 2 TTFT s | turn 2 prompt tokens | cached | computed | "
            "turn 2 TTFT / exlcli's |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        t1, t2 = r["turns"][0]["ttft_s"], r["turns"][1]["ttft_s"]
        prompt, cached, computed = turn_two_counts(r)
        rows.append(f"| {r['engine']} | {t1:.2f} | {t2:.2f} | {prompt} | {cached} | {computed} | {t2 / base:.1f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", required=True, help="folder with llama-server")
    ap.add_argument("--model", required=True, help="the GGUF file (made first if missing)")
    ap.add_argument("--convert", default="../shared/peers/llama.cpp/convert_hf_to_gguf.py",
                    help="llama.cpp's convert_hf_to_gguf.py (its gguf-py beside it), to make --model")
    ap.add_argument("--layers", type=int, default=6, help="layers of a model made here (every sixth global)")
    ap.add_argument("--hidden", type=int, default=640, help="hidden size of a model made here")
    ap.add_argument("--intermediate", type=int, default=2048, help="MLP size of a model made here")
    ap.add_argument("--tokens", type=int, default=16384, help="turn 1's prompt length (about)")
    ap.add_argument("--ctx", type=int, default=32768, help="context of both servers (-c)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--follow-up", default="Thank you. Now say it again in one short sentence, please.")
    ap.add_argument("--engines", default="exlcli,llama-server,llama-server --swa-full")
    ap.add_argument("--edit-back", type=int, default=0,
                    help="turn 2 also halves the user message that starts about this many characters before the end "
                         "(as an agent trims an old tool output), so the prompts part there (0: turn 2 extends turn 1)")
    ap.add_argument("--exlcli-args", default="", help="more flags for exlcli serve, e.g. '--dtype float32'")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()

    model = Path(a.model)
    if not model.exists():
        make_model(model, Path(a.convert), a.layers, a.hidden, a.intermediate)

    messages = conversation_for(model, a.tokens)

    server = shutil.which("llama-server", path=a.llama_bin) or os.path.join(a.llama_bin, "llama-server")
    logdir = Path(tempfile.mkdtemp(prefix="second_turn_"))
    results = []
    for name in [e.strip() for e in a.engines.split(",")]:
        port = free_port()
        if name == "exlcli":
            cmd = [sys.executable, "-m", "exlcli", "serve", str(model), "--port", str(port), "-c", str(a.ctx),
                   "-t", str(a.threads), "--device", "cpu", "--no-display", *a.exlcli_args.split()]
        else:
            cmd = [server, "-m", str(model), "--port", str(port), "-c", str(a.ctx), "-t", str(a.threads),
                   "-np", "1", *name.split()[1:]]
        results.append(run_server(name, cmd, port, messages, a, logdir))
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
