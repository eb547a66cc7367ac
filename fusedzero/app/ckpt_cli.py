"""`fusedzero ckpt inspect|verify|export`: look at, check and consolidate sharded checkpoints.

    fusedzero ckpt inspect DIR                  world size, stage, step, params, files (sizes)
    fusedzero ckpt verify DIR                   sizes, headers and sha256 of every shard
    fusedzero ckpt export DIR OUT [--dtype bf16|fp32] [--max-shard-size 5GB] [--hf-config C]
    fusedzero ckpt upgrade OLD NEW_ROOT         an older format version -> the current one

DIR is a checkpoint directory, a root holding `latest`, or a tensor-parallel root (it holds
tensor_parallel.json, docs/tensor_parallel.md): `inspect` and `verify` go through its tp folders
(each bound to the record), `export` assembles full tensors from them. Exit status: 0 ok; 1
`inspect` or `verify` found bad shard files (one line per problem: which file, and why); 2 an
error (no checkpoint there, a model mismatch, bad flags), reported as one line
`fusedzero: error: ...`.

The `fusedzero` CLI wires this in with `add_ckpt_subparser(subparsers)`; the parsed namespace
carries `func=run_ckpt`. `python -m fusedzero.app.ckpt_cli ...` runs it alone.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from fusedzero import _dtypes as dtypes, checkpoint
from fusedzero.app.runlock import LOCK_NAME, RunLock
from fusedzero.checkpoint._placements import check_bound, check_folder, folder, read as tp_record

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def add_ckpt_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `ckpt` command (with inspect / verify / export) to an argparse subparsers set."""
    p = subparsers.add_parser(
        "ckpt",
        help="inspect, verify or export a sharded checkpoint",
        description=__doc__.split("\n\n")[0],
    )
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    a = sub.add_parser("inspect", help="world size, stage, step, params, files")
    a.add_argument("dir", help="checkpoint directory, or a root holding `latest`")
    a = sub.add_parser("verify", help="check sizes, headers and sha256 of every shard")
    a.add_argument("dir", help="checkpoint directory, or a root holding `latest`")
    a = sub.add_parser("export", help="one safetensors file with the model's param names")
    a.add_argument(
        "dir", help="checkpoint directory, a root holding `latest`, or a tensor-parallel root"
    )
    a.add_argument("out", help="output .safetensors path")
    a.add_argument(
        "--dtype",
        choices=sorted(dtypes.SHORT_NAMES),
        default="fp32",
        help="dtype of the exported params (default fp32, the master values)",
    )
    a.add_argument(
        "--max-shard-size",
        default=None,
        type=_parse_size,
        help="split into HF-style shards + index above this size, e.g. 5GB",
    )
    a.add_argument("--no-verify", action="store_true", help="skip the sha256 check")
    a.add_argument(
        "--hf-config",
        default=None,
        metavar="CONFIG_JSON",
        help="OUT is a folder for transformers' from_pretrained: model.safetensors "
        "(or shards + index) and this config.json (see fusedzero.checkpoint.hf)",
    )
    a = sub.add_parser(
        "import-dcp",
        help="an FSDP2 + AdamW torch.distributed.checkpoint "
        "folder -> a fusedzero checkpoint (see fusedzero.checkpoint.dcp)",
    )
    a.add_argument("dcp_dir", help="DCP folder of {'model': ..., 'optim': ...} state dicts")
    a.add_argument("out", help="fusedzero checkpoint root to write (out/step-N, out/latest)")
    a = sub.add_parser(
        "upgrade",
        help="convert a checkpoint of format version 1 or 2 (or a "
        "tensor-parallel root of record version 1) into the current version "
        "(see fusedzero.checkpoint._upgrade, tp_upgrade)",
    )
    a.add_argument(
        "dir", help="old checkpoint directory, a root holding `latest`, or a tensor-parallel root"
    )
    a.add_argument("out", help="checkpoint root to write (out/step-N, out/latest)")
    p.set_defaults(func=run_ckpt)
    return p


def _parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", s.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5GB, 500MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_ckpt(args: argparse.Namespace) -> int:
    """Handler for the parsed `ckpt` namespace; returns the exit status."""
    try:
        if args.ckpt_command in ("inspect", "verify"):
            one = _inspect if args.ckpt_command == "inspect" else _verify
            status = 0
            for label, d in _each_tp_folder(args.dir):
                if label:
                    _print(f"== {label}: {d}")
                status = max(status, one(d))
            return status
        if args.ckpt_command == "upgrade":
            return _upgrade(args.dir, args.out)
        if args.ckpt_command == "import-dcp":
            from fusedzero.checkpoint.dcp import run_import_dcp

            return run_import_dcp(args)
        if args.ckpt_command == "export" and getattr(args, "hf_config", None):
            from fusedzero.checkpoint import hf

            r = hf.export_hf(  # reads --hf-config first: a FIFO or device refused, not read
                args.dir,
                args.out,
                hf_config=args.hf_config,
                dtype=dtypes.SHORT_NAMES[args.dtype],
                max_shard_bytes=args.max_shard_size,
                verify=not args.no_verify,
            )
            _print(f"wrote {hf.CONFIG_NAME} and {len(r.files)} weight file(s) in {args.out}")
            return 0
        if args.ckpt_command == "export":
            r = checkpoint.export(
                args.dir,
                args.out,
                dtype=dtypes.SHORT_NAMES[args.dtype],
                max_shard_bytes=args.max_shard_size,
                verify=not args.no_verify,
            )
            for f in r.files:
                _print(f"wrote {f}")
            if r.index is not None:
                _print(f"wrote {r.index}")
            _print(
                f"{_human(r.bytes)} of {args.dtype} params; peak buffer "
                f"{_human(r.peak_buffer_bytes)}"
            )
            return 0
    except BrokenPipeError:
        raise  # `fusedzero ckpt inspect | head`: the CLI ends quietly
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        msg = " ".join(str(e).split())  # one line, as the rest of the `fusedzero` CLI
        _print(f"fusedzero: error: {msg}", file=sys.stderr)
        return 2
    raise AssertionError(args.ckpt_command)


