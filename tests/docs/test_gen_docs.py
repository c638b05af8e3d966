"""The generated reference pages (scripts/gen_docs.py) are current and complete: every CLI and
subcommand in cli.md, every field of pipeline.proto in config.md with what the code does with it,
and the ``[unsupported]`` tags of the .proto are what the parser refuses."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from protos import pipeline_pb2
from scripts import gen_docs
from scripts.gen_docs import Read
from shared.config import ConfigSource, load_config

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
FIX = f"run `{gen_docs.REGENERATE}` and commit the pages it writes"


@pytest.fixture(scope="module")
def schema() -> gen_docs.Schema:
    return gen_docs.schema()


def test_generated_references_are_fresh() -> None:
    stale = gen_docs.stale_pages()
    assert not stale, f"stale generated docs: {[str(p) for p in stale]}; {FIX}"


def _sections(page: Path) -> dict[str, str]:
    """``## `Name` {#Name}`` heading -> the text up to the next one."""
    parts = re.split(r"^##+ `([^`]+)` \{#[^}]+\}$", page.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _row(section: str, name: str) -> list[str] | None:
    """The cells of the table row of ``name`` in a section, None if it has none."""
    for line in section.splitlines():
        if line.startswith(f"| `{name}` |"):
            return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return None


def test_every_accepted_config_field_is_documented(schema: gen_docs.Schema) -> None:
    sections = _sections(ROOT / gen_docs.CONFIG_PAGE)
    missing, wrong = [], []
    for m in pipeline_pb2.DESCRIPTOR.message_types_by_name.values():
        status = {f.name: f.read for f in schema.fields[m.name]}
        for f in m.fields:
            row = _row(sections.get(m.name, ""), f.name)
            if row is None:
                missing.append(f"{m.name}.{f.name}")
            elif (status[f.name] is Read.UNSUPPORTED) != ("unsupported" in row[5]):
                wrong.append(
                    f"{m.name}.{f.name}: read {row[5]!r}, the .proto says {status[f.name]}"
                )
    for e in pipeline_pb2.DESCRIPTOR.enum_types_by_name.values():
        missing += [f"{e.name}.{v.name}" for v in e.values if not _row(sections[e.name], v.name)]
    assert not missing, f"not in {gen_docs.CONFIG_PAGE}: {missing}; {FIX}"
    assert not wrong, f"{gen_docs.CONFIG_PAGE} disagrees with the .proto's tags: {wrong}; {FIX}"
    assert schema.accepted_fields(), "no accepted field at all: the tags are misread"


def test_every_cli_is_documented() -> None:
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for package in ("train", "serve", "shared", "loadtest", "protos")
        for p in (ROOT / package).rglob("__main__.py")
    }
    assert found <= set(gen_docs.CLIS), (
        f"CLIs missing from scripts/gen_docs.py's CLIS: {sorted(found - set(gen_docs.CLIS))}; "
        f"add them there, then {FIX}"
    )
    page = (ROOT / gen_docs.CLI_PAGE).read_text()
    undocumented = [
        command.prog
        for module in gen_docs.CLIS
        for command in gen_docs.commands(gen_docs.cli_parser(module))
        if f"## `{command.prog}` {{#" not in page
    ]
    assert not undocumented, f"not in {gen_docs.CLI_PAGE}: {undocumented}; {FIX}"


# --------------------------------------------------------------------------- [unsupported] tags


def _seed() -> pipeline_pb2.EasyRecConfig:
    return load_config(SEED)


def _features(cfg: pipeline_pb2.EasyRecConfig) -> None:
    from shared.features import build_feature_set

    build_feature_set(cfg, ConfigSource("", "test"))


def _sparse_sgd() -> None:
    from train.model.multi_tower_din import sparse_adagrad

    cfg = _seed()
    cfg.train_config.sparse_optimizer.sgd_optimizer.lr = 0.1
    sparse_adagrad(cfg.train_config)


def _dense(which: str) -> Callable[[], None]:
    def run() -> None:
        from train.trainer import build_optimizers

        cfg = _seed()
        getattr(cfg.train_config.dense_optimizer, which).lr = 0.1
        # refused before the model is looked at
        build_optimizers(None, cfg.train_config)  # type: ignore[arg-type]

    return run


def _sequence_raw_feature() -> None:
    cfg = _seed()
    seq = next(fc.sequence_feature for fc in cfg.feature_configs if fc.HasField("sequence_feature"))
    raw = seq.features.add().raw_feature
    raw.feature_name, raw.expression, raw.embedding_dim = "price", "item:price", 8
    raw.boundaries.extend([1.0, 2.0])
    _features(cfg)


def _wide_group() -> None:
    cfg = _seed()
    cfg.model_config.feature_groups[0].group_type = pipeline_pb2.WIDE
    _features(cfg)


# (message or enum, field or value) tagged [unsupported] -> (a config using it, the refusal)
REFUSALS: dict[tuple[str, str], tuple[Callable[[], None], str]] = {
    ("SparseOptimizer", "sgd_optimizer"): (_sparse_sgd, "only adagrad_optimizer"),
    ("DenseOptimizer", "sgd_optimizer"): (_dense("sgd_optimizer"), "only adam_optimizer"),
    ("DenseOptimizer", "adagrad_optimizer"): (_dense("adagrad_optimizer"), "only adam_optimizer"),
    ("SeqFeatureConfig", "raw_feature"): (_sequence_raw_feature, "only id_feature sub-features"),
    ("FeatureGroupType", "WIDE"): (_wide_group, "WIDE groups are not supported"),
}


def _tagged_unsupported(schema: gen_docs.Schema) -> set[tuple[str, str]]:
    """Fields and enum values whose own comment says [unsupported] (not those of a message
    that only unsupported fields lead to)."""
    fields = {
        (f.message, f.name)
        for fs in schema.fields.values()
        for f in fs
        if f.read is Read.UNSUPPORTED and schema.message_read.get(f.message) is not Read.UNSUPPORTED
    }
    values = {
        (e, v.name) for e, vs in schema.values.items() for v in vs if v.read is Read.UNSUPPORTED
    }
    return fields | values


def test_unsupported_tags_are_what_the_parser_refuses(schema: gen_docs.Schema) -> None:
    tagged = _tagged_unsupported(schema)
    assert tagged == set(REFUSALS), (
        "protos/pipeline.proto's [unsupported] tags and this test's REFUSALS differ: tagged "
        f"only {sorted(tagged - set(REFUSALS))}, refused only {sorted(set(REFUSALS) - tagged)}; "
        "tag what the code refuses, and give each tag a config here that shows it"
    )
    for refused, message in REFUSALS.values():
        with pytest.raises(ValueError, match=re.escape(message)):
            refused()


def test_descriptor_walk_sees_every_message() -> None:
    """config.md orders messages from EasyRecConfig: every message of the file is reachable
    (an unreachable one would be documented but could never appear in a config)."""
    seen: set[str] = set()
    todo = [pipeline_pb2.EasyRecConfig.DESCRIPTOR]
    while todo:
        m = todo.pop()
        if m.name not in seen:
            seen.add(m.name)
            todo += [f.message_type for f in m.fields if f.message_type is not None]
    assert seen == set(pipeline_pb2.DESCRIPTOR.message_types_by_name)
