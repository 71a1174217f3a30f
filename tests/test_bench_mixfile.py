"""Mixes from a TOML file (bench.burst.mixfile): what the file states is the traffic the runners
draw, and a file that cannot define a usable mix is refused with the key at fault."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.burst import experiment, ideal, matrix, sweep
from bench.burst.matrix import SCALES, Cell, cell_record, cells
from bench.burst.mixes import MIXES, REALISTIC, Mix
from bench.burst.mixfile import MixFileError, chosen_mixes, load_mixes, register
from bench.burst.workload import plan

# The repository's three mixes, restated: the article's by reference to its classes, chat's
# partly, generation's from scratch.
RESTATED = """
[mix.article-again]
summary = "the article's mix, restated"
[[mix.article-again.class]]
like = "article/vip-chat"
[[mix.article-again.class]]
like = "article/normal-app"
[[mix.article-again.class]]
like = "article/batch-docs"
[[mix.article-again.class]]
like = "article/batch-gen"

[mix.chat-again]
burst_factor = 4
max_tokens = { none = 0.2, cap = 0.5, exact = 0.3, cap_factor = 4.0 }
[[mix.chat-again.class]]
like = "chat/vip-chat"
[[mix.chat-again.class]]
like = "article/vip-chat"
name = "normal-chat"
tier = "normal"
rate = 2.0
prompt = { lo = 150, hi = 1500, log = true }
output = { lo = 50, hi = 600, log = true }
burst = true
[[mix.chat-again.class]]
like = "chat/batch-docs"