def _upgrade(src: str, out: str) -> int:
    """Convert into root `out` holding its run lock (fusedzero/app/runlock.py): a live run's
    keep-last in that root cannot delete what the conversion writes, nor the conversion
    write into a root a run is saving to."""
    with RunLock(out):
        if tp_record(Path(src)) is not None:
            from fusedzero.checkpoint._tp_upgrade import upgrade_tp

            _print(
                f"wrote {upgrade_tp(src, out, allowed={LOCK_NAME})} (a tensor-parallel root, "
                "its tp folders bound to its record)"
            )
            return 0
        from fusedzero.checkpoint._upgrade import upgrade

        d = upgrade(src, out)
        _print(f"wrote {d} (format version {checkpoint.read_manifest(d)['version']})")
        return 0


def _print(*parts: Any, **kw: Any) -> None:
    """print, with a path that is not valid UTF-8 (os.fsdecode's surrogates) shown escaped
    (b"\\xff" as "\\xff") instead of a UnicodeEncodeError after the work is done."""
    print(*(_escaped(p) if isinstance(p, str) else p for p in parts), **kw)


def _escaped(text: str) -> str:
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _each_tp_folder(path: str) -> list[tuple[str, str]]:
    """[("", path)] for a checkpoint directory or root; for a tensor-parallel root, each tp
    folder (labelled), once every folder is bound to the record and its latest checkpoint
    holds the local shapes the record's placements give (CheckpointError otherwise)."""
    root = Path(path)
    rec = tp_record(root)
    if rec is None:
        return [("", path)]
    T = rec["tp"]
    check_bound(root, rec)
    folders = [folder(root, t, T) for t in range(T)]
    for t, f in enumerate(folders):
        d = checkpoint.resolve(f)
        check_folder(d, checkpoint.read_manifest(d), rec, t)
    return [(f"tp rank {t} of {T}", str(f)) for t, f in enumerate(folders)]


def _verify(path: str) -> int:
    d = checkpoint.resolve(path)
    bad = checkpoint.problems(d)
    for line in bad:
        _print(f"FAILED {line}")
    n = len(checkpoint.read_manifest(d)["files"])
    if bad:
        _print(
            f"{d}: failed verification, {len(bad)} problem(s) ({n} shard file(s), the "
            "rank states and the folder's name checked)"
        )
        return 1
    _print(
        f"ok: {d}: {n} shard file(s), sizes, headers and sha256 match the manifest; rank "
        "states and folder name sound"
    )
    return 0


def _inspect(path: str) -> int:
    info = checkpoint.inspect(path)
    m = checkpoint.read_manifest(info["path"])
    _print(f"checkpoint   {info['path']}")
    _print(f"world size   {info['world_size']}")
    _print(f"stage        {info['stage']}")
    _print(f"step         {info['step']} (optimizer steps taken: {info['step_count']:g})")
    _print(f"params       {info['num_params']} tensors, {info['param_elements']:,} elements")
    _print(f"size         {_human(info['bytes'])} in {len(info['files'])} file(s)")
    _print()
    width = max([len(f["name"]) for f in info["files"]] + [4])
    _print(f"{'file':<{width}}  {'bytes':>12}  status")
    ok = True
    for f in info["files"]:
        if f.get("symlink"):
            status = "SYMLINK (refused: shard files must be regular files)"
        elif f["present_bytes"] is None:
            status = "MISSING"
        elif not f["ok"]:
            status = f"SIZE {f['present_bytes']} != {f['bytes']}"
        else:
            status = "ok (size; `verify` checks sha256)"
        ok &= f["ok"]
        _print(f"{f['name']:<{width}}  {f['bytes']:>12,}  {status}")
    _print()
    if not m["params"]:
        _print("params       none: this checkpoint holds no parameters")
        return 0 if ok else 1
    names = [_shown(p["name"]) for p in m["params"]]
    width = max(len(n) for n in names)
    _print(f"{'param':<{width}}  {'shape':<16} dtype")
    for p, name in zip(m["params"], names):
        alias = f"  (also {', '.join(_shown(a) for a in p['aliases'])})" if p.get("aliases") else ""
        _print(f"{name:<{width}}  {str(tuple(p['shape'])):<16} {p['dtype']}{alias}")
    return 0 if ok else 1


def _shown(name: str) -> str:
    """A name from a manifest as printed: itself when printable, else escaped (a name holding
    terminal escape sequences must not run them)."""
    return name if name.isprintable() else ascii(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusedzero")
    add_ckpt_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
