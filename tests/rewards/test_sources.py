"""Reward sources (function, model, HTTP), their registry, and score_rollout (lmppo.rewards)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from helpers_tokenizers import make_bpe_tokenizer
from lmppo.config import RewardConfig, RewardSourceConfig
from lmppo.errors import ConfigError, RewardError
from lmppo.rewards import (
    REWARD_SOURCES,
    FunctionSource,
    HttpSource,
    RewardSource,
    SourceContext,
    build_reward_sources,
    mask_url,
    register_reward_source,
    score_rollout,
)

T = 6


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def rollout(tok):
    """Two responses: " was great!" + EOS (4 tokens) and "Bad movie" truncated (3 tokens), padded to T."""
    texts = [" was great!", "Bad movie"]
    rows = [tok(texts[0])["input_ids"] + [tok.eos_token_id], tok(texts[1])["input_ids"]]
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([[j < len(r) for j in range(T)] for r in rows])
    return ["Prompt one:", "Prompt two:"], texts, ids, mask


def fn_source(fn, name="f", weight=1.0, span_placement="last"):
    return FunctionSource.from_callable(fn, name=name, weight=weight, span_placement=span_placement)


def score(sources, rollout, tok, on_bad_output="error", **kw):
    prompts, texts, ids, mask = rollout
    return score_rollout(sources, prompts, texts, ids, mask, tok, on_bad_output=on_bad_output, **kw)


# ----------------------------------------------------------------------------- score_rollout


def test_weighted_sum_of_sources_and_per_source_totals(rollout, tok):
    scalar = fn_source(lambda p, c: [1.0, -1.0], name="scalar", weight=2.0)
    spans = fn_source(lambda p, c: [[(5, 10, 3.0)], [(0, 9, 3.0)]], name="spans", weight=0.5, span_placement="spread")
    tokens = fn_source(lambda p, c: [[1, 1, 1, 1], [0, 2, 0]], name="tokens", weight=1.0)
    res = score([scalar, spans, tokens], rollout, tok)
    expected = torch.zeros(2, T)
    # scalars (x2) on the last real token: the EOS of row 0, " movie" of row 1 (truncated)
    expected[0, 3] += 2.0
    expected[1, 2] += -2.0
    # spans (x0.5): "great" is token 1 " great"; "Bad movie" is spread over "B", "ad", " movie"
    expected[0, 1] += 0.5 * 3.0
    expected[1, :3] += 0.5 * 1.0
    # per-token (x1)
    expected[0, :4] += 1.0
    expected[1, 1] += 2.0
    assert torch.allclose(res.token_scores, expected)
    assert res.valid.tolist() == [True, True] and res.num_invalid == 0
    assert torch.allclose(res.per_source["scalar"], torch.tensor([1.0, -1.0]))  # unweighted
    assert torch.allclose(res.per_source["spans"], torch.tensor([3.0, 3.0]))
    assert torch.allclose(res.per_source["tokens"], torch.tensor([4.0, 2.0]))


def test_sources_get_prompts_and_completions(rollout, tok):
    seen = {}

    def fn(prompts, completions):
        seen.update(prompts=prompts, completions=completions)
        return [0.0, 0.0]

    score([fn_source(fn)], rollout, tok)
    assert seen == {"prompts": ["Prompt one:", "Prompt two:"], "completions": [" was great!", "Bad movie"]}


def test_numpy_and_tensor_outputs(rollout, tok):
    import numpy as np

    res = score(
        [fn_source(lambda p, c: np.array([1.0, 2.0])), fn_source(lambda p, c: torch.tensor([1.0, 2.0]), name="g")],
        rollout,
        tok,
    )
    assert res.token_scores[0, 3].item() == 2.0 and res.token_scores[1, 2].item() == 4.0


def test_terminated_given_explicitly(rollout, tok):
    # "!" as a literal stop token: the response is " was" " great" "!" and its text excludes the "!"
    prompts, _, ids, mask = rollout
    ids, mask = ids.clone(), mask.clone()
    ids[0, 3], mask[0, 3] = tok.pad_token_id, False
    span = fn_source(lambda p, c: [[(0, 10, 1.0)], []], span_placement="spread")
    res = score_rollout(
        [span], prompts, [" was great", "Bad movie"], ids, mask, tok, terminated=torch.tensor([True, False])
    )
    assert res.token_scores[0].tolist() == [0.5, 0.5, 0, 0, 0, 0]  # on " was" and " great", not on "!"
    with pytest.raises(RewardError, match="sample 0: cannot map spans to tokens: the completion text"):
        score_rollout(
            [span], prompts, [" was great", "Bad movie"], ids, mask, tok, terminated=torch.tensor([False, False])
        )


BAD = [
    (lambda p, c: [1.0], r"source `bad`, the whole batch of 2: returned 1 outputs; expected a list of 2"),
    (lambda p, c: 3.0, r"source `bad`, the whole batch of 2: returned a float \(3.0\)"),
    (lambda p, c: [1.0, [1.0, 2.0]], r"source `bad`, sample 1: per-token scores have length 2, the response has 3"),
    (lambda p, c: [[(0, 12, 1.0)], 0.0], r"source `bad`, sample 0: span \[0\] \(0, 12, 1.0\) is outside the text"),
    (lambda p, c: [[(4, 2, 1.0)], 0.0], r"sample 0: span \[0\] \(4, 2, 1.0\) is outside the text"),
    (lambda p, c: [0.0, float("nan")], r"source `bad`, sample 1: the score is nan, not finite \(value nan\)"),
    (lambda p, c: [float("-inf"), 0.0], r"sample 0: the score is -inf, not finite"),
    (lambda p, c: ["good", 0.0], r"sample 0: got 'good' of type str; expected a number"),
    (lambda p, c: [None, 0.0], r"sample 0: got None of type NoneType"),
]


@pytest.mark.parametrize("fn,match", BAD)
def test_bad_output_raises_naming_source_sample_and_value(rollout, tok, fn, match):
    with pytest.raises(RewardError, match=match):
        score([fn_source(fn, name="bad")], rollout, tok)


def test_exception_inside_the_function_is_chained(rollout, tok):
    def boom(prompts, completions):
        raise KeyError("missing label")

    with pytest.raises(
        RewardError, match=r"source `boom`, the whole batch of 2: raised KeyError: 'missing label'"
    ) as info:
        score([fn_source(boom, name="boom")], rollout, tok)
    assert isinstance(info.value.__cause__, KeyError)


def test_drop_marks_samples_invalid_and_counts_them(rollout, tok):
    good = fn_source(lambda p, c: [1.0, 1.0], name="good")
    bad = fn_source(lambda p, c: [0.0, float("nan")], name="bad")
    res = score([good, bad], rollout, tok, on_bad_output="drop")
    assert res.valid.tolist() == [True, False] and res.num_invalid == 1
    assert res.token_scores[0, 3].item() == 1.0 and torch.all(res.token_scores[1] == 0)
    assert res.per_source["good"].tolist() == [1.0, 0.0]
    assert len(res.problems) == 1 and "sample 1" in res.problems[0]

    def boom(prompts, completions):
        raise RuntimeError("down")

    res = score([good, fn_source(boom, name="boom")], rollout, tok, on_bad_output="drop")
    assert res.num_invalid == 2 and torch.all(res.token_scores == 0)


# ----------------------------------------------------------------------------- function sources and the registry

MODULE_SRC = """
THRESHOLD = 3

