"""The LiteLLM comparison's setup, without installing LiteLLM or touching the network."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.perf import litellm_env


def test_config_routes_demo_to_the_backend_with_redis_backed_limits(tmp_path: Path) -> None:
    path = litellm_env.write_config(tmp_path / "litellm.yaml", 8123, "127.0.0.1", 6399, "pw")
    config = yaml.safe_load(path.read_text())
    [model] = config["model_list"]
    assert model["model_name"] == "demo"
    params = model["litellm_params"]
    assert params["model"] == "openai/demo"
    assert params["api_base"] == "http://127.0.0.1:8123/v1"
    # Limits that are checked on every request but far above any benchmark rate.
    assert params["rpm"] >= 10_000_000 and params["tpm"] >= params["rpm"]
    router = config["router_settings"]
    assert router["routing_strategy"] == "usage-based-routing-v2"
    assert (router["redis_host"], router["redis_port"], router["redis_password"]) == (
        "127.0.0.1", 6399, "pw")
    assert config["general_settings"]["master_key"] == litellm_env.MASTER_KEY
    assert config["litellm_settings"]["set_verbose"] is False


def test_config_without_password_has_no_password_key() -> None:
    config = litellm_env.proxy_config(8123, "127.0.0.1", 6399)
    assert "redis_password" not in config["router_settings"]


def test_companion_pins_are_relaxed_to_the_release_only() -> None:
    relax = litellm_env.relax_companion_pin
    assert relax("litellm-proxy-extras==0.4.110.post1") == (
        "litellm-proxy-extras>=0.4.110,<=0.4.110.post1")
    assert relax("litellm-enterprise==0.1.79") == "litellm-enterprise==0.1.79"
    assert relax("fastapi<1.0,>=0.136.3") == "fastapi<1.0,>=0.136.3"


def test_proxy_env_leaves_the_project_venv_out() -> None:
    env = litellm_env.proxy_env()
    assert "VIRTUAL_ENV" not in env
    assert env["PATH"].startswith(str(litellm_env.VENV / "bin"))
