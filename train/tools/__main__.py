"""``python -m train.tools {init-ckpt,convert,inspect,delta-export,delta-apply,plan}``: checkpoint
and table tools.

Examples::

    python -m train.tools init-ckpt --config cfg --table user_id=init/user.parquet \\
        --world_size 2 --out runs/init
    python -m train train --config cfg ... --fine_tune_checkpoint runs/init
    python -m train.tools convert --from-config configs/multi_tower_din_taobao.config \\
        --checkpoint runs/nb/checkpoints/step_500 --to-config cfg --samples data/samples/train \\
        --eval data/samples/eval --out runs/converted
    python -m train.tools inspect --checkpoint runs/dyn
    python -m train.tools inspect --bundle runs/dyn/bundle
    python -m train.tools inspect --server unix:/run/dynrec/admin.sock --token-file token
    python -m train.tools delta-export --config cfg --base exports/v1 --model-dir runs/dyn \\
        --out /srv/deltas/step-2000
    python -m train.tools delta-apply --server 127.0.0.1:8501 --token-file token \\
        --delta step-2000
    python -m train.tools plan --config cfg --device cuda

``--server`` is the server's admin address (``serve --admin-address``), not its public port;
``--delta`` is relative to the server's ``--delta-root`` (:mod:`train.tools.admin_client`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.cli import Parser, plain, run_cli

if TYPE_CHECKING:
    from train.tools.admin_client import AdminTarget


def _parser() -> argparse.ArgumentParser:
    doc = plain(__doc__)
    p = Parser(
        prog="python -m train.tools",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_command(name: str, what: str) -> argparse.ArgumentParser:
        mine, keep = [], False
        for line in doc.split("\n\n")[2].splitlines():  # the examples, 4 spaces in
            if line.startswith("    python"):
                keep = line.startswith(f"    python -m train.tools {name} ")
            if keep:
                mine.append(line[2:])
        epilog = "example:\n" + "\n".join(mine)
        return sub.add_parser(name, help=what, description=what, epilog=epilog)

    i = add_command("init-ckpt", "init_table(s) -> initial dynamicemb checkpoint")
    i.add_argument(
        "--config", "--pipeline_config_path", type=Path, required=True, help="pipeline config"
    )
    i.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="init table of a dynamic table or feature (repeatable); default: the config's "
        "dynamicemb.init_table of every table",
    )
    i.add_argument(
        "--world_size",
        "--world-size",
        dest="world_size",
        type=int,
        default=1,
        help="ranks of the training that will load it",
    )
    i.add_argument(
        "--out", "--save_dir", dest="out", type=Path, required=True, help="checkpoint dir to write"
    )
    i.add_argument("--separator", default=",", help="between the values of a string embedding")
    i.add_argument("--delimiter", default=",", help="CSV field delimiter")
    i.add_argument("--max-errors", type=int, default=20, help="bad rows listed before a count")
    i.add_argument("--overwrite", action="store_true", help="replace a checkpoint at --out")

    c = add_command("convert", "num_buckets checkpoint -> dynamic checkpoint")
    c.add_argument("--from-config", type=Path, required=True, help="config of the checkpoint")
    c.add_argument("--checkpoint", type=Path, required=True, help="step dir or model dir")
    c.add_argument("--to-config", type=Path, required=True, help="config with dynamicemb tables")
    c.add_argument("--samples", type=Path, required=True, help="Parquet samples: ids to convert")
    c.add_argument("--eval", type=Path, help="eval samples; default: the configs' eval path")
    c.add_argument("--out", type=Path, required=True, help="model dir of the converted model")
    c.add_argument("--no-eval", action="store_true", help="skip the AUC comparison")

    s = add_command("inspect", "table statistics of a checkpoint, a bundle or a server")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", type=Path, help="step dir, model dir or init-ckpt dir")
    where.add_argument("--bundle", type=Path, help="an export bundle directory (either naming)")
    where.add_argument("--server", metavar="ADMIN_ADDRESS", help=SERVER_HELP)
    s.add_argument("--top-k", type=int, default=10, help="rows listed per table")
    s.add_argument("--json", action="store_true", help="JSON instead of text")

    d = add_command("delta-export", "rows changed since a bundle -> delta dir")
    d.add_argument("--config", type=Path, required=True, help="pipeline config")
    d.add_argument("--base", type=Path, required=True, help="the bundle the server runs")
    d.add_argument("--checkpoint", type=Path, help="default: newest in --model-dir")
    d.add_argument("--model-dir", type=Path, help="default: the config's model_dir")
    d.add_argument("--out", type=Path, required=True, help="the delta directory to write")
    d.add_argument("--id", help="delta id; default: step-<N> of the checkpoint")
    d.add_argument("--overwrite", action="store_true", help="replace a delta at --out")

    a = add_command("delta-apply", "apply a delta dir to a running server")
    a.add_argument("--server", metavar="ADMIN_ADDRESS", required=True, help=SERVER_HELP)
    a.add_argument(
        "--delta",
        required=True,
        help="the delta directory relative to the server's --delta-root, e.g. step-2000",
    )
    a.add_argument("--timeout", type=float, default=300.0, help="seconds the call may take")
    pl = add_command("plan", "each dynamic table's placement and memory, before a run")
    pl.add_argument("--config", type=Path, required=True, help="pipeline config")
    pl.add_argument(
        "--device",
        default="cpu",
        help="the training device; with cuda and no budget, its free memory is the budget",
    )
    pl.add_argument(
        "--hbm-gib",
        type=float,
        help="device memory (GiB) the tables may use; default: the config's "
        "train_config.table_hbm_budget_gib",
    )
    for command in (i, c, d, a, pl):
        command.add_argument("--json", action="store_true", help="JSON instead of text")
    for command in (s, a):
        _admin_arguments(command)
    return p


SERVER_HELP = "the server's admin address (serve --admin-address): HOST:PORT or unix:/path"


def _admin_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admin service access (with --server)")
    g.add_argument("--token-file", type=Path, help="bearer token (the server's --admin-token-file)")
    g.add_argument("--tls-ca", type=Path, help="PEM roots of the server's TLS certificate")
    g.add_argument("--tls-cert", type=Path, help="PEM client certificate (mTLS), with --tls-key")
    g.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def _admin_target(args: argparse.Namespace) -> AdminTarget:
    from train.tools.admin_client import AdminTarget

    return AdminTarget(args.server, args.token_file, args.tls_ca, args.tls_cert, args.tls_key)


def _init_ckpt(args: argparse.Namespace) -> dict[str, Any]:
    from shared.config import load_config
    from shared.features import IdMode, build_feature_set
    from train.tools.init_table import read_init_table, resolve_tables, write_init_checkpoint

    config = load_config(args.config)
    fs = build_feature_set(config)
    if fs.id_mode is not IdMode.DYNREC:
        # init tables hold raw ids; their keys are computed as dynrec's id mode does
        raise ValueError(
            f"{args.config}: init-ckpt supports data_config.dynrec_id_mode DYNREC only (the "
            f"config asks {fs.id_mode.name}); build the initial table with TorchEasyRec's "
            "create_dynamicemb_init_ckpt and pass it to --fine-tune-checkpoint"
        )
    paths = resolve_tables(fs, args.table)
    tables = {
        name: read_init_table(
            path,
            fs.tables[name].dim,
            separator=args.separator,
            delimiter=args.delimiter,
            max_errors=args.max_errors,
        )
        for name, path in paths.items()
    }
    manifest = write_init_checkpoint(
        args.out,
        tables,
        fs,
        config.train_config,
        world_size=args.world_size,
        overwrite=args.overwrite,
    )
    return {"out": str(args.out), **manifest}


def _convert(args: argparse.Namespace) -> dict[str, Any]:
    from train.fine_tune import resolve_checkpoint
    from train.tools.convert import convert_checkpoint

    for flag, path in (("--samples", args.samples), ("--eval", args.eval)):
        if path is not None and not path.exists():
            raise FileNotFoundError(
                f"{flag} {path}: no such file or directory; pass a Parquet file or a directory "
                "of them (python -m train.data build writes train/ and eval/)"
            )
    result = convert_checkpoint(
        source_config=args.from_config,
        source_checkpoint=resolve_checkpoint(args.checkpoint),
        target_config=args.to_config,
        samples=args.samples,
        out_dir=args.out,
        eval_path=args.eval,
        evaluate=not args.no_eval,
    )
    out: dict[str, Any] = {"checkpoint": str(result.checkpoint), "tables": result.tables}
    out["copied_num_buckets_tables"] = result.copied
    if result.eval:
        keys = ("rows", "auc", "logloss", "oracle_auc", "head_auc", "tail_auc")
        out["eval"] = {k: {m: v[m] for m in keys} for k, v in result.eval.items()}
    return out


def _delta_apply(args: argparse.Namespace) -> dict[str, Any]:
    from protos import predict_pb2, predict_pb2_grpc

    target = _admin_target(args)
    with target.channel() as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        request = predict_pb2.ApplyDeltaRequest(path=args.delta)
        resp = stub.ApplyDelta(request, metadata=target.metadata(), timeout=args.timeout)
    return {
        "model_version": resp.model_version,
        "base_version": resp.base_version,
        "deltas": list(resp.deltas),
        "dense_program": resp.dense_program,
        "apply_seconds": round(resp.apply_seconds, 4),
        "tables": {
            n: {
                "is_hashmap": t.is_hashmap,
                "new": t.new,
                "updated": t.updated,
                "evicted": t.evicted,
                "rows": t.rows,
            }
            for n, t in sorted(resp.tables.items())
        },
    }


def _text(cmd: str, out: dict[str, Any]) -> str:
    """The human-readable form of a command's JSON answer."""
    from train.tools.inspection import grid

    if cmd == "init-ckpt":
        lines = [f"initial checkpoint {out['out']} (world_size {out['world_size']})"]
        rows = [
            [n, t["rows"], " ".join(map(str, t["rows_per_rank"])), t["source"]]
            for n, t in out["tables"].items()
        ]
        return "\n".join(lines + grid(["table", "rows", "per rank", "source"], rows))
    if cmd == "convert":
        lines = [f"converted checkpoint {out['checkpoint']}"]
        rows = [
            [n, t.get("from", ""), t["keys"], t.get("stored", t["keys"]), t.get("dropped", 0)]
            for n, t in out["tables"].items()
        ]
        lines += grid(["table", "from", "ids seen", "stored", "dropped"], rows)
        lines.append("copied as they are: " + ", ".join(out["copied_num_buckets_tables"]))
        for which, m in out.get("eval", {}).items():
            lines.append(
                f"eval {which:<9} auc {m['auc']:.4f}  logloss {m['logloss']:.4f}  rows {m['rows']}"
            )
        return "\n".join(lines)
    if cmd in ("delta-export", "delta-apply"):
        if cmd == "delta-export":
            prog = "dense program included" if out["dense_program"] else "dense program unchanged"
            lines = [
                f"delta {out['path']}: {out['delta_id']} against base "
                f"{out['base']['version']} ({out['bytes']:,} bytes; {prog})"
            ]
        else:
            prog = "new dense program" if out["dense_program"] else "same dense program"
            lines = [
                f"serving {out['model_version']} (base {out['base_version']}; deltas "
                f"applied: {', '.join(out['deltas'])}; {prog}; "
                f"{out['apply_seconds']:.3f} s)"
            ]
        rows = [
            [n, t["new"], t["updated"], t["evicted"], t["rows"]]
            for n, t in out["tables"].items()
            if t["is_hashmap"]
        ]
        rows += [
            [n, "-", "-", "-", t["rows"]] for n, t in out["tables"].items() if not t["is_hashmap"]
        ]
        return "\n".join(lines + grid(["table", "new", "updated", "evicted", "rows"], rows))
    return json.dumps(out, indent=1)


