"""Token counting, output lengths and request validation, without a server."""

from __future__ import annotations

import orjson
import pytest

from bench.sim.cli import build_parser, config_from_args, config_to_argv
from bench.sim.config import SimConfig
from bench.sim.protocol import OUTPUT_TOKENS_HEADER, ApiError, Kind, ParsedRequest, parse_request
from bench.sim.timing import StepCosts
from bench.sim.tokens import (
    chat_prompt_tokens,
    completion_prompt_tokens,
    eos_position,
    text_tokens,
)

CONFIG = SimConfig(model="m", num_gpu_blocks=101, max_model_len=1000)


def parse(kind: Kind, body: dict[str, object], headers: dict[str, str] | None = None,
          config: SimConfig = CONFIG) -> ParsedRequest:
    return parse_request(kind, orjson.dumps(body), headers or {}, config)


def test_text_tokens_is_bytes_over_four_rounded_up() -> None:
    assert text_tokens("") == 0
    assert text_tokens("abcd") == 1
    assert text_tokens("abcde") == 2
    assert text_tokens("é") == 1  # two UTF-8 bytes
    assert text_tokens("x" * 32_000) == 8000


def test_prompt_counting_rule() -> None:
    assert completion_prompt_tokens("abcdefgh") == 1 + 2
    assert completion_prompt_tokens([5, 6, 7]) == 3
    # BOS + (5 + 3) + (5 + 1) + generation prompt 4
    assert chat_prompt_tokens(["a" * 12, "hi"]) == 1 + 8 + 6 + 4


def test_chat_content_parts_are_concatenated() -> None:
    parsed = parse("chat", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "abcd"},
                                     {"type": "text", "text": "efgh"}]},
    ], "max_tokens": 5})
    assert parsed.prompt_tokens == chat_prompt_tokens(["abcdefgh"])


def test_max_tokens_defaults_like_vllm() -> None:
    chat = parse("chat", {"messages": [{"role": "user", "content": "abcd"}]})
    prompt = chat_prompt_tokens(["abcd"])
    assert chat.max_tokens == 1000 - prompt
    completion = parse("completion", {"prompt": "abcd"})
    assert completion.max_tokens == 16
    preferred = parse("chat", {"messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 9, "max_completion_tokens": 7})
    assert preferred.max_tokens == 7


@pytest.mark.parametrize(
    ("kind", "body", "status", "needle"),
    [
        ("chat", {"messages": [{"role": "user", "content": "x" * 4000}]}, 400,
         "maximum context length is 1000 tokens. However, your request has 1010 input tokens"),
        ("completion", {"prompt": "x", "max_tokens": 999}, 400,
         "'max_tokens' or 'max_completion_tokens' is too large: 999"),
        ("completion", {"prompt": "x", "max_tokens": 0}, 400, "at least 1"),
        ("chat", {"messages": [{"role": "user", "content": "x"}],
                  "stream_options": {"include_usage": True}}, 400,
         "Stream options can only be defined when `stream=True`."),
        ("chat", {"messages": [], "max_tokens": 1}, 400, "messages"),
        ("completion", {"prompt": {"no": 1}}, 400, "prompt"),
        ("chat", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404,
         "The model `other` does not exist."),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "priority": 3}, 400,
         "Got priority 3 but Priority scheduling is not enabled."),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "priority": "high"}, 400,
         "'priority' must be an integer."),
    ],
)
def test_invalid_requests(kind: Kind, body: dict[str, object], status: int, needle: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(kind, body)
    assert info.value.status == status
    assert needle in info.value.message
    error = orjson.loads(info.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status


def test_empty_stream_options_without_stream_is_accepted() -> None:
    # vLLM's validator tests truthiness, so {} passes.
    parsed = parse("chat", {"messages": [{"role": "user", "content": "x"}],
                            "stream_options": {}, "max_tokens": 3})
    assert parsed.stream is False and parsed.include_usage is False


def test_priority_accepted_with_priority_policy() -> None:
    config = SimConfig(model="m", num_gpu_blocks=101, max_model_len=1000,
                       scheduling_policy="priority")
    parsed = parse("chat", {"messages": [{"role": "user", "content": "x"}], "priority": -2},
                   config=config)
    assert parsed.priority == -2


def test_forced_output_header_sets_exact_length() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}
    assert parse("chat", body, {OUTPUT_TOKENS_HEADER: "7"}).eos_at == 7
    # At or beyond max_tokens the request simply runs to max_tokens ("length").
    assert parse("chat", body, {OUTPUT_TOKENS_HEADER: "100"}).eos_at is None
    with pytest.raises(ApiError):
        parse("chat", body, {OUTPUT_TOKENS_HEADER: "zero"})


def test_sampled_eos_is_deterministic_and_has_the_configured_mean() -> None:
    def draw(i: int, seed: int = 1) -> int:
        pos = eos_position(max_tokens=1000, forced=None, ignore_eos=False, output_fraction=0.3,
                           seed=seed, body=b"request %d" % i)
        return 1000 if pos is None else pos

    lengths = [draw(i) for i in range(3000)]
    assert lengths == [draw(i) for i in range(3000)]
    assert [draw(i, seed=2) for i in range(50)] != lengths[:50]
    mean = sum(lengths) / len(lengths) / 1000
    assert mean == pytest.approx(0.3, abs=0.02)
    assert min(lengths) >= 1


def test_ignore_eos_and_full_fraction_run_to_max_tokens() -> None:
    common = {"max_tokens": 100, "forced": None, "seed": 0, "body": b"x"}
    assert eos_position(ignore_eos=True, output_fraction=0.3, **common) is None  # type: ignore[arg-type]
    assert eos_position(ignore_eos=False, output_fraction=1.0, **common) is None  # type: ignore[arg-type]


def test_cli_flags_round_trip_a_config() -> None:
    config = SimConfig(
        model="x/y", num_gpu_blocks=5000, max_num_seqs=64, max_num_batched_tokens=4096,
        max_model_len=8192, scheduling_policy="priority", time_scale=0.5, capacity_scale=0.25,
        v0_metrics=True, cache_config_info=False, output_fraction=0.4, seed=9,
        crash_after_full_s=3.5, step_costs=StepCosts(fixed_s=0.01),
    )
    args = build_parser().parse_args(["--port", "0", *config_to_argv(config)])
    assert config_from_args(args) == config
