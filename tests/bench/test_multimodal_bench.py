"""The multimodal benchmark's verdict: the ensemble against the best single view, per category."""

import pytest
from specserve.bench.multimodal import ROWS, MultimodalBenchConfig, aims, format_table


def rows(ensemble: dict[str, float]) -> list[dict]:
    views = {"multimodal": 10.0, "text-only": 12.0, "pooled": 11.0, "caption": 11.5, "ensemble-static": 9.0,
             "target-only": 15.0}
    return [{"view": v, "category": c, "tokens_per_s": ensemble[c] if v == "ensemble" else views[v],
             "mean_accepted_len": 1.0} for v in ROWS for c in ensemble]


def test_the_aim_is_every_category_at_097_of_the_best_view_and_the_mix_above_it():
    met = aims(rows({"bars": 11.7, "dots": 12.5, "mix": 12.2}))
    assert met["ensemble_over_best_view"] == {"bars": 0.975, "dots": 1.042, "mix": 1.017} and met["met"]
    assert not aims(rows({"bars": 11.0, "dots": 13.0, "mix": 12.5}))["met"]   # bars 0.917
    assert not aims(rows({"bars": 12.0, "dots": 12.0, "mix": 12.0}))["met"]   # the mix only equals it


def test_a_run_of_two_views_is_judged_against_those_two():
    from specserve.bench.multimodal import MultimodalBenchConfig, rows_of

    two = [r for r in rows({"bars": 11.8, "mix": 11.8}) if r["view"] in rows_of(("pooled", "caption"))]
    assert aims(two)["ensemble_over_best_view"] == {"bars": 1.026, "mix": 1.026}   # best of the two: 11.5
    assert "text-only" not in format_table({"rows": two, "aims": aims(two)})
    with pytest.raises(ValueError, match="views"):
        MultimodalBenchConfig(views=("pooled", "thumbnail"))


def test_the_table_names_every_row_and_the_verdict():
    result = {"rows": rows({"bars": 11.0, "mix": 11.0}), "aims": aims(rows({"bars": 11.0, "mix": 11.0}))}
    table = format_table(result)
    assert all(view in table for view in ROWS) and "not met" in table


def frame_row(attention, frames, ms=2.0, decode_speedup=1.2, tau=1.5):
    return {"draft_attention": attention, "frames": frames, "tokens_per_s": 20.0, "decode_tokens_per_s": 30.0,
            "speedup": 1.1, "decode_speedup": decode_speedup, "draft_ms_per_token": ms, "acceptance_rate": 0.4,
            "mean_accepted_len": tau}


def test_sparrows_aims_are_a_kept_speedup_a_flat_cost_and_ivsb_raising_tau():
    from specserve.bench.multimodal import frame_aims

    flat = [frame_row("target-only", 1, 0.0, 1.0, 1.0), frame_row("target-only", 64, 0.0, 1.0, 1.0),
            frame_row("full", 1, 2.0, 1.2), frame_row("full", 64, 6.0, 0.8),
            frame_row("windowed", 1, 2.0, 1.2), frame_row("windowed", 64, 2.4, 1.18),
            frame_row("windowed+ivsb", 1, 2.0, 1.3, 1.7), frame_row("windowed+ivsb", 64, 2.4, 1.3, 1.6)]
    aims = frame_aims(flat)
    assert aims["windowed_cost_growth"] == 1.2 and aims["full_speedup_kept"] == 0.667
    assert aims["ivsb_tau_gain_at_fewest"] == 0.2 and aims["met"]
    assert not frame_aims([*flat[:5], frame_row("windowed", 64, 2.4, 1.0), *flat[6:]])["met"]   # speedup fell
    assert not frame_aims([*flat[:5], frame_row("windowed", 64, 2.8, 1.2), *flat[6:]])["met"]   # cost 1.4x
    assert not frame_aims([*flat[:6], frame_row("windowed+ivsb", 1, 2.0, 1.3, 1.4), flat[7]])["met"]   # τ lower
    assert "ivsb_tau_gain_at_fewest" not in frame_aims(flat[:6])
    assert frame_aims([]) == {}