def length_score(prompts, completions):
    return [float(len(c)) for c in completions]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "lmppo_test_rewards_mod.py").write_text(MODULE_SRC)
    (tmp_path / "lmppo_test_broken_dep.py").write_text("import lmppo_no_such_dependency_xyz\n")
    (tmp_path / "crash.py").write_text("raise RuntimeError('bad import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def src_cfg(path, **kw):
    return RewardSourceConfig(kind="function", path=path, **kw)


def test_function_from_module_and_from_file(reward_module):
    cfg = RewardConfig(
        sources=[
            src_cfg("lmppo_test_rewards_mod:length_score", weight=0.5),
            src_cfg(f"{reward_module}/lmppo_test_rewards_mod.py:length_score", name="len2"),
        ]
    )
    a, b = build_reward_sources(cfg)
    assert (a.name, a.weight, b.name) == ("length_score", 0.5, "len2")
    assert a(["p"], ["abc"]) == [3.0] and b(["p"], ["ab"]) == [2.0]


@pytest.mark.parametrize(
    "path,match",
    [
        ("lmppo_no_such_module_xyz:f", r"no module named `lmppo_no_such_module_xyz`"),
        ("lmppo_test_broken_dep:f", r"it needs module `lmppo_no_such_dependency_xyz`, which is not installed"),
        ("lmppo_test_rewards_mod:length_scor", r"has no attribute `length_scor` \(did you mean `length_score`\?\)"),
        ("lmppo_test_rewards_mod:THRESHOLD", r"`THRESHOLD` is a int, not callable"),
        ("missing_dir/file.py:f", r"no such file `missing_dir/file.py`"),
        ("no_colon", r"must look like `module:function`"),
    ],
)
def test_function_import_errors(reward_module, path, match):
    with pytest.raises(RewardError, match=match):
        build_reward_sources(RewardConfig(sources=[src_cfg(path)]))


def test_function_file_that_fails_to_import(reward_module):
    with pytest.raises(RewardError, match=r"loading `.*crash.py` failed with RuntimeError: bad import"):
        build_reward_sources(RewardConfig(sources=[src_cfg(f"{reward_module}/crash.py:f")]))


def test_api_callables_list_and_dict(reward_module):
    def brevity(prompts, completions):
        return [-len(c) for c in completions]

    cfg = RewardConfig(sources=[src_cfg("lmppo_test_rewards_mod:length_score")])
    sources = build_reward_sources(cfg, [brevity, lambda p, c: [0.0] * len(c)])
    assert [s.name for s in sources] == ["length_score", "brevity", "lambda"]
    # a dict key that is a config source's path binds the callable to that source (its weight and name)
    cfg = RewardConfig(sources=[src_cfg("my_fn", name="mine", weight=3.0)])
    sources = build_reward_sources(cfg, {"my_fn": brevity, "other": brevity})
    assert [(s.name, s.weight) for s in sources] == [("mine", 3.0), ("other", 1.0)]
    assert sources[0](["p"], ["abcd"]) == [-4]
    with pytest.raises(RewardError, match="not callable"):
        build_reward_sources(RewardConfig(sources=[]), {"x": 3})


def test_repeated_names_get_a_suffix(reward_module):
    cfg = RewardConfig(sources=[src_cfg("lmppo_test_rewards_mod:length_score")] * 3)
    assert [s.name for s in build_reward_sources(cfg)] == ["length_score", "length_score_2", "length_score_3"]


def test_registry_has_the_kinds_and_refuses_duplicates():
    assert {"function", "model", "http"} <= set(REWARD_SOURCES)
    with pytest.raises(ValueError, match="`function` is already registered"):
        register_reward_source("function")(FunctionSource)

    @register_reward_source("lmppo_test_constant")
    class Constant(RewardSource):
        def __call__(self, prompts, completions):
            return [float(self.cfg.path)] * len(completions)

    try:
        (src,) = build_reward_sources(
            RewardConfig(sources=[RewardSourceConfig(kind="lmppo_test_constant", path="2.5", name="c")])
        )
        assert src(["a"], ["b"]) == [2.5]
    finally:
        del REWARD_SOURCES["lmppo_test_constant"]
    with pytest.raises(ConfigError, match=r"kind` = 'functon': must be one of .* \(did you mean `function`\?\)"):
        RewardSourceConfig(kind="functon", path="a:b")  # the registry's kinds, refused as the config is built


def test_mask_url():
    assert mask_url("https://user:s3cret@example.org:8/x?a=1") == "https://***@example.org:8/x?a=1"
    assert mask_url("http://127.0.0.1:9/score") == "http://127.0.0.1:9/score"


def test_score_rollout_gives_token_sources_prompt_plus_response_ids(rollout, tok):
    seen = {}

    class IdReader(RewardSource):
        wants_token_ids = True

        def __call__(self, prompts, completions, token_ids=None):
            seen["ids"] = token_ids
            return [float(len(x)) for x in token_ids]

    reader = IdReader(RewardSourceConfig(kind="function", path="x:y", name="ids"), SourceContext())
    prompt_ids = [[11, 12], [13]]
    result = score([reader], rollout, tok, prompt_ids=prompt_ids)
    _, _, ids, mask = rollout
    assert seen["ids"][0] == [11, 12] + ids[0, :4].tolist()  # the stop token (EOS) included
    assert seen["ids"][0][-1] == tok.eos_token_id
    assert seen["ids"][1] == [13] + ids[1, :3].tolist()
    assert result.per_source["ids"].tolist() == [6.0, 4.0]
    with pytest.raises(ValueError, match="prompt_ids"):
        score([reader], rollout, tok)


# ----------------------------------------------------------------------------- HTTP sources


class Handler(BaseHTTPRequestHandler):
    calls: dict[str, int] = {}
    auth: list = []

    def log_message(self, *args):  # keep the test output quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.calls[self.path] = Handler.calls.get(self.path, 0) + 1
        Handler.auth.append(self.headers.get("Authorization"))
        n = len(body["completions"])
        if self.path == "/good":
            return self.reply(200, {"scores": [float(len(c)) for c in body["completions"]]})
        if self.path == "/list":
            return self.reply(200, [[[0, 3, 1.0]]] * n)  # one span per completion
        if self.path == "/error":
            return self.reply(500, "x" * 300)
        if self.path == "/flaky":
            return self.reply(503, "busy") if Handler.calls[self.path] == 1 else self.reply(200, [1.0] * n)
        if self.path == "/slow":
            time.sleep(1.0)
            return self.reply(200, [1.0] * n)
        if self.path == "/garbage":
            return self.reply(200, "<html>not json</html>")
        if self.path == "/shape":
            return self.reply(200, {"rewards": [1.0] * n})
        return self.reply(404, "no such endpoint")

    def reply(self, status, payload):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout test)
            pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(HttpSource, "backoff", 0.01)