[mix.generation-again]
[[mix.generation-again.class]]
name = "vip-chat"
tier = "vip"
rate = 1.2
prompt = [150, 600]
output = [100, 300]
[[mix.generation-again.class]]
name = "normal-app"
tier = "normal"
rate = 0.6
prompt = { lo = 100, hi = 4000, log = true }
output = { lo = 50, hi = 1000, log = true }
[[mix.generation-again.class]]
name = "batch-gen"
tier = "batch"
rate = 0.25
prompt = [50, 300]
output = [1000, 4000]
stream = false
burst = true
"""


@pytest.fixture(autouse=True)
def known_mixes() -> Iterator[None]:
    """Registering is global (the runners read MIXES); each test leaves it as it found it."""
    before = dict(MIXES)
    yield
    MIXES.clear()
    MIXES.update(before)


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mixes.toml"
    path.write_text(text)
    return path


def test_a_file_restating_the_repository_mixes_draws_the_same_schedules(
        tmp_path: Path) -> None:
    mixes = load_mixes(_file(tmp_path, RESTATED))
    assert list(mixes) == ["article-again", "chat-again", "generation-again"]
    assert mixes["article-again"].summary == "the article's mix, restated"
    for name, mix in mixes.items():
        builtin = MIXES[name.removesuffix("-again")]
        assert (mix.classes, mix.burst_factor, mix.max_tokens) == (
            builtin.classes, builtin.burst_factor, builtin.max_tokens), name
        settings = SCALES["reduced"]
        for seed in (1, 2):
            assert plan(settings.profile, mix.classes, settings.scale, seed, mix.max_tokens) == (
                plan(settings.profile, builtin.classes, settings.scale, seed,
                     builtin.max_tokens))


def test_registered_mixes_run_like_the_repository_ones(tmp_path: Path) -> None:
    path = _file(tmp_path, RESTATED)
    assert chosen_mixes(None, path) == ["article-again", "chat-again", "generation-again"]
    # Named ones only; without a file, the repository's three.
    assert chosen_mixes("chat-again,article", path) == ["chat-again", "article"]
    assert chosen_mixes(None, None) == ["article", "chat", "generation"]
    # A file mix's default seeds are 1-5; the cell's settings carry its traffic.
    todo = cells("reduced", ["generation-again"], [2], None)
    assert [c.seed for c in todo] == [1, 2, 3, 4, 5]
    settings = todo[0].settings()
    assert (settings.mix, settings.classes, settings.max_tokens) == (
        "generation-again", MIXES["generation"].classes, REALISTIC)
    # The cell's record keeps the whole definition, as JSON.
    record = cell_record(todo[0], settings, [], 1.0, "abc")
    traffic = json.loads(json.dumps(record["traffic"]))
    assert traffic["name"] == "generation-again"
    assert [c["tier"] for c in traffic["classes"]] == ["vip", "normal", "batch"]
    assert traffic["classes"][2]["output"] == {"lo": 1000, "hi": 4000, "log": False}
    assert traffic["max_tokens"] == dataclasses.asdict(REALISTIC)


def test_registering_a_name_again_must_be_the_same_traffic(tmp_path: Path) -> None:
    mixes = load_mixes(_file(tmp_path, RESTATED))
    register(mixes)
    register(mixes)  # the same definition: fine (a runner called twice)
    other = dataclasses.replace(mixes["chat-again"], burst_factor=3.0)
    with pytest.raises(MixFileError, match="'chat-again' is already defined otherwise"):
        register({"chat-again": other})
    assert MIXES["chat-again"].burst_factor == 4.0


_VIP = '[[mix.m.class]]\nlike = "article/vip-chat"\n'
_BURST = '[[mix.m.class]]\nlike = "article/batch-docs"\n'


@pytest.mark.parametrize(("text", "message"), [
    ("[mix.m]\n" + _VIP + _BURST + "colour = 1\n", "mix.m.class[1]: unknown key 'colour'"),
    ("[mix.m]\nrate = 2\n" + _VIP + _BURST, "mix.m: unknown key 'rate'"),
    ("[mix.m]\n" + _VIP + _BURST + 'tier = "gold"\n', "mix.m.class[1].tier: must be vip"),
    ("[mix.m]\n" + _VIP + _BURST + "tier = 1\n", "mix.m.class[1].tier: must be vip"),
    ("[mix.m]\n" + _VIP + _BURST + "rate = 0\n", "mix.m.class[1].rate: must be > 0"),
    ("[mix.m]\n" + _VIP + _BURST + "rate = true\n", "mix.m.class[1].rate: must be a number"),
    ("[mix.m]\n" + _VIP + _BURST + "prompt = [5, 100]\n",
     "mix.m.class[1].prompt.lo: must be >= 11"),
    ("[mix.m]\n" + _VIP + _BURST + "prompt = [900, 100]\n", "prompt: hi 100 is below lo 900"),
    ("[mix.m]\n" + _VIP + _BURST + "prompt = [100, 200, 300]\n", "must be [lo, hi]"),
    ("[mix.m]\n" + _VIP + _BURST + "output = { lo = 1.5, hi = 9 }\n",
     "output.lo: must be a whole number"),
    ("[mix.m]\n" + _VIP + _BURST + "output = { lo = 1, hi = 9, shape = 2 }\n",
     "output: unknown key 'shape'"),
    ("[mix.m]\n" + _VIP + _BURST + "output = [100, 9000]\n",
     "prompt hi + output hi = 17400 tokens, more than the engines' context of 16384"),
    ("[mix.m]\n" + _VIP + _BURST + "stream = 1\n", "stream: must be true or false"),
    ("[mix.m]\n" + _BURST, "mix.m: needs a VIP class"),
    ("[mix.m]\n" + _VIP, "mix.m: needs a class with burst = true"),
    ("[mix.m]\n" + _VIP + _BURST + _BURST, "mix.m.class[2].name: 'batch-docs' is already"),
    ("[mix.m]\n" + _VIP + '[[mix.m.class]]\nname = "x"\ntier = "batch"\nburst = true\n',
     "mix.m.class[1]: needs rate, prompt, output"),
    ("[mix.m]\n" + _VIP + _BURST + 'name = "Batch Docs"\n', "class[1].name: must be 1-40"),
    ("[mix.m]\n" + _VIP + '[[mix.m.class]]\nlike = "article/nope"\n',
     "mix.m.class[1].like: must name a class of the repository's mixes (article/vip-chat"),
    ("[mix.chat]\n" + _VIP.replace("mix.m", "mix.chat"), "'chat' is one of the repository's"),
    ('[mix."My Mix"]\nsummary = "x"\n', "mix.My Mix: must be 1-40"),
    ("[mix.m]\nsummary = 3\n" + _VIP + _BURST, "mix.m.summary: must be a string"),
    ("[mix.m]\nburst_factor = 0.5\n" + _VIP + _BURST, "mix.m.burst_factor: must be >= 1"),
    ("[mix.m]\nmax_tokens = { none = 0.5, cap = 0.5, exact = 0.5 }\n" + _VIP + _BURST,
     "mix.m.max_tokens: max_tokens fractions must be >= 0 and sum to 1"),
    ("[mix.m]\nmax_tokens = { none = 1.0, cap = 0, exact = 0, capfactor = 2 }\n" + _VIP + _BURST,
     "mix.m.max_tokens: unknown key 'capfactor'"),
    ("[mix.m]\nsummary = \"no classes\"\n", "mix.m.class: needs at least one"),
    ("[other]\nx = 1\n", "unknown key 'other'"),
    ("", "defines no mix"),
    ("[mix.m\n", "not TOML"),
])
def test_a_file_that_cannot_define_a_usable_mix_is_refused_with_the_key(
        tmp_path: Path, text: str, message: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(MixFileError) as raised:
        load_mixes(path)
    assert message in str(raised.value)
    assert str(raised.value).startswith(str(path))


def test_a_missing_file_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(MixFileError, match="No such file"):
        load_mixes(tmp_path / "absent.toml")


def test_the_runners_refuse_a_bad_file_and_an_unknown_mix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _file(tmp_path, "[mix.m]\n" + _VIP)
    out = str(tmp_path / "out")
    for main, args in ((matrix.main, ["--out", out]), (ideal.main, ["--out", out]),
                       (sweep.main, ["--mix", "m", "--size", "2", "--seed", "1", "default",
                                     "--out", out]),
                       (experiment.main, ["--mix", "m", "--out", out])):
        assert main(["--mix-file", str(bad), *args]) == 2
        assert "needs a class with burst = true" in capsys.readouterr().err
    assert matrix.main(["--mix", "nope", "--out", out]) == 2
    assert sweep.main(["--mix", "nope", "--size", "2", "--seed", "1", "default",
                       "--out", out]) == 2
    assert experiment.main(["--mix", "nope", "--out", out]) == 2
    assert "unknown mix 'nope'; choose from article, chat, generation" in (
        capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_the_ideal_replays_a_file_mix_and_refuses_one_the_matrix_ran_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = RESTATED.split("[mix.chat-again]")[0].replace("article-again", "docs")
    path = _file(tmp_path, text)
    out = tmp_path / "out"
    args = ["--mix-file", str(path), "--scale", "ci", "--size", "2", "--seed", "1",
            "--out", str(out)]
    assert ideal.main(args) == 0
    records = json.loads((out / "ideal-ci.json").read_text())
    assert [r["cell"] for r in records] == [{"scale": "ci", "mix": "docs", "size": 2,
                                             "seed": 1}]
    assert "| docs | 2 | 1 |" in (out / "ideal-ci.md").read_text()
    # A matrix record of the cell on the same traffic is read beside it...
    cell = Cell("ci", "docs", 2, 1)
    (out / "cells").mkdir()
    same = cell_record(cell, cell.settings(), [], 1.0, "abc")
    same["traffic"]["summary"] = "the same traffic, described otherwise"
    (out / "cells" / f"{cell.name}.json").write_text(json.dumps(same))
    assert ideal.main(args) == 0
    # ...one on other traffic (its Batch documents at twice the rate) is not.
    MIXES.pop("docs")
    other = dataclasses.replace(load_mixes(path)["docs"])
    docs = dataclasses.replace(other.classes[2], rate=1.0)
    register({"docs": Mix("docs", other.summary, (*other.classes[:2], docs,
                                                   other.classes[3]))})
    record = cell_record(cell, cell.settings(), [], 1.0, "abc")
    (out / "cells" / f"{cell.name}.json").write_text(json.dumps(record))
    MIXES.pop("docs")
    assert ideal.main(args) == 2
    assert "another definition of mix 'docs'" in capsys.readouterr().err



def test_the_readme_example_is_a_valid_mix_file(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[1] / "bench" / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    mixes = load_mixes(_file(tmp_path, example))
    assert list(mixes) == ["rag"]
    rag = mixes["rag"]
    assert rag.burst_factor == 3.0
    assert [(c.name, c.burst) for c in rag.classes] == [
        ("vip-chat", False), ("batch-docs", False), ("normal-rag", True)]
