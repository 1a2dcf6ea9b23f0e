"""Text: tokenizers (Hugging Face and GGUF vocabularies), chat templates, tool-call formats and
incremental detokenisation. Torch-free; the model layer loads a tokenizer from here, the engine
streams text through it and the front ends render prompts with it."""