def run(args: argparse.Namespace) -> str:
    """The command's output: text, or JSON with ``--json``."""
    if args.cmd == "inspect":
        from train.tools.inspection import (
            format_report,
            inspect_bundle,
            inspect_checkpoint,
            inspect_server,
        )

        if args.server is None:
            access = (args.token_file, args.tls_ca, args.tls_cert, args.tls_key)
            if any(v is not None for v in access):
                what = "--checkpoint" if args.checkpoint is not None else "--bundle"
                raise ValueError(f"--token-file and --tls-* are for --server, not {what}")
        if args.checkpoint is not None:
            report = inspect_checkpoint(args.checkpoint, top_k=args.top_k)
        elif args.bundle is not None:
            report = inspect_bundle(args.bundle)
        else:
            report = inspect_server(_admin_target(args), top_k=args.top_k)
        return (
            json.dumps(report, indent=1) if args.json else format_report(report, top_k=args.top_k)
        )
    if args.cmd == "plan":
        from train.tools.plan import plan_report, plan_text

        report = plan_report(args.config, device=args.device, hbm_gib=args.hbm_gib)
        return json.dumps(report, indent=1) if args.json else plan_text(report)
    if args.cmd == "init-ckpt":
        out = _init_ckpt(args)
    elif args.cmd == "convert":
        out = _convert(args)
    elif args.cmd == "delta-export":
        from train.tools.delta import export_delta

        report = export_delta(
            args.config,
            base=args.base,
            out=args.out,
            model_dir=args.model_dir,
            checkpoint=args.checkpoint,
            delta_id=args.id,
            overwrite=args.overwrite,
        )
        keep = ("path", "bytes", "delta_id", "base", "target_version", "dense_program", "tables")
        out = {k: report[k] for k in keep}
    else:
        out = _delta_apply(args)
    return json.dumps(out, indent=1) if args.json else _text(args.cmd, out)


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
