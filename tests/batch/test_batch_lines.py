"""Input lines -> jobs or bad lines, both shapes."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exlcli.batch.failures import line_error
from exlcli.batch.lines import (
    NATIVE,
    OPENAI,
    BadLine,
    Job,
    LineDefaults,
    count_lines,
    detect_shape,
    parse_line,
    read_jobs,
)
from exlcli.client.base import GenerationParams

DEFAULTS = LineDefaults(GenerationParams(max_tokens=32, temperature=0.5, stop=["END"]), system=None)


def parse(obj, line_no=7, defaults=DEFAULTS, file_shape=NATIVE):
    raw = obj if isinstance(obj, bytes) else (obj if isinstance(obj, str) else json.dumps(obj)).encode()
    return parse_line(raw, line_no, defaults, file_shape)


def test_native_prompt_line_takes_defaults_and_batch_priority():
    job = parse({"id": "a", "prompt": "hello"})
    assert isinstance(job, Job)
    assert (job.id, job.kind, job.shape, job.prompt) == ("a", "complete", NATIVE, "hello")
    assert (job.params.max_tokens, job.params.temperature, job.params.stop) == (32, 0.5, ["END"])
    assert (job.params.priority, job.params.client) == ("batch", "batch")
    job.params.stop.append("x")  # a job's params are its own, not the shared defaults
    assert DEFAULTS.params.stop == ["END"]


def test_native_line_fields_override_defaults():
    job = parse({"id": "a", "prompt": "p", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 4,
                 "min_p": 0.1, "seed": 3, "stop": "\n"})
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (5, 0.0, 0.9, 4, 0.1, 3, ["\n"])


def test_line_without_id_gets_line_number_and_int_id_becomes_string():
    assert parse({"prompt": "p"}, line_no=12).id == "line-12"
    assert parse({"id": 42, "prompt": "p"}).id == "42"


def test_messages_line_gets_system_from_line_or_default():
    job = parse({"id": "c", "messages": [{"role": "user", "content": "hi"}], "system": "be brief"})
    assert job.kind == "chat"
    assert job.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with_default = LineDefaults(GenerationParams(), system="default sys")
    job = parse({"messages": [{"role": "user", "content": "hi"}]}, defaults=with_default)
    assert job.messages[0] == {"role": "system", "content": "default sys"}
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert parse({"messages": own}, defaults=with_default).messages == own  # default does not stack


def test_content_parts_are_joined():
    job = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]})
    assert job.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("line, code, words", [
    ('{"id": "x", "prompt": ', "invalid_json", "not valid JSON"),
    (b'{"id": "x", "prompt": "\xff\xfe"}', "invalid_utf8", "UTF-8"),
    ('[1, 2]', "invalid_type", "must be a JSON object"),
    ({"id": "x"}, "missing_prompt", "neither prompt nor messages"),
    ({"id": "x", "prompt": "a", "messages": []}, "missing_prompt", "either prompt or messages"),
    ({"id": "x", "prompt": 5}, "invalid_type", "prompt must be a string"),
    ({"id": "x", "prompt": ""}, "invalid_value", "prompt is empty"),
    ({"id": "x", "messages": "hi"}, "invalid_type", "messages must be"),
    ({"id": "x", "messages": [{"role": "robot", "content": "hi"}]}, "invalid_type", "messages[0].role"),
    ({"id": "x", "messages": [{"role": "user"}]}, "missing_field", "no content"),
    ({"id": "x", "messages": [{"role": "user", "content": 3}]}, "invalid_type", "messages[0].content"),
    ({"id": "x", "prompt": "a", "max_tokens": "10"}, "invalid_type", "max_tokens must be a positive integer"),
    ({"id": "x", "prompt": "a", "max_tokens": 0}, "invalid_type", "max_tokens"),
    ({"id": "x", "prompt": "a", "temperature": "hot"}, "invalid_type", "temperature must be a finite number"),
    ({"id": "x", "prompt": "a", "temperature": True}, "invalid_type", "temperature"),
    ({"id": "x", "prompt": "a", "top_k": 1.5}, "invalid_type", "top_k must be an integer"),
    ({"id": "x", "prompt": "a", "seed": "s"}, "invalid_type", "seed"),
    ({"id": "x", "prompt": "a", "stop": [1]}, "invalid_type", "stop"),
    ({"id": "x", "prompt": "a", "top_p": 0}, "invalid_value", "top_p"),
    ({"id": "x", "prompt": "a", "temperature": -1}, "invalid_value", "temperature"),
    ({"id": "x", "prompt": "a", "system": "s"}, "invalid_value", "system applies to messages"),
    ({"id": "x", "messages": [{"role": "user", "content": "a"}], "system": 1}, "invalid_type", "system"),
])
def test_bad_native_lines_say_what_is_wrong(line, code, words):
    bad = parse(line, line_no=9)
    assert isinstance(bad, BadLine)
    assert bad.code == code
    assert words in bad.message
    assert bad.line_no == 9
    assert bad.id in ("x", "line-9")


def test_bad_id_type_is_an_error_with_line_id():
    bad = parse({"id": ["no"], "prompt": "a"}, line_no=3)
    assert isinstance(bad, BadLine) and bad.id == "line-3" and "id must be" in bad.message


def openai_line(url="/v1/chat/completions", **body):
    body.setdefault("messages" if "chat" in url else "prompt",
                    [{"role": "user", "content": "hi"}] if "chat" in url else "once upon")
    return {"custom_id": "r1", "method": "POST", "url": url, "body": body}


def test_openai_chat_and_completion_lines():
    job = parse(openai_line(max_completion_tokens=9, temperature=0, presence_penalty=0.5, model="gpt-x"))
    assert (job.id, job.shape, job.kind) == ("r1", OPENAI, "chat")
    assert (job.params.max_tokens, job.params.temperature, job.params.presence_penalty) == (9, 0.0, 0.5)
    job = parse(openai_line("/v1/completions", prompt=["one prompt"], stop=["\n"]))
    assert (job.kind, job.prompt, job.params.stop) == ("complete", "one prompt", ["\n"])


@pytest.mark.parametrize("line, code, words", [
    ({"custom_id": "r1", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}, "invalid_value", "POST"),
    ({"custom_id": "r1", "url": "/v1/embeddings", "body": {"input": "a"}}, "invalid_value", "url must be"),
    ({"custom_id": "r1", "url": "/v1/completions", "body": "a"}, "invalid_type", "body must be an object"),
    ({"custom_id": "r1", "url": "/v1/completions", "body": {}}, "missing_prompt", "no prompt"),
    ({"custom_id": "r1", "url": "/v1/chat/completions", "body": {}}, "missing_prompt", "no messages"),
    (openai_line(n=3), "unsupported", "n = 1"),
    (openai_line(tools=[{"type": "function"}]), "unsupported", "body.tools"),
    (openai_line("/v1/completions", prompt=["a", "b"]), "invalid_type", "prompt must be a string"),
    (openai_line(max_tokens=-2), "invalid_type", "max_tokens"),
])
def test_bad_openai_lines(line, code, words):
    bad = parse(line)
    assert isinstance(bad, BadLine) and bad.shape == OPENAI
    assert (bad.code, bad.id) == (code, "r1")
    assert words in bad.message


def test_read_jobs_streams_numbers_lines_skips_blanks_and_flags_duplicates(write_jsonl):
    path = write_jsonl([{"id": "a", "prompt": "1"}, "", {"prompt": "2"}, {"id": "a", "prompt": "3"},
                        {"id": "line-3", "prompt": "4"}, "not json"])
    items = list(read_jobs(path, DEFAULTS))
    # line 5 claims "line-3" as its own id, so line 3's automatic id steps aside (see the auto id tests)
    assert [(i.id, i.line_no) for i in items] == [("a", 1), ("line-3-auto", 3), ("a", 4), ("line-3", 5),
                                                  ("line-6", 6)]
    assert [getattr(i, "code", None) for i in items] == [None, None, "duplicate_id", None, "invalid_json"]
    assert "already used on line 1" in items[2].message
    assert count_lines(path) == 5


def test_shape_of_unparsable_lines_follows_the_file(write_jsonl):
    path = write_jsonl(["{broken", openai_line()])
    assert detect_shape(path) == OPENAI
    first = next(read_jobs(path, DEFAULTS))
    assert isinstance(first, BadLine) and first.shape == OPENAI


# ---- nothing in a line can stop the file ----

DEEP = b'{"id": "deep", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = [  # (raw line, code): every way we found a line could raise, each must become one error line
    (rb'{"id": "s", "prompt": "x \ud800 y"}', "invalid_unicode"),          # lone surrogate in the prompt
    (rb'{"id": "\udfff", "prompt": "x"}', "invalid_unicode"),              # ... in the id: it gets line-N
    (rb'{"id": "k", "prompt": "x", "meta\ud83d": 1}', "invalid_unicode"),  # ... in a key nobody reads
    (rb'{"id": "p", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
     "invalid_unicode"),
    (b'{"id": "bytes", "prompt": "\xc3\x28"}', "invalid_utf8"),
    (b'{"id": "n", "prompt": "x", "temperature": NaN}', "invalid_json"),
    (b'{"id": "i", "prompt": "x", "top_p": Infinity}', "invalid_json"),
    (b'{"id": "m", "prompt": "x", "meta": -Infinity}', "invalid_json"),
    (b'{"id": "f", "prompt": "x", "temperature": 1e400}', "invalid_json"),  # a float that overflows
    (b'{"id": "d", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),  # past int parsing
    (b'{"id": "b", "prompt": "x", "temperature": ' + b"9" * 400 + b"}", "invalid_type"),  # int too big for float
    (b'{"id": "b2", "prompt": "x", "seed": ' + b"9" * 30 + b"}", "invalid_type"),
    (b'{"id": "b3", "prompt": "x", "top_k": 18446744073709551616}', "invalid_type"),
    (b'{"id": 100000000000000000000000, "prompt": "x"}', "invalid_type"),
    (DEEP, "invalid_json"),
    (b'{"id": "nest", "prompt": ' + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}", "invalid_type"),
    (b'{"id": "obj", "messages": {"role": "user"}}', "invalid_type"),
    (b'{"id": "args", "messages": [{"role": "user", "content": {"text": "hi"}}]}', "invalid_type"),
    (b'"just a string"', "invalid_type"),
    (b"17", "invalid_type"),
    (b"null", "invalid_type"),
    (b"[]", "invalid_type"),
    (b"true", "invalid_type"),
    (b"{}", "missing_prompt"),
    (b'{"id": "ctl", "prompt": "tab\tinside"}', "invalid_json"),  # a raw control character in a string
    (b"\x00\x01", "invalid_json"),
]


@pytest.mark.parametrize("raw, code", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_no_line_can_raise_each_becomes_an_error_line_that_can_be_written(raw, code):
    from exlcli.batch.jsonl import dump_line
    from exlcli.batch.records import bad_line_record

    bad = parse(raw, line_no=4)
    assert isinstance(bad, BadLine), bad
    assert (bad.code, bad.line_no) == (code, 4), bad
    assert 0 < len(bad.message) <= 200
    record = json.loads(dump_line(bad_line_record(bad)))  # strict JSON, valid UTF-8: always writable
    assert record["line"] == 4 and record["error"]["code"] == code
    if b"\\ud" in raw[:20] or not raw.startswith(b'{"id": "'):
        assert bad.id == "line-4"  # an id that can't be written, or none: the automatic one


def test_a_surrogate_pair_is_fine_only_a_lone_half_is_not():
    job = parse(rb'{"id": "emoji", "prompt": "x \ud83d\ude00"}')
    assert isinstance(job, Job) and job.prompt == "x \U0001F600"


def test_utf8_bom_on_the_first_line_is_ignored(write_jsonl, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    assert [type(i).__name__ for i in read_jobs(path, DEFAULTS)] == ["Job", "Job"]


TEXTS = st.text(st.characters(exclude_categories=()), max_size=8) | st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "line-3", "", "\U0001F600"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=80), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXTS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["id", "prompt", "messages", "role", "content", "max_tokens", "temperature", "stop",
                         "seed", "custom_id", "url", "body", "system", "top_k"]) | st.text(max_size=4),
        inner, max_size=5),
    max_leaves=12)))
def test_property_any_line_is_a_job_or_a_writable_error_line(value):
    from exlcli.batch.jsonl import dump_line
    from exlcli.batch.records import bad_line_record

    raw = value if isinstance(value, bytes) else json.dumps(value).encode()  # json.dumps writes NaN, \ud800
    item = parse_line(raw, 3, DEFAULTS, NATIVE)
    assert isinstance(item, (Job, BadLine))
    if isinstance(item, BadLine):
        dump_line(bad_line_record(item))
    else:
        dump_line({"id": item.id, "prompt": item.prompt, "messages": item.messages})


# ---- automatic ids never collide with a user's ----

def test_auto_id_steps_aside_for_a_user_id_claimed_before_or_after_it(write_jsonl):
    path = write_jsonl([{"id": "line-2", "prompt": "user claims line 2's name, before it"},
                        {"prompt": "no id"},
                        {"prompt": "no id either"},
                        {"id": "line-3", "prompt": "user claims line 3's name, after it"},
                        {"id": "line-3-auto", "prompt": "and the first fallback too"},
                        {"id": "line-6", "prompt": "a user id equal to its own line's auto id"}])
    items = list(read_jobs(path, DEFAULTS))
    assert [i.id for i in items] == ["line-2", "line-2-auto", "line-3-auto2", "line-3", "line-3-auto", "line-6"]
    assert all(isinstance(i, Job) for i in items)  # nobody is a duplicate of anybody


def test_a_claim_spelled_with_json_escapes_is_still_seen(write_jsonl):
    path = write_jsonl(['{"id": "\\u006cine-1", "prompt": "escaped"}', {"prompt": "no id"}])
    assert [i.id for i in read_jobs(path, DEFAULTS)] == ["line-1", "line-2"]
    path = write_jsonl([{"prompt": "no id"}, '{"id": "\\u006cine-1", "prompt": "escaped"}'])
    assert [i.id for i in read_jobs(path, DEFAULTS)] == ["line-1-auto", "line-1"]


def test_scan_counts_lines_finds_the_shape_and_the_claims(write_jsonl):
    from exlcli.batch.lines import auto_id, scan_input

    path = write_jsonl(["{broken", "", openai_line(), {"custom_id": "line-9", "url": "/v1/completions",
                                                        "body": {"prompt": "x"}}, {"id": "lineup", "prompt": "x"}])
    scan = scan_input(path)
    assert (scan.num_lines, scan.shape, scan.claimed) == (4, OPENAI, frozenset({"line-9"}))
    assert auto_id(9, scan.claimed) == "line-9-auto" and auto_id(8, scan.claimed) == "line-8"


def test_speculative_false_on_a_line_turns_drafting_off_for_it():
    assert parse({"id": "a", "prompt": "p"}).params.speculative is None
    assert parse({"id": "a", "prompt": "p", "speculative": False}).params.speculative is False
    assert parse(openai_line(speculative=True)).params.speculative is True
    bad = parse({"id": "a", "prompt": "p", "speculative": "no"})
    assert isinstance(bad, BadLine) and bad.code == "invalid_type"
    assert "speculative must be true or false" in bad.message


def test_context_overflow_keys_on_both_shapes():
    job = parse({"id": "a", "prompt": "p", "context_overflow": "sinks", "sink_tokens": 0, "window": 128})
    assert (job.params.context_overflow, job.params.sink_tokens, job.params.window) == ("sinks", 0, 128)
    body = {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "p", "context_overflow": "shift"}}
    assert parse(body, file_shape=OPENAI).params.context_overflow == "shift"
    for bad in ({"context_overflow": "wrap"}, {"sink_tokens": -2}, {"window": "big"}):
        line = parse({"id": "c", "prompt": "p", **bad})
        assert isinstance(line, BadLine) and next(iter(bad)) in line.message


@pytest.mark.parametrize("text, message", [
    ('{"id": "x", "prompt": "abc', "line is not valid JSON (Unterminated string starting at column 23)"),
    ('{"a": "b\x01"}', "line is not valid JSON (Invalid control character at column 9)"),
    ('{"a": }', "line is not valid JSON (Expecting value at column 7)"),
])
def test_a_json_error_names_its_column_in_plain_words(text, message):
    with pytest.raises(json.JSONDecodeError) as decode:
        json.loads(text)
    assert line_error(decode.value, "invalid_line").message == message  # no "starting at at column"
