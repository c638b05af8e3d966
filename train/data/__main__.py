"""python -m train.data: generate synthetic raw files, build sample Parquet, print the oracle AUC.

examples:
  python -m train.data generate --size small --out data/small --seed 0   # data/small/raw/*.csv
  python -m train.data build --raw data/small/raw --out data/small/samples \\
      --config configs/multi_tower_din_taobao_dynamicemb.config
  python -m train.data oracle-auc --samples data/small/samples
  python -m train.data all --size small --out data/small                 # the three above
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.cli import Parser, run_cli
from shared.config import load_config
from shared.features import build_feature_set
from train.data import synthetic, taobao

DEFAULT_CONFIG = (
    Path(__file__).resolve().parents[2] / "configs" / "multi_tower_din_taobao_dynamicemb.config"
)


def _generate(size: str, out: Path, seed: int) -> None:
    r = synthetic.generate(size, out, seed=seed)
    print(
        f"generated {r.size} (seed {r.seed}) in {out / 'raw'}: {r.samples} samples, {r.users} users, "
        f"{r.ads} ads, CTR {r.ctr:.4f}, mean click-sequence length {r.mean_sequence_length:.2f} "
        f"(max {r.max_prior_clicks} earlier clicks), ads seen < 3 times {r.ads_seen_lt3:.1%}, "
        f"users seen < 3 times {r.users_seen_lt3:.1%} [{r.seconds:.1f} s]"
    )


def _build(raw: Path, out: Path, config: Path) -> None:
    import time

    started = time.perf_counter()
    fs = build_feature_set(load_config(config))
    r = taobao.build_samples(raw, out, fs)
    seq = ", ".join(f"{k} {v:.2f}" for k, v in r.mean_sequence_length.items())
    print(
        f"built {out}: train {r.train_rows} rows ({r.parts.get('train', 0)} files), eval "
        f"{r.eval_rows} rows, dropped {r.dropped_other_days} (other days); samples without "
        f"profile {r.samples_without_profile}, unknown ads {r.samples_with_unknown_ad}; mean "
        f"click-sequence length: {seq} [{time.perf_counter() - started:.1f} s; details in "
        f"{out / '_build_report.json'}]"
    )


def _oracle(samples: Path, split: str) -> None:
    auc, rows, ctr = synthetic.oracle_auc(samples, split)
    print(f"oracle AUC ({split}, {rows} rows, CTR {ctr:.4f}): {auc:.4f}")


def _parser() -> argparse.ArgumentParser:
    examples = __doc__.split("\n\n", 1)[1].splitlines()
    parser = Parser(
        prog="python -m train.data",
        description=__doc__.split("\n")[0],
        epilog="\n".join(examples),
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    def command(name: str, what: str, *example_lines: int) -> argparse.ArgumentParser:
        epilog = "example:\n" + "\n".join(examples[i] for i in example_lines)
        return sub.add_parser(name, help=what, description=what, epilog=epilog)

    size_help = "synthetic data size (rows, users, ads)"
    config_help = "pipeline config: the features to build"
    g = command("generate", "write synthetic raw CSV files + the oracle side file", 1)
    g.add_argument("--size", choices=sorted(synthetic.SIZES), default="small", help=size_help)
    g.add_argument("--out", type=Path, required=True, help="writes OUT/raw/*.csv")
    g.add_argument("--seed", type=int, default=0, help="random seed of the generator")
    b = command("build", "join raw CSV files into sample Parquet (train/ and eval/)", 2, 3)
    b.add_argument("--raw", type=Path, required=True, help="directory of the raw CSV files")
    b.add_argument("--out", type=Path, required=True, help="writes OUT/train/ and OUT/eval/")
    b.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=config_help)
    o = command("oracle-auc", "AUC of the true click probabilities", 4)
    o.add_argument("--samples", type=Path, required=True, help="samples dir (with train/, eval/)")
    o.add_argument("--split", choices=["train", "eval"], default="eval", help="which split")
    a = command("all", "generate, build and print the oracle AUC", 5)
    a.add_argument("--size", choices=sorted(synthetic.SIZES), default="small", help=size_help)
    a.add_argument("--out", type=Path, required=True, help="writes OUT/raw/ and OUT/samples/")
    a.add_argument("--seed", type=int, default=0, help="random seed of the generator")
    a.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=config_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.cmd in ("generate", "all"):
        _generate(args.size, args.out, args.seed)
    if args.cmd == "build":
        _build(args.raw, args.out, args.config)
    if args.cmd == "all":
        _build(args.out / "raw", args.out / "samples", args.config)
    if args.cmd == "oracle-auc":
        _oracle(args.samples, args.split)
    if args.cmd == "all":
        _oracle(args.out / "samples", "eval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
