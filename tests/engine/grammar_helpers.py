"""A real byte-level BPE tokenizer small enough for the tiny random model (512 ids), and a suite
of JSON schemas for structured-output tests."""

from __future__ import annotations

from exlcli.text.tokenizer import Tokenizer, _HFBackend

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "score": -1.5e3}',
    '{"items": [{"id": 1, "qty": 2}, {"id": 22, "qty": null}], "status": "active"}',
    "The quick brown fox jumps over the lazy dog. 0123456789 ABC-1234 2026-12-01",
    '[1, 2, 3] {"a": {"b": {"c": false}}} "hello world" yes no maybe',
]

def closed(schema):
    """additionalProperties: false on every object (what OpenAI's strict mode asks of a schema):
    else a random model pads objects with extra keys, which JSON Schema allows."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 8},
                                    "address": {"type": "object",
                                                "properties": {"city": {"type": "string", "maxLength": 6}},
                                                "required": ["city"]}},
                     "required": ["name", "address"]},
        },
        "required": ["user"],
    },
    "array_bounds": {"type": "object",
                     "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "minItems": 2, "maxItems": 4}},
                     "required": ["xs"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"]},
    "pattern": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
                "required": ["sku"]},
    "number_range": {"type": "object",
                     "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 120},
                                    "x": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["n", "x"]},
    "any_of": {"type": "object",
               "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                              {"type": "boolean"}, {"type": "null"}]}},
               "required": ["v"]},
    "optional": {"type": "object",
                 "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                "c": {"enum": ["x", "y"]}},
                 "required": ["a"]},
    "array_of_objects": {"type": "array", "maxItems": 3,
                         "items": {"type": "object", "properties": {"k": {"enum": ["p", "q"]},
                                                                    "ok": {"type": "boolean"}},
                                   "required": ["k", "ok"]}},
}


SCHEMAS = {name: closed(schema) for name, schema in SCHEMAS.items()}


def small_bpe_tokenizer() -> Tokenizer:
    """Byte-level BPE with 400 ids (id 0 is <|endoftext|>, the EOS), trained on CORPUS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return Tokenizer(_HFBackend(tok), kind="test byte-level BPE", bos_token_id=None, eos_token_ids=[0], add_bos=False)