def http_source(url, **kw):
    cfg = RewardConfig(sources=[RewardSourceConfig(kind="http", path=url, **kw)])
    return build_reward_sources(cfg)[0]


def test_http_good_answers(server, rollout, tok):
    src = http_source(server + "/good")
    assert src.name == "http_127.0.0.1"
    assert src(["p", "q"], ["abc", "de"]) == [3.0, 2.0]
    res = score([src], rollout, tok)
    assert res.token_scores[0, 3].item() == 11.0 and res.token_scores[1, 2].item() == 9.0
    spans = score([http_source(server + "/list", name="spans")], rollout, tok)  # a plain list of span lists
    assert spans.token_scores[0, 0].item() == 1.0 and spans.token_scores[1, 1].item() == 1.0


def test_http_500_names_status_and_body(server):
    with pytest.raises(RewardError, match=r"/error: answered HTTP 500: 'x{200}' \(after 2 attempts\)$"):
        http_source(server + "/error", retries=1)("p", "c")


def test_http_retries_then_succeeds(server):
    assert http_source(server + "/flaky", retries=2)(["p"], ["c"]) == [1.0]
    assert Handler.calls["/flaky"] == 2


def test_http_timeout(server):
    start = time.monotonic()
    with pytest.raises(
        RewardError, match=r"/slow: no complete answer within 0.2 s \(timeout: a total deadline per request\)$"
    ):
        http_source(server + "/slow", timeout=0.2, retries=0)(["p"], ["c"])
    assert time.monotonic() - start < 1.0


