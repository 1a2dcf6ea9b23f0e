"""`exlcli perplexity`: perplexity of a text, and the KL divergence of one model's predictions from a
saved reference run, computed as llama.cpp's `llama-perplexity` computes them (tools/perplexity/
perplexity.cpp, read at llama-cpp-python 0.3.36), so that the two tools' numbers can be compared.

The rules, as that source has them:

- The whole text is tokenized once, with the special tokens the model adds (a BOS first when the
  tokenizer adds one), and cut into ``n_chunks = min(--chunks, len(tokens) // n_ctx)`` chunks of
  n_ctx tokens; a remainder shorter than n_ctx is not used. Fewer than 2 * n_ctx tokens is an error.
- Each chunk is its own sequence (an empty cache, positions 0 .. n_ctx - 1). When the model adds a
  BOS, the chunk's first token is replaced by it (not inserted: the chunk stays n_ctx long).
- Only the second half is scored: with ``first = n_ctx // 2``, the logits at positions first ..
  n_ctx - 2 predict the tokens at first + 1 .. n_ctx - 1, so n_ctx - 1 - first tokens per chunk
  (255 at n_ctx 512); the first half gives context only.
- A token's NLL is -log_softmax(logits)[token] in fp32 (log-sum-exp in double in llama.cpp).
  PPL = exp(mean NLL), printed after each chunk over all tokens so far (`[1]12.3456,[2]...`).
- Its uncertainty: with m = mean NLL and v = mean NLL^2 - m^2 over the N scored tokens, the
  standard error of m is sqrt(v / (N - 1)), and the PPL's is PPL * that (d exp(m) = exp(m) dm).

The KL divergence statistics (stats.py) follow its `kl_divergence` the same way.
"""