def test_the_plot_shows_the_views_and_sparrows_cost(tmp_path):
    from specserve.bench.multimodal import plot

    frames = [frame_row(a, f, ms) for a, f, ms in (("target-only", 1, 0.0), ("target-only", 16, 0.0), ("full", 1, 2.0),
                                                   ("full", 16, 6.0), ("windowed", 1, 2.0), ("windowed", 16, 2.2))]
    result = {"rows": rows({"bars": 11.0, "mix": 11.0}), "frames": frames, "machine": {"cpu_model": "cpu"},
              "date": "2026-11-27"}
    for name, data in (("views.png", {**result, "frames": []}), ("both.png", result),
                       ("frames.png", {**result, "rows": []})):
        plot(data, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_scenarios_are_checked_and_an_unseen_picture_is_turned_inverted_and_speckled():
    import numpy as np
    from PIL import Image

    from specserve.bench.multimodal import SCENARIOS, unseen

    with pytest.raises(ValueError, match="unknown scenarios"):
        MultimodalBenchConfig(scenarios=("single", "karaoke"))
    assert MultimodalBenchConfig(scenarios=SCENARIOS).scenarios == SCENARIOS
    picture = Image.new("RGB", (20, 10), (250, 10, 10))
    odd = np.asarray(unseen(picture)).astype(int)
    assert odd.shape == (20, 10, 3)                                    # a quarter turn
    assert abs(odd[..., 0].mean() - 5) < 15 and abs(odd[..., 1].mean() - 245) < 15   # inverted
    assert odd.std() > 5                                               # speckled


def test_no_pictures_runs_sparrows_rows_alone_and_the_table_shows_only_them():
    from specserve.bench.multimodal import MultimodalBenchConfig, format_table

    assert MultimodalBenchConfig(pictures=0).pictures == 0
    with pytest.raises(ValueError, match="--frames"):
        MultimodalBenchConfig(pictures=0, frames=())
    frames = [frame_row(a, f) for a in ("target-only", "full", "windowed") for f in (1, 16)]
    from specserve.bench.multimodal import frame_aims
    table = format_table({"rows": [], "aims": aims([]), "frames": frames, "frame_aims": frame_aims(frames)})
    assert "ensemble / best view" not in table and "windowed" in table


def test_sparrows_rows_can_ask_a_clip_of_as_many_frames():
    """A clip category's prompt at n frames is one clip of n frames and its question; a picture
    category's is n pictures and the question about the last."""
    from specserve.bench.multimodal import MultimodalBenchConfig, frame_prompt
    from specserve.data.synthetic_clips import CLIP_QUESTIONS

    question, shown = frame_prompt("sequence", 6, 0)
    assert question == CLIP_QUESTIONS["sequence"] and len(shown) == 6
    assert frame_prompt("sequence", 6, 1)[1][0].tobytes() != shown[0].tobytes()   # prompts differ
    question, shown = frame_prompt("shape", 3, 0)
    assert "last picture" in question and len(shown) == 3
    with pytest.raises(ValueError, match="at least 2"):
        MultimodalBenchConfig(frame_category="moves", frames=(1, 4))
    with pytest.raises(ValueError, match="unknown --frame-category"):
        MultimodalBenchConfig(frame_category="karaoke")


def test_the_served_rows_are_drafts_of_one_application_and_pictures_travel_as_data_urls():
    from PIL import Image

    from specserve.bench.multimodal_served import openai_messages, served_config
    from specserve.cluster.config import AppConfig

    config = MultimodalBenchConfig(views=("multimodal", "pooled"), scenarios=("single",), frames=())
    serve = served_config(config, replicas=2)
    app = serve["applications"][0]
    drafts = {d["name"]: d for d in AppConfig.model_validate(app["args"]).model_dump()["drafts"]}
    assert set(drafts) == {"multimodal", "pooled", "ensemble", "ensemble-static"}
    assert drafts["ensemble"]["ensemble"]["views"] == ["multimodal", "pooled"]
    assert drafts["ensemble-static"]["ensemble"]["weights"] == "static"
    assert {d["placement"] for d in drafts.values()} == {"inside"}
    target = next(d for d in app["deployments"] if d["name"] == "target")["autoscaling_config"]
    assert (target["min_replicas"], target["max_replicas"]) == (2, 2)
    with pytest.raises(ValueError, match="replicas"):
        served_config(config, replicas=0)

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": "two squares"}]
    sent = openai_messages(messages, (red, blue))
    urls = [p["image_url"]["url"] for p in sent[0]["content"] if p["type"] == "image_url"]
    assert len(urls) == 2 and urls[0] != urls[1] and all(u.startswith("data:image/png;base64,") for u in urls)
    assert sent[0]["content"][2] == {"type": "text", "text": "?"} and sent[1] == messages[1]


def test_served_rows_leave_a_running_stack_alone_and_take_down_one_that_failed_to_come_up(monkeypatch, tmp_path):
    from specserve.bench import multimodal_served
    from specserve.cluster import local

    config = MultimodalBenchConfig(views=("multimodal", "pooled"), scenarios=("single",), frames=(),
                                   json_path=tmp_path / "x.json", plot_path=tmp_path / "x.png")
    downs = []
    monkeypatch.setattr(local, "down", lambda: downs.append(1) or [])
    with pytest.raises(ValueError, match="caption"):
        multimodal_served.run_served_multimodal_bench(MultimodalBenchConfig(
            views=("multimodal", "caption"), scenarios=("single",), frames=()))
    monkeypatch.setattr(local.LocalState, "load", classmethod(lambda cls: local.LocalState()))
    with pytest.raises(RuntimeError, match="a local stack is up"):
        multimodal_served.run_served_multimodal_bench(config)
    assert downs == []

    def up(serve):
        raise TimeoutError("the application was not healthy")

    monkeypatch.setattr(local.LocalState, "load", classmethod(lambda cls: None))
    monkeypatch.setattr(local, "up", up)
    with pytest.raises(TimeoutError):
        multimodal_served.run_served_multimodal_bench(config)
    assert downs == [1]   # what up had started is stopped


def test_sparrows_served_rows_are_the_heads_and_the_draft_lm_of_one_application_and_clips_travel_as_video():
    from PIL import Image

    from specserve.bench.multimodal_served import check_served, frames_served_config, openai_messages
    from specserve.cluster.config import AppConfig

    config = MultimodalBenchConfig(pictures=0, frames=(2, 8), head="smollm2-vlm-hsr", ivsb_head="smollm2-vlm-sparrow")
    app = frames_served_config(config, replicas=1)["applications"][0]
    drafts = {d["name"]: d for d in AppConfig.model_validate(app["args"]).model_dump()["drafts"]}
    assert set(drafts) == {"full", "windowed", "windowed-ivsb", "draft-lm"}
    assert (drafts["full"]["model"], drafts["full"]["windowed"]) == ("smollm2-vlm-hsr", False)
    assert (drafts["windowed"]["model"], drafts["windowed"]["windowed"]) == ("smollm2-vlm-hsr", True)
    assert (drafts["windowed-ivsb"]["model"], drafts["windowed-ivsb"]["windowed"]) == ("smollm2-vlm-sparrow", True)
    assert drafts["draft-lm"]["ensemble"]["views"] == ["multimodal"] and drafts["draft-lm"]["placement"] == "inside"
    assert app["args"]["max_video_frames"] == 8   # no clip is sampled down to fewer frames than its row says
    with pytest.raises(ValueError, match="with --pictures 0, Sparrow's rows"):   # neither scenarios nor frames
        check_served(MultimodalBenchConfig(pictures=1, frames=(), scenarios=()))

    frames = tuple(Image.new("RGB", (8, 8), c) for c in ("red", "green", "blue"))
    sent = openai_messages([{"role": "user", "content": [{"type": "video", "frames": 3}, {"type": "text", "text": "?"}]}],
                           frames)
    clip = sent[0]["content"][0]
    assert clip["type"] == "video_url" and len(clip["video_url"]["frames"]) == 3
    assert len(set(clip["video_url"]["frames"])) == 3


def test_sparrows_served_table_takes_each_requests_prefill_from_its_time_at_the_client():
    from specserve.bench.multimodal_served import frame_table

    def cell(tokens, seconds, prefill, steps, drafted, draft_s, accepted_steps=0.0):
        return {"tokens": tokens, "seconds": seconds, "prefill": prefill, "steps": steps, "drafted": drafted,
                "draft_s": draft_s, "accepted_steps": accepted_steps, "slowest_s": seconds}

    # Two requests a row: α 0.5 over 10 steps and 0.25 over 6 (weighted by steps: 6.5 / 16).
    totals = {("target-only", 4): cell(40, 3.0, 1.0, 40, 0, 0.0),
              ("windowed", 4): cell(40, 2.0, 1.0, 16, 48, 0.096, 0.5 * 10 + 0.25 * 6),
              ("full", 4): cell(40, 2.5, 1.0, 16, 48, 0.192, 0.5 * 16)}
    rows = {r["draft_attention"]: r for r in frame_table(totals, ("target-only", "windowed", "full"), (4,))}
    assert rows["target-only"]["speedup"] == 1 and rows["target-only"]["decode_speedup"] == 1
    assert rows["windowed"]["speedup"] == 1.5 and rows["windowed"]["decode_speedup"] == 2.0
    assert rows["full"]["decode_speedup"] == round(40 / 1.5 / 20, 3)
    assert rows["windowed"]["draft_ms_per_token"] == 2.0 and rows["windowed"]["mean_accepted_len"] == 2.5
    assert rows["windowed"]["acceptance_rate"] == round(6.5 / 16, 3) and rows["full"]["acceptance_rate"] == 0.5
    assert rows["target-only"]["draft_ms_per_token"] == 0 and rows["target-only"]["acceptance_rate"] == 0
