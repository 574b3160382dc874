"""Input wait per step, reading from an S3 server on loopback, with and without reading ahead.

    python -m benchmarks.data_input [--steps 12] [--repeats 3] [--json bench-results/data_input.json]

A moto S3 server runs on 127.0.0.1 (server mode, spoken to over HTTP by s3fs/botocore, the
workers' own client). Two corpora are uploaded: byte-level ``text`` files (every sample is a
range read of one file) and a ``tokens`` ``.bin`` stream (uint16, a range read per sample).
Each is trained on by one process with a GPT preset (forward, backward, AdamW step on the CPU),
with the job's loader (``workers.data.ShardedBatchLoader``) reading the next batch ahead
(``prefetch=True``, what the training loop uses) or not. The input wait of a step is the time
``next_batch()`` blocks; the table gives its median share of the step and the median step time.
Modes are interleaved, repeat by repeat, in rotated order; the first step of each run (the
loader's first read, the model's warm-up) is not counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contract.presets import PRESETS
from contract.spec import DataSpec
from service.launchers.ports import free_port
from workers.data import ShardedBatchLoader, build_dataset
from workers.models import GPT


def upload(endpoint: str, bucket: str, seq_len: int) -> dict[str, dict[str, Any]]:
    """The two corpora in ``bucket``; the data blocks that read them."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    rng = np.random.default_rng(0)
    for i in range(16):  # 16 files of 256 KiB of printable bytes
        s3.put_object(Bucket=bucket, Key=f"text/part-{i:02d}.txt",
                      Body=rng.integers(32, 127, size=256 * 1024, dtype=np.uint8).tobytes())
    s3.put_object(Bucket=bucket, Key="tokens/stream.bin",
                  Body=rng.integers(0, 256, size=2 * 1024 * 1024, dtype=np.uint16).tobytes())
    return {"text": {"kind": "text", "uri": f"s3://{bucket}/text", "seq_len": seq_len},
            "tokens": {"kind": "tokens", "format": "bin", "uri": f"s3://{bucket}/tokens", "seq_len": seq_len}}


def run(block: dict[str, Any], prefetch: bool, args: argparse.Namespace) -> dict[str, Any]:
    """``args.steps`` training steps reading ``block``; per step the wait and the step time."""
    torch.manual_seed(0)
    model = GPT(PRESETS[args.preset])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = build_dataset(DataSpec.model_validate(block), seed=0)
    loader = ShardedBatchLoader(dataset, global_batch_size=args.batch, micro_batch_size=args.micro_batch,
                                prefetch=prefetch)
    waits, steps = [], []
    try:
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            batch = loader.next_batch()
            waited = time.perf_counter() - start
            for x, y in batch:
                (model(x, y) / len(batch)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            waits.append(waited)
            steps.append(time.perf_counter() - start)
    finally:
        loader.close()
    waits, steps = waits[1:], steps[1:]  # the first read has nothing ahead of it
    shares = [w / s for w, s in zip(waits, steps)]
    return {"wait_s": statistics.median(waits), "step_s": statistics.median(steps),
            "wait_share": statistics.median(shares), "wait_share_max": max(shares)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-nano")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ["ZEROTRAIN_S3_ENDPOINT_URL"] = endpoint
    try:
        blocks = upload(endpoint, "zt-data-input", args.seq_len)
        modes = [(kind, prefetch) for kind in blocks for prefetch in (False, True)]
        runs: dict[tuple[str, bool], list[dict[str, Any]]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for kind, prefetch in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                print(f"[data input] {kind}, prefetch {prefetch}, repeat {rep + 1}", file=sys.stderr, flush=True)
                runs[(kind, prefetch)].append(run(blocks[kind], prefetch, args))
    finally:
        server.stop()
    rows = []
    for (kind, prefetch), results in runs.items():
        shares = [r["wait_share"] for r in results]
        rows.append({"kind": kind, "prefetch": prefetch, "wait_share_median": statistics.median(shares),
                     "wait_share_range": [min(shares), max(shares)],
                     "wait_s_median": statistics.median(r["wait_s"] for r in results),
                     "step_s_median": statistics.median(r["step_s"] for r in results), "repeats": results})
    from rich.console import Console
    from rich.table import Table

    table = Table("data", "prefetch", "input wait / step (median, min-max of repeats)", "wait s", "step s",
                  title=f"Input wait from S3 on loopback: {args.preset}, batch {args.batch} of {args.seq_len} "
                        f"(micro {args.micro_batch}), {args.steps} steps x {args.repeats} repeats")
    for r in rows:
        table.add_row(r["kind"], "yes" if r["prefetch"] else "no",
                      f"{r['wait_share_median']:.1%} ({r['wait_share_range'][0]:.1%}-{r['wait_share_range'][1]:.1%})",
                      f"{r['wait_s_median']:.4f}", f"{r['step_s_median']:.3f}")
    Console(width=160).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
