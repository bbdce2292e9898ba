"""--token_ids and --tokenizer: the ids and logprobs each server sends land in the rows exactly,
against loopback servers shaped like vLLM (streamed and not), SGLang and llama.cpp's llama-server
(tests/support/token_servers.py); an endpoint without ids is refused before any prompt; a reply
with bad ids fails its prompt; the journal and the cache keep ids; a local tokenizer retokenizes."""
from __future__ import annotations

import json

import pytest

from tests.conftest import read_jsonl, write_jsonl
from tests.support import token_servers
from tests.support.token_servers import BOS, completion_ids, logprobs, prompt_ids
from trajgen import token_ids, tokenizer
from trajgen.errors import MalformedResponse, UsageError

CALL = {"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "echo hi"}'}}
TWO_TURNS = [{"content": "", "tool_calls": [CALL], "reasoning_content": "a tool"},
             {"content": "done", "reasoning_content": "it said hi"}]
# the scripted servers render the tool call's turn in the next prompt otherwise than it was generated:
# the conversation is two training samples (trajgen/samples.py)
TWO_SAMPLES = {"samples": [{"first_turn": 0, "last_turn": 0}, {"first_turn": 1, "last_turn": 1}],
               "breaks": [{"turn": 1, "cause": "call_rerendered"}]}
TWO_SAMPLES_COUNTED = {"samples": {"rows": 1, "total": 2, "mean_per_row": 2.0, "max_per_row": 2},
                       "breaks": {"reasoning_dropped": 0, "call_rerendered": 1, "context_changed": 0, "compacted": 0}}


@pytest.fixture
def token_server():
    started = []

    def start(kind: str, replies: list[dict] = TWO_TURNS) -> token_servers.TokenServer:
        started.append(token_servers.start(kind, replies))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _run(inline, server, *extra: str, prompts=("say hi",), **flags):
    write_jsonl(inline.cwd / "prompts.jsonl", [{"prompt": p} for p in prompts])
    return inline.run(*inline.args(server, num_workers=1, command_timeout=60, **flags), *extra)


def _calls(server, prompt: str = "say hi") -> list[dict]:
    """The chat requests of a prompt's conversation, in order (not the probe's `ping`)."""
    return [b for b in server.requests if b["messages"][-1]["content"] != "ping"
            and any(m["role"] == "user" and m["content"] == prompt for m in b["messages"])]


def _gpt_tokens(row: dict) -> list[dict]:
    return [t["tokens"] for t in row["conversations"] if t["from"] == "gpt"]


@pytest.mark.parametrize("kind,stream", [("vllm", True), ("vllm", False), ("sglang", True), ("llama.cpp", True),
                                         ("llama.cpp", False)])
def test_each_turn_keeps_exactly_the_ids_and_logprobs_its_server_sent(inline, token_server, kind, stream):
    server = token_server(kind)
    done = _run(inline, server, "--token_ids", stream=stream)
    assert done.returncode == 0, done.stderr
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    calls = _calls(server)
    assert len(calls) == 2 == len(_gpt_tokens(row))
    for sent, reply, tokens in zip(calls, TWO_TURNS, _gpt_tokens(row)):
        prompt = [BOS, *prompt_ids(sent)] if kind == "llama.cpp" else prompt_ids(sent)  # llama.cpp: from /tokenize
        completion = completion_ids({"role": "assistant", **reply})
        assert tokens == {"prompt_ids": prompt, "prompt_source": "server", "completion_ids": completion,
                          "completion_source": "logprob_ids" if kind == "llama.cpp" else "server",
                          "completion_logprobs": logprobs(len(completion)),
                          "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop",
                          "sampling": {"temperature": None, "top_p": None, "max_tokens": None}}
    version = token_servers.BUILD_INFO if kind == "llama.cpp" else token_servers.VERSIONS[kind]
    assert row["metadata"]["token_ids"] == {"server": {"kind": kind, "version": version}, "tokenizer": None,
                                            "logprob_mode": "server", "drift_turns": 0, **TWO_SAMPLES}
    assert all(c.get("stream", False) is (stream and kind != "sglang") for c in calls)
    said = [line for line in done.stderr.splitlines() if "--token_ids" in line]
    assert len(said) == 1 and kind in said[0] and (("unstreamed" in said[0]) is (kind == "sglang"))
    statistics = json.loads((inline.run_dir() / "statistics.json").read_text())
    assert statistics["token_ids"] == {"rows_with_ids": 1, "drift_turns": 0, **TWO_SAMPLES_COUNTED}


def test_an_endpoint_without_ids_is_refused_before_any_prompt_naming_the_way_out(inline, token_server):
    server = token_server("openai")
    done = _run(inline, server, "--token_ids")
    assert done.returncode == 2
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "no token ids" in said[0] and "--tokenizer=" in said[0]
    assert not _calls(server) and [b["messages"][-1]["content"] for b in server.requests] == ["ping"]


def test_without_the_flag_nothing_is_asked_and_the_rows_carry_no_ids(inline, token_server):
    server = token_server("vllm")
    assert _run(inline, server).returncode == 0
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert "token_ids" not in row["metadata"] and not any("tokens" in t for t in row["conversations"])
    assert not any(key in body for body in server.requests for key in ("return_token_ids", "logprobs"))
    assert "token_ids" not in json.loads((inline.run_dir() / "statistics.json").read_text())


def test_a_run_from_before_the_flags_resumes_without_them(inline, token_server):
    server = token_server("vllm")
    assert _run(inline, server, prompts=("say hi", "again")).returncode == 0
    manifest_path = inline.run_dir() / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("token_ids") is False and manifest.pop("tokenizer") is None
    manifest_path.write_text(json.dumps(manifest))
    done = _run(inline, server, prompts=("say hi", "again"), resume=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("fault", ["short_logprobs", "no_ids"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_reply_with_bad_ids_fails_its_prompt_and_is_never_written(inline, token_server, fault, stream):
    server = token_server("vllm", [TWO_TURNS[0], {**TWO_TURNS[1], "fault": fault}])
    assert _run(inline, server, "--token_ids", stream=stream).returncode == 1  # a prompt failed
    assert read_jsonl(inline.run_dir() / "trajectories.jsonl") == []
    failure = read_jsonl(inline.run_dir() / "failures.jsonl")[0]
    assert failure["error_class"] == "MalformedResponse", failure
    assert ("logprobs" if fault == "short_logprobs" else "missing") in failure["message"]


def test_the_cache_serves_ids_again_but_never_a_reply_without_them(inline, token_server, tmp_path):
    server = token_server("vllm")
    cache = str(tmp_path / "cache")
    assert _run(inline, server, run_name="plain", cache_dir=cache).returncode == 0  # cached without ids
    assert _run(inline, server, "--token_ids", run_name="first", cache_dir=cache).returncode == 0
    assert len(_calls(server)) == 4  # asked again: the cached replies have no ids
    first = read_jsonl(inline.run_dir("first") / "trajectories.jsonl")[0]
    assert _run(inline, server, "--token_ids", run_name="again", cache_dir=cache).returncode == 0
    assert len(_calls(server)) == 4  # no call: the cached replies have their ids
    again = read_jsonl(inline.run_dir("again") / "trajectories.jsonl")[0]
    assert _gpt_tokens(again) == _gpt_tokens(first) and len(_gpt_tokens(again)) == 2


def test_a_resumed_prompt_replays_its_journaled_reply_with_its_ids(inline, token_server):
    server = token_server("vllm", [TWO_TURNS[0], {**TWO_TURNS[1], "fault": "no_ids"}])
    assert _run(inline, server, "--token_ids").returncode == 1  # the second reply had no ids: the prompt failed
    server.replies = TWO_TURNS
    assert _run(inline, server, "--token_ids", resume=True).returncode == 0
    calls = _calls(server)
    assert len(calls) == 3  # the first reply was not asked again: the journal gave it back, ids and all
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    assert [t["prompt_ids"] for t in _gpt_tokens(row)] == [prompt_ids(calls[0]), prompt_ids(calls[2])]
    assert _gpt_tokens(row)[0]["completion_logprobs"] == logprobs(len(_gpt_tokens(row)[0]["completion_ids"]))


def test_checked_refuses_what_is_not_ids():
    found = {"prompt_ids": [1, 2], "prompt_where": "vllm", "completion_ids": [3], "logprobs": [-0.5],
             "logprob_ids": [None]}
    assert token_ids.checked(found, {})["completion_ids"] == [3]
    for bad in ({"prompt_ids": None}, {"completion_ids": [3, "x"]}, {"prompt_ids": [-1]}, {"logprobs": ["a"]},
                {"completion_ids": None, "logprob_ids": []}):
        with pytest.raises(MalformedResponse):
            token_ids.checked({**found, **bad}, {})


# --tokenizer: a character-level tokenizer (each character's id is its code point, as the servers
# above count) with a chat template, built under tmp_path: nothing is downloaded.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def char_tokenizer(tmp_path) -> str:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(2, 0x250)} | {"<unk>": 1}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")
    wrapped.chat_template = TEMPLATE
    path = tmp_path / "char-tokenizer"
    wrapped.save_pretrained(path)
    return str(path)


def test_the_tokenizer_api_renders_requests_with_its_chat_template(char_tokenizer):
    tok = tokenizer.load(char_tokenizer)
    assert tok.name == char_tokenizer and tok.chat_template_sha256 and tok.revision is None
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render(tok, messages, None) == [ord(c) for c in "<|user|>hi<|assistant|>"]
    assert tokenizer.count(tok, "hello") == 5
    assert tokenizer.completion(tok, messages, None, {"role": "assistant", "content": "ok"}) == [ord("o"), ord("k")]


def test_a_tokenizer_that_cannot_load_stops_the_run_before_any_request(inline, token_server, tmp_path):
    server = token_server("vllm")
    done = _run(inline, server, tokenizer=str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "--tokenizer=" in done.stderr and "cannot be loaded" in done.stderr
    assert server.requests == []


def test_a_tokenizer_without_a_chat_template_is_refused_for_a_run_and_only_counts(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from trajgen import options

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(tmp_path / "bare")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(UsageError, match="no chat template"):
        options.check(options.RunOptions(dataset_file=str(tmp_path / "prompts.jsonl"), run_name="r",
                                         tokenizer=str(tmp_path / "bare")))
    bare = tokenizer.load(str(tmp_path / "bare"))
    assert tokenizer.counts(bare, ["a b", ""]) == [1, 0]  # --compress counts with it
    with pytest.raises(UsageError, match="no chat template"):
        tokenizer.render(bare, [{"role": "user", "content": "hi"}], None)


def test_an_endpoint_without_ids_gets_retokenized_ids_and_no_logprobs(inline, token_server, char_tokenizer):
    server = token_server("openai")
    assert _run(inline, server, tokenizer=char_tokenizer).returncode == 0
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    tok = tokenizer.load(char_tokenizer)
    for sent, tokens in zip(_calls(server), _gpt_tokens(row)):
        assert tokens["prompt_ids"] == tokenizer.render(tok, sent["messages"], sent.get("tools"))
        assert (tokens["prompt_source"], tokens["completion_source"]) == ("retokenized", "retokenized")
        assert tokens["completion_logprobs"] is None and "retokenized" not in tokens
    assert row["metadata"]["token_ids"]["server"] == {"kind": "none", "version": None}
    assert row["metadata"]["token_ids"]["tokenizer"] == tok.as_row()
    assert row["metadata"]["token_ids"]["logprob_mode"] == "none"


def test_with_server_ids_and_a_tokenizer_both_are_kept_and_the_drift_counted(inline, token_server, char_tokenizer):
    server = token_server("vllm")
    plain = token_server("vllm", [{"content": "fine", "reasoning_content": "easy"}])
    assert _run(inline, server, "--token_ids", tokenizer=char_tokenizer).returncode == 0
    assert _run(inline, plain, "--token_ids", run_name="plain", tokenizer=char_tokenizer).returncode == 0
    row = read_jsonl(inline.run_dir() / "trajectories.jsonl")[0]
    tok = tokenizer.load(char_tokenizer)
    first = _gpt_tokens(row)[0]
    assert first["prompt_source"] == "server" and first["retokenized"]["prompt_ids"] == tokenizer.render(
        tok, _calls(server)[0]["messages"], _calls(server)[0].get("tools"))
    # the template renders the tool call's turn otherwise than the server: both turns drift (its
    # completion, then the next prompt that holds it); a plain answer's prompt does not
    assert row["metadata"]["token_ids"]["drift_turns"] == 2
    assert json.loads((inline.run_dir() / "statistics.json").read_text())["token_ids"] == {
        "rows_with_ids": 1, "drift_turns": 2, **TWO_SAMPLES_COUNTED}
    plain_row = read_jsonl(inline.run_dir("plain") / "trajectories.jsonl")[0]
    only = _gpt_tokens(plain_row)[0]
    assert only["retokenized"]["prompt_ids"] == only["prompt_ids"]
