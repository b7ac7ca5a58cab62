import pytest

from orthon.data.config import FilterConfig
from orthon.data.filters import FilterChain, heuristic_quality, load_scorer, resolve
from orthon.core.config import ConfigError, build

PROSE = ("The quick brown fox jumps over the lazy dog near the river bank.\n"
         "Afterwards it rested under a tall oak tree and watched the sunset.\n")
CODE = "def add(a, b):\n    total = a + b\n    return total\n"


def test_heuristic_quality_hand_checked():
    assert heuristic_quality(PROSE) == 1.0
    assert heuristic_quality(CODE) == 1.0
    assert heuristic_quality("Q: 37+45=? A: 82\nQ: 3*4=? A: 12\n") == 1.0
    assert heuristic_quality("") == 0.0
    # fails only "at least 5 words"
    assert heuristic_quality("two words") == pytest.approx(5 / 6)
    # the same line ten times: fails only "repeated lines"
    assert heuristic_quality("this line repeats itself again\n" * 10) == pytest.approx(5 / 6)
    # symbols and control characters: fails the symbol share and the control-character rules
    noisy = "a b c d e f " + "\x01#@!%^&*" * 20
    assert heuristic_quality(noisy) == pytest.approx(4 / 6)
    # one very long line of one long "word": fails word length and line length
    assert heuristic_quality("x" * 6000 + " a b c d") == pytest.approx(4 / 6)
    assert heuristic_quality("two words", min_words=2) == 1.0


def test_scorers_by_dotted_path():
    assert resolve("orthon.data.filters.heuristic_quality") is heuristic_quality
    assert resolve("orthon.data.filters:heuristic_quality") is heuristic_quality
    with_kwargs = load_scorer(FilterConfig("orthon.data.filters.heuristic_quality", 1.0, {"min_words": 2}))
    assert with_kwargs("two words") == 1.0
    cls = load_scorer(FilterConfig("test_data_support.LengthScorer", 1.0, {"min_len": 3}))
    assert cls("abcd") == 1.0 and cls("ab") == 0.0


def test_bad_scorer_paths_are_config_errors():
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        resolve("no_such_module.score")
    with pytest.raises(ConfigError, match="has no attribute nope"):
        resolve("orthon.data.filters.nope")
    with pytest.raises(ConfigError, match="dotted path"):
        resolve("justaname")
    with pytest.raises(ConfigError, match="not callable"):
        load_scorer(FilterConfig("orthon.data.filters:_WORD.pattern", 0.5))


def test_filter_chain_names_the_failed_filter():
    chain = FilterChain([FilterConfig("test_data_support.LengthScorer", 1.0, {"min_len": 20}),
                         FilterConfig("orthon.data.filters.heuristic_quality", 1.0)])
    assert chain.reject(PROSE) is None
    assert chain.reject("short") == "filtered:LengthScorer"
    assert chain.reject("this line repeats itself again\n" * 10) == "filtered:heuristic_quality"
    assert not FilterChain([])


def test_filter_config_from_yaml_mapping():
    cfg = build(FilterConfig, {"path": "orthon.data.filters.heuristic_quality", "min_score": "0.5",
                               "kwargs": {"min_words": 3}})
    assert cfg.min_score == 0.5 and cfg.kwargs == {"min_words": 3}
    with pytest.raises(ConfigError, match="min_score"):
        build(FilterConfig, {"path": "x.y"})
