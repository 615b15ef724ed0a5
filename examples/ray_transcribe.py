"""Transcribe a directory, a list of files or S3 prefixes with Ray Data, one model per GPU across a cluster.

    pip install 'glmasr[cuda,ray]'
    # on a cluster (after `ray start --head` / `ray start --address=HEAD:6379` on every node):
    python examples/ray_transcribe.py s3://bucket/audio/ --output s3://bucket/transcripts/ \\
        --model zai-org/GLM-ASR-Nano-2512 --concurrency 16 --batch-size 32
    # one machine, CPU only, JSON lines:
    python examples/ray_transcribe.py data/audio/ --output out/ --format jsonl --num-gpus 0 --device cpu
    # a list of paths / URIs, one per line:
    python examples/ray_transcribe.py @files.txt --output out/

Inputs are read as bytes (``ray.data.read_binary_files``: local paths, folders searched for audio files,
``s3://``/``gs://`` URIs through pyarrow's file systems), decoded and transcribed on the actors
(``glmasr.integrations.ray_data.GlmAsrPredictor``), and written as Parquet or JSON lines: one row per file with
``path``, ``text``, ``segments``, ``duration_s``, ``finish_reason``, timings and ``error`` (set for a file that
could not be decoded; the job goes on). ``--model`` must be reachable from every node: a hub id (each node
downloads it once into its cache) or a folder on storage every node mounts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

AUDIO_EXTENSIONS = ["wav", "flac", "ogg", "oga", "opus", "mp3", "m4a", "mp4", "webm", "aac", "aif", "aiff",
                    "mka", "mkv"]


def expand_inputs(items: list[str]) -> list[str]:
    """``@file`` -> the paths/URIs listed in it (one per line, # comments); others as given."""
    out = []
    for item in items:
        if item.startswith("@"):
            for line in Path(item[1:]).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append(line)
        else:
            out.append(item)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="files, folders, s3:// URIs, or @list.txt (one per line)")
    p.add_argument("--output", "-o", required=True, help="output folder or URI")
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    p.add_argument("--model", default=None, help="hub id or checkpoint folder reachable from every node "
                                                 "(default: zai-org/GLM-ASR-Nano-2512)")
    p.add_argument("--device", default=None, help="device inside each actor (default: cuda if it has a GPU)")
    p.add_argument("--num-gpus", type=float, default=1.0, help="GPUs per actor (0: CPU actors)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs per actor (default: 1 for CPU actors)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="actors (default: the cluster's GPUs / --num-gpus, or 1 for CPU actors)")
    p.add_argument("--batch-size", type=int, default=32, help="files per batch (submitted to an engine together)")
    p.add_argument("--segmentation", choices=("windows", "vad"), default="windows")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, or a local Ray)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ray

    from glmasr.integrations.ray_data import GlmAsrPredictor

    if not ray.is_initialized():
        ray.init(address=args.address)
    paths = expand_inputs(args.inputs)
    ds = ray.data.read_binary_files(paths, include_paths=True, file_extensions=AUDIO_EXTENSIONS)
    if args.concurrency is not None:
        concurrency = args.concurrency
    elif args.num_gpus > 0:
        concurrency = max(1, int(ray.cluster_resources().get("GPU", 0) // args.num_gpus))
    else:
        concurrency = 1
    resources = {"num_gpus": args.num_gpus} if args.num_gpus > 0 else {}
    if args.num_cpus is not None or args.num_gpus == 0:
        resources["num_cpus"] = args.num_cpus if args.num_cpus is not None else 1
    ds = ds.map_batches(
        GlmAsrPredictor,
        fn_constructor_kwargs={"model": args.model, "device": args.device, "segmentation": args.segmentation,
                               "max_new_tokens": args.max_new_tokens},
        batch_size=args.batch_size, concurrency=concurrency, **resources)
    if args.format == "parquet":
        ds.write_parquet(args.output)
    else:
        ds.write_json(args.output)  # JSON lines, one file per block
    print(f"wrote {args.format} to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
