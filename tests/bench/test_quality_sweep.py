"""bench/quality_sweep.py: the sweep file's errors naming their field, the seed-by-seed order,
the paired differences, and a real sweep on tiny data whose runs equal bench_quality's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_quality
from bench.quality_sweep import Recipe, check_recipes, load_sweep, main, minus_reference, plan

ROOT = Path(__file__).resolve().parents[2]
FAST = "--batch 256 --max-steps 3 --num-workers 0 --device cpu --variants on"


def _sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_load_sweep(tmp_path: Path) -> None:
    common, recipes = load_sweep(_sweep(tmp_path, """
args = "--device cpu --variants on"
[recipes.a]
what = "lr 0.05"
args = "--sparse-lr 0.05 --crosses 'cms_group_id:cate_id'"
seeds = [0, 1]
[recipes.b]
args = "--batch 4096"
seeds = [2]
reference = "a"
"""))  # fmt: skip
    assert common == ["--device", "cpu", "--variants", "on"]
    assert recipes == [
        Recipe("a", "lr 0.05", ["--sparse-lr", "0.05", "--crosses", "cms_group_id:cate_id"],
               [0, 1], None),
        Recipe("b", "", ["--batch", "4096"], [2], "a"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[recipes.a]\nseeds = [0]\nbatch = 3\n", r"recipes\.a: unknown key\(s\) \['batch'\]"),
        ("[recipes.a]\nseeds = []\n", r"recipes\.a\.seeds: give distinct seeds"),
        ("[recipes.a]\nseeds = [0, 0]\n", r"recipes\.a\.seeds: give distinct seeds"),
        ("[recipes.a]\nseeds = 0\n", r"recipes\.a\.seeds: give a list"),
        ('[recipes.a]\nseeds = [0]\nreference = "b"\n', r"recipes\.a\.reference: no recipe 'b'"),
        ('[recipes.a]\nseeds = [0]\nreference = "a"\n', r"recipes\.a\.reference: give another"),
        ('[recipes.a]\nseeds = [0]\nargs = "--seeds 1"\n', r"recipes\.a\.args: the sweep sets"),
        ('args = "x"\n', r"recipes: give one or more"),
        ('args = "--out x"\n[recipes.a]\nseeds = [0]\n', r"sweep\.toml: args: the sweep sets"),
        ("seed = 1\n[recipes.a]\nseeds = [0]\n", r"unknown key\(s\) \['seed'\]"),
        ("[recipes.a\n", r"not TOML"),
    ],
)
def test_bad_sweep_files_name_the_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_sweep(_sweep(tmp_path, text))


@pytest.mark.parametrize(
    "sweep", sorted((ROOT / "bench" / "sweeps").glob("*.toml")), ids=lambda p: p.name
)
def test_the_committed_sweeps_are_bench_quality_commands(
    sweep: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep file is the plan of a device call: its mistakes must show here, not there."""
    monkeypatch.chdir(ROOT)  # the device runs the files' relative config paths from the root
    check_recipes(sweep, *load_sweep(sweep))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ('"--crosses cms_group_id:nope"', r"recipes\.b: .*nope"),
        ('"--admission pvalue_level:5"', r"recipes\.b: .*pvalue_level"),
        ('"--sparse-lr 0"', r"recipes\.b: --sparse-lr 0"),
        ('"--no-such-flag"', r"recipes\.b: args and the common args are not bench_quality's"),
    ],
)
def test_a_bad_recipe_fails_before_any_run(tmp_path: Path, args: str, error: str) -> None:
    sweep = _sweep(tmp_path, f'args = "{FAST}"\n[recipes.a]\nseeds = [0]\n'
                             f"[recipes.b]\nargs = {args}\nseeds = [0]\n")  # fmt: skip
    out = tmp_path / "sweep.json"
    with pytest.raises(ValueError, match=error):
        main([str(sweep), "--out", str(out)])
    assert not out.exists()  # recipe a did not run either


def test_plan_goes_seed_by_seed() -> None:
    a, b = Recipe("a", "", [], [0, 1, 2], None), Recipe("b", "", [], [5], "a")
    assert [(r.name, s) for r, s in plan([a, b])] == [("a", 0), ("b", 5), ("a", 1), ("a", 2)]


def test_minus_reference_pairs_seeds_both_ran() -> None:
    def variant(tails: dict[str, float]) -> dict[str, object]:
        return {
            "runs": {s: {"auc": 0.7, "head_auc": 0.71, "tail_auc": t} for s, t in tails.items()}
        }

    got = minus_reference({"on": variant({"0": 0.63, "1": 0.62})},
                          {"on": variant({"1": 0.60, "2": 0.5}), "off": variant({"0": 0.1})})  # fmt: skip
    assert list(got) == ["on"] and list(got["on"]) == ["1"]
    assert got["on"]["1"]["tail_auc"] == pytest.approx(0.02)
    assert got["on"]["1"]["auc"] == 0.0