def test_http_garbage_and_wrong_shape(server, rollout, tok):
    with pytest.raises(RewardError, match=r"the answer is not JSON: '<html>not json</html>'"):
        http_source(server + "/garbage")(["p"], ["c"])
    with pytest.raises(RewardError, match=r"the answer has keys \['rewards'\]; expected \{\"scores\": \[...\]\}"):
        http_source(server + "/shape")(["p"], ["c"])
    with pytest.raises(RewardError, match=r"reward source `http_127.0.0.1`, the whole batch of 2: raised RewardError"):
        score([http_source(server + "/shape")], rollout, tok)
    with pytest.raises(RewardError, match=r"answered HTTP 404: 'no such endpoint'$"):
        http_source(server + "/nowhere", retries=3)(["p"], ["c"])  # 4xx: not retried


def test_http_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RewardError, match="connection refused"):
        http_source(f"http://127.0.0.1:{port}/x", retries=0)(["p"], ["c"])


def test_http_credentials_are_sent_but_never_shown(server):
    Handler.auth.clear()
    url = server.replace("http://", "http://alice:s3cret@") + "/error"
    with pytest.raises(RewardError) as info:
        http_source(url, retries=0)(["p"], ["c"])
    assert "s3cret" not in str(info.value) and "***@127.0.0.1" in str(info.value)
    assert Handler.auth[-1] == "Basic YWxpY2U6czNjcmV0"  # base64 of alice:s3cret
