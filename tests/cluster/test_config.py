"""AppConfig refuses configurations that could not serve, with the reason."""

import pytest
from pydantic import ValidationError

from specserve.cluster.config import AppConfig, DraftSpec


def test_defaults_are_the_reference_target_with_prompt_lookup():
    config = AppConfig()
    assert config.model_id == "smollm2-135m-instruct"
    assert config.draft_names == ["prompt-lookup"] and config.default_draft == "prompt-lookup"


@pytest.mark.parametrize("fields, message", [
    ({"default_draft": "ghost"}, "default_draft 'ghost' is not a configured draft"),
    ({"drafts": [{"name": "prompt-lookup"}, {"name": "prompt-lookup"}]}, "draft names must be unique"),
    ({"default_window": 17}, "less than or equal to 16"),
    ({"surprise": 1}, "Extra inputs are not permitted"),
    ({"gpu_memory_utilization": 0}, "greater than 0"),
    ({"gpu_memory_utilization": 1.5}, "less than or equal to 1"),
])
def test_bad_app_configs(fields, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(fields)


@pytest.mark.parametrize("fields, message", [
    ({"name": "none"}, "cannot be named 'none'"),
    ({"name": "auto"}, "cannot be named 'auto'"),
    ({"name": "prompt-lookup", "model": "x"}, "is the model-free draft"),
    ({"name": "Bad Name", "model": "x"}, "should match pattern"),
    ({"name": "s", "method": "suffix", "model": "x"}, "drafts without a model"),
    ({"name": "s", "seed_outputs": "answers"}, "set method: suffix"),
    ({"name": "s", "method": "suffix", "placement": "separate"}, "runs inside the target replica"),
    ({"name": "s", "method": "suffix", "seed_outputs": "/nowhere"}, "is not a folder"),
    ({"name": "s", "method": "ngram"}, "Input should be 'prompt-lookup' or 'suffix'"),
    ({"name": "s", "quantization": "int8"}, "a model-free draft has none"),
    ({"name": "s", "model": "x", "quantization": "int4"}, "Input should be 'int8'"),
])
def test_bad_draft_specs(fields, message):
    with pytest.raises(ValidationError, match=message):
        DraftSpec.model_validate(fields)


def test_the_shipped_answers_seed_a_suffix_draft_by_name():
    from specserve.training.answers import ANSWERS_DIR

    spec = DraftSpec(name="suffix", method="suffix", seed_outputs="answers")
    assert spec.seed_outputs == str(ANSWERS_DIR) and any(ANSWERS_DIR.glob("answers-*.npz"))


def test_the_edges_limits_reach_the_ingress():
    from specserve.cluster.config import AppConfig

    config = AppConfig(max_request_image_pixels=1000, max_image_aspect_ratio=4.0, body_timeout_s=7.5).ingress_config()
    assert (config.images.max_total_pixels, config.images.max_aspect_ratio, config.body_timeout_s) == (1000, 4.0, 7.5)


# ---- the Redis URL: from the config, else from the environment of the process that builds the app ----


def test_a_config_without_redis_url_takes_it_from_the_environment(monkeypatch):
    from specserve.cluster.config import REDIS_URL_ENV

    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@redis:6379/1")
    assert AppConfig.model_validate({}).redis_url == "redis://:pw@redis:6379/1"
    monkeypatch.setenv(REDIS_URL_ENV, "")   # set but empty: no Redis, as when unset
    assert AppConfig.model_validate({}).redis_url is None
    monkeypatch.delenv(REDIS_URL_ENV)
    assert AppConfig.model_validate({}).redis_url is None


@pytest.mark.parametrize("given", ["redis://other:6379/0", None], ids=["a-url", "none"])
def test_a_redis_url_in_the_config_wins_over_the_environment(monkeypatch, given):
    from specserve.cluster.config import REDIS_URL_ENV

    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@redis:6379/1")
    # An explicit null is a choice too: this application learns alone whatever the node says.
    assert AppConfig.model_validate({"redis_url": given}).redis_url == given


def test_a_redis_url_kubernetes_did_not_expand_is_refused_naming_the_variable(monkeypatch):
    from specserve.cluster.config import REDIS_URL_ENV

    # What a pod gets when the password variable is defined below the URL in its env list.
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:$(SPECSERVE_REDIS_PASSWORD)@specserve-redis:6379/1")
    with pytest.raises(ValidationError, match=f"unexpanded .* before {REDIS_URL_ENV}"):
        AppConfig.model_validate({})