@pytest.fixture(scope="module")
def swept(tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A real sweep on tiny data (three trainings, two at a time) and its JSON: what
    test_a_sweep_runs_what_bench_quality_runs checks, and the earlier sweep that
    test_resume_runs_only_the_seeds_missing resumes (each training a process start of ~5 s on
    a 2-core machine, so the two tests share these three). Both tests only read it."""
    root = tmp_path_factory.mktemp("swept")
    sweep = _sweep(root, f"""
args = "--samples {tiny_samples} {FAST}"
[recipes.base]
args = "--sparse-lr 0.05"
seeds = [0, 1]
[recipes.cross]
what = "with a cross"
args = "--sparse-lr 0.05 --crosses cms_group_id:cate_id"
seeds = [1]
reference = "base"
""")  # fmt: skip
    out = root / "sweep.json"
    return main([str(sweep), "--jobs", "2", "--out", str(out)]), out


def test_a_sweep_runs_what_bench_quality_runs(
    swept: tuple[dict, Path], tiny_samples: Path, tmp_path: Path
) -> None:
    """Two recipes, one with a reference, two trainings at a time: each run equals
    bench_quality's own run of the same arguments; the differences are the runs' differences."""
    doc, out = swept
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    base, cross = doc["recipes"]["base"], doc["recipes"]["cross"]
    assert base["seeds"] == [0, 1] and cross["seeds"] == [1] and cross["not_run"] == []
    assert doc["data"]["train_rows"] > 0 and doc["jobs"] == 2
    alone = bench_quality.main(["--samples", str(tiny_samples), *FAST.split(), "--sparse-lr",
                                "0.05", "--crosses", "cms_group_id:cate_id", "--seeds", "1",
                                "--out", str(tmp_path / "alone.json")])  # fmt: skip
    mine, theirs = cross["variants"]["on"]["runs"]["1"], alone["variants"]["on"]["runs"]["1"]
    for k in ("auc", "head_auc", "tail_auc", "logloss", "steps"):
        assert mine[k] == theirs[k], k
    diff = cross["minus_reference_by_seed"]["on"]["1"]["tail_auc"]
    assert diff == mine["tail_auc"] - base["variants"]["on"]["runs"]["1"]["tail_auc"]
    assert base["minus_reference_by_seed"] is None
    assert base["goal"]["checks"]["tail_auc"]["got"] == base["variants"]["on"]["tail_auc"]


def test_stop_after_starts_nothing_late_and_says_what_was_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = _sweep(tmp_path, f'args = "{FAST}"\n[recipes.a]\nseeds = [0, 1]\n')
    out = tmp_path / "sweep.json"
    doc = main([str(sweep), "--stop-after", "0", "--out", str(out)])
    assert doc["recipes"]["a"]["seeds"] == [] and doc["recipes"]["a"]["not_run"] == [0, 1]
    assert json.loads(out.read_text())["recipes"]["a"]["not_run"] == [0, 1]
    assert "not run (--stop-after 0): a seed 0, a seed 1" in capsys.readouterr().out


def test_resume_runs_only_the_seeds_missing(
    swept: tuple[dict, Path],
    tiny_samples: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Resuming the shared sweep (its ``cross`` recipe left out of this one) with ``base``'s
    seeds 0 and 2: only seed 2 trains, seed 0's runs are the earlier sweep's."""
    first, first_out = swept
    common = f'args = "--samples {tiny_samples} {FAST}"\n'
    sweep = _sweep(tmp_path, common + '[recipes.base]\nargs = "--sparse-lr 0.05"\nseeds = [0, 2]\n')
    both = main([str(sweep), "--resume", str(first_out),
                 "--out", str(tmp_path / "both.json")])  # fmt: skip
    printed = capsys.readouterr().out
    assert "base seed 2:" in printed and "base seed 0:" not in printed
    runs = both["recipes"]["base"]["variants"]["on"]["runs"]
    assert (
        list(runs) == ["0", "2"]
        and runs["0"] == first["recipes"]["base"]["variants"]["on"]["runs"]["0"]
    )
    assert both["data"] == first["data"]
    changed = _sweep(
        tmp_path, common + '[recipes.base]\nargs = "--sparse-lr 0.1"\nseeds = [0, 2]\n'
    )
    with pytest.raises(
        ValueError, match=r"recipes\.base\.args changed since \(--sparse-lr 0\.05\)"
    ):
        main([str(changed), "--resume", str(first_out), "--out", str(tmp_path / "x")])
